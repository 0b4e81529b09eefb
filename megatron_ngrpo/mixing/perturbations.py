"""Embedding-level exploration baselines that share N-GRPO's record path (docs/ALGORITHM.md §6).

Every strategy turns one decode step's (vocab-parallel) logits and the Bernoulli gate into a
:class:`~megatron_ngrpo.mixing.decision.MixDecision` (ids anchor/first, weights, optional noise);
engines record the mixed rows as :class:`~megatron_ngrpo.mixing.records.MixRecord` and the
trainer replays them through the mixing embedding, so noise is recorded and replay is exact.

* ``neighbor``      N-GRPO: anchor + its table neighbours (:func:`decision.decide`).
* ``soft_thinking`` top-k truncated Soft Thinking: the k most probable tokens of z/τ, weights
                    softmax(z/τ) renormalised on them.
* ``stht``          Soft Tokens, Hard Truths: the same top-k mixture plus σ·N(0, I_d),
                    σ = noise_scale × RMS of the embedding entries (so ‖noise‖ ≈ noise_scale ×
                    the RMS row norm); the reference code uses the top-``mix_top_k`` mixture too.
* ``gumbel``        Gumbel Soft-Thinking: candidates = top-k of z/T + Gumbel noise, weights =
                    softmax(z/T) of the clean logits on the candidates; ids[0] (the "anchor") is
                    the Gumbel-max token, i.e. a sample of softmax(z/T).

Randomness (Gumbel noise, STHT noise) is a counter-based draw keyed on (seed, sequence key,
position, index), so every TP rank, engine and TP layout draws the same values without sharing
RNG state, and only mixed rows are drawn. Top-k over the vocabulary is vocab-parallel: local
top-k per partition, all-gather of k values and ids, merge by (-value, id) (ties → lower id).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ngrpo.mixing.decision import (
    MixDecision,
    _gather_global_columns,
    _tp_active,
    counter_uniform,
    decide,
)

# Seed streams of the baselines' draws, distinct from the gate's.
_NOISE_STREAM = 0x5354485400000000
_GUMBEL_STREAM = 0x47554D4200000000


@dataclass(frozen=True)
class NoiseSpec:
    """STHT noise: i.i.d. N(0, sigma²) per embedding dimension (``dim`` of them)."""

    sigma: float
    dim: int

    @classmethod
    def from_embedding(
        cls,
        weight_local: torch.Tensor,
        num_real_tokens: int,
        scale: float,
        vocab_start: int = 0,
        tp_group: dist.ProcessGroup | None = None,
    ) -> NoiseSpec:
        """σ = ``scale`` × RMS of the entries of the real rows (ids < ``num_real_tokens``) of the
        vocab-parallel embedding whose local rows ``weight_local`` [V_local, d] start at
        ``vocab_start``; one all-reduce over ``tp_group``."""
        rows = weight_local[: max(0, min(weight_local.shape[0], num_real_tokens - vocab_start))]
        sq = rows.detach().double().pow(2).sum().reshape(1)
        if _tp_active(tp_group):
            dist.all_reduce(sq, group=tp_group)
        d = weight_local.shape[1]
        return cls(sigma=scale * math.sqrt(float(sq) / (num_real_tokens * d)), dim=d)


def gaussian_noise(
    seed: int, key: torch.Tensor, position: torch.Tensor, spec: NoiseSpec
) -> torch.Tensor:
    """[B, d] float32 σ·N(0, 1) per (seed, key[b], position[b], dimension), Box–Muller on
    counter-based uniforms."""
    key, position = torch.as_tensor(key).view(-1, 1), torch.as_tensor(position).view(-1, 1)
    j = torch.arange(spec.dim, device=key.device).view(1, -1)
    u1 = counter_uniform(seed ^ _NOISE_STREAM, key, position, 2 * j)
    u2 = counter_uniform(seed ^ _NOISE_STREAM, key, position, 2 * j + 1)
    n = torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2.0 * math.pi * u2)
    return (spec.sigma * n).float()


def global_topk(
    scores: torch.Tensor, k: int, vocab_start: int = 0, tp_group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the whole (vocab-parallel) vocabulary: values [B, k] and global ids [B, k],
    ordered by (-value, id), ties at the boundary → lower id. ``scores`` [B, V_local] are this
    rank's columns ``vocab_start ..``. Entries of value -inf get id 0 (weight-0 padding)."""
    vals, cols = _local_topk(scores, k)
    sentinel = torch.iinfo(torch.long).max
    ids = torch.where(torch.isneginf(vals), torch.full_like(cols, sentinel), cols + vocab_start)
    if _tp_active(tp_group):
        world = dist.get_world_size(tp_group)
        all_vals = [torch.empty_like(vals) for _ in range(world)]
        all_ids = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(all_vals, vals.contiguous(), group=tp_group)
        dist.all_gather(all_ids, ids.contiguous(), group=tp_group)
        vals, ids = torch.cat(all_vals, 1), torch.cat(all_ids, 1)
    by_id = torch.argsort(ids, dim=1, stable=True)
    order = torch.gather(
        by_id, 1, torch.argsort(-torch.gather(vals, 1, by_id), dim=1, stable=True)
    )[:, :k]
    vals, ids = torch.gather(vals, 1, order), torch.gather(ids, 1, order)
    return vals, ids.masked_fill(ids == sentinel, 0)


