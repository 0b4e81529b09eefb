"""Training throughput and MFU of the 1.5B shape (DeepSeek-R1-Distill-Qwen-1.5B) on one GPU.

    python -m bench.bench_mfu [--seq 4096 --micro-batch 1 --micro-batches 4 --steps 5 --peak-tflops 989.4]

GPU only (written for one H100 SXM: bf16 dense peak 989.4 TFLOP/s; pass --peak-tflops for other
parts). Builds the 1.5B architecture (28 layers, hidden 1536, FFN 8960, 12 heads, 2 KV heads,
vocab 151936, tied embeddings) with random weights, bf16, Transformer-Engine layer spec when it
imports, recompute off; runs full GRPO optimizer steps (``grpo.update.loss_and_grads`` on
``micro-batches`` × ``micro-batch`` sequences of ``seq`` tokens, prompt quarter / response three
quarters, then the megatron optimizer step), with and without mixing records (ρ = 0.1, k = 3).

Reported: tokens/s (all tokens of the step / median step time) and MFU = model FLOPs / time /
peak, model FLOPs per token = 3 × forward (QKV + output projections, causal attention scores,
SwiGLU MLP, LM head), recomputation not counted.
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

SHAPE = dict(
    num_layers=28,
    hidden_size=1536,
    intermediate_size=8960,
    num_heads=12,
    num_kv_heads=2,
    vocab_size=151936,
    tied=True,
)


def _args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=989.4)
    # auto = TE on a GPU (refused where TE does not import); local = megatron's local spec
    p.add_argument("--layer-spec", default="auto", choices=("auto", "te", "local"))
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def flops_per_token(seq: int) -> float:
    """Training FLOPs per token (3 × forward) of the SHAPE at sequence length ``seq``."""
    h, f, L, v = (
        SHAPE["hidden_size"],
        SHAPE["intermediate_size"],
        SHAPE["num_layers"],
        SHAPE["vocab_size"],
    )
    d = h // SHAPE["num_heads"]
    kv = SHAPE["num_kv_heads"] * d
    per_layer = (
        2 * h * (h + 2 * kv) + 2 * h * h + 2 * seq * h + 2 * 3 * h * f
    )  # causal: half of 4·s·h
    return 3.0 * (L * per_layer + 2 * h * v)


def main(argv=None) -> dict:
    if not torch.cuda.is_available():
        sys.exit("bench_mfu.py needs a GPU (it measures tokens/s and MFU on one H100)")
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

    args = _args(argv)
    init_distributed()
    initialize_model_parallel(1, 1, None, seed=0)
    hf = write_tiny_hf(tempfile.mkdtemp(), weights=False, max_pos=args.seq, **SHAPE)
    chunks = wrap_for_training(
        build_model(
            ModelConfig(
                hf_path=str(hf), dtype="bfloat16", max_seq_len=args.seq, layer_spec=args.layer_spec
            )
        )
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-6, bf16=True, params_dtype=torch.bfloat16, clip_grad=1.0
        ),
        chunks,
    )
    unwrap(chunks[0]).config.grad_scale_func = optimizer.scale_loss

    n = args.micro_batch * args.micro_batches
    plen, rlen = args.seq // 4, args.seq - args.seq // 4
    g = torch.Generator().manual_seed(0)
    v = SHAPE["vocab_size"]
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
    dev = torch.device("cuda")
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

    out = {"shape": SHAPE, "args": vars(args), "device": torch.cuda.get_device_name()}
    tokens = n * args.seq
    for name, tb in (("plain", plain), ("mixed", mixed)):
        step(tb)  # warm-up
        times = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(tb)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        mfu = flops_per_token(args.seq) * tokens / t / (args.peak_tflops * 1e12)
        out[name] = {
            "step_s": t,
            "tokens_per_s": tokens / t,
            "mfu": mfu,
            "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
        print(
            f"{name}: {t:.3f} s/step, {tokens / t:,.0f} tokens/s, MFU {100 * mfu:.1f}%", flush=True
        )
    out["mixed_over_plain"] = out["mixed"]["step_s"] / out["plain"]["step_s"]
    print(f"mixed / plain step time: {out['mixed_over_plain']:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
