"""Configuration of the GRPO objective (advantages, ratio and clipping, KL, DRA).

Defaults are the N-GRPO paper's (docs/ALGORITHM.md §4–5); reference-code choices are options.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from megatron_ngrpo.config_loader import fail
from megatron_ngrpo.grpo.mismatch import MismatchConfig


@dataclass
class DRAConfig:
    """DRA reward adjustment (DRA-GRPO paper): r̃_i = r_i / (1 + Σ_{j≠i} s(o_i, o_j))."""

    enabled: bool = False
    # "tfidf": hashed bag-of-n-grams TF-IDF of the response text (lexical stand-in for the
    # paper's jina sentence embedder); "policy_hidden": the policy's final hidden states
    # mean-pooled over the response (from the replay pass); "local_model": a sentence-embedding
    # model loaded from model_path (grpo/dra.py).
    embedder: Literal["tfidf", "policy_hidden", "local_model"] = "tfidf"
    # local_model: a local directory holding a transformers model and its tokenizer.
    model_path: str = ""
    # local_model: tokens embedded per response.
    max_length: int = 512
    # Similarities span each prompt's group (paper rule) or every response of the local batch
    # (DRA reference code).
    scope: Literal["group", "batch"] = "group"
    ngram: int = 2
    hash_dim: int = 2**18

    def validate(self) -> None:
        if self.embedder == "local_model" and not os.path.isfile(
            os.path.join(self.model_path, "config.json")
        ):
            fail(
                "model_path",
                self.model_path,
                "embedder = local_model needs a local model directory (config.json)",
            )
        if self.max_length < 1:
            fail("max_length", self.max_length, "must be >= 1")
        if self.ngram < 1:
            fail("ngram", self.ngram, "must be >= 1")
        if self.hash_dim < 16:
            fail("hash_dim", self.hash_dim, "must be >= 16")


@dataclass
class GRPOConfig:
    # Advantage: "grpo" = (r - mean) / (std + eps) per group (unbiased std); "dr_grpo" = r - mean.
    advantage: Literal["grpo", "dr_grpo"] = "grpo"
    adv_eps: float = 1e-6
    # Policy ratio: "token" (GRPO, Eq. 13) or "gspo" (sequence ratio exp(mean_t log-ratio), N-GSPO).
    loss_mode: Literal["token", "gspo"] = "token"
    # Aggregation over the mini-batch (global over micro-batches and DP ranks):
    # seq-mean-token-mean (paper Eq. 13), token-mean (reference code), seq-mean-token-sum-norm
    # (Dr.GRPO: token sum / (sequences × rollout.max_new_tokens)).
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = (
        "seq-mean-token-mean"
    )
    clip_low: float = 0.2
    clip_high: float = 0.2
    # Dual-clip constant c for negative advantages (null = off).
    dual_clip: float | None = 3.0
    log_ratio_clamp: float = 20.0
    # KL(π_θ‖π_ref): "loss" adds kl_coef·KL to the loss, "metric" only logs it, "off" skips the
    # reference model.
    kl_mode: Literal["loss", "metric", "off"] = "loss"
    kl_coef: float = 0.001
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    # k3 values are clamped to ±this (verl's low_var_kl).
    kl_clamp: float = 10.0
    # Groups whose rewards are all equal are masked out (no gradient, not counted in the
    # normalisers). Off in the paper and the reference code (their advantage is 0 anyway).
    filter_zero_variance: bool = False
    # Old log-probs: "recompute" with the trainer before the updates (reference code) or take the
    # engine's "rollout" log-probs.
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    # Truncated importance sampling: per-token weight min(π_old/π_rollout, tis_cap) (null = off);
    # short for mismatch.mode = token-tis, mismatch.cap = tis_cap (old_logprobs = recompute only).
    tis_cap: float | None = None
    # Rollout-trainer mismatch corrections (grpo/mismatch.py); its metrics are logged every step
    # with grpo.old_logprobs = recompute.
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    dra: DRAConfig = field(default_factory=DRAConfig)

    def validate(self) -> None:
        if self.adv_eps < 0:
            fail("adv_eps", self.adv_eps, "must be >= 0")
        if not 0 <= self.clip_low < 1:
            fail("clip_low", self.clip_low, "must be in [0, 1)")
        if self.clip_high < 0:
            fail("clip_high", self.clip_high, "must be >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1:
            fail("dual_clip", self.dual_clip, "must be > 1 (or null to disable)")
        if self.log_ratio_clamp <= 0:
            fail("log_ratio_clamp", self.log_ratio_clamp, "must be > 0")
        if self.kl_clamp <= 0:
            fail("kl_clamp", self.kl_clamp, "must be > 0")
        if self.kl_coef < 0:
            fail("kl_coef", self.kl_coef, "must be >= 0")
        if self.tis_cap is not None and self.tis_cap <= 0:
            fail("tis_cap", self.tis_cap, "must be > 0 (or null to disable)")
        if self.tis_cap is not None and self.mismatch.mode != "off":
            fail(
                "tis_cap",
                self.tis_cap,
                f"set either tis_cap or mismatch.mode (= {self.mismatch.mode!r}), not both",
            )
        # With the engine's log-probs as π_old, ρ = π_old/π_rollout is 1: nothing to correct.
        for name, value in (("tis_cap", self.tis_cap), ("mismatch.mode", self.mismatch.mode)):
            if value not in (None, "off") and self.old_logprobs != "recompute":
                fail(
                    name,
                    value,
                    "corrects π_old (recomputed) against the engine's "
                    "log-probs: needs grpo.old_logprobs = recompute",
                )

    @property
    def correction(self) -> MismatchConfig:
        """The mismatch correction in force (``tis_cap`` read as token-tis)."""
        if self.tis_cap is not None:
            return MismatchConfig(mode="token-tis", cap=self.tis_cap)
        return self.mismatch

    @property
    def needs_reference(self) -> bool:
        return self.kl_mode != "off"
