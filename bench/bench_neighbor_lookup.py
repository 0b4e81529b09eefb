"""A GRPO step on the real model with N-GRPO mixing, per neighbour lookup mode, vs plain GRPO.

    OMP_NUM_THREADS=1 python -m bench.bench_neighbor_lookup [--max-seconds 600] [--modes on_demand,table]

One process, built-in Megatron engine, SmolLM2-135M-Instruct (HF folder ``--model``, V = 49,152,
d = 576, fp32), the arithmetic prompts of examples/arithmetic, 4 prompts × 4 samples, 48 new
tokens, ρ = 0.1, k = 3, ``refresh_every: 1`` (issue #33's setting). One ``Trainer``; each mode's
steps alternate with plain steps (``mixing.strategy: none``) in interleaved pairs
(``bench/_timing.py``, process CPU time; the policy keeps training, both members of a pair see
the same drift). Printed per mode: the step ratio mode / plain with its 95% interval (goal for
on_demand: ≤ 1.10), and the neighbour search's share of the mixed step: the trainer's
``time/neighbor_table`` phase (table) or the engine's on-demand lookup seconds (rows searched,
inside the rollout), each over that step's wall time. Also the inputs of ``auto``'s rule
(``MixingConfig.lookup_mode``) measured here: seconds per table row and per on-demand row.
Results → bench/results/neighbor_lookup.md.

    python -m bench.bench_neighbor_lookup --row-cost [--shape 152064x3584] [--device cuda]

The rule's constant alone: seconds per row of the whole table (``build_neighbor_table``) and per
on-demand row at 1, 4 and 16 new anchors per search (``NeighborLookup.ensure``; the median of
repeated searches of fresh anchors), their ratios, on the real matrix (default) or a random
Gaussian matrix of a given shape (the 7B shape: Qwen2.5-7B's V × d), fp32, cosine, k = 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

from bench._timing import compare

DEFAULT_MODEL = "/root/.cache/megatron_ngrpo/models/SmolLM2-135M-Instruct"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-seconds", type=float, default=600.0, help="per mode")
    p.add_argument("--modes", default="on_demand,table")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--row-cost", action="store_true", help="only the per-row costs of auto's rule")
    p.add_argument("--shape", default="", help="VxD of a random matrix instead of the real one")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    if args.row_cost:
        print(row_cost(args.model, args.shape, args.device))
        return

    from megatron_ngrpo.mixing.config import ON_DEMAND_ROW_COST
    from megatron_ngrpo.mixing.neighbors import NeighborLookup
    from megatron_ngrpo.training.job_config import load_config
    from megatron_ngrpo.training.neighbor_source import NeighborSource
    from megatron_ngrpo.training.trainer import Trainer
    from tests.slurm_harness import write_arithmetic_task

    repo = Path(__file__).resolve().parents[1]
    root = Path(tempfile.mkdtemp(prefix="bench_neighbor_lookup_"))
    write_arithmetic_task(root)
    overrides = [
        f"tokenizer={args.model}",
        f"model.hf_path={args.model}",
        "train.load=''",
        "model.make_vocab_size_divisible_by=128",
        f"train.run_dir={root / 'run'}",
        f"data.train=[{{path: {root / 'train.jsonl'}}}]",
        "data.template.kind=plain",
        "mixing.rate=0.1",
        "mixing.refresh_every=1",
        "rollout.n=4",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "train.prompts_per_step=4",
        "train.mini_batch_prompts=4",
        "train.micro_batch_size=4",
        "train.max_steps=100000",
        "train.save_every=0",
        "optim.lr=1e-6",
    ]
    cfg = load_config([repo / "configs" / "tiny_test.yaml"], overrides)
    trainer = Trainer(cfg)
    trainer.setup()
    shares: dict[str, list[float]] = {}
    searched: dict[str, list[int]] = {}

    def source(strategy: str, lookup: str) -> NeighborSource:
        mixing = dataclasses.replace(cfg.mixing, strategy=strategy, neighbor_lookup=lookup)
        mode = lookup if strategy == "neighbor" else "none"
        return NeighborSource(mixing, mode, trainer.neighbors.build_table)

    def step(neighbors: NeighborSource):
        def run():
            trainer.rollouts.neighbors = neighbors
            t0 = time.perf_counter()
            out = trainer.train_step()
            wall = time.perf_counter() - t0
            trainer.step += 1
            if neighbors.mode != "none":
                found = [
                    v
                    for v in trainer.rollouts.engine._derived.values()
                    if isinstance(v, NeighborLookup)
                ]
                search = found[0].seconds if found else out.get("time/neighbor_table", 0.0)
                shares.setdefault(neighbors.mode, []).append(search / wall)
                if found:
                    searched.setdefault(neighbors.mode, []).append(found[0].rows_computed)
            return None

        return run

    lines = []
    plain = step(source("none", "auto"))
    for mode in args.modes.split(","):
        r = compare(
            step(source("neighbor", mode)),
            plain,
            label=f"GRPO step, mixing ({mode}) / plain",
            max_seconds=args.max_seconds,
            min_pairs=12,
        )
        share = shares[mode]
        lines.append(str(r))
        lines.append(
            f"  {mode}: neighbour search share of the mixed step: median {statistics.median(share):.3f} "
            f"(min {min(share):.3f}, max {max(share):.3f}, {len(share)} steps)"
            + (
                f"; rows searched per step: median {statistics.median(searched[mode])}"
                if mode in searched
                else ""
            )
        )
        print(lines[-2], lines[-1], sep="\n", flush=True)
    cost = ON_DEMAND_ROW_COST["cpu"]
    print(
        f"auto's rule on CPU: on_demand when rate · positions · {cost} < V; here "
        f"{cfg.mixing.rate} · {4 * 4 * args.max_new_tokens} · {cost} = "
        f"{cfg.mixing.rate * 16 * args.max_new_tokens * cost:.0f} vs V = 49152 → "
        f"{cfg.mixing.lookup_mode(16 * args.max_new_tokens, 49152)}"
    )


def row_cost(model: str, shape: str, device: str) -> str:
    """Seconds per table row and per on-demand row (1, 4, 16 anchors per search), and ratios."""
    import torch

    from megatron_ngrpo.mixing.neighbors import NeighborLookup, build_neighbor_table

    if shape:
        v, d = (int(x) for x in shape.split("x"))
        weight = torch.randn(v, d, generator=torch.Generator().manual_seed(0)).to(device)
        what = f"random {v} x {d}"
    else:
        from safetensors import safe_open

        with safe_open(str(Path(model) / "model.safetensors"), "pt") as f:
            weight = f.get_tensor("model.embed_tokens.weight").float().to(device)
        what = f"{Path(model).name} {tuple(weight.shape)}"
    sync = torch.cuda.synchronize if weight.is_cuda else (lambda: None)
    v = weight.shape[0]
    order = torch.randperm(v, generator=torch.Generator().manual_seed(1))
    lookup = NeighborLookup(weight, 0, 3)
    lookup.ensure(order[:16])  # key rows prepared, warm
    per_row, used = {}, 16
    for batch in (1, 4, 16):
        times = []
        for _ in range(max(3, 48 // batch)):
            sync()
            t0 = time.perf_counter()
            lookup.ensure(order[used : used + batch])
            sync()
            times.append((time.perf_counter() - t0) / batch)
            used += batch
        per_row[batch] = statistics.median(times)
    build_neighbor_table(weight[:4096], 0, 3)  # warm-up (kernels, the screen dtype's timing)
    sync()
    t0 = time.perf_counter()
    build_neighbor_table(weight, 0, 3)
    sync()
    table_row = (time.perf_counter() - t0) / v
    rows = ", ".join(
        f"{b} per search {t * 1e3:.3f} ms = {t / table_row:.1f} table rows"
        for b, t in per_row.items()
    )
    return f"{what} on {device}: table {table_row * 1e3:.4f} ms per row ({table_row * v:.2f} s); on-demand rows: {rows}"


if __name__ == "__main__":
    main()
