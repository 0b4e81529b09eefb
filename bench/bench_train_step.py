"""GRPO train step with mixing records vs without, on the same batch (goal ≤ 1.01×).

    OMP_NUM_THREADS=1 python -m bench.bench_train_step [--hidden 256 --layers 4 --vocab 32768 --batch 8 --prompt 64 --response 192]

One process, TP=1, megatron GPTModel (local spec, fp32) wrapped in DDP as the trainer wraps it.
The same right-padded replay batch is run through ``grpo.update.loss_and_grads`` (forward +
backward of the clipped GRPO loss with KL, global aggregation) and through the forward-only
``grpo.logprobs.batch_logprobs`` (old / reference log-probs), once with its mixing records
(ρ = 0.1 of response positions, k = 3) and once without, timed in interleaved pairs by
``bench/_timing.py`` (process CPU time; on a shared machine wall time mostly measures waiting for
a core): median ratio over A B / B A blocks with its 95% interval, repeated until ±1.5% or
``--max-seconds``. Results → bench/results/train.md.

``--hf DIR``: the real model of an HF folder (its shapes; weights are not needed for timing)
instead of the random tiny one; ``--vocab`` etc. are then the folder's. ``--memory``: instead of
the timing, the peak resident memory of the second train step of the mixed batch (DDP with fp32
grads, distributed Adam as the trainer builds it, ``loss_and_grads`` + ``optimizer.step``)
against ``launch.memory.train_memory`` for the same shapes (CPU number formats, megatron's unfused
local-spec attention, no fixed overhead term: the peak is measured above the resident size before
the model is built). glibc is told to serve allocations ≥ 64 KiB by mmap and return freed
memory at once (the process re-executes itself with that environment), so the resident size
follows the live tensors, as in tests/dist/memory_worker.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from bench._timing import compare
from tests.harness.records import mix_record

# glibc: mmap every allocation >= 64 KiB and give freed memory back at once (--memory).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=192)
    p.add_argument("--rate", type=float, default=0.1)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--max-seconds", type=float, default=300.0)
    p.add_argument("--out", default="")
    p.add_argument("--hf", default="", help="HF folder of a real model (its shapes)")
    p.add_argument("--recompute", action="store_true", help="full activation recomputation")
    p.add_argument("--memory", action="store_true", help="peak memory vs the memory model only")
    args = p.parse_args(argv)
    if args.hf:
        from megatron_ngrpo.architecture import ArchSpec

        args.vocab = ArchSpec.from_hf(args.hf).vocab_size
    return args


def model_dir(args) -> str:
    """The HF folder whose config.json gives the shapes: ``--hf`` or a random tiny one."""
    from tests.harness.tiny import write_tiny_hf

    if args.hf:
        return args.hf
    return str(
        write_tiny_hf(
            tempfile.mkdtemp(),
            weights=False,
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=2 * args.hidden,
            max_pos=args.prompt + args.response,
        )
    )


def build(path: str, recompute: bool, ddp_config=None):
    from megatron_ngrpo.grpo.update import wrap_for_training
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel

    init_distributed()
    initialize_model_parallel(1, 1, None, seed=0)
    cfg = ModelConfig(hf_path=path, dtype="float32", layer_spec="local", recompute=recompute)
    return wrap_for_training(build_model(cfg), ddp_config)


def batch(args):
    """A replay batch with mixes, and the same batch without them."""
    from dataclasses import replace

    from megatron_ngrpo.grpo.batches import TokenBatch
    from megatron_ngrpo.grpo.loss_inputs import LossInputs
    from megatron_ngrpo.rollout.types import RolloutBatch

    g = torch.Generator().manual_seed(0)
    b, k = args.batch, args.k
    prompts = [torch.randint(0, args.vocab, (args.prompt,), generator=g).tolist() for _ in range(b)]
    responses = [
        torch.randint(0, args.vocab, (args.response,), generator=g).tolist() for _ in range(b)
    ]
    per_seq = []
    for _ in range(b):
        pos = torch.nonzero(torch.rand(args.response, generator=g) < args.rate).flatten().tolist()
        per_seq.append(
            [
                (
                    p,
                    torch.randint(0, args.vocab, (k,), generator=g).tolist(),
                    torch.softmax(torch.randn(k, generator=g), 0).tolist(),
                )
                for p in pos
            ]
        )
    rb = RolloutBatch(
        prompts,
        responses,
        [[0.0] * args.response] * b,
        ["stop"] * b,
        mix_record(per_seq, k),
        [i // 4 for i in range(b)],
    )
    mixed = TokenBatch.from_rollout(rb)
    lp = torch.randn(mixed.tokens.shape, generator=g) * 0.1 - 3.0
    mixed = mixed.with_inputs(
        LossInputs(
            old_logprobs=lp * mixed.mask,
            ref_logprobs=(lp + 0.01) * mixed.mask,
            advantages=torch.randn(b, generator=g),
            active=torch.ones(b, dtype=torch.bool),
        )
    )
    return mixed, replace(mixed, mix=None), len(rb.mixes) / (b * args.response)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def memory(args) -> dict:
    """Peak resident memory of a train step (the second: Adam allocates its moments in the
    first) above the resident size before the model was built, and the memory model's total."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ngrpo.architecture import ArchSpec, unwrap
    from megatron_ngrpo.grpo.config import GRPOConfig
    from megatron_ngrpo.grpo.update import UpdateSettings, loss_and_grads
    from megatron_ngrpo.launch import memory as model

    mixed, _, _ = batch(args)
    path = model_dir(args)
    spec = ArchSpec.from_hf(path)
    gc.collect()
    base = _status("VmRSS")
    chunks = build(
        path,
        args.recompute,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-6,
            clip_grad=1.0,
            params_dtype=torch.float32,
            use_distributed_optimizer=True,
        ),
        chunks,
    )
    unwrap(chunks[0]).config.grad_scale_func = optimizer.scale_loss
    settings = UpdateSettings(
        temperature=1.0, micro_batch_size=args.micro_batch, max_response_len=args.response
    )
    for _ in range(2):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM
        loss_and_grads(chunks, mixed, GRPOConfig(), settings, optimizer)
        optimizer.step()
    peak = _status("VmHWM") - base
    seq = args.prompt + args.response
    layout = model.TrainLayout(
        tp=1,
        pp=1,
        dp=1,
        tokens=args.micro_batch * seq,
        sequence_parallel=False,
        recompute=args.recompute,
        param_bytes=model.FP32,
        unfused_seq_len=seq,
        overhead=0,
    )
    m = model.train_memory(spec, layout)
    mib = {
        k: getattr(m, k) / 2**20
        for k in ("weights", "grads", "optimizer", "activations", "working", "logits")
    }
    terms = ", ".join(f"{k} {v:.0f}" for k, v in mib.items())
    print(
        f"train step peak RSS {peak / 2**20:.0f} MiB vs the memory model {m.total / 2**20:.0f} MiB "
        f"(ratio {peak / m.total:.3f}; {m.params / 1e6:.1f} M params; terms in MiB: {terms})",
        flush=True,
    )
    return {"peak": peak, "model": m.total, "terms_mib": mib}


