"""Throughput of the built-in Megatron rollout engine with and without neighbour mixing.

One process (TP=1), a tiny random Qwen2, the same prompts and sampling settings for both modes;
runs alternate (plain, mixed, plain, ...), so the ratio is measured in one run on one machine.
Goal: mixed (ρ=0.1) ≥ 0.97 × plain tokens/s. The primary figure is the median over repeats of
the ratio within each (plain, mixed) pair of back-to-back runs, in tokens per second of process
CPU time (``time.process_time``, one thread): on a shared machine wall-clock rates swing with
other load, and pairing cancels slow drifts. Best-of and wall-clock figures are printed too.

    OMP_NUM_THREADS=1 python bench/bench_rollout_megatron.py [--prompts 32 --new-tokens 64 ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rate", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=5)
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
    from megatron_ngrpo.testing.tiny import write_tiny_hf

    init_distributed()
    initialize_model_parallel(1, 1)
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_tiny_hf(tmp, weights=False, vocab_size=args.vocab, hidden_size=args.hidden,
                           num_layers=args.layers, num_heads=8, num_kv_heads=4,
                           intermediate_size=4 * args.hidden, initializer_range=0.05)
        chunks = build_model(ModelConfig(hf_path=str(hf), dtype="float32"))
    engine = MegatronEngine(chunks, args.vocab)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab, (int(torch.randint(16, 49, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    modes = {"plain": None, f"mixed rho={args.rate}": MixingConfig(rate=args.rate)}

    for mix in modes.values():  # warm-up; builds the neighbour table
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=4), mix)
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    wall: dict[str, list[float]] = {m: [] for m in modes}
    mixed_frac = 0.0
    for _ in range(args.repeats):
        for name, mix in modes.items():
            c0, t0 = time.process_time(), time.perf_counter()
            out = engine.generate(prompts, params, mix)
            c1, t1 = time.process_time(), time.perf_counter()
            tokens = sum(out.response_lengths)
            cpu[name].append(tokens / (c1 - c0))
            wall[name].append(tokens / (t1 - t0))
            if mix is not None:
                mixed_frac = len(out.mixes) / tokens
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
          f"{args.prompts} prompts x n={args.n}, {args.new_tokens} new tokens, {args.repeats} repeats")
    print(f"mixed positions: {mixed_frac:.3f} of tokens")
    mixed = f"mixed rho={args.rate}"
    for label, rates in (("CPU-time", cpu), ("wall", wall)):
        for m, v in rates.items():
            print(f"{label:>8} {m:>14}: best {max(v):8.1f}  median {statistics.median(v):8.1f} tok/s"
                  f"  (runs: {', '.join(f'{x:.0f}' for x in v)})")
        paired = statistics.median(m / p for m, p in zip(rates[mixed], rates["plain"]))
        print(f"{label:>8} ratio mixed/plain: paired median {paired:.3f}, best-of "
              f"{max(rates[mixed]) / max(rates['plain']):.3f} (goal >= 0.97)")


if __name__ == "__main__":
    main()
