"""THE vocab-parallel log-softmax of the batch-invariant mode (``rollout.batch_invariant``),
shared by the built-in engine's sampler and the trainer's log-prob pass, so that both compute
``log softmax(z / τ)[label]`` with the same operations in the same order.

Per TP shard r of the vocabulary (its [M, V/TP] logits): the row max m_r of z/τ over the shard's
valid columns, S_r = Σ exp(z/τ − m_r) and the label's z/τ where the shard owns it
(:func:`shard_stats`, over fixed blocks of :data:`~megatron_ngrpo.models.batch_invariant.BLOCK_ROWS`
rows, padded: a row's reductions never depend on how many rows came with it). The shards' stats
are merged in rank order (:func:`ordered_merge`): global max M, S = ((S_0·e^(m_0−M) + S_1·e^(m_1−M))
+ …), log p = z_label/τ − M − log S. The trainer's ranks each compute their own shard's stats and
all-gather them; the engine's deciding rank holds the gathered logits and computes every shard's
stats itself (:func:`gathered_logprobs`): the same numbers, merged by the same function. A
max-then-sum all-reduce would instead depend on the collective's algorithm, and
``F.log_softmax`` over the gathered vocabulary is a different function altogether (NeMo-RL's TP > 1
obstacle, docs/ALGORITHM.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ngrpo.models.batch_invariant import BLOCK_ROWS


def shard_stats(
    z: torch.Tensor,
    inv_temp: float,
    local: torch.Tensor,
    owned: torch.Tensor,
    valid: int,
    with_entropy: bool = False,
) -> torch.Tensor:
    """Stats [4, M] float32 of one shard's logits ``z`` [M, Vs] (any float dtype): row max m of
    z/τ over the first ``valid`` columns, S = Σ e^(z/τ − m), T = Σ e^(z/τ − m)·(z/τ − m) (zeros
    without ``with_entropy``) and the label's z/τ (0 where ``owned`` [M] is False; ``local`` [M]
    its column). A shard without valid columns gives m = −inf, S = 0."""
    m_rows = z.shape[0]
    pad = (-m_rows) % BLOCK_ROWS
    z = F.pad(z, (0, 0, 0, pad)) if pad else z
    local = F.pad(local, (0, pad)) if pad else local
    out = torch.zeros(4, m_rows + pad, dtype=torch.float32, device=z.device)
    for a in range(0, m_rows + pad, BLOCK_ROWS):
        s = z[a : a + BLOCK_ROWS].float() * inv_temp
        s[:, valid:] = float("-inf")
        m = s.max(dim=-1).values
        out[0, a : a + BLOCK_ROWS] = m
        out[3, a : a + BLOCK_ROWS] = s.gather(1, local[a : a + BLOCK_ROWS, None]).view(-1)
        d = s - torch.where(torch.isinf(m), torch.zeros_like(m), m)[:, None]
        e = d.exp()
        out[1, a : a + BLOCK_ROWS] = e.sum(-1)
        if with_entropy:
            out[2, a : a + BLOCK_ROWS] = torch.where(e > 0, e * d, torch.zeros_like(e)).sum(-1)
    out = out[:, :m_rows]
    out[3] = torch.where(owned, out[3], torch.zeros_like(out[3]))
    return out


def ordered_merge(
    stats: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stats [R, 4, M] of the R shards (rank order) → log-probs, entropy, global max M and total
    S, each [M] float32, summed over the shards one by one in rank order."""
    top = stats[:, 0].max(dim=0).values
    total = torch.zeros_like(top)
    tsum = torch.zeros_like(top)
    label = torch.zeros_like(top)
    for m, s, t, lab in stats:
        has = s > 0  # a shard with no valid column has m = -inf
        shift = torch.where(has, m - top, torch.zeros_like(m))
        scale = torch.where(has, shift.exp(), torch.zeros_like(m))
        total = total + s * scale
        tsum = tsum + scale * (t + shift * s)
        label = label + lab
    log_s = total.log()
    return label - top - log_s, log_s - tsum / total, top, total


def gathered_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, shards: int, vocab_limit: int
) -> torch.Tensor:
    """The engine's side: log softmax(logits / τ)[labels] [M] float32 from the TP-gathered
    ``logits`` [M, V] (columns ≥ ``vocab_limit`` left out), computed as ``shards`` TP ranks of
    the trainer would (:func:`shard_stats` per shard, :func:`ordered_merge`)."""
    vs = logits.shape[1] // shards
    stats = []
    for r in range(shards):
        valid = max(0, min(vs, vocab_limit - r * vs))
        local = labels - r * vs
        owned = (local >= 0) & (local < valid)
        stats.append(
            shard_stats(
                logits[:, r * vs : (r + 1) * vs],
                1.0 / temperature,
                torch.where(owned, local, torch.zeros_like(local)),
                owned,
                valid,
            )
        )
    return ordered_merge(torch.stack(stats))[0]
