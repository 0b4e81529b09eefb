"""Training throughput and MFU of the 1.5B shape (DeepSeek-R1-Distill-Qwen-1.5B) on one GPU.

    python -m bench.bench_mfu [--seq 4096 --micro-batch 1 --micro-batches 4 --steps 5 --peak-tflops 989.4]
        [--layer-spec local --attention sdpa|unfused] [--count-syncs] [--shape tiny]

GPU only (written for one H100 SXM: bf16 dense peak 989.4 TFLOP/s; pass --peak-tflops for other
parts), except ``--shape tiny`` (a few-layer model that also runs on CPU: scripts/gpu_bench.py's
``--dry`` mode). Builds the 1.5B architecture (28 layers, hidden 1536, FFN 8960, 12 heads, 2 KV
heads, vocab 151936, tied embeddings) with random weights, bf16, Transformer-Engine layer spec when
it imports (``--layer-spec local``: megatron's local spec, its core attention ``--attention``:
torch SDPA, the default, or megatron's unfused one), recompute off; runs full GRPO optimizer steps
(``grpo.update.loss_and_grads`` on ``micro-batches`` × ``micro-batch`` sequences of ``seq``
tokens, prompt quarter / response three quarters, then the megatron optimizer step), with and
without mixing records (ρ = 0.1, k = 3).

Reported per kind (plain, mixed): tokens/s (all tokens of the step / median step time), MFU =
model FLOPs / time / peak, model FLOPs per token = 3 × forward (QKV + output projections, causal
attention scores, SwiGLU MLP, LM head), recomputation (the log-prob pass's second output-layer
GEMM included) not counted, and the peak allocated memory of that kind's steps.
``--count-syncs``: one more step of each kind under torch.profiler, counting the host syncs in it
(CUDA runtime synchronisations, and ``aten::_local_scalar_dense``: device-to-host scalar reads
such as ``.item()``, which also counts on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.harness.records import mix_record

SHAPES = {
    "1.5b": dict(
        num_layers=28,
        hidden_size=1536,
        intermediate_size=8960,
        num_heads=12,
        num_kv_heads=2,
        vocab_size=151936,
        tied=True,
    ),
    "tiny": dict(
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        num_kv_heads=1,
        vocab_size=512,
        tied=True,
    ),
}
SHAPE = SHAPES["1.5b"]
# CUDA runtime calls that block the host until the device is done.
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=989.4)
    # auto = TE on a GPU (refused where TE does not import); local = megatron's local spec
    p.add_argument("--layer-spec", default="auto", choices=("auto", "te", "local"))
    p.add_argument("--attention", default="sdpa", choices=("sdpa", "unfused"))
    p.add_argument("--shape", default="1.5b", choices=tuple(SHAPES))
    p.add_argument("--count-syncs", action="store_true")
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def flops_per_token(seq: int, shape: dict = SHAPE) -> float:
    """Training FLOPs per token (3 × forward) of ``shape`` at sequence length ``seq``."""
    h, f, L, v = (
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_layers"],
        shape["vocab_size"],
    )
    d = h // shape["num_heads"]
    kv = shape["num_kv_heads"] * d
    per_layer = (
        2 * h * (h + 2 * kv) + 2 * h * h + 2 * seq * h + 2 * 3 * h * f
    )  # causal: half of 4·s·h
    return 3.0 * (L * per_layer + 2 * h * v)


def count_syncs(fn) -> dict[str, int]:
    """Host syncs while ``fn`` runs (torch.profiler): CUDA runtime synchronisations and
    device-to-host scalar reads."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
    names = [e.name for e in prof.events()]
    return {
        "cuda_syncs": sum(n in SYNC_EVENTS for n in names),
        "scalar_reads": names.count("aten::_local_scalar_dense"),
    }


