"""The seeded study: plain GRPO vs N-GRPO vs its baselines on an arithmetic task, several seeds each.

Every (arm, seed) run is one training job of a recipe in one process (TP=1) so that runs go two at
a time on a 2-core machine; arms differ only in the exploration strategy, and a seed gives every
arm the same warm-start and the same prompt order. Recipes (``--recipe``):

- ``tiny`` (default): the main job (``configs/tiny_cpu.yaml``: a 2-layer model, supervised
  warm-start, then GRPO) on ``--task maxmin`` (the main job's max / min task) or ``--task sums``
  (one- and two-digit sums: room to explore, pass@64 far above pass@1), results in
  ``examples/study/RESULTS.md``;
- ``smollm2``: the real pretrained model (``configs/smollm2_135m_arith.yaml``, SmolLM2-135M-Instruct
  on the chat-phrased task), validated with sampling (n = 4) on every other held-out problem, with
  each step's generations and mix records dumped; results in ``examples/smollm2/RESULTS.md``.

Runs resume: the same command with a larger ``--steps`` goes on from each run's checkpoint, and
each run's ``commits.txt`` lists the commit of every piece. Then, from the runs' ``metrics.jsonl``
and saved validation generations:

- held-out mean@n and pass@n at the last validation, mean ± std over seeds per arm, and a paired
  t-test of each arm against plain GRPO over the seeds (scipy);
- rollout diversity on the held-out problems at the last validation: distinct extracted answers
  per problem, mean pairwise edit distance between a problem's responses, and the entropy (nats) of
  its answer distribution;
- pass@k for k = 1, 2, 4, ..., n (unbiased estimator per problem) before the first GRPO step
  (``validation.at_start``) and at the last validation: mean ± std over seeds per arm with a
  bootstrap interval over problems, and the paired difference of each arm against GRPO at
  pass@1 and pass@n (paired-t interval, p) beside the smallest difference the design could
  detect at 80 % power (``examples/study/passk_study.py``);
- ``heldout.png``: held-out mean@n per step per arm, mean over seeds with a ±1 std band;
  ``passk.png``: that curve beside pass@k against k (log2 axis) at the start and the end;
- ``results.json`` and ``table.md`` (the tables that ``RESULTS.md`` quotes).

    python -m examples.study.run_study --task sums --heldout-per-level 32 --n 64 \
        --arms grpo,ngrpo,stht --seeds 8 --steps 100 --out runs/study_sums \
        validation.every=25 validation.keep_best=false
    python -m examples.study.run_study --out runs/study --seeds 5 --steps 60
    python -m examples.study.run_study --recipe smollm2 --arms grpo,ngrpo --seeds 3 --steps 10 \
        --out runs/study_smollm2
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from examples.arithmetic.task import TASKS, write_chat_task, write_task
from examples.study import passk_study

REPO = Path(__file__).resolve().parents[2]

# Arm → config overrides. ρ and k are the paper's; STHT perturbs the same fraction of steps.
ARMS = {
    "grpo": ["mixing.strategy=none"],
    "ngrpo": ["mixing.strategy=neighbor", "mixing.rate=0.1", "mixing.k=3"],
    "stht": ["mixing.strategy=stht", "mixing.rate=0.1"],
    "ngrpo_rho1": ["mixing.strategy=neighbor", "mixing.rate=1.0", "mixing.k=3"],
}


def write_tiny(task_dir: Path, task: str, heldout_per_level: int) -> dict:
    """The tiny recipe's task (model, tokenizer, warm-start data) and its config paths."""
    write_task(task_dir, heldout_per_level=heldout_per_level, task=task)
    return {
        "tokenizer": str(task_dir / "tokenizer"),
        "model": {"hf_path": str(task_dir / "model")},
        "train": {"warmstart": {"path": str(task_dir / "sft.jsonl")}},
        "data": {"train": [{"path": str(task_dir / "train.jsonl")}]},
        "validation": {"benchmarks": [str(task_dir / "heldout.jsonl")]},
    }


