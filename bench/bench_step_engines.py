"""N-GRPO train step with colocated vLLM rollouts vs the built-in Megatron engine, same job.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m bench.bench_step_engines [--max-seconds 240]
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m bench.bench_step_engines --sync-only --hidden 512 --layers 4

Two gloo ranks, trainer TP=2, vLLM TP=2 (one in-process worker per rank), the arithmetic task of
``examples/arithmetic`` (head_dim 32 for vLLM's CPU attention), mixing on (ρ = 0.3, k = 3). One
``Trainer`` is set up with the Megatron engine; a colocated vLLM engine is built beside it, and
whole train steps (weight sync, rollout, reward, replay, update) alternate between the two
engines, timed in interleaved pairs by ``bench/_timing.py`` (process CPU time of rank 0; the
decision to stop is joint). Steps keep training the same policy, so both engines see the same
weights drift. Also printed: the weight-sync seconds per M parameters (excluding the neighbour
table, which the trainer builds) and the table build.

Weight sync alone (also with ``--sync-only``): the vLLM engine's ``gloo`` weight-transfer route
(rollout/vllm/weight_transfer.py, buckets of ``rollout.vllm.sync_bucket_mb``) against the ``reload``
route (per-tensor ``reload_weights``), interleaved pairs of whole syncs of the trainer's weights
(TP gather included, neighbour table excluded): process CPU seconds per M parameters of each
(median, with the 95% interval of the median) and their ratio. Results →
bench/results/engines.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from bench._timing import compare, median_interval


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-seconds", type=float, default=240.0)
    p.add_argument("--sync-only", action="store_true", help="only the weight-sync comparison")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    args = p.parse_args()

    import torch.distributed as dist

    from megatron_ngrpo.rollout.factory import build_engine
    from megatron_ngrpo.training.job_config import load_config
    from megatron_ngrpo.training.trainer import Trainer
    from tests.slurm_harness import write_arithmetic_task

    repo = Path(__file__).resolve().parents[1]
    root = Path(tempfile.mkdtemp(prefix="bench_step_engines_"))
    write_arithmetic_task(root, hidden_size=args.hidden, num_layers=args.layers)
    common = [
        f"train.run_dir={root / 'run'}",
        "model.tensor_parallel=2",
        "rollout.vllm.tensor_parallel=2",
        "rollout.vllm.max_model_len=64",
        "train.max_steps=1000",
        "train.save_every=0",
        "rollout.vllm.weight_transfer=gloo",
        f"rollout.vllm.sync_bucket_mb={args.bucket_mb}",
    ]
    cfg = load_config([repo / "configs" / "tiny_test.yaml", root / "paths.yaml"], common)
    trainer = Trainer(cfg)
    trainer.setup()
    vllm_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="vllm"))
    engines = {
        "megatron": trainer.rollouts.engine,
        "vllm": build_engine(
            vllm_cfg, trainer.chunks, tokenizer=trainer.tokenizer, seed=cfg.train.seed
        ),
    }
    sync = weight_sync_comparison(engines["vllm"], trainer.chunks, args.max_seconds)
    if args.sync_only:
        if dist.get_rank() == 0:
            print(sync)
        engines["vllm"].close()
        return
    syncs, n_model = [], model_params(engines["vllm"], trainer.chunks)

    def step(name: str):
        def run():
            trainer.rollouts.engine = engines[name]
            out = trainer.train_step()
            trainer.step += 1
            if name == "vllm":  # per M parameters of the model (a rank loads fewer shard-to-shard)
                syncs.append((out["weight_sync/load_seconds"], n_model))
            return None

        return run

    result = compare(
        step("vllm"),
        step("megatron"),
        label="train step, vLLM / Megatron engine",
        max_seconds=args.max_seconds,
        group=dist.group.WORLD,
    )
    trainer.neighbors.table = None  # force a rebuild: its time, separately from the weight sync
    t0 = time.perf_counter()
    trainer.neighbors.refresh(trainer.updates)
    table_s = time.perf_counter() - t0
    if dist.get_rank() == 0:
        print(result)
        per_m = sorted(s / (n / 1e6) for s, n in syncs)
        print(
            f"vLLM weight sync in train steps (excluding the table): median {per_m[len(per_m) // 2]:.4f} s "
            f"per M params ({len(per_m)} syncs, {syncs[0][1] / 1e6:.2f} M params); neighbour table build "
            f"{table_s:.4f} s"
        )
        print(sync)
    engines["vllm"].close()


def model_params(engine, chunks) -> int:
    """Parameters of the HF model the engine syncs."""
    import math

    from megatron_ngrpo.conversion.hf_export import export_hf_layout

    return sum(math.prod(shape) for _, shape, _ in export_hf_layout(chunks, engine.spec))


def weight_sync_comparison(engine, chunks, max_seconds: float) -> str:
    """gloo weight-transfer route vs reload route on one colocated engine, whole syncs in
    interleaved pairs (a collective of all ranks), shard-to-shard where the engine syncs so
    (``engine.tp_shards``); CPU seconds per M parameters of the model."""
    import torch.distributed as dist

    from megatron_ngrpo.conversion.hf_export import export_hf_tensors
    from megatron_ngrpo.rollout.vllm.weight_transfer import MegatronSource

    engine.sync_weights(chunks)  # builds the sender (the rendezvous is not a sync)
    num_params = model_params(engine, chunks)
    shards = engine.tp_shards

    def gloo():
        engine._sender.send(MegatronSource(chunks, engine.spec, tp_shards=shards))
        return num_params / 1e6

    def reload():
        engine.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": export_hf_tensors(chunks, engine.spec, tp_shards=shards)},
        )
        return num_params / 1e6

    r = compare(
        gloo,
        reload,
        label="weight sync, gloo / reload route",
        max_seconds=max_seconds / 2,
        group=dist.group.WORLD,
    )
    lines = [str(r)]
    for name, key in (("gloo", "a"), ("reload", "b")):
        c, w = (median_interval(r.samples[key][clock]) for clock in (0, 1))
        lines.append(
            f"{name} route: {c} CPU s per M params, wall {w} s per M params "
            f"({num_params / 1e6:.2f} M params, median [95% CI], {r.pairs} syncs, bucket "
            f"{engine.cfg.sync_bucket_mb:g} MiB, shard-to-shard: {'yes' if shards else 'no'})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
