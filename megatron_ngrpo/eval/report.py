"""Evaluation outputs: results.json, results.csv, summary.md, passk.png, generations/*.jsonl.

pass@k comes with a 95 % bootstrap interval over problems (results.json ``passk_interval``, the
band on passk.png): a benchmark of a few dozen problems moves by several points between draws.

Every file is written to a temporary name and renamed, so a killed run never leaves a half
file behind.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np

from megatron_ngrpo.atomic import atomic_write
from megatron_ngrpo.eval.passk import bootstrap_interval, pass_at_k_curve
from megatron_ngrpo.eval.result import GENERATIONS_DIR, EvalResult

AVERAGE = "average"


def _columns(result: EvalResult) -> list[str]:
    first = next(iter(result.metrics.values()))
    return [k for k in first if k != "problems"]


def metrics_table(result: EvalResult) -> list[dict]:
    """One row per benchmark plus the average: benchmark, problems, mean@n, pass@k..."""
    rows = [
        {"benchmark": name, "problems": int(m["problems"]), **{k: m[k] for k in _columns(result)}}
        for name, m in result.metrics.items()
    ]
    rows.append(
        {"benchmark": AVERAGE, "problems": sum(r["problems"] for r in rows), **result.average}
    )
    return rows


def to_csv(result: EvalResult) -> str:
    rows = metrics_table(result)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in row.items()})
    return buf.getvalue()


def to_markdown(result: EvalResult) -> str:
    """Percentages, one decimal; the average is the macro mean over benchmarks."""
    rows = metrics_table(result)
    cols = list(rows[0])
    lines = [
        f"Evaluation: n = {result.n} samples per problem; metrics in %.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "|".join("---" for _ in cols) + "|",
    ]
    for row in rows:
        cells = [str(row["benchmark"]), str(row["problems"])]
        cells += [f"{100 * row[c]:.1f}" for c in cols[2:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def passk_interval(result: EvalResult) -> dict[str, dict[str, list[float]]]:
    """Per benchmark with saved generations, ``{"pass@k": [low, high]}``: the seeded 95 %
    percentile bootstrap over problems (1000 resamples) of the pass@k the metrics report."""
    out = {}
    for name, records in result.generations.items():
        ks = sorted(int(k.split("@")[1]) for k in result.metrics[name] if k.startswith("pass@"))
        counts = np.zeros(1 + max(r["problem"] for r in records), dtype=np.int64)
        for r in records:
            counts[r["problem"]] += r["score"] > 0.5
        low, high = bootstrap_interval(pass_at_k_curve(counts, result.n, ks))
        out[name] = {f"pass@{k}": [float(a), float(b)] for k, a, b in zip(ks, low, high)}
    return out


def plot_passk(result: EvalResult, path: Path, interval: dict | None = None) -> None:
    # lazy: plotting only
    import matplotlib

    matplotlib.use("Agg")
    # lazy: plotting only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for name, m in result.metrics.items():
        ks = sorted(int(k.split("@")[1]) for k in m if k.startswith("pass@"))
        line = ax.plot(ks, [100 * m[f"pass@{k}"] for k in ks], marker="o", label=name)
        if interval and name in interval:
            band = np.array([interval[name][f"pass@{k}"] for k in ks]) * 100
            ax.fill_between(ks, band[:, 0], band[:, 1], color=line[0].get_color(), alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("Pass@k (%)")
    ax.set_title(f"Pass@k (n = {result.n}; band: 95 % bootstrap over problems)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write(path, buf.getvalue())


def write_report(result: EvalResult, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    (out / GENERATIONS_DIR).mkdir(parents=True, exist_ok=True)
    for name, records in result.generations.items():
        atomic_write(
            out / GENERATIONS_DIR / f"{name}.jsonl",
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
        )
    interval = passk_interval(result)
    summary = {
        "n": result.n,
        "metrics": result.metrics,
        "average": result.average,
        "passk_interval": interval,
        "settings": result.settings,
    }
    atomic_write(out / "results.json", json.dumps(summary, indent=1))
    atomic_write(out / "results.csv", to_csv(result))
    atomic_write(out / "summary.md", to_markdown(result))
    plot_passk(result, out / "passk.png", interval)
    return out
