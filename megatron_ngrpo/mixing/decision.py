"""The mixing decision of one decode step (N-GRPO paper §3.1–3.3, Eqs. 2–11).

Given the (vocab-parallel) logits of the rows being sampled:

* anchor  v* = argmax_v z(v)/τ over real token ids, global across TP partitions (ties → lower id);
* C       = neighbour-table row of v* (anchor first, k ids);
* α       = softmax over C of z(c)/τ (the temperature-scaled probabilities renormalised on C);
* gate    m ~ Bernoulli(ρ) per sequence and step, drawn by a counter-based hash of
  (seed, sequence key, position) so that every TP rank, every engine and every re-run draws the
  same value without sharing RNG state.

Communication under TP: one MAX and one MIN all-reduce for the global argmax, one SUM all-reduce
of the k candidate logits (each rank contributes the candidates it owns).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class MixDecision:
    """Per row: ``mixed`` [B] bool, ``anchor`` [B] int64, ``ids`` [B, k] int64 (anchor first),
    ``weights`` [B, k] float32 (sum to 1). ids/weights are filled for every row; only rows with
    ``mixed`` become records."""

    mixed: torch.Tensor
    anchor: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def gate_uniform(seed: int, key: torch.Tensor | np.ndarray | list, position: torch.Tensor | np.ndarray | list) -> torch.Tensor:
    """Uniform [0, 1) float64 per (seed, key, position): a stateless counter-based draw.

    ``key`` identifies the sequence (e.g. its rollout index), ``position`` the response-token
    index t of the decision. Same inputs give the same draw on every rank and engine.
    """
    with np.errstate(over="ignore"):
        k = np.asarray(key, dtype=np.int64).astype(np.uint64)
        p = np.asarray(position, dtype=np.int64).astype(np.uint64)
        h = _splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ _splitmix64(k * _M1 + _splitmix64(p)))
    return torch.from_numpy((h >> np.uint64(11)).astype(np.float64) / float(1 << 53))


def gate(rate: float, seed: int, key, position) -> torch.Tensor:
    """Bernoulli(rate) per row as bool [B] (rate 0 → never, 1 → always)."""
    return gate_uniform(seed, key, position) < rate


def decide(
    logits: torch.Tensor,
    table: torch.Tensor,
    temperature: float,
    mixed: torch.Tensor,
    num_real_tokens: int,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
) -> MixDecision:
    """Anchor, candidates and weights for each row of ``logits``.

    Args:
        logits: [B, V_local] this rank's vocab partition (columns ``vocab_start ..``); the full
            vocabulary when ``tp_group`` is None or of size 1.
        table: [V, k] int64 neighbour table (row v = v followed by its k-1 neighbours), replicated.
        temperature: τ of α and of the argmax (argmax is τ-invariant; α is not).
        mixed: [B] bool gate of each row (from :func:`gate`); copied into the decision.
        num_real_tokens: ids >= this (padding, unused rows) are never the anchor.
        vocab_start: global id of column 0 of ``logits``.
        tp_group: tensor-parallel group over which the vocabulary is split.
    """
    z = logits.float() / temperature
    b, v_local = z.shape
    col_ids = torch.arange(vocab_start, vocab_start + v_local, device=z.device)
    z = z.masked_fill(col_ids.unsqueeze(0) >= num_real_tokens, float("-inf"))
    anchor = _global_argmax(z, vocab_start, tp_group)
    ids = table.to(z.device)[anchor]  # [B, k]
    cand = _gather_global_columns(z, ids, vocab_start, tp_group)  # [B, k]
    weights = torch.softmax(cand, dim=-1)
    return MixDecision(mixed=mixed.to(z.device), anchor=anchor, ids=ids, weights=weights)


def _tp_active(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def _global_argmax(z: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """[B] global argmax id; the lowest id among exact ties (torch.max picks the first locally)."""
    local_max, local_arg = z.max(dim=-1)
    if not _tp_active(group):
        return local_arg
    global_max = local_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    big = torch.iinfo(torch.long).max
    cand = torch.where(local_max == global_max, local_arg + vocab_start, torch.full_like(local_arg, big))
    dist.all_reduce(cand, op=dist.ReduceOp.MIN, group=group)
    return cand


def _gather_global_columns(z: torch.Tensor, ids: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """z[b, ids[b, j]] for global ids [B, k], across vocab partitions (one SUM all-reduce)."""
    v_local = z.shape[1]
    local = ids - vocab_start
    inside = (local >= 0) & (local < v_local)
    vals = torch.gather(z, 1, local.clamp(0, v_local - 1))
    if not _tp_active(group):
        return vals
    # -inf (excluded ids) cannot be summed; carry them as a flag.
    finite = torch.where(inside & torch.isfinite(vals), vals, torch.zeros_like(vals))
    neg_inf = (inside & torch.isneginf(vals)).to(z.dtype)
    packed = torch.cat([finite, neg_inf], dim=-1)
    dist.all_reduce(packed, group=group)
    finite, neg_inf = packed.split(ids.shape[1], dim=-1)
    return finite.masked_fill(neg_inf > 0, float("-inf"))
