"""The GRPO / GSPO policy loss of one micro-batch, with globally normalised aggregation.

Per token (label-aligned [b, s] tensors): ratio r = exp(clamp(log π_θ − log π_old, ±20));
surrogate max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)), and for A < 0 at most −A·c (dual clip);
optionally × a rollout-correction weight (TIS, ICEPOP, ...: grpo/mismatch.py); plus β·KL(π_θ‖π_ref) (k1/k2/k3).
GSPO (``loss_mode="gspo"``) uses one ratio per sequence, exp(mean_t log-ratio), in the same
clipped surrogate, broadcast to the sequence's tokens.

Aggregation is a weighted sum with per-token weights fixed for the whole mini-batch
(:func:`aggregation_weights`), whose normalisers are already global over micro-batches and
data-parallel ranks; the sum of the micro-batch losses over all micro-batches and DP ranks is the
mini-batch objective, so megatron must neither average over micro-batches nor over DP (the
trainer sets ``calculate_per_token_loss``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ngrpo.grpo.config import GRPOConfig
from megatron_ngrpo.grpo.kl import kl_estimate
from megatron_ngrpo.grpo.loss_inputs import LossInputs


def aggregation_weights(
    mask: torch.Tensor,
    active: torch.Tensor,
    mode: str,
    max_len: int,
    dp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, float]:
    """Per-token weights [B, L] such that Σ weights·ℓ is the aggregated loss of the mini-batch
    spread over all DP ranks.

    ``mask`` [B, L] response tokens; ``active`` [B] bool, sequences that take part (False for
    filtered groups). Modes: ``token-mean`` 1/N_tokens; ``seq-mean-token-mean`` (paper Eq. 13)
    1/(N_seqs·|o_i|); ``seq-mean-token-sum-norm`` (Dr.GRPO) 1/(N_seqs·max_len).
    N_tokens / N_seqs count active tokens / sequences on every DP rank (one all-reduce).
    Returns the weights and the global normaliser (0 when nothing is active: all weights 0).
    """
    m = mask.float() * active.float().unsqueeze(1)
    lengths = m.sum(1)
    counts = torch.stack([m.sum(), (lengths > 0).float().sum()]).double()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(counts, group=dp_group)
    n_tokens, n_seqs = float(counts[0]), float(counts[1])
    if mode == "token-mean":
        norm = n_tokens
        w = m
    elif mode == "seq-mean-token-mean":
        norm = n_seqs
        w = m / lengths.clamp(min=1).unsqueeze(1)
    elif mode == "seq-mean-token-sum-norm":
        norm = n_seqs * max_len
        w = m
    else:
        raise ValueError(f"loss_agg {mode!r}")
    if norm == 0:
        return torch.zeros_like(m), 0.0
    return w / norm, norm


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss [b, s], clipped indicator [b, s] and ratio [b, s].

    ``advantages`` [b] (sequence level). ``mask`` [b, s] response tokens (for the GSPO mean).
    """
    log_ratio = logprobs - old_logprobs
    if cfg.loss_mode == "gspo":
        m = mask.float()
        seq = (log_ratio * m).sum(1) / m.sum(1).clamp(min=1)
        log_ratio = seq.unsqueeze(1).expand_as(logprobs)
    ratio = torch.exp(log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    adv = advantages.unsqueeze(1).to(ratio.dtype)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = torch.maximum(loss1, loss2)
    clipped = loss2 > loss1
    if cfg.dual_clip is not None:
        loss3 = -adv * cfg.dual_clip
        dual = (adv < 0) & (loss > loss3)
        loss = torch.where(adv < 0, torch.minimum(loss, loss3), loss)
        clipped = clipped | dual
    return loss, clipped, ratio


STAT_KEYS = (
    "loss",
    "pg_loss",
    "kl_loss",
    "tokens",
    "clipped",
    "kl",
    "entropy",
    "ratio",
    "abs_log_ratio",
    "ratio_max",
)


def micro_batch_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    inputs: LossInputs,
    mask: torch.Tensor,
    cfg: GRPOConfig,
) -> tuple[torch.Tensor, dict]:
    """The loss of one micro-batch and its statistics.

    ``inputs``: the micro-batch's :class:`LossInputs` [b, ...], ``token_weight`` set (from
    :func:`aggregation_weights`); a ``tis_weight`` scales the surrogate, a ``ref_logprobs`` adds
    the KL term. Returns the scalar loss (its sum over micro-batches and DP ranks is the
    objective) and a dict of float64 sums: the weighted ``loss``/``pg_loss``/``kl_loss`` (already
    normalised), and over response tokens the count ``tokens`` and sums of ``clipped``, ``kl``,
    ``entropy``, ``ratio``, ``abs_log_ratio`` (|log π_θ − log π_old|), plus ``ratio_max``.
    """
    w = inputs.token_weight
    pg, clipped, ratio = policy_loss(logprobs, inputs.old_logprobs, inputs.advantages, mask, cfg)
    if inputs.tis_weight is not None:
        pg = pg * inputs.tis_weight
    per_token = pg
    kl = None
    if inputs.ref_logprobs is not None:
        kl = kl_estimate(logprobs, inputs.ref_logprobs, cfg.kl_estimator, cfg.kl_clamp)
        if cfg.kl_mode == "loss" and cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
    loss = (per_token * w).sum()
    m = mask.float()
    with torch.no_grad():
        stats = {
            "loss": loss.detach(),
            "pg_loss": (pg * w).sum(),
            "kl_loss": ((kl * w).sum() * cfg.kl_coef)
            if kl is not None and cfg.kl_mode == "loss"
            else loss.new_zeros(()),
            "tokens": m.sum(),
            "clipped": (clipped.float() * m).sum(),
            "kl": (kl * m).sum() if kl is not None else m.new_zeros(()),
            "entropy": (entropy * m).sum() if entropy is not None else m.new_zeros(()),
            "ratio": (ratio * m).sum(),
            "abs_log_ratio": ((logprobs - inputs.old_logprobs).abs() * m).sum(),
            "ratio_max": (ratio * m).max() if m.numel() else m.new_zeros(()),
        }
    return loss, {k: v.double() for k, v in stats.items()}
