"""Launcher-test workload (not shipped): a real megatron-core forward pass of the configured model
on every rank, with the trainer's command line (``--config FILE.yaml [a.b=c ...]``).

The launcher tests run it with ``ngrpo-launch run ... --module smoke_workload`` (``tests/`` on the
job's PYTHONPATH) where they check the launch itself (ranks, nodes, TP, the memory model's
parameter count) rather than training: it builds the model of ``model.*`` (TP from the config,
DP the rest of the world), runs one forward with megatron's vocab-parallel cross entropy on
seeded random tokens, and writes ``{"loss", "world_size", "tp", "nodes", ...}`` from rank 0 to
``smoke.out``.

Model weights are megatron's CPU initialisation from ``smoke.seed``; every TP layout slices the same
full matrices, so the loss is independent of the layout.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ngrpo.config_loader import ConfigError, fail, load
from megatron_ngrpo.models.config import ModelConfig
from megatron_ngrpo.rollout.config import RolloutConfig


@dataclass
class SmokeOptions:
    out: str = ""
    batch: int = 2
    seq_len: int = 32
    seed: int = 1234


@dataclass
class SmokeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    smoke: SmokeOptions = field(default_factory=SmokeOptions)


def tokens(cfg: SmokeConfig, vocab_size: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(cfg.smoke.seed)
    return torch.randint(0, vocab_size, (cfg.smoke.batch, cfg.smoke.seq_len), generator=g).tolist()


def forward(cfg: SmokeConfig) -> dict:
    """One forward pass on every rank; the mean token loss (the same on all ranks)."""
    import torch
    import torch.distributed as dist

    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel

    spec = ArchSpec.from_hf(cfg.model.hf_path)
    ids = tokens(cfg, spec.vocab_size)
    init_distributed()
    initialize_model_parallel(
        cfg.model.tensor_parallel, cfg.model.pipeline_parallel, seed=cfg.smoke.seed
    )
    torch.manual_seed(cfg.smoke.seed)
    (model,) = build_model(cfg.model)
    model.eval()
    x = torch.tensor(ids)
    b, s = x.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).expand(b, 1, s, s)
    with torch.no_grad():
        loss = model(x, torch.arange(s).expand(b, s), mask, labels=x.roll(-1, dims=1))
    nodes = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, os.environ.get("SLURMD_NODENAME", socket.gethostname()))
    return {
        "loss": loss.float().mean().item(),
        "world_size": dist.get_world_size(),
        "tp": cfg.model.tensor_parallel,
        "nodes": nodes,
        "rank": dist.get_rank(),
        "params": sum(p.numel() for p in model.parameters()),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] != "--config":
        print("usage: python -m smoke_workload --config FILE.yaml [a.b=c ...]", file=sys.stderr)
        return 2
    try:
        cfg = load(SmokeConfig, argv[1], argv[2:])
        if cfg.model.pipeline_parallel != 1:
            fail(
                "model.pipeline_parallel",
                cfg.model.pipeline_parallel,
                "the smoke forward runs PP = 1 only",
            )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    result = forward(cfg)
    if result["rank"] == 0:
        print(
            f"SMOKE loss={result['loss']:.6f} world_size={result['world_size']} nodes={result['nodes']}",
            flush=True,
        )
        if cfg.smoke.out:
            Path(cfg.smoke.out).write_text(json.dumps(result))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
