"""Mixing embedding forward+backward vs megatron's plain VocabParallelEmbedding (goal ≤ 1.05×).

    OMP_NUM_THREADS=1 python -m bench.bench_mixing_embedding [--vocab 32768 151936 --tp 1 2 4 --hidden 256]
        [--processes P] [--ddp] [--dtype bfloat16]

For every vocabulary size and TP degree: TP=1 runs in this process, TP>1 under torchrun (that many
gloo processes). Both embeddings share one weight (under ``--ddp`` equal copies: each DDP owns its
buffer); plain and mixing steps are timed in interleaved
pairs by ``bench/_timing.py`` (process CPU time, median ratio over A B / B A blocks with its 95%
interval, repeated until ±1.5%). Each TP rank times its own steps; rank 0's interval is printed. Mixes:
ρ = 0.1 of positions, k = 3 candidates, random weights. The default token count keeps
Qwen2.5-1.5B's micro-batch (4×2048 tokens) with a narrow hidden size so that it runs on a
laptop-class CPU; at V=152k that is the vocabulary-to-token ratio of the real model.

One process's interval does not see the spread between fresh processes (measured here for the
same code at V=32k: 1.04 to 1.16 on the idle machine, 0.996 to 1.10 under load; the allocator's
page faults and cache placement differ per process): ``--processes P`` repeats each TP=1 measurement in P fresh processes and adds the
median of their ratios with a bootstrap 95% interval over processes.

``--ddp`` wraps both in megatron's DDP as every training path does: megatron's embedding then forms
a dense [V, h] gradient that the DDP hook adds into ``main_grad``, the mixing embedding adds its
rows into ``main_grad`` itself. Without it, the bare ops (each returns ``weight.grad``).

``--dtype bfloat16``: 16-bit weights, where TP > 1 adds the mixing embedding's one reduce of the
[M, k, h] candidate rows (the engine's arithmetic bit for bit, mixing/embedding.py).

The CPU ratio measures computation only: the mixed step's host syncs (none beyond the plain
step's since the sparse, host-built MixBatch; tests/test_mixing.py
``test_mixed_replay_has_no_host_sync``) cost nothing on a CPU. The goal of the whole GRPO step on
a GPU, mixed / plain ≤ 1.02 at the 1.5B shape with fused attention, is not measurable here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from bench._timing import compare
from tests.harness.multiproc import case, launch, run_cases
from tests.harness.tiny import in_megatron_ddp


def _args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rate", type=float, default=0.1)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=120.0)
    p.add_argument("--processes", type=int, default=1, help="fresh processes per TP=1 measurement")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--ddp",
        action="store_true",
        help="both embeddings in megatron DDP, as the trainer runs them (gradients into main_grad)",
    )
    p.add_argument(
        "--json-out", help=argparse.SUPPRESS
    )  # a child of --processes writes its rows here
    return p.parse_args(argv)


def measure(args, vocab: int, tp: int) -> dict:
    """Interval of the mixing / plain fwd+bwd CPU-time ratio at (vocab, tp) on this rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    from megatron_ngrpo.mixing.embedding import MixBatch, MixingVocabParallelEmbedding
    from megatron_ngrpo.parallel import initialize_model_parallel

    initialize_model_parallel(tp=tp)
    dtype = getattr(torch, args.dtype)
    cfg = ModelParallelConfig(
        tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=dtype
    )
    plain = VocabParallelEmbedding(
        vocab, args.hidden, init_method=torch.nn.init.normal_, config=cfg
    )
    mixing = VocabParallelEmbedding(
        vocab, args.hidden, init_method=torch.nn.init.normal_, config=cfg
    )
    mixing.__class__ = MixingVocabParallelEmbedding
    if args.ddp:  # each its own DDP buffer: equal weights, not one Parameter
        mixing.weight.data.copy_(plain.weight.data)
        plain, mixing = in_megatron_ddp(plain, tp), in_megatron_ddp(mixing, tp)
    else:
        mixing.weight = plain.weight

    g = torch.Generator().manual_seed(0)
    b, s, k = args.batch, args.seq, args.k
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    ids = torch.randint(0, vocab, (b, s, k), generator=g)
    weights = torch.rand(b, s, k, generator=g)
    mix = MixBatch.from_dense(
        ids, weights / weights.sum(-1, keepdim=True), torch.rand(b, s, generator=g) < args.rate
    )
    grad = torch.randn(b, s, args.hidden, generator=g).to(dtype)

    def step(module, fn):
        def run():
            module.zero_grad(set_to_none=True)  # without DDP; under it the hook leaves no grad
            fn().backward(grad)

        return run

    label = f"V={vocab} TP={tp} {args.dtype}" + (" DDP" if args.ddp else "")
    r = compare(
        step(mixing, lambda: mixing(tokens, mix)),
        step(plain, lambda: plain(tokens)),
        label=label,
        max_seconds=args.max_seconds,
        group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
    )
    return dict(
        vocab=vocab,
        tp=tp,
        plain_ms=1e3 * r.b_cpu,
        mixing_ms=1e3 * r.a_cpu,
        text=str(r),
        row=r.row(),
        ratio=r.cpu.value,
    )


