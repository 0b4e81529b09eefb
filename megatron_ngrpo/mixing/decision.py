"""The mixing decision of one decode step (N-GRPO paper §3.1–3.3, Eqs. 2–11).

Given the (vocab-parallel) logits of the rows being sampled:

* anchor  v* = argmax_v z(v) over real token ids (= argmax of z/τ; taken on the raw logits),
  global across TP partitions (ties → lower id);
* C       = neighbour-table row of v* (anchor first, k ids);
* α       = softmax over C of z(c)/τ (the temperature-scaled probabilities renormalised on C),
  computed in float64 from the k gathered logits;
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
    ``weights`` [B, k] float32 (sum to 1), ``noise`` [B, d] float32 or None (STHT baseline; zero
    on unmixed rows). ids/weights are filled for every row; only rows with ``mixed`` become
    records."""

    mixed: torch.Tensor
    anchor: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    noise: torch.Tensor | None = None

    def select(self, index: torch.Tensor) -> MixDecision:
        """The decision of rows ``index`` [M] only."""
        return MixDecision(
            mixed=self.mixed[index],
            anchor=self.anchor[index],
            ids=self.ids[index],
            weights=self.weights[index],
            noise=None if self.noise is None else self.noise[index],
        )

    def unmix_anchors(self, skip: torch.Tensor) -> None:
        """Leave unmixed the rows whose anchor is flagged in ``skip`` [>= V_real] bool (the
        special ids: ``mixing.skip_special_anchors``); their noise becomes zero."""
        keep = ~skip.to(self.anchor.device)[self.anchor]
        self.mixed = self.mixed & keep
        if self.noise is not None:
            self.noise = self.noise * keep.unsqueeze(1).to(self.noise.dtype)


def id_mask(ids, num_real_tokens: int, device=None) -> torch.Tensor:
    """[num_real_tokens] bool, True at the real ids among ``ids`` (special ids → the anchors
    :meth:`MixDecision.unmix_anchors` skips)."""
    mask = torch.zeros(num_real_tokens, dtype=torch.bool)
    real = [i for i in ids if 0 <= i < num_real_tokens]
    mask[real] = True
    return mask.to(device) if device is not None else mask


# splitmix64 constants as signed int64 (torch has no uint64 arithmetic; int64 wraps alike).
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def counter_uniform(seed: int, *counters) -> torch.Tensor:
    """Uniform [0, 1) float64 per combination of integer counters (broadcast together): a
    stateless counter-based draw, the same on every rank, engine and device.

    With two counters (key, position) this is :func:`gate_uniform`; baselines add a third
    (embedding dimension, vocabulary id) and their own ``seed`` stream.
    """
    ts = [torch.as_tensor(c, dtype=torch.long) for c in counters]
    device = next((t.device for t in ts if t.device.type != "cpu"), torch.device("cpu"))
    ts = [t.to(device) for t in ts]
    acc = _splitmix64(ts[-1])
    for t in reversed(ts[:-1]):
        acc = _splitmix64(t * _M1 + acc)
    seed64 = (seed & 0xFFFFFFFFFFFFFFFF) - ((1 << 64) if seed & (1 << 63) else 0)
    h = _splitmix64(acc ^ seed64)
    return _shr(h, 11).double() / float(1 << 53)


def gate_uniform(
    seed: int, key: torch.Tensor | np.ndarray | list, position: torch.Tensor | np.ndarray | list
) -> torch.Tensor:
    """Uniform [0, 1) float64 per (seed, key, position): a stateless counter-based draw.

    ``key`` identifies the sequence (e.g. its rollout index), ``position`` the response-token
    index t of the decision. Same inputs give the same draw on every rank and engine.
    """
    return counter_uniform(seed, key, position)


def gate(rate: float, seed: int, key, position) -> torch.Tensor:
    """Bernoulli(rate) per row as bool [B] (rate 0 → never, 1 → always)."""
    return gate_uniform(seed, key, position) < rate


def decide(
    logits: torch.Tensor,
    table,
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
        table: [V, k] int64 neighbour table (row v = v followed by its k-1 neighbours), replicated,
            or a :class:`~megatron_ngrpo.mixing.neighbors.NeighborLookup` (the same rows on demand,
            for the anchors of all B rows: pass only the gated rows; collective where a row is new).
        temperature: τ of α (the argmax is τ-invariant and taken on the raw logits).
        mixed: [B] bool gate of each row (from :func:`gate`); copied into the decision.
        num_real_tokens: ids >= this (padding, unused rows) are never the anchor.
        vocab_start: global id of column 0 of ``logits``.
        tp_group: tensor-parallel group over which the vocabulary is split.
    """
    anchor = anchors(logits, num_real_tokens, vocab_start, tp_group)
    ids = (
        table.to(logits.device)[anchor]
        if torch.is_tensor(table)
        else table.rows(anchor).to(logits.device)
    )
    cand = _gather_global_columns(logits, ids, vocab_start, tp_group).double()  # [B, k]
    cand = cand.masked_fill(ids >= num_real_tokens, float("-inf"))
    # α in float64 from the k gathered logits: exact softmax of z/τ renormalised on C.
    weights = torch.softmax(cand / temperature, dim=-1).float()
    return MixDecision(mixed=mixed.to(logits.device), anchor=anchor, ids=ids, weights=weights)


def anchors(
    logits: torch.Tensor,
    num_real_tokens: int,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """[B] anchor ids of vocab-parallel logits [B, V_local]: the global argmax over the real ids
    (ties → lower id), as :func:`decide` takes it."""
    # From the raw logits (argmax is τ-invariant; dividing in fp32 first can merge distinct
    # logits into ties), over the real ids only: a view, no [B, V] copy.
    real = max(0, min(logits.shape[1], num_real_tokens - vocab_start))
    return _global_argmax(logits[:, :real], vocab_start, tp_group)


def _tp_active(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def _global_argmax(z: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """[B] global argmax id of z [B, V_l] (any float dtype; V_l may be 0 on a rank without real
    ids); the lowest id among exact ties (torch.max picks the first locally)."""
    if z.shape[1]:
        local_max, local_arg = z.max(dim=-1)
    else:
        local_max = z.new_full((z.shape[0],), float("-inf"))
        local_arg = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    if not _tp_active(group):
        return local_arg
    local_max = local_max.float()  # exact for 16-bit logits; one dtype for the collective
    global_max = local_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    big = torch.iinfo(torch.long).max
    cand = torch.where(
        local_max == global_max, local_arg + vocab_start, torch.full_like(local_arg, big)
    )
    dist.all_reduce(cand, op=dist.ReduceOp.MIN, group=group)
    return cand


def _gather_global_columns(
    z: torch.Tensor, ids: torch.Tensor, vocab_start: int, group
) -> torch.Tensor:
    """z[b, ids[b, j]] for global ids [B, k], across vocab partitions (one SUM all-reduce)."""
    v_local = z.shape[1]
    local = ids - vocab_start if vocab_start else ids
    vals = torch.gather(z, 1, local.clamp(0, v_local - 1))
    if not _tp_active(group):
        return vals
    inside = (local >= 0) & (local < v_local)
    # -inf (excluded ids) cannot be summed; carry them as a flag.
    finite = torch.where(inside & torch.isfinite(vals), vals, torch.zeros_like(vals))
    neg_inf = (inside & torch.isneginf(vals)).to(z.dtype)
    packed = torch.cat([finite, neg_inf], dim=-1)
    dist.all_reduce(packed, group=group)
    finite, neg_inf = packed.split(ids.shape[1], dim=-1)
    return finite.masked_fill(neg_inf > 0, float("-inf"))
