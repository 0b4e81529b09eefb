"""Throughput of the built-in Megatron rollout engine with and without neighbour mixing.

One process (TP=1), a tiny random Qwen2, the same prompts and sampling settings for both modes,
timed in interleaved pairs by ``bench/_timing.py``: the ratio of tokens per second of process
CPU time (one thread; on a shared machine wall-clock rates swing with other load), median over
A B / B A blocks with its 95% interval, repeated until ±1.5% or ``--max-seconds``. Goal: mixed (ρ=0.1)
≥ 0.97 × plain, lower confidence bound ≥ 0.95.

    OMP_NUM_THREADS=1 python -m bench.bench_rollout_megatron [--prompts 32 --new-tokens 64 ...]
"""

from __future__ import annotations

import argparse
import tempfile

from bench._timing import compare
from tests.harness.tiny import random_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rate", type=float, default=0.1)
    ap.add_argument("--max-seconds", type=float, default=400.0)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args()

    from megatron_ngrpo.mixing.config import MixingConfig
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel
    from megatron_ngrpo.rollout.megatron_engine import MegatronEngine
    from megatron_ngrpo.rollout.types import SamplingParams
    from tests.harness.tiny import write_tiny_hf

    init_distributed()
    initialize_model_parallel(1, 1)
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_tiny_hf(
            tmp,
            weights=False,
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=4 * args.hidden,
            initializer_range=0.05,
        )
        chunks = build_model(ModelConfig(hf_path=str(hf), dtype="float32"))
    engine = MegatronEngine(chunks, args.vocab)
    prompts = random_prompts(args.prompts, args.vocab)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    modes = {"plain": None, f"mixed rho={args.rate}": MixingConfig(rate=args.rate)}

    for mix in modes.values():  # warm-up; builds the neighbour table
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=4), mix)
    frac = []

    def run(mix):
        def go():
            out = engine.generate(prompts, params, mix)
            tokens = sum(out.response_lengths)
            if mix is not None:
                frac.append(len(out.mixes) / tokens)
            return tokens

        return go

    mixed = f"mixed rho={args.rate}"
    r = compare(
        run(modes[mixed]),
        run(None),
        kind="rate",
        label=f"tokens/s {mixed} / plain",
        max_seconds=args.max_seconds,
    )
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
        f"{args.prompts} prompts x n={args.n}, {args.new_tokens} new tokens"
    )
    print(
        f"mixed positions: {sum(frac) / len(frac):.3f} of tokens; plain {1 / r.b_cpu:.0f} tok/s, "
        f"mixed {1 / r.a_cpu:.0f} tok/s (CPU time, medians)"
    )
    print(r, "(goal: ratio >= 0.97, lower bound >= 0.95)")


if __name__ == "__main__":
    main()
