"""The study's pass@k analysis: per-run pass@k curves (the unbiased estimator, per problem, with a
bootstrap interval over problems), their mean ± std over seeds per arm, the paired difference of
each arm against plain GRPO at pass@1 and pass@n with a paired-t interval, and the smallest
difference the design could detect at 80 % power from the observed paired spread.

Inputs are the validation generations the trainer saves (``<run>/validation/step<N>/generations``:
one record per sample with ``benchmark``, ``problem`` and a 0/1 ``score``); step 0 is the
validation before the first GRPO step (``validation.at_start``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from scipy import stats

from megatron_ngrpo.eval.passk import bootstrap_interval, default_ks, pass_at_k_curve

ALPHA, POWER = 0.05, 0.80


def correct_counts(records: list[dict]) -> tuple[np.ndarray, int]:
    """Per problem (benchmark, problem) the number of correct samples, and n (samples per
    problem, the same for every problem)."""
    groups: dict[tuple, list[float]] = {}
    for r in records:
        groups.setdefault((r.get("benchmark"), r["problem"]), []).append(float(r["score"]))
    sizes = {len(g) for g in groups.values()}
    if len(sizes) != 1:
        raise ValueError(f"problems have different sample counts {sorted(sizes)}")
    counts = np.array([sum(s > 0.5 for s in g) for _, g in sorted(groups.items())])
    return counts, sizes.pop()


def run_curve(records: list[dict], resamples: int = 1000, seed: int = 0) -> dict:
    """One validation's pass@k for k = 1, 2, 4, ..., n: ``{"n", "ks", "mean", "low", "high",
    "per_problem"}`` (mean over problems, its 95 % percentile-bootstrap interval over problems,
    and the [problems, ks] values)."""
    counts, n = correct_counts(records)
    ks = default_ks(n)
    per_problem = pass_at_k_curve(counts, n, ks)  # [problems, len(ks)]
    low, high = bootstrap_interval(per_problem, resamples=resamples, seed=seed)
    return {
        "n": n,
        "ks": ks,
        "mean": per_problem.mean(axis=0).tolist(),
        "low": low.tolist(),
        "high": high.tolist(),
        "per_problem": per_problem.tolist(),
    }


def mdd(sd: float, seeds: int) -> float:
    """Minimum detectable paired difference (two-sided α = 0.05, power 0.8) with ``seeds``
    seeds and paired std ``sd``: (t_{1−α/2, m−1} + t_{power, m−1}) · sd / √m."""
    df = seeds - 1
    return float((stats.t.ppf(1 - ALPHA / 2, df) + stats.t.ppf(POWER, df)) * sd / math.sqrt(seeds))


def paired(diffs: list[float]) -> dict:
    """Mean paired difference over seeds, its 95 % paired-t interval, two-sided p, and the
    minimum detectable difference (two-sided α = 0.05, power 0.8) of a paired t-test with this
    many seeds and this spread of differences: (t_{1−α/2, m−1} + t_{power, m−1}) · sd / √m."""
    d = np.asarray(diffs, dtype=np.float64)
    m = len(d)
    mean = float(d.mean())
    if m < 2:
        return {"seeds": m, "mean": mean, "sd": math.nan, "ci": [math.nan] * 2, "p": math.nan}
    sd = float(d.std(ddof=1))
    se = sd / math.sqrt(m)
    t_alpha = stats.t.ppf(1 - ALPHA / 2, m - 1)
    p = float(2 * stats.t.sf(abs(mean) / se, m - 1)) if se > 0 else math.nan
    return {
        "seeds": m,
        "mean": mean,
        "sd": sd,
        "ci": [mean - t_alpha * se, mean + t_alpha * se],
        "p": p,
        "mdd": mdd(sd, m),
    }


def aggregate(curves: dict[str, dict[int, dict]], base: str = "grpo") -> dict:
    """``curves[arm][seed] = {"start": run_curve, "end": run_curve}`` → per arm and phase the
    mean and std over seeds at each k; per arm other than ``base``, the paired differences at
    pass@1 and pass@n at the end (and at the start, where the arms share a warm-start)."""
    seeds = sorted(set.intersection(*(set(c) for c in curves.values())))
    out: dict = {"seeds": seeds, "arms": {}, "paired": {}}
    for arm, runs in curves.items():
        out["arms"][arm] = {}
        for phase in ("start", "end"):
            ys = np.array([runs[s][phase]["mean"] for s in seeds])  # [seeds, ks]
            # Every seed is validated on the same problems: the seed-mean per problem,
            # resampled over problems, is the arm's interval over problems.
            per_problem = np.mean([runs[s][phase]["per_problem"] for s in seeds], axis=0)
            low, high = bootstrap_interval(per_problem)
            out["arms"][arm][phase] = {
                "ks": runs[seeds[0]][phase]["ks"],
                "mean": ys.mean(axis=0).tolist(),
                "std": (ys.std(axis=0, ddof=1) if len(seeds) > 1 else 0 * ys[0]).tolist(),
                "low": low.tolist(),
                "high": high.tolist(),
            }
    if base in curves:
        for arm, runs in curves.items():
            if arm == base:
                continue
            ks = runs[seeds[0]]["end"]["ks"]
            out["paired"][arm] = {
                f"{phase} pass@{k}": paired(
                    [runs[s][phase]["mean"][i] - curves[base][s][phase]["mean"][i] for s in seeds]
                )
                for phase in ("end", "start")
                for i, k in ((0, ks[0]), (len(ks) - 1, ks[-1]))
            }
    return out


def table(agg: dict, base: str = "grpo", plan: int = 8) -> str:
    """pass@k per arm (mean ± std over seeds) at the start and the end, then the paired
    differences against ``base`` with their minimum detectable difference, and the one a study
    of ``plan`` seeds would have at the same paired std (for planning a larger run)."""
    first = next(iter(agg["arms"].values()))["end"]
    ks = first["ks"]
    lines = [
        "| arm | phase | " + " | ".join(f"pass@{k}" for k in ks) + " |",
        "|---|---|" + "---|" * len(ks),
    ]
    for arm, phases in agg["arms"].items():
        for phase in ("start", "end"):
            r = phases[phase]
            cells = [
                f"{m:.3f}{f' ± {s:.3f}' if len(agg['seeds']) > 1 else ''} [{lo:.2f}, {hi:.2f}]"
                for m, s, lo, hi in zip(r["mean"], r["std"], r["low"], r["high"])
            ]
            lines.append(f"| {arm} | {phase} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + (
        f"\n\nmean ± std over seeds {agg['seeds']} [95 % bootstrap interval over problems of the "
        "seed-mean, 1000 resamples]; start: the validation before the first GRPO step\n"
    )
    if agg["paired"]:
        text += (
            f"\npaired difference vs {base} over seeds (arm − {base}): mean, 95 % paired-t "
            f"interval, two-sided p, and the minimum detectable difference (MDD, α = {ALPHA}, "
            f"power {POWER:.0%}) of this design from the observed paired std\n\n"
            f"| arm | metric | difference | 95 % CI | p | paired sd | MDD (80 % power) "
            f"| MDD at {plan} seeds, same sd |\n"
            "|---|---|---|---|---|---|---|---|\n"
        )
        for arm, rows in agg["paired"].items():
            for metric, r in rows.items():
                if r["seeds"] < 2:
                    text += f"| {arm} | {metric} | {r['mean']:+.3f} | — | — | — | — | — |\n"
                    continue
                text += (
                    f"| {arm} | {metric} | {r['mean']:+.3f} | [{r['ci'][0]:+.3f}, "
                    f"{r['ci'][1]:+.3f}] | {r['p']:.3f} | {r['sd']:.3f} | {r['mdd']:.3f} "
                    f"| {mdd(r['sd'], plan):.3f} |\n"
                )
    return text


def plot(agg: dict, heldout: dict, path: Path, title: str) -> None:
    """Three panels: held-out mean@n per step (mean ± 1 std over seeds; ``heldout[arm][seed]``
    = {step: mean@n}), and pass@k against k (log2 axis) per arm at the start and at the end of
    training (mean ± 1 std over seeds)."""
    # lazy: plotting only
    import matplotlib

    matplotlib.use("Agg")
    # lazy: plotting only
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for arm, runs in heldout.items():
        steps = sorted(next(iter(runs.values())))
        ys = np.array([[run[s] for s in steps] for run in runs.values()], dtype=np.float64)
        std = ys.std(0, ddof=1) if len(ys) > 1 else np.zeros(len(steps))
        axes[0].plot(steps, ys.mean(0), marker="o", label=f"{arm} ({len(ys)} seeds)")
        axes[0].fill_between(steps, ys.mean(0) - std, ys.mean(0) + std, alpha=0.2)
    axes[0].set_xlabel("GRPO step")
    axes[0].set_ylabel("held-out mean@n")
    for ax, phase in zip(axes[1:], ("start", "end")):
        for arm, phases in agg["arms"].items():
            r = phases[phase]
            mean, std = np.array(r["mean"]), np.array(r["std"])
            ax.plot(r["ks"], mean, marker="o", label=arm)
            ax.fill_between(r["ks"], mean - std, mean + std, alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.set_ylabel("held-out pass@k")
        ax.set_title(f"{phase} of GRPO", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
