"""Rollout–trainer mismatch corrections and their metrics.

The rollout engine samples from π_rollout (its kernels, its precision, and at N-GRPO's mixed
steps its own mixing decision); the trainer scores the same tokens as π_old. Per response token
ρ_t = π_old(y_t) / π_rollout(y_t) = exp(old_t − rollout_t). A correction turns ρ into a weight
on the token's policy-gradient term and a keep mask; rejected tokens leave both the loss and its
normaliser (verl's rule: the aggregation counts kept tokens only).

Modes (``grpo.mismatch.mode``; C = ``cap``, [lo, hi] = ``lower``/``upper``):

- ``token-tis``  TIS (Yao et al.): w_t = min(ρ_t, C).
- ``token-mask`` token rejection: keep_t = ρ_t ∈ [lo, hi], w_t = 1.
- ``icepop``     IcePop (Ring-1T): keep_t = ρ_t ∈ [lo, hi], w_t = ρ_t (calibrated, masked).
- ``seq-tis``    sequence TIS: w = min(ρ_seq, C), ρ_seq = Π_t ρ_t (the sequence's IS ratio).
- ``seq-mask``   sequence rejection: keep = ρ_geo ∈ [lo, hi], ρ_geo = exp(mean_t log ρ_t)
  (the geometric mean: length-independent), w = 1.
- ``seq-mask-tis`` ``seq-mask`` then token TIS on the kept sequences: w_t = min(ρ_t, C).
- ``mis``        masked importance sampling (Liu, Li et al., sequence level): keep = ρ_seq ≤ C,
  w = ρ_seq (untruncated).

Log-ratios are clamped to ±``log_ratio_clamp`` before exponentiation (overflow guard only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from megatron_ngrpo.config_loader import fail

MismatchMode = Literal[
    "off", "token-tis", "token-mask", "icepop", "seq-tis", "seq-mask", "seq-mask-tis", "mis"
]
MISMATCH_MODES = get_args(MismatchMode)


@dataclass
class MismatchConfig:
    """Rollout-correction mode and its thresholds (module docstring)."""

    mode: MismatchMode = "off"
    cap: float = 2.0
    lower: float = 0.5
    upper: float = 2.0
    log_ratio_clamp: float = 20.0

    def validate(self) -> None:
        if self.cap <= 0:
            fail("cap", self.cap, "must be > 0")
        if not 0 <= self.lower < self.upper:
            fail("lower", self.lower, f"must be in [0, upper = {self.upper})")
        if self.log_ratio_clamp <= 0:
            fail("log_ratio_clamp", self.log_ratio_clamp, "must be > 0")


def correction(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, cfg: MismatchConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weight [B, L] (0 off ``mask``) and keep mask [B, L] bool (⊆ ``mask``) of a
    mode other than ``off``.

    ``old`` / ``rollout`` [B, L] label-aligned log-probs of the trainer and the engine; ``mask``
    [B, L] response tokens. Computed in the inputs' dtype (float64 in the tests' reference).
    """
    m = mask.to(old.dtype)
    log_rho = ((old - rollout) * m).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    rho = torch.exp(log_rho)
    seq_log = (log_rho * m).sum(1, keepdim=True)
    length = m.sum(1, keepdim=True).clamp(min=1)
    seq_rho = torch.exp(seq_log.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)).expand_as(rho)
    geo = torch.exp(seq_log / length).expand_as(rho)
    ones = torch.ones_like(rho)
    every = torch.ones_like(mask, dtype=torch.bool)
    in_band = (rho >= cfg.lower) & (rho <= cfg.upper)
    geo_band = (geo >= cfg.lower) & (geo <= cfg.upper)
    weight, keep = {
        "token-tis": (rho.clamp(max=cfg.cap), every),
        "token-mask": (ones, in_band),
        "icepop": (rho, in_band),
        "seq-tis": (seq_rho.clamp(max=cfg.cap), every),
        "seq-mask": (ones, geo_band),
        "seq-mask-tis": (rho.clamp(max=cfg.cap), geo_band),
        "mis": (seq_rho, seq_rho <= cfg.cap),
    }[cfg.mode]
    keep = keep & mask.bool()
    return weight * keep.to(weight.dtype), keep


def mismatch_sums(
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    mixed: torch.Tensor | None,
    keep: torch.Tensor | None,
) -> dict[str, float]:
    """Local sums for the mismatch metrics, split into ``mixed`` and ``plain`` positions.

    ``mixed`` [B, L] bool: label columns whose input embedding is a recorded mix (None: none).
    Per split: ``n`` tokens, ``gap`` Σ|old − rollout|, ``kl`` Σ k3 estimate of
    KL(π_rollout‖π_old) (samples from the rollout: ρ − 1 − log ρ ≥ 0), ``masked`` rejected tokens.
    Reduce over DP and divide with :func:`mismatch_metrics`.
    """
    d = (old - rollout).double()
    mask = mask.bool()
    mixed = torch.zeros_like(mask) if mixed is None else mixed.bool() & mask
    rejected = torch.zeros_like(mask) if keep is None else mask & ~keep.bool()
    k3 = torch.expm1(d) - d
    out = {}
    for name, sel in (("mixed", mixed), ("plain", mask & ~mixed)):
        s = sel.double()
        out[f"{name}/n"] = float(s.sum())
        out[f"{name}/gap"] = float((d.abs() * s).sum())
        out[f"{name}/kl"] = float((k3 * s).sum())
        out[f"{name}/masked"] = float((rejected & sel).sum())
    return out


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """``mismatch/{mixed,plain,all}/{logprob_gap,kl,masked_frac}`` from DP-summed
    :func:`mismatch_sums` (0 where a split has no tokens)."""
    sums = {
        **sums,
        **{
            f"all/{k}": sums[f"mixed/{k}"] + sums[f"plain/{k}"]
            for k in ("n", "gap", "kl", "masked")
        },
    }
    out = {}
    for name in ("mixed", "plain", "all"):
        n = max(sums[f"{name}/n"], 1.0)
        out[f"mismatch/{name}/logprob_gap"] = sums[f"{name}/gap"] / n
        out[f"mismatch/{name}/kl"] = sums[f"{name}/kl"] / n
        out[f"mismatch/{name}/masked_frac"] = sums[f"{name}/masked"] / n
    return out
