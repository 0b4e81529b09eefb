"""Evaluation outputs: results.json, results.csv, summary.md, passk.png, generations/*.jsonl.

Every file is written to a temporary name and renamed, so a killed run never leaves a half
file behind.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from megatron_ngrpo.atomic import atomic_write
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


def plot_passk(result: EvalResult, path: Path) -> None:
    # lazy: plotting only
    import matplotlib

    matplotlib.use("Agg")
    # lazy: plotting only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for name, m in result.metrics.items():
        ks = sorted(int(k.split("@")[1]) for k in m if k.startswith("pass@"))
        ax.plot(ks, [100 * m[f"pass@{k}"] for k in ks], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("Pass@k (%)")
    ax.set_title(f"Pass@k (n = {result.n})")
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
    summary = {
        "n": result.n,
        "metrics": result.metrics,
        "average": result.average,
        "settings": result.settings,
    }
    atomic_write(out / "results.json", json.dumps(summary, indent=1))
    atomic_write(out / "results.csv", to_csv(result))
    atomic_write(out / "summary.md", to_markdown(result))
    plot_passk(result, out / "passk.png")
    return out
