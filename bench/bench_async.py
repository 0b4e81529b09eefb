"""Steps per hour of the tiny TP=2 N-GRPO job, synchronous vs one-step-off rollouts, same job.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m bench.bench_async [--max-seconds 240]

Two gloo ranks, trainer TP=2, the arithmetic task of ``examples/arithmetic`` (configs/tiny_test.yaml:
mixing ρ = 0.3, k = 3), ``train.async.max_staleness: 1``. One ``Trainer`` is set up; blocks of
``--block`` train steps alternate between one-step-off (the producer generates step n+1 on its
thread while step n trains; the block's first step fills the pipeline, its last launches
nothing) and synchronous (the same engine copy, generation then training), timed in
interleaved pairs by ``bench/_timing.py`` (steps per second; decision to stop joint). Both
modes keep training the same policy.

Also printed, from the steps' own metrics: the overlap achieved (the share of the background
generation time the trainer did not wait for) and the synchronous step's split into generation
and the rest; from that split, the speedup an ideal overlap would give, (G + T) / max(G, T), a
computation, not a measurement on a GPU. Results → bench/results/async.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench._timing import compare


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-seconds", type=float, default=240.0)
    p.add_argument("--block", type=int, default=5, help="train steps per timed block")
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args()

    import torch.distributed as dist

    from megatron_ngrpo.training.job_config import load_config
    from megatron_ngrpo.training.trainer import Trainer
    from tests.slurm_harness import write_arithmetic_task

    repo = Path(__file__).resolve().parents[1]
    root = Path(tempfile.mkdtemp(prefix="bench_async_"))
    write_arithmetic_task(root)
    overrides = [
        f"train.run_dir={root / 'run'}",
        "model.tensor_parallel=2",
        "train.async.max_staleness=1",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "train.max_steps=100000",
        "train.save_every=0",
    ]
    cfg = load_config([repo / "configs" / "tiny_test.yaml", root / "paths.yaml"], overrides)
    trainer = Trainer(cfg)
    trainer.setup()
    producer = trainer.rollouts.producer
    seen = {"async": [], "sync": []}  # (step wall seconds, metrics) per step

    def block(mode: str):
        def run():
            trainer.rollouts.producer = producer if mode == "async" else None
            trainer.total_steps = (
                trainer.step + args.block
            )  # the block's last step launches nothing
            for _ in range(args.block):
                t0 = time.perf_counter()
                out = trainer.train_step()
                seen[mode].append((time.perf_counter() - t0, out))
                trainer.step += 1
            return args.block

        return run

    result = compare(
        block("async"),
        block("sync"),
        kind="rate",
        label="steps/s, one-step-off / synchronous",
        max_seconds=args.max_seconds,
        group=dist.group.WORLD,
    )
    if dist.get_rank() == 0:
        print(
            f"{cfg.rollout.n} x {cfg.train.prompts_per_step} responses per step, {args.max_new_tokens} new "
            f"tokens max, blocks of {args.block} steps"
        )
        print(result)
        per_step = {
            m: statistics.median(result.samples[k][1])
            for m, k in (("one-step-off", "a"), ("synchronous", "b"))
        }
        print(
            "wall steps/hour (median over blocks, each block's pipeline-filling first step included): "
            + ", ".join(f"{m} {3600 / s:.0f}" for m, s in per_step.items())
        )
        # Overlapped steps only: every async step but each block's first, which generates in line.
        steady = [m for _, m in seen["async"] if m["async/staleness"] == 1]
        gen = sum(m["async/generation_s"] for m in steady)
        waited = sum(m["async/training_waits_generation_s"] for m in steady)
        idle = sum(m["async/generation_waits_training_s"] for m in steady)
        print(
            f"one-step-off, {len(steady)} overlapped steps: background generation {gen / len(steady):.3f} s/step, "
            f"trainer waited {waited / len(steady):.3f} s/step, engine idle {idle / len(steady):.3f} s/step; "
            f"overlap achieved {1 - waited / gen:.1%} of generation time"
        )
        g = statistics.median(m["time/rollout"] for _, m in seen["sync"])
        step = statistics.median(s for s, _ in seen["sync"])
        t = step - g
        print(
            f"synchronous step: median {step:.3f} s = generation {g:.3f} s + rest {t:.3f} s "
            f"(generation {g / step:.0%})"
        )
        print(
            f"computed, not measured: with ideal overlap a step takes max(G, T) instead of G + T, "
            f"a {step / max(g, t):.2f}x speedup at this split"
        )
    producer.close()


if __name__ == "__main__":
    main()
