"""The main job: a real, tiny N-GRPO training on CPU, end to end.

1. Writes the arithmetic task (``examples/arithmetic/task.py``): a character tokenizer, a tiny
   Qwen2 config, train / held-out problems answered as ``\\boxed{N}``, worked solutions.
2. Trains through the NeMo-Run local launcher (``python -m megatron_ngrpo.launch run tiny --executor local``):
   torchrun with 2 processes, TP=2, built-in Megatron rollout engine, neighbour mixing at ρ=0.1,
   k=3, rewards from the project's math grader (``configs/tiny_cpu.yaml``). The run starts with a
   brief supervised warm-start on the worked solutions (a model created from scratch never writes
   a gradeable answer), then N-GRPO. Metrics: ``metrics.jsonl`` + TensorBoard; checkpoints
   resumable (re-running this script resumes the run). The launcher shows the job's output
   (progress bar with reward and KL, validation lines) while it runs, without torchrun's start-up
   INFO lines; the full log stays under ``$NEMORUN_HOME/experiments``.
3. Exports the final checkpoint to Hugging Face format (``tools/convert_megatron_to_hf.py``).
4. Plots reward and accuracy per step (``metrics.png``) and prints the mean reward of the first
   and last 10 steps and the held-out validation scores.

    python -m examples.tiny_ngrpo [--out runs/demo] [--steps 40] [extra a.b=c overrides]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

from examples.arithmetic.task import write_task
from megatron_ngrpo.compat.notices import quiet_cpu_notices

REPO = Path(__file__).resolve().parents[1]


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "demo")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the config's)")
    ap.add_argument("overrides", nargs="*", help="extra config overrides a.b=c")
    args = ap.parse_args(argv)
    quiet_cpu_notices()

    out = args.out.resolve()
    task_dir, run_dir = out / "task", out / "train"
    print(json.dumps({"task": write_task(task_dir)}))
    # The task's paths as a config layer over configs/tiny_cpu.yaml.
    paths = out / "task_paths.yaml"
    paths.write_text(
        yaml.safe_dump(
            {
                "tokenizer": str(task_dir / "tokenizer"),
                "model": {"hf_path": str(task_dir / "model")},
                "train": {
                    "run_dir": str(run_dir),
                    "warmstart": {"path": str(task_dir / "sft.jsonl")},
                    **({"max_steps": args.steps} if args.steps else {}),
                },
                "data": {"train": [{"path": str(task_dir / "train.jsonl")}]},
                "validation": {"benchmarks": [str(task_dir / "heldout.jsonl")]},
            }
        )
    )
    run(
        [
            sys.executable,
            "-m",
            "megatron_ngrpo.launch",
            "run",
            "tiny",
            "--executor",
            "local",
            "--config",
            "configs/tiny_cpu.yaml",
            "--config",
            str(paths),
            "--hf-path",
            str(task_dir / "model"),
            *args.overrides,
        ]
    )

    hf_out = out / "hf"
    run(
        [
            sys.executable,
            "tools/convert_megatron_to_hf.py",
            "--input",
            str(run_dir),
            "--output",
            str(hf_out),
            "--hf-source",
            str(task_dir / "tokenizer"),
            "--overwrite",
            "--no-progress",
        ]
    )
    run(
        [
            sys.executable,
            "tools/plot_metrics.py",
            str(run_dir),
            "--title",
            "tiny N-GRPO (CPU, TP=2)",
        ]
    )

    rows = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line
    ]
    window = max(1, min(10, len(rows) // 2))  # per-step rewards are noisy (16 prompts a step)
    mean = lambda part, key: sum(r[key] for r in part) / len(part)  # noqa: E731
    summary = {
        "steps": rows[-1]["step"],
        f"reward_first_{window}_steps": mean(rows[:window], "reward/mean"),
        f"reward_last_{window}_steps": mean(rows[-window:], "reward/mean"),
        "validation": {r["step"]: r["val/mean@4"] for r in rows if "val/mean@4" in r},
        "run_dir": str(run_dir),
        "hf_export": str(hf_out),
        "plot": str(run_dir / "metrics.png"),
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