def main(argv=None) -> dict:
    from megatron_ngrpo.grpo.config import GRPOConfig
    from megatron_ngrpo.grpo.logprobs import batch_logprobs
    from megatron_ngrpo.grpo.update import UpdateSettings, loss_and_grads

    args = _args(argv)
    if args.memory:
        if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
            os.execve(
                sys.executable,
                [sys.executable, "-m", "bench.bench_train_step", *sys.argv[1:]],
                {**os.environ, **MALLOC_ENV},
            )
        out = memory(args)
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
        return out
    chunks = build(model_dir(args), args.recompute)
    mixed, plain, frac = batch(args)
    cfg = GRPOConfig()
    settings = UpdateSettings(
        temperature=1.0, micro_batch_size=args.micro_batch, max_response_len=args.response
    )
    steps = {
        "train_step": lambda tb: loss_and_grads(chunks, tb, cfg, settings),
        "logprobs": lambda tb: batch_logprobs(chunks, tb, 1.0, args.micro_batch),
    }
    out = {"shape": vars(args), "mixed_fraction": frac}
    for name, fn in steps.items():
        r = compare(
            lambda: fn(mixed),
            lambda: fn(plain),
            label=f"{name} with mixes / without",
            max_seconds=args.max_seconds,
        )
        out[name] = {
            "mixed_s": r.a_cpu,
            "plain_s": r.b_cpu,
            "ratio": r.cpu.value,
            "lo": r.cpu.lo,
            "hi": r.cpu.hi,
            "pairs": r.pairs,
            "converged": r.converged,
        }
        print(f"{r} | mixed {r.a_cpu:.4f} s, plain {r.b_cpu:.4f} s (goal <= 1.01)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
