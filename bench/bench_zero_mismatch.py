"""Cost of the zero-mismatch mode (``rollout.batch_invariant``), side by side in one run.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 1 -m bench.bench_zero_mismatch [--max-seconds 240]
        [--model DIR] [--set train.prompts_per_step=2 ...]
        [--engine-prompts 8 --engine-new-tokens 16]

One process (TP 1), configs/tiny_test.yaml on the arithmetic task of ``examples/arithmetic``
(mixing on, ρ = 0.3, the built-in engine); ``--model DIR`` puts an HF folder's weights and
tokenizer in place of the tiny model (the SmolLM2 shape: ``--model
~/.cache/megatron_ngrpo/models/SmolLM2-135M-Instruct``, scripts/setup_real_model.sh builds it);
``--set`` overrides the config (e.g. a smaller batch for that shape, as in
bench/results/zero_mismatch.md). One ``Trainer``; its chunks and engine are switched between
the two forwards (``models.batch_invariant.enable/disable_batch_invariant``) before each
timed call, so both see the same weights drift:

* GRPO step: the mode with ``grpo.old_logprobs = rollout`` (exact, so the old-log-prob replay is
  skipped) / the default forward with ``grpo.old_logprobs = recompute`` — whole train steps
  (rollout, reward, replays, update);
* engine: tokens per second of the mode / the default, the same prompts and sampling.

Ratios from ``bench/_timing.py`` (process CPU time, interleaved pairs, median with its 95%
interval); the gap of each step's engine log-probs to the trainer's replay is printed for both
(``logprob_gap/max_abs`` of a recompute step). Results → bench/results/zero_mismatch.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench._timing import compare


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-seconds", type=float, default=240.0)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument(
        "--model",
        type=Path,
        help="an HF folder (e.g. SmolLM2-135M-Instruct): its weights and tokenizer",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override (repeatable), e.g. train.prompts_per_step=2",
    )
    ap.add_argument("--engine-prompts", type=int, default=8)
    ap.add_argument("--engine-new-tokens", type=int, default=16)
    args = ap.parse_args()

    import torch.distributed as dist

    from megatron_ngrpo.models.batch_invariant import (
        disable_batch_invariant,
        enable_batch_invariant,
    )
    from megatron_ngrpo.rollout.types import SamplingParams
    from megatron_ngrpo.training.job_config import load_config
    from megatron_ngrpo.training.trainer import Trainer
    from tests.slurm_harness import write_arithmetic_task

    repo = Path(__file__).resolve().parents[1]
    root = Path(tempfile.mkdtemp(prefix="bench_zero_mismatch_"))
    write_arithmetic_task(root, hidden_size=args.hidden, num_layers=args.layers)
    cfg = load_config(
        [repo / "configs" / "tiny_test.yaml", root / "paths.yaml"],
        [f"train.run_dir={root / 'run'}", "train.max_steps=100000", "train.save_every=0"]
        + ([f"model.hf_path={args.model}", f"tokenizer={args.model}"] if args.model else [])
        + args.set,
    )
    trainer = Trainer(cfg)
    trainer.setup()
    engine, grpo = trainer.rollouts.engine, trainer.loss_inputs.cfg

    def mode(on: bool) -> None:
        (enable_batch_invariant if on else disable_batch_invariant)(trainer.chunks)
        engine.batch_invariant = on
        grpo.old_logprobs = "rollout" if on else "recompute"

    gaps = {True: [], False: []}

    def step(on: bool):
        def run():
            mode(on)
            trainer.train_step()
            trainer.step += 1

        return run

    def gap(on: bool) -> float:
        mode(on)
        grpo.old_logprobs = "recompute"
        out = trainer.train_step()
        trainer.step += 1
        return out["logprob_gap/max_abs"]

    for on in (True, False):
        gaps[on] = [gap(on) for _ in range(2)]
    steps = compare(
        step(True),
        step(False),
        label="GRPO step, batch-invariant + rollout old log-probs / default + recompute",
        max_seconds=args.max_seconds,
        group=dist.group.WORLD,
    )
    if dist.get_rank() == 0:
        print(f"max |engine - replay| per step, mode on: {gaps[True]}, off: {gaps[False]}")
        print(steps, flush=True)
    vocab = engine.num_real_tokens
    prompts = [[(7 * i + j) % vocab for j in range(20)] for i in range(args.engine_prompts)]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=args.engine_new_tokens, seed=3)

    def generate(on: bool):
        def run():
            mode(on)
            out = engine.generate(prompts, params)
            return sum(len(r) for r in out.response_ids)

        return run

    tokens = compare(
        generate(True),
        generate(False),
        label="engine tokens/s, batch-invariant / default",
        kind="rate",
        max_seconds=args.max_seconds,
        group=dist.group.WORLD,
    )
    if dist.get_rank() == 0:
        print(tokens)


if __name__ == "__main__":
    main()
