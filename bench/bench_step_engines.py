"""N-GRPO train step with colocated vLLM rollouts vs the built-in Megatron engine, same job.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/bench_step_engines.py [--max-seconds 240]

Two gloo ranks, trainer TP=2, vLLM TP=2 (one in-process worker per rank), the arithmetic task of
``examples/arithmetic`` (head_dim 32 for vLLM's CPU attention), mixing on (ρ = 0.3, k = 3). One
``Trainer`` is set up with the Megatron engine; a colocated vLLM engine is built beside it, and
whole train steps (weight sync, rollout, reward, replay, update) alternate between the two
engines, timed in interleaved pairs by ``bench/_timing.py`` (process CPU time of rank 0; the
decision to stop is joint). Steps keep training the same policy, so both engines see the same
weights drift. Also printed: the weight-sync seconds per M parameters (excluding the neighbour
table, which the trainer builds) and the table build. Results → bench/results/engines.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _timing import compare  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-seconds", type=float, default=240.0)
    args = p.parse_args()

    import torch.distributed as dist

    from megatron_ngrpo.rollout.factory import build_engine
    from megatron_ngrpo.training.job_config import load_config
    from megatron_ngrpo.training.trainer import Trainer
    from slurm_harness import write_arithmetic_task

    repo = Path(__file__).resolve().parents[1]
    root = Path(tempfile.mkdtemp(prefix="bench_step_engines_"))
    write_arithmetic_task(root, hidden_size=128)
    common = [f"train.run_dir={root / 'run'}", "model.tensor_parallel=2", "rollout.vllm.tensor_parallel=2",
              "rollout.vllm.max_model_len=64", "train.max_steps=1000", "train.save_every=0"]
    cfg = load_config([repo / "configs" / "tiny_test.yaml", root / "paths.yaml"], common)
    trainer = Trainer(cfg)
    trainer.setup()
    vllm_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="vllm"))
    engines = {"megatron": trainer.engine,
               "vllm": build_engine(vllm_cfg, trainer.chunks, tokenizer=trainer.tokenizer, seed=cfg.train.seed)}
    syncs = []

    def step(name: str):
        def run():
            trainer.engine = engines[name]
            out = trainer.train_step()
            trainer.step += 1
            if name == "vllm":
                syncs.append((out["weight_sync/load_seconds"], out["weight_sync/num_params"]))
            return None
        return run

    result = compare(step("vllm"), step("megatron"), label="train step, vLLM / Megatron engine",
                     max_seconds=args.max_seconds, min_pairs=8, group=dist.group.WORLD)
    trainer.table = None  # force a rebuild: its time, separately from the weight sync
    t0 = time.perf_counter()
    trainer._refresh_table()
    table_s = time.perf_counter() - t0
    if dist.get_rank() == 0:
        print(result)
        per_m = sorted(s / (n / 1e6) for s, n in syncs)
        print(f"vLLM weight sync (excluding the table): median {per_m[len(per_m) // 2]:.4f} s per M params "
              f"({len(per_m)} syncs, {syncs[0][1] / 1e6:.2f} M params); neighbour table build {table_s:.4f} s")
    engines["vllm"].close()


if __name__ == "__main__":
    main()
