"""Stand-in workload for launcher tests: a real megatron-core forward pass of the configured model
on every rank, with the trainer's command line (``--config FILE.yaml [a.b=c ...]``).

Runs in place of ``megatron_ngrpo.train`` / ``megatron_ngrpo.eval`` (``ngrpo-launch --module
megatron_ngrpo.launch.smoke``) where those cannot run (the CPU test cluster). Modes (``smoke.mode``):

* ``forward``: build the model of ``model.*`` (TP from the config, DP the rest of the world), run
  one forward with megatron's vocab-parallel cross entropy on seeded random tokens, and write
  ``{"loss", "world_size", "tp", "nodes", ...}`` from rank 0 to ``smoke.out``. With
  ``smoke.port`` set, the tokens come from the rollout group's server at
  ``$NGRPO_ROLLOUT_HOST:port`` instead (disaggregated jobs).
* ``serve``: serve the seeded tokens over HTTP on ``smoke.port`` until killed (stands in for the
  rollout group's vLLM server).

Model weights are megatron's CPU initialisation from ``smoke.seed``; every TP layout slices the same
full matrices, so the loss is independent of the layout.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from megatron_ngrpo.config_loader import ConfigError, fail, load
from megatron_ngrpo.models.config import ModelConfig
from megatron_ngrpo.rollout.config import RolloutConfig


@dataclass
class SmokeOptions:
    mode: str = "forward"  # forward | serve
    out: str = ""
    batch: int = 2
    seq_len: int = 32
    seed: int = 1234
    port: int = 0

    def validate(self) -> None:
        if self.mode not in ("forward", "serve"):
            fail("mode", self.mode, "expected 'forward' or 'serve'")
        if self.mode == "serve" and not self.port:
            fail("port", self.port, "serve needs a port")


@dataclass
class SmokeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    smoke: SmokeOptions = field(default_factory=SmokeOptions)


def tokens(cfg: SmokeConfig, vocab_size: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(cfg.smoke.seed)
    return torch.randint(0, vocab_size, (cfg.smoke.batch, cfg.smoke.seq_len), generator=g).tolist()


def serve(cfg: SmokeConfig, vocab_size: int) -> None:
    body = json.dumps({"tokens": tokens(cfg, vocab_size), "host": socket.gethostname()}).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

    print(f"SMOKE serving on port {cfg.smoke.port}", flush=True)
    HTTPServer(("0.0.0.0", cfg.smoke.port), Handler).serve_forever()


def fetch(port: int, timeout_s: float = 120.0) -> list[list[int]]:
    """The rollout group's tokens; it may still be starting, so retry until ``timeout_s``."""
    import time

    url = f"http://{os.environ['NGRPO_ROLLOUT_HOST']}:{port}/"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.loads(r.read())["tokens"]
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def forward(cfg: SmokeConfig) -> dict:
    """One forward pass on every rank; the mean token loss (the same on all ranks)."""
    import torch
    import torch.distributed as dist

    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel

    spec = ArchSpec.from_hf(cfg.model.hf_path)
    ids = fetch(cfg.smoke.port) if cfg.smoke.port else tokens(cfg, spec.vocab_size)
    init_distributed()
    initialize_model_parallel(cfg.model.tensor_parallel, cfg.model.pipeline_parallel, seed=cfg.smoke.seed)
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
    return {"loss": loss.float().mean().item(), "world_size": dist.get_world_size(),
            "tp": cfg.model.tensor_parallel, "nodes": nodes, "tokens_from_server": bool(cfg.smoke.port),
            "rank": dist.get_rank(), "params": sum(p.numel() for p in model.parameters())}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] != "--config":
        print("usage: python -m megatron_ngrpo.launch.smoke --config FILE.yaml [a.b=c ...]", file=sys.stderr)
        return 2
    try:
        cfg = load(SmokeConfig, argv[1], argv[2:])
        if cfg.model.pipeline_parallel != 1:
            fail("model.pipeline_parallel", cfg.model.pipeline_parallel, "the smoke forward runs PP = 1 only")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if cfg.smoke.mode == "serve":
        from megatron_ngrpo.architecture import ArchSpec

        serve(cfg, ArchSpec.from_hf(cfg.model.hf_path).vocab_size)
        return 0
    result = forward(cfg)
    if result["rank"] == 0:
        print(f"SMOKE loss={result['loss']:.6f} world_size={result['world_size']} nodes={result['nodes']}",
              flush=True)
        if cfg.smoke.out:
            Path(cfg.smoke.out).write_text(json.dumps(result))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