def main(argv=None) -> dict:
    args = _args(argv)
    gpu = torch.cuda.is_available()
    if not gpu and args.shape != "tiny":
        sys.exit(
            "bench_mfu.py needs a GPU (it measures tokens/s and MFU on one H100); --shape tiny runs on CPU"
        )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ngrpo.architecture import unwrap
    from megatron_ngrpo.grpo.batches import TokenBatch
    from megatron_ngrpo.grpo.config import GRPOConfig
    from megatron_ngrpo.grpo.loss_inputs import LossInputs
    from megatron_ngrpo.grpo.update import (
        UpdateSettings,
        loss_and_grads,
        wrap_for_training,
    )
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel
    from megatron_ngrpo.rollout.types import RolloutBatch
    from tests.harness.tiny import write_tiny_hf

    shape = SHAPES[args.shape]
    init_distributed()
    initialize_model_parallel(1, 1, None, seed=0)
    hf = write_tiny_hf(tempfile.mkdtemp(), weights=False, max_pos=args.seq, **shape)
    dtype = torch.bfloat16 if gpu else torch.float32
    chunks = wrap_for_training(
        build_model(
            ModelConfig(
                hf_path=str(hf),
                dtype=str(dtype).removeprefix("torch."),
                max_seq_len=args.seq,
                layer_spec=args.layer_spec,
                attention=args.attention,
            )
        )
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-6,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            clip_grad=1.0,
        ),
        chunks,
    )
    unwrap(chunks[0]).config.grad_scale_func = optimizer.scale_loss

    n = args.micro_batch * args.micro_batches
    plen, rlen = args.seq // 4, args.seq - args.seq // 4
    g = torch.Generator().manual_seed(0)
    v = shape["vocab_size"]
    prompts = [torch.randint(0, v, (plen,), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(0, v, (rlen,), generator=g).tolist() for _ in range(n)]
    mixes = [
        [
            (p, torch.randint(0, v, (3,), generator=g).tolist(), [0.6, 0.3, 0.1])
            for p in torch.nonzero(torch.rand(rlen, generator=g) < 0.1).flatten().tolist()
        ]
        for _ in range(n)
    ]
    rb = RolloutBatch(
        prompts,
        responses,
        [[0.0] * rlen] * n,
        ["stop"] * n,
        mix_record(mixes, 3),
        [i // 4 for i in range(n)],
    )
    dev = torch.device("cuda" if gpu else "cpu")
    mixed = TokenBatch.from_rollout(rb, device=dev)
    lp = (torch.randn(mixed.tokens.shape, generator=g) * 0.1 - 3.0).to(dev) * mixed.mask
    mixed = mixed.with_inputs(
        LossInputs(
            old_logprobs=lp,
            ref_logprobs=lp + 0.01,
            advantages=torch.randn(n, generator=g).to(dev),
            active=torch.ones(n, dtype=torch.bool, device=dev),
        )
    )
    from dataclasses import replace

    plain = replace(mixed, mix=None)
    settings = UpdateSettings(
        temperature=1.0, micro_batch_size=args.micro_batch, max_response_len=rlen
    )
    cfg = GRPOConfig()

    def step(tb):
        loss_and_grads(chunks, tb, cfg, settings, optimizer)
        optimizer.step()

    out = {
        "shape": shape,
        "args": vars(args),
        "device": torch.cuda.get_device_name() if gpu else "cpu",
    }
    tokens = n * args.seq
    sync = torch.cuda.synchronize if gpu else lambda: None
    for name, tb in (("plain", plain), ("mixed", mixed)):
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        step(tb)  # warm-up
        times = []
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            step(tb)
            sync()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        mfu = flops_per_token(args.seq, shape) * tokens / t / (args.peak_tflops * 1e12)
        out[name] = {
            "step_s": t,
            "tokens_per_s": tokens / t,
            "mfu": mfu,
            "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        }
        if args.count_syncs:
            out[name]["syncs"] = count_syncs(lambda tb=tb: step(tb))
        print(
            f"{name}: {t:.3f} s/step, {tokens / t:,.0f} tokens/s, MFU {100 * mfu:.1f}%"
            + (f", peak {out[name]['max_memory_gib']:.1f} GiB" if gpu else "")
            + (f", host syncs {out[name]['syncs']}" if args.count_syncs else ""),
            flush=True,
        )
    out["mixed_over_plain"] = out["mixed"]["step_s"] / out["plain"]["step_s"]
    print(f"mixed / plain step time: {out['mixed_over_plain']:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
