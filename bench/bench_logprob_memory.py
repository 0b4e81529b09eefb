"""Peak memory of the log-prob pass at full model shapes, simulated on CPU (issue #38 item 4).

    python -m bench.bench_logprob_memory [--out FILE]

No GPU and no data: the pass (grpo/token_logprobs.py, from hidden states: forward with the
entropy, backward with the output matrix's gradient added into an fp32 ``main_grad`` as under
megatron DDP) runs on fake tensors (torch's ``FakeTensorMode``: shapes, dtypes and allocations,
no storage) while torch's ``MemTracker`` counts the bytes of tensors live after every op (what a
GPU's caching allocator hands out; tests/test_memory_model.py checks the same count on real CPU
tensors at small shapes). Reported per shape,
beyond the live inputs: the simulated peak, the memory plan's term
(``launch/memory.py logprob_pass_bytes``) and, for comparison, the plan's term before the pass was
chunked (the bf16 logits plus 1.5 fp32 logits tensors, (2 + 1.5·4) B per logit: the output
layer's logits, GPTModel's and Float16Module's copies and their gradients; validated on CPU
within 20 % at the time). A TP rank's pass is simulated with its vocabulary shard (the
collectives move only [tokens]-sized statistics). Simulated, not measured on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch

# (name, tokens per micro-batch, hidden, padded vocabulary, TP): the bench_mfu shape
# (DeepSeek-R1-Distill-Qwen-1.5B, 4 × 4096 tokens a step, one micro-batch of 4096 at a time) and
# the r1-7b recipe's (Qwen2-7B at TP 4, 24,576-token micro-batches).
SHAPES = [
    ("1.5B bench_mfu, TP 1", 4096, 1536, 151936, 1),
    ("7B r1-7b recipe, TP 4", 24576, 3584, 152064, 4),
]
GIB = 2**30


def pass_peak(
    tokens: int, hidden: int, vocab_local: int, dtype=torch.bfloat16, fake: bool = True
) -> int:
    """Bytes of tensors live at the peak of the pass beyond its inputs (torch's MemTracker), on
    fake tensors (``fake``: any shape, nothing computed) or real CPU ones."""
    # lazy: MemTracker is a private torch tool, imported only when measuring
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from megatron_ngrpo.grpo.token_logprobs import linear_vocab_parallel_logprobs

    with FakeTensorMode() if fake else contextlib.nullcontext():
        g = torch.Generator().manual_seed(0) if not fake else None
        h = torch.randn(tokens, hidden, dtype=dtype, generator=g).requires_grad_()
        weight = torch.nn.Parameter(torch.randn(vocab_local, hidden, dtype=dtype, generator=g))
        weight.main_grad, weight.grad_added_to_main_grad = torch.zeros(vocab_local, hidden), False
        labels = torch.randint(0, vocab_local, (tokens,), generator=g)
        tracker = MemTracker()
        tracker.track_external(h, weight, weight.main_grad, labels)
        before = tracker.get_tracker_snapshot()[h.device]["Total"]
        with tracker:
            lp, _ = linear_vocab_parallel_logprobs(h, weight, labels, 0.7, with_entropy=True)
            (lp * 0.5).sum().backward()
        peak = tracker.get_tracker_snapshot("peak")[h.device]["Total"]
    return peak - before


def main(argv=None) -> dict:
    from megatron_ngrpo.launch.memory import BF16, FP32, logprob_pass_bytes

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    out = {}
    for name, tokens, hidden, vocab, tp in SHAPES:
        local = vocab // tp
        row = {
            "simulated_gib": pass_peak(tokens, hidden, local) / GIB,
            "plan_gib": logprob_pass_bytes(tokens, local, hidden, BF16) / GIB,
            "previous_plan_gib": (BF16 + 1.5 * FP32) * tokens * local / GIB,
        }
        out[name] = row
        print(
            f"{name}: {tokens} tokens, h {hidden}, V/TP {local}: simulated peak "
            f"{row['simulated_gib']:.3f} GiB, plan {row['plan_gib']:.3f} GiB "
            f"(before chunking: {row['previous_plan_gib']:.2f} GiB)",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