def in_fresh_processes(count: int) -> list[dict]:
    """The TP=1 rows of ``count`` child processes (one after the other), each with the
    ``ratio`` of every vocabulary size; the returned rows carry ``across``, the median over the
    processes with its bootstrap interval."""
    import subprocess
    import tempfile

    from bench._timing import paired_median_ratio

    runs = []
    for i in range(count):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            # this command's own arguments, the later flags overriding
            argv = [
                sys.executable,
                "-m",
                "bench.bench_mixing_embedding",
                *sys.argv[1:],
                "--tp",
                "1",
                "--processes",
                "1",
                "--json-out",
                out.name,
            ]
            done = subprocess.run(
                argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
            if done.returncode:
                raise SystemExit(f"process {i + 1} failed:\n{done.stderr[-3000:]}")
            runs.append(json.loads(Path(out.name).read_text()))
        print(f"process {i + 1}/{count}: " + "; ".join(r["text"] for r in runs[-1]), flush=True)
    rows = runs[0]
    for j, row in enumerate(rows):
        values = [run[j]["ratio"] for run in runs]
        row["across"] = (
            f"{paired_median_ratio(values, [1.0] * count)} over {count} processes "
            f"(each: {', '.join(f'{v:.3f}' for v in values)})"
        )
    return rows


_ARGS = None
_WORKER_ENV = "NGRPO_BENCH_ARGV"


@case
def tp_runs():
    return [measure(_ARGS, v, int(os.environ["WORLD_SIZE"])) for v in _ARGS.vocab]


def main() -> None:
    global _ARGS
    if _WORKER_ENV in os.environ:  # worker under torchrun: bench arguments come by environment
        _ARGS = _args(json.loads(os.environ[_WORKER_ENV]))
        run_cases()
        return
    _ARGS = args = _args()
    from megatron_ngrpo.parallel import init_distributed

    print(
        f"shape: vocab {args.vocab}, hidden {args.hidden}, tokens {args.batch}x{args.seq}, "
        f"rate {args.rate}, k {args.k}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
        flush=True,
    )
    rows = []
    for tp in args.tp:
        if tp == 1 and args.processes > 1:
            got = in_fresh_processes(args.processes)
        elif tp == 1:
            init_distributed()
            got = [measure(args, v, 1) for v in args.vocab]
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(got))
                return
        else:
            res = launch(
                Path(__file__).resolve(),
                tp,
                timeout=3600,
                env={_WORKER_ENV: json.dumps(sys.argv[1:])},
            )
            if not res["tp_runs"]["ok"]:
                raise SystemExit(f"TP={tp} run failed: {res['tp_runs']['errors']}")
            got = res["tp_runs"]["value"]
        for r in got:
            print(
                r["text"] + (f"; across processes {r['across']}" if "across" in r else ""),
                flush=True,
            )
        rows += got
    print(
        "| V | TP | plain fwd+bwd (cpu ms) | mixing fwd+bwd (cpu ms) | ratio [95% CI] | pairs | ±1.5% reached | "
        "across processes | goal |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["vocab"], r["tp"])):
        print(
            f"| {r['vocab']} | {r['tp']} | {r['plain_ms']:.1f} | {r['mixing_ms']:.1f} | {r['row']} | "
            f"{r.get('across', '-')} | <= 1.05x |"
        )


if __name__ == "__main__":
    main()