def _local_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local top-k (padded with -inf to k columns) whose membership breaks boundary ties by the
    lower column: rows with a finite tie across the k-th value are redone with a stable sort."""
    m = min(k, scores.shape[1])
    vals, cols = torch.topk(scores, m, dim=1)
    kth = vals[:, m - 1 : m]
    tied = torch.isfinite(kth.squeeze(1)) & ((scores >= kth).sum(1) > m)
    rows = tied.nonzero().squeeze(1)
    if rows.numel():
        vals[rows], cols[rows] = (
            t[:, :m] for t in torch.sort(scores[rows], dim=1, descending=True, stable=True)
        )
    if m < k:
        vals = torch.cat([vals, vals.new_full((vals.shape[0], k - m), float("-inf"))], 1)
        cols = torch.cat([cols, cols.new_zeros(cols.shape[0], k - m)], 1)
    return vals, cols


def _scaled(
    logits: torch.Tensor, temperature: float, num_real_tokens: int, vocab_start: int
) -> torch.Tensor:
    """fp32 z/τ with columns of ids >= num_real_tokens set to -inf."""
    z = logits.float() / temperature
    col_ids = torch.arange(vocab_start, vocab_start + z.shape[1], device=z.device)
    return z.masked_fill(col_ids.unsqueeze(0) >= num_real_tokens, float("-inf"))


def _check_k(k: int, num_real_tokens: int) -> None:
    if not 1 <= k <= num_real_tokens:
        raise ValueError(f"k = {k}: must be in [1, num_real_tokens = {num_real_tokens}]")


def soft_thinking(
    logits: torch.Tensor,
    k: int,
    temperature: float,
    mixed: torch.Tensor,
    num_real_tokens: int,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
) -> MixDecision:
    """Top-k truncated Soft Thinking: ids = the k largest z/τ (anchor = argmax first), weights =
    softmax of z/τ on them. ``logits`` [B, V_local] vocab-parallel as in :func:`decision.decide`."""
    _check_k(k, num_real_tokens)
    z = _scaled(logits, temperature, num_real_tokens, vocab_start)
    vals, ids = global_topk(z, k, vocab_start, tp_group)
    return MixDecision(
        mixed=mixed.to(z.device),
        anchor=ids[:, 0].clone(),
        ids=ids,
        weights=torch.softmax(vals, dim=-1),
    )


def stht(
    logits: torch.Tensor,
    k: int,
    temperature: float,
    mixed: torch.Tensor,
    num_real_tokens: int,
    noise: NoiseSpec,
    seed: int,
    key: torch.Tensor,
    position: torch.Tensor,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
) -> MixDecision:
    """STHT: the :func:`soft_thinking` mixture plus recorded Gaussian noise on mixed rows
    (``noise`` [B, d], zero on unmixed rows). ``key``/``position`` [B] as for the gate."""
    dec = soft_thinking(logits, k, temperature, mixed, num_real_tokens, vocab_start, tp_group)
    dec.noise = torch.zeros(logits.shape[0], noise.dim, device=logits.device)
    rows = dec.mixed.nonzero().squeeze(1)
    if rows.numel():
        key, position = (
            torch.as_tensor(key).to(rows.device),
            torch.as_tensor(position).to(rows.device),
        )
        dec.noise[rows] = gaussian_noise(seed, key[rows], position[rows], noise).to(logits.device)
    return dec


def gumbel(
    logits: torch.Tensor,
    k: int,
    temperature: float,
    mixed: torch.Tensor,
    num_real_tokens: int,
    seed: int,
    key: torch.Tensor,
    position: torch.Tensor,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
) -> MixDecision:
    """Gumbel Soft-Thinking: candidates = top-k of z/T + Gumbel(0, 1) (drawn on mixed rows only;
    unmixed rows get the noise-free top-k), weights = softmax of the clean z/T on them."""
    _check_k(k, num_real_tokens)
    z = _scaled(logits, temperature, num_real_tokens, vocab_start)
    perturbed = z.double()
    rows = mixed.to(z.device).nonzero().squeeze(1)
    if rows.numel():
        key = torch.as_tensor(key).to(z.device)[rows].view(-1, 1)
        position = torch.as_tensor(position).to(z.device)[rows].view(-1, 1)
        col_ids = torch.arange(vocab_start, vocab_start + z.shape[1], device=z.device).view(1, -1)
        u = counter_uniform(seed ^ _GUMBEL_STREAM, key, position, col_ids).clamp_min_(1e-300)
        perturbed[rows] += -torch.log(-torch.log(u))
    _, ids = global_topk(perturbed, k, vocab_start, tp_group)
    clean = _gather_global_columns(z, ids, vocab_start, tp_group)
    return MixDecision(
        mixed=mixed.to(z.device),
        anchor=ids[:, 0].clone(),
        ids=ids,
        weights=torch.softmax(clean, dim=-1),
    )


def decide_for_strategy(
    cfg,
    logits: torch.Tensor,
    mixed: torch.Tensor,
    *,
    temperature: float,
    num_real_tokens: int,
    table: torch.Tensor | None = None,
    noise: NoiseSpec | None = None,
    seed: int = 0,
    key: torch.Tensor | None = None,
    position: torch.Tensor | None = None,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
    special: torch.Tensor | None = None,
) -> MixDecision:
    """The decision of ``cfg.strategy`` (a :class:`MixingConfig`) for one decode step.

    Args:
        logits: [B, V_local] vocab-parallel logits (columns from ``vocab_start``).
        mixed: [B] bool gate (from :func:`decision.gate`).
        temperature: the rollout's sampling temperature; ``cfg.temperature`` overrides it for α
            (``neighbor``, ``soft_thinking``, ``stht``); ``gumbel`` uses ``cfg.gumbel_temperature``.
        table: [V, k] neighbour table (``neighbor``).
        noise: :class:`NoiseSpec` (``stht``).
        seed, key, position: counter of the draws (``stht``, ``gumbel``): key [B] sequence keys,
            position [B] response-token indices — the same ones the gate uses.
        special: [num_real_tokens] bool, the special ids (:func:`decision.id_mask`): with
            ``cfg.skip_special_anchors`` a row whose anchor is one stays unmixed.
    Strategy ``none`` returns a decision with no mixed row (anchor = argmax, ids = [anchor]).
    """
    tau = cfg.temperature if cfg.temperature is not None else temperature
    if cfg.strategy in ("neighbor", "none", "soft_thinking"):
        dec = _decide_without_draws(
            cfg, logits, mixed, tau, num_real_tokens, table, vocab_start, tp_group
        )
    else:
        dec = _decide_with_draws(
            cfg,
            logits,
            mixed,
            tau,
            num_real_tokens,
            noise,
            seed,
            key,
            position,
            vocab_start,
            tp_group,
        )
    if special is not None and cfg.skip_special_anchors:
        dec.unmix_anchors(special)
    return dec


def _decide_without_draws(
    cfg,
    logits: torch.Tensor,
    mixed: torch.Tensor,
    tau: float,
    num_real_tokens: int,
    table: torch.Tensor | None,
    vocab_start: int,
    tp_group: dist.ProcessGroup | None,
) -> MixDecision:
    """``neighbor``, ``none`` and ``soft_thinking``: functions of the logits alone."""
    strategy = cfg.strategy
    if strategy == "neighbor":
        if table is None:
            raise ValueError("strategy 'neighbor' needs the neighbour table")
        return decide(logits, table, tau, mixed, num_real_tokens, vocab_start, tp_group)
    if strategy == "none":
        return soft_thinking(
            logits,
            1,
            tau,
            torch.zeros_like(mixed, dtype=torch.bool),
            num_real_tokens,
            vocab_start,
            tp_group,
        )
    return soft_thinking(logits, cfg.k, tau, mixed, num_real_tokens, vocab_start, tp_group)


def _decide_with_draws(
    cfg,
    logits: torch.Tensor,
    mixed: torch.Tensor,
    tau: float,
    num_real_tokens: int,
    noise: NoiseSpec | None,
    seed: int,
    key: torch.Tensor | None,
    position: torch.Tensor | None,
    vocab_start: int,
    tp_group: dist.ProcessGroup | None,
) -> MixDecision:
    """``stht`` and ``gumbel``: random draws counted by (seed, key, position)."""
    strategy = cfg.strategy
    if key is None or position is None:
        raise ValueError(f"strategy {strategy!r} needs key and position for its draws")
    if strategy == "stht":
        if noise is None:
            raise ValueError("strategy 'stht' needs a NoiseSpec (NoiseSpec.from_embedding)")
        return stht(
            logits,
            cfg.k,
            tau,
            mixed,
            num_real_tokens,
            noise,
            seed,
            key,
            position,
            vocab_start,
            tp_group,
        )
    if strategy == "gumbel":
        return gumbel(
            logits,
            cfg.k,
            cfg.gumbel_temperature,
            mixed,
            num_real_tokens,
            seed,
            key,
            position,
            vocab_start,
            tp_group,
        )
    raise ValueError(f"mixing.strategy {strategy!r}: unknown")
