"""Plot a training run's metrics (``<run_dir>/metrics.jsonl``) to a PNG: the training reward per
step (and its running mean) with the held-out validation score (``val/mean@n``) on the same axes,
then one panel per further key.

    python tools/plot_metrics.py RUN_DIR [--out RUN_DIR/metrics.png] [--keys mixing/mixed_token_frac kl]
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


def plot(
    rows: list[dict], keys: list[str], out: str | Path, title: str = "", window: int = 10
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1 + len(keys), 1, figsize=(7, 3.2 + 2.4 * len(keys)), sharex=True, squeeze=False
    )
    ax = axes[0, 0]
    reward = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    if reward:
        steps, values = zip(*reward)
        ax.plot(
            steps,
            values,
            color="tab:blue",
            alpha=0.3,
            linewidth=1,
            label="training reward (per step)",
        )
        running = [
            sum(values[max(0, i - window + 1) : i + 1])
            / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))
        ]
        ax.plot(steps, running, color="tab:blue", label=f"training reward ({window}-step mean)")
    val_key = next((k for r in rows for k in r if k.startswith("val/mean@")), None)
    if val_key:
        held = [(r["step"], r[val_key]) for r in rows if val_key in r]
        ax.plot(
            *zip(*held), color="tab:red", marker="o", label=f"held-out {val_key[len('val/') :]}"
        )
    ax.set_ylabel("reward / accuracy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    for ax, key in zip(axes[1:, 0], keys):
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
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("run_dir")
    ap.add_argument("--out")
    ap.add_argument("--keys", nargs="+", default=["mixing/mixed_token_frac", "kl"])
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
