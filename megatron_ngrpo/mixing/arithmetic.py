"""THE arithmetic of a mixed input row, shared by the trainer's mixing embedding
(mixing/embedding.py) and vLLM's hook (rollout/vllm/hook.py): in bf16 the engine that sampled a
token and the trainer that replays it must build the same bits, or every mixed row differs (up
to 0.5% of its largest value when one side rounds each product and the other does not).

No GEMM: a batched matmul's fp32 result depends on process-global settings (TF32 rounds its
inputs to 10 mantissa bits) and on the library's kernel choice per shape (another summation order
per batch size), so the engine mixing the rows of one decode step and the trainer mixing a
micro-batch could round differently. Separate elementwise products and sums in a fixed order are
correctly rounded IEEE operations: the same bits on every device, setting and batch size."""

from __future__ import annotations

import torch


def mix_rows(
    cand: torch.Tensor, weights: torch.Tensor, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """((w0·c0 + w1·c1) + w2·c2 …) (+ noise), each product and sum rounded in fp32 (fp64 rows:
    fp64), in candidate order, then rounded once to ``cand``'s dtype.

    Shapes: cand [M, k, h] (the candidates' embedding rows), weights [M, k], noise [M, h] or
    None → [M, h] in ``cand.dtype``.
    """
    acc = torch.promote_types(cand.dtype, torch.float32)
    w = weights.to(acc)
    # separate mul and add, never addcmul / a fused kernel: an FMA rounds once per step
    out = w[:, 0, None] * cand[:, 0].to(acc)
    for j in range(1, cand.shape[1]):
        out = out + w[:, j, None] * cand[:, j].to(acc)
    if noise is not None:
        out = out + noise.to(acc)
    return out.to(cand.dtype)
