"""Mixing embedding forward+backward vs megatron's plain VocabParallelEmbedding (goal ≤ 1.05×).

    OMP_NUM_THREADS=1 python bench/bench_mixing_embedding.py [--vocab 151936 --hidden 256 --batch 4 --seq 2048]

Measures TP=1 in this process, then TP=2 under torchrun (2 processes, gloo). Both embeddings share
one weight; plain and mixing steps alternate so machine load hits both alike. Times are process
CPU seconds (on a shared machine wall time mostly measures waiting for a core); the ratio is the
median of per-pair ratios. Mixes: ρ = 0.1 of positions, k = 3 candidates, random weights.
The default shape keeps Qwen2.5-1.5B's vocabulary-to-token ratio (V = 151936 rows against a
micro-batch of 8192 tokens) with a narrow hidden size so that it runs on a laptop-class CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ngrpo.testing.multiproc import case, launch, run_cases  # noqa: E402


def _args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rate", type=float, default=0.1)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--reps", type=int, default=21)
    return p.parse_args(argv)


def measure(args, tp: int) -> dict:
    """Median plain and mixing fwd+bwd times (s) and the median per-pair ratio at TP=``tp``."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    from megatron_ngrpo.mixing.embedding import MixBatch, MixingVocabParallelEmbedding
    from megatron_ngrpo.parallel import initialize_model_parallel

    initialize_model_parallel(tp=tp)
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True)
    plain = VocabParallelEmbedding(args.vocab, args.hidden, init_method=torch.nn.init.normal_, config=cfg)
    mixing = VocabParallelEmbedding(args.vocab, args.hidden, init_method=torch.nn.init.normal_, config=cfg)
    mixing.__class__ = MixingVocabParallelEmbedding
    mixing.weight = plain.weight

    g = torch.Generator().manual_seed(0)
    b, s, k = args.batch, args.seq, args.k
    tokens = torch.randint(0, args.vocab, (b, s), generator=g)
    ids = torch.randint(0, args.vocab, (b, s, k), generator=g)
    weights = torch.rand(b, s, k, generator=g)
    mix = MixBatch(ids, weights / weights.sum(-1, keepdim=True), torch.rand(b, s, generator=g) < args.rate)
    grad = torch.randn(b, s, args.hidden, generator=g)

    def step(fn) -> float:
        plain.weight.grad = None
        t0 = time.process_time()
        fn().backward(grad)
        return time.process_time() - t0

    run_plain = lambda: plain(tokens)  # noqa: E731
    run_mix = lambda: mixing(tokens, mix)  # noqa: E731
    for _ in range(2):
        step(run_plain), step(run_mix)
    tp_, tm_ = [], []
    for i in range(args.reps):
        if i % 2:
            tm_.append(step(run_mix)), tp_.append(step(run_plain))
        else:
            tp_.append(step(run_plain)), tm_.append(step(run_mix))
    return dict(tp=tp, plain_s=statistics.median(tp_), mixing_s=statistics.median(tm_),
                ratio=statistics.median(m / p for m, p in zip(tm_, tp_)),
                mixed_positions=int(mix.mask.sum()))


_ARGS = None
_WORKER_ENV = "NGRPO_BENCH_ARGV"


@case
def tp2():
    return measure(_ARGS, 2)


def main() -> None:
    global _ARGS
    if _WORKER_ENV in os.environ:  # worker under torchrun: bench arguments come by environment
        _ARGS = _args(json.loads(os.environ[_WORKER_ENV]))
        run_cases()
        return
    _ARGS = args = _args()
    from megatron_ngrpo.parallel import init_distributed

    print(f"shape: vocab {args.vocab}, hidden {args.hidden}, tokens {args.batch}x{args.seq}, "
          f"rate {args.rate}, k {args.k}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    init_distributed()
    rows = [measure(args, 1)]
    res = launch(Path(__file__).resolve(), 2, env={_WORKER_ENV: json.dumps(sys.argv[1:])})
    if not res["tp2"]["ok"]:
        raise SystemExit(f"TP=2 run failed: {res['tp2']['errors']}")
    rows.append(res["tp2"]["value"])
    print("| TP | plain fwd+bwd (cpu ms) | mixing fwd+bwd (cpu ms) | ratio (median of pairs) | goal |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tp']} | {1e3 * r['plain_s']:.1f} | {1e3 * r['mixing_s']:.1f} | {r['ratio']:.3f}x | <= 1.05x |")


if __name__ == "__main__":
    main()