# The chat task's held-out set: 64 problems per list length, in order of length; validating every
# s-th keeps the lengths balanced (a validation.limit would take the shortest lists only).
CHAT_STRIDES = {64 // s: s for s in (1, 2, 4, 8)}


def write_smollm2(task_dir: Path, task: str, heldout_per_level: int) -> dict:
    """The real model's chat task; validation on ``heldout_per_level`` of the 64 held-out problems
    of each list length (evenly strided; default 32, every other one), sampled as the rollouts are
    (n = 4, T = 1), so that pass@n and the diversity metrics mean something and one validation
    costs about 3 minutes on one core."""
    if task != "maxmin" or heldout_per_level not in CHAT_STRIDES:
        raise SystemExit(
            f"--recipe smollm2: only --task maxmin and --heldout-per-level in {sorted(CHAT_STRIDES)}"
            f" (a divisor of the chat task's 64 per list length), got {task}, {heldout_per_level}"
        )
    write_chat_task(task_dir)
    rows = (task_dir / "heldout.jsonl").read_text().splitlines()
    picked = rows[:: CHAT_STRIDES[heldout_per_level]]
    (task_dir / "heldout_study.jsonl").write_text("".join(r + "\n" for r in picked))
    return {
        "data": {"train": [{"path": str(task_dir / "train.jsonl")}]},
        "validation": {
            "benchmarks": [str(task_dir / "heldout_study.jsonl")],
            "every": 5,
            "sampling": {"n": 4, "temperature": 1.0, "max_new_tokens": 64},
        },
        "train": {"dump_generations": True, "save_every": 5, "keep_last": 1},
    }


# Recipe → (config, task writer returning its config paths, plot title), default held-out per level.
RECIPES = {
    "tiny": (
        "configs/tiny_cpu.yaml",
        write_tiny,
        "{task} task (examples/arithmetic), tiny Qwen2, CPU: mean ± 1 std over seeds",
        64,
    ),
    "smollm2": (
        "configs/smollm2_135m_arith.yaml",
        write_smollm2,
        "chat max / min task, SmolLM2-135M-Instruct, CPU: mean ± 1 std over seeds",
        32,
    ),
}


def commit() -> str:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True
    )
    return (head.stdout.strip() or "unknown") + ("+dirty" if dirty.stdout.strip() else "")


def train_one(
    out: Path, config: str, paths: Path, arm: str, seed: int, steps: int, extra: list[str]
) -> Path:
    """One (arm, seed) training run (resumes if its run directory holds a checkpoint)."""
    run_dir = out / "runs" / f"{arm}_seed{seed}"
    log = out / "logs" / f"{arm}_seed{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "commits.txt").open("a") as f:
        f.write(f"{commit()} to step {steps}\n")
    cmd = [
        sys.executable,
        "-m",
        "megatron_ngrpo.train",
        "--config",
        config,
        "--config",
        str(paths),
        "model.tensor_parallel=1",
        f"train.seed={seed}",
        f"train.max_steps={steps}",
        f"train.run_dir={run_dir}",
        "train.progress=false",
        "reward.workers=1",
        *ARMS[arm],
        *extra,
    ]
    # Each run is its own single-process job: a rendezvous address inherited from a launcher
    # (MASTER_PORT, RANK, ...) would make the runs that go in parallel collide on one port.
    launcher = {
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
    }
    env = {**{k: v for k, v in os.environ.items() if k not in launcher}, "OMP_NUM_THREADS": "1"}
    with log.open("a") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"run {arm} seed {seed} failed (exit {proc.returncode}): see {log}")
    return run_dir


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (responses here are a few characters: a plain DP needs no library)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def diversity(records: list[dict]) -> dict[str, float]:
    """Per-problem diversity of the sampled responses, averaged over problems."""
    groups: dict[int, list[dict]] = {}
    for r in records:
        groups.setdefault(r["problem"], []).append(r)
    distinct, dist, entropy = [], [], []
    for group in groups.values():
        answers = [str(r.get("extracted")) for r in group]
        counts = [answers.count(a) for a in set(answers)]
        distinct.append(len(counts))
        entropy.append(-sum(c / len(answers) * math.log(c / len(answers)) for c in counts))
        pairs = list(itertools.combinations([r["response"] for r in group], 2))
        dist.append(sum(edit_distance(a, b) for a, b in pairs) / max(len(pairs), 1))
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    return {
        "distinct_answers": mean(distinct),
        "edit_distance": mean(dist),
        "answer_entropy": mean(entropy),
    }


