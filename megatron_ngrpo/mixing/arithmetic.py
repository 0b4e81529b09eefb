"""THE arithmetic of a mixed input row, shared by the trainer's mixing embedding
(mixing/embedding.py) and vLLM's hook (rollout/vllm/hook.py): in bf16 the engine that sampled a
token and the trainer that replays it must build the same bits, or every mixed row differs (up
to 0.5% of its largest value when one side rounds each product and the other does not)."""

from __future__ import annotations

import torch


def mix_rows(
    cand: torch.Tensor, weights: torch.Tensor, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """Σ_j weights[:, j]·cand[:, j] (+ noise) accumulated in fp32 (fp64 rows: fp64) and rounded
    once to ``cand``'s dtype.

    Shapes: cand [M, k, h] (the candidates' embedding rows), weights [M, k], noise [M, h] or
    None → [M, h] in ``cand.dtype``.
    """
    acc = torch.promote_types(cand.dtype, torch.float32)
    out = torch.bmm(weights.to(acc).unsqueeze(1), cand.to(acc)).squeeze(1)
    if noise is not None:
        out = out + noise.to(acc)
    return out.to(cand.dtype)
