"""GRPO train step with mixing records vs without, on the same batch (goal ≤ 1.01×).

    OMP_NUM_THREADS=1 python bench/bench_train_step.py [--hidden 256 --layers 4 --vocab 32768 --batch 8 --prompt 64 --response 192]

One process, TP=1, megatron GPTModel (local spec, fp32) wrapped in DDP as the trainer wraps it.
The same right-padded replay batch is run through ``grpo.update.loss_and_grads`` (forward +
backward of the clipped GRPO loss with KL, global aggregation) and through the forward-only
``grpo.logprobs.batch_logprobs`` (old / reference log-probs), once with its mixing records
(ρ = 0.1 of response positions, k = 3) and once without; the two alternate so machine load hits
both alike. Times are process CPU seconds (on a shared machine wall time mostly measures waiting
for a core); the ratio is the median of per-pair ratios. Results → bench/results/train.md.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def build(args):
    from megatron_ngrpo.grpo.update import wrap_for_training
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel
    from megatron_ngrpo.testing.tiny import write_tiny_hf

    init_distributed()
    initialize_model_parallel(1, 1, None, seed=0)
    hf = write_tiny_hf(tempfile.mkdtemp(), weights=False, vocab_size=args.vocab, hidden_size=args.hidden,
                       num_layers=args.layers, num_heads=4, num_kv_heads=2, intermediate_size=2 * args.hidden,
                       max_pos=args.prompt + args.response)
    return wrap_for_training(build_model(ModelConfig(hf_path=str(hf), dtype="float32", layer_spec="local")))


def batch(args):
    """A replay batch with mixes, and the same batch without them."""
    from dataclasses import replace

    from megatron_ngrpo.grpo.logprobs import TokenBatch
    from megatron_ngrpo.mixing.records import MixRecord
    from megatron_ngrpo.rollout.types import RolloutBatch

    g = torch.Generator().manual_seed(0)
    b, k = args.batch, args.k
    prompts = [torch.randint(0, args.vocab, (args.prompt,), generator=g).tolist() for _ in range(b)]
    responses = [torch.randint(0, args.vocab, (args.response,), generator=g).tolist() for _ in range(b)]
    per_seq = []
    for _ in range(b):
        pos = torch.nonzero(torch.rand(args.response, generator=g) < args.rate).flatten().tolist()
        per_seq.append([(p, torch.randint(0, args.vocab, (k,), generator=g).tolist(),
                         torch.softmax(torch.randn(k, generator=g), 0).tolist()) for p in pos])
    rb = RolloutBatch(prompts, responses, [[0.0] * args.response] * b, ["stop"] * b,
                      MixRecord.from_lists(per_seq, k), [i // 4 for i in range(b)])
    mixed = TokenBatch.from_rollout(rb)
    lp = torch.randn(mixed.tokens.shape, generator=g) * 0.1 - 3.0
    mixed = mixed.with_extras(old_logprobs=lp * mixed.mask, ref_logprobs=(lp + 0.01) * mixed.mask,
                              advantages=torch.randn(b, generator=g), active=torch.ones(b, dtype=torch.bool))
    return mixed, replace(mixed, mix=None), len(rb.mixes) / (b * args.response)


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main(argv=None) -> dict:
    from megatron_ngrpo.grpo.config import GRPOConfig
    from megatron_ngrpo.grpo.logprobs import batch_logprobs
    from megatron_ngrpo.grpo.update import UpdateSettings, loss_and_grads

    args = _args(argv)
    chunks = build(args)
    mixed, plain, frac = batch(args)
    cfg = GRPOConfig()
    settings = UpdateSettings(temperature=1.0, micro_batch_size=args.micro_batch, max_response_len=args.response)
    steps = {
        "train_step": lambda tb: loss_and_grads(chunks, tb, cfg, settings),
        "logprobs": lambda tb: batch_logprobs(chunks, tb, 1.0, args.micro_batch),
    }
    out = {"shape": vars(args), "mixed_fraction": frac}
    for name, fn in steps.items():
        fn(mixed), fn(plain)  # warm-up
        times = {"mixed": [], "plain": []}
        for rep in range(args.reps):
            order = ("mixed", "plain") if rep % 2 == 0 else ("plain", "mixed")
            for which in order:
                times[which].append(cpu_seconds(lambda: fn(mixed if which == "mixed" else plain)))
        ratios = [m / p for m, p in zip(times["mixed"], times["plain"])]
        out[name] = {"mixed_s": statistics.median(times["mixed"]), "plain_s": statistics.median(times["plain"]),
                     "ratio": statistics.median(ratios)}
        print(f"{name}: mixed {out[name]['mixed_s']:.4f}s plain {out[name]['plain_s']:.4f}s "
              f"ratio {out[name]['ratio']:.4f} (median of {args.reps} pairs)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
