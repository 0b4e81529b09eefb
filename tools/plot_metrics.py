"""Plot a training run's per-step metrics (``<run_dir>/metrics.jsonl``) to a PNG.

    python tools/plot_metrics.py RUN_DIR [--out RUN_DIR/metrics.png] [--keys reward/mean accuracy]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics (has the run written a step yet?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(rows: list[dict], keys: list[str], out: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    if title:
        axes[0, 0].set_title(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--out")
    ap.add_argument("--keys", nargs="+", default=["reward/mean", "accuracy", "mixing/mixed_token_frac"])
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    try:
        rows = read_metrics(args.run_dir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(plot(rows, args.keys, args.out or Path(args.run_dir) / "metrics.png", args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