def read_generations(gen_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted(gen_dir.glob("*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def paired_difference(records: list[dict], base: list[dict]) -> tuple[float, float]:
    """(mean, standard error) over problems of a run's per-problem mean score minus the untrained
    model's on the same problems (the validation's generations against the baseline eval's)."""
    per_problem = lambda rs: {  # noqa: E731
        p: sum(r["score"] for r in rs if r["problem"] == p)
        / sum(1 for r in rs if r["problem"] == p)
        for p in {r["problem"] for r in rs}
    }
    cur, ref = per_problem(records), per_problem(base)
    diffs = [cur[p] - ref[p] for p in sorted(ref)]
    n = len(diffs)
    mean = sum(diffs) / n
    return mean, math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n)


def summarise_run(run_dir: Path, base: list[dict] | None = None) -> dict:
    rows = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line
    ]
    val = [r for r in rows if any(k.startswith("val/mean@") for k in r)]
    if not val:
        raise SystemExit(f"{run_dir}: no validation rows in metrics.jsonl")
    mean_key = next(k for k in val[-1] if k.startswith("val/mean@"))
    pass_key = mean_key.replace("mean@", "pass@")
    last = val[-1]
    records = read_generations(run_dir / "validation" / f"step{last['step']:07d}" / "generations")
    return {
        **({"vs_untrained": paired_difference(records, base)} if base else {}),
        "curve": {r["step"]: r[mean_key] for r in val},
        "mean": last[mean_key],
        "pass": last.get(pass_key, float("nan")),
        "metric": mean_key[len("val/") :],
        "first": val[0][mean_key],
        **diversity(records),
    }


def paired_test(a: list[float], b: list[float]) -> float:
    """Two-sided paired t-test p-value of a vs b over seeds (nan when undefined)."""
    from scipy.stats import ttest_rel

    if len(a) < 2 or all(x == y for x, y in zip(a, b)):
        return float("nan")
    return float(ttest_rel(a, b).pvalue)


def aggregate(results: dict[str, dict[int, dict]]) -> dict:
    import numpy as np

    out = {}
    seeds = sorted(set.intersection(*(set(r) for r in results.values())))
    for arm, runs in results.items():
        row = {}
        for key in ("mean", "pass", "first", "distinct_answers", "edit_distance", "answer_entropy"):
            xs = np.array([runs[s][key] for s in seeds], dtype=np.float64)
            row[key] = {
                "mean": float(xs.mean()),
                "std": float(xs.std(ddof=1)) if len(xs) > 1 else 0.0,
            }
        if arm != "grpo" and "grpo" in results:
            row["p_vs_grpo"] = paired_test(
                [runs[s]["mean"] for s in seeds], [results["grpo"][s]["mean"] for s in seeds]
            )
        out[arm] = row
    return {
        "seeds": seeds,
        "arms": out,
        "metric": next(iter(next(iter(results.values())).values()))["metric"],
    }


def table(agg: dict) -> str:
    m = agg["metric"]
    lines = [
        f"| arm | held-out {m}, first validation | held-out {m}, last | pass@n, last | paired p vs GRPO "
        "| distinct answers / problem | pairwise edit distance | answer entropy (nats) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, r in agg["arms"].items():
        f = lambda k: f"{r[k]['mean']:.3f} ± {r[k]['std']:.3f}"  # noqa: E731
        p = r.get("p_vs_grpo")
        lines.append(
            f"| {arm} | {f('first')} | {f('mean')} | {f('pass')} | "
            f"{'—' if p is None else f'{p:.3f}'} | {f('distinct_answers')} | {f('edit_distance')} "
            f"| {f('answer_entropy')} |"
        )
    return "\n".join(lines) + f"\n\nmean ± std over seeds {agg['seeds']}\n"


def plot(
    results: dict[str, dict[int, dict]], path: Path, metric: str, title: str, base: float | None
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if base is not None:
        ax.axhline(base, color="gray", linestyle="--", label="untrained model")
    for arm, runs in results.items():
        steps = sorted(next(iter(runs.values()))["curve"])
        ys = np.array([[run["curve"][s] for s in steps] for run in runs.values()], dtype=np.float64)
        if base is not None:  # every arm starts from the same untrained model at step 0
            steps, ys = [0, *steps], np.concatenate([np.full((len(ys), 1), base), ys], axis=1)
        mean, std = ys.mean(0), ys.std(0, ddof=1) if len(ys) > 1 else np.zeros(len(steps))
        ax.plot(steps, mean, marker="o", label=f"{arm} ({len(ys)} seeds)")
        ax.fill_between(steps, mean - std, mean + std, alpha=0.2)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"held-out {metric}")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--recipe", choices=list(RECIPES), default="tiny")
    ap.add_argument("--task", choices=sorted(TASKS), default="maxmin", help="the tiny task")
    ap.add_argument(
        "--heldout-per-level",
        type=int,
        help="held-out problems per task level (default: tiny 64, smollm2 32 of its 64)",
    )
    ap.add_argument(
        "--n", type=int, help="validation samples per problem (default: the recipe's config)"
    )
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "study")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {list(ARMS)}")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60, help="GRPO steps per run")
    ap.add_argument("--parallel", type=int, default=2, help="runs at a time (one core each)")
    ap.add_argument(
        "--plan-seeds",
        type=int,
        default=8,
        help="also state the MDD a study of this many seeds would have at the observed paired std",
    )
    ap.add_argument(
        "--summarise-only",
        action="store_true",
        help="no training: the table, plot and results of the runs as they are in --out",
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        help="the untrained model's eval results.json under the validation's settings (a line "
        "on the plot, a sentence under the table)",
    )
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every run, a.b=c")
    args = ap.parse_args(argv)
    args.arms = args.arms.split(",")
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; expected some of {list(ARMS)}")
    # The start of the pass@k curve is the validation before the first GRPO step; the caller's
    # overrides come last and win.
    args.overrides = [
        "validation.at_start=true",
        *([f"validation.sampling.n={args.n}"] if args.n else []),
        *args.overrides,
    ]
    return args


def baseline_text(results: dict, agg: dict, baseline: Path) -> tuple[str, float]:
    """The untrained model's line under the table, and its mean@n (for the plot)."""
    average = json.loads(baseline.read_text())["average"]
    m = agg["metric"]
    base = average[m]
    text = (
        f"untrained model ({baseline}): {m} {base:.3f} ± {average[f'se({m})']:.3f} (s.e.), "
        f"pass@{m.split('@')[1]} {average['pass@' + m.split('@')[1]]:.3f}\n\n"
        f"last validation minus the untrained model, paired by problem (± s.e.):\n"
    )
    for arm, runs in results.items():
        text += "".join(
            f"- {arm} seed {seed}: {r['vs_untrained'][0]:+.3f} ± {r['vs_untrained'][1]:.3f}\n"
            for seed, r in sorted(runs.items())
        )
    return text, base


def passk_curves(run_dir: Path, curve: dict[int, float]) -> dict[str, dict]:
    """pass@k at the first validation (step 0 with validation.at_start) and at the last."""
    return {
        phase: passk_study.run_curve(
            read_generations(run_dir / "validation" / f"step{step:07d}" / "generations")
        )
        | {"step": step}
        for phase, step in (("start", min(curve)), ("end", max(curve)))
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    config, write, title, per_level = RECIPES[args.recipe]
    title = title.format(task="max / min" if args.task == "maxmin" else args.task)
    out = args.out.resolve()
    # Seed-major order: the arms of one seed run side by side, under the same load.
    jobs = [(arm, seed) for seed in range(args.seeds) for arm in args.arms]
    if args.summarise_only:
        dirs = [out / "runs" / f"{arm}_seed{seed}" for arm, seed in jobs]
    else:
        paths = out / "task_paths.yaml"
        task_paths = write(out / "task", args.task, args.heldout_per_level or per_level)
        paths.write_text(yaml.safe_dump(task_paths))
        with ThreadPoolExecutor(args.parallel) as pool:
            dirs = list(
                pool.map(
                    lambda j: train_one(out, config, paths, j[0], j[1], args.steps, args.overrides),
                    jobs,
                )
            )
    base_records = read_generations(args.baseline.parent / "generations") if args.baseline else None
    results: dict[str, dict[int, dict]] = {arm: {} for arm in args.arms}
    curves: dict[str, dict[int, dict]] = {arm: {} for arm in args.arms}
    for (arm, seed), run_dir in zip(jobs, dirs):
        results[arm][seed] = summarise_run(run_dir, base_records)
        curves[arm][seed] = passk_curves(run_dir, results[arm][seed]["curve"])
    agg, passk = aggregate(results), passk_study.aggregate(curves)
    text, base = table(agg), None
    if args.baseline:
        line, base = baseline_text(results, agg, args.baseline)
        text += line
    text += "\n" + passk_study.table(passk, plan=args.plan_seeds)
    (out / "results.json").write_text(
        json.dumps(
            {"aggregate": agg, "runs": results, "baseline": base, "passk": passk, "curves": curves},
            indent=1,
        )
    )
    (out / "table.md").write_text(text)
    plot(results, out / "heldout.png", agg["metric"], title, base)
    heldout = {arm: {s: r["curve"] for s, r in runs.items()} for arm, runs in results.items()}
    passk_study.plot(passk, heldout, out / "passk.png", title)
    print(text)
    print(f"wrote {out / 'results.json'}, {out / 'table.md'}, {out / 'heldout.png'}, passk.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
