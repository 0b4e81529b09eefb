"""Configuration of the GRPO objective, the optimizer and the training loop.

Defaults are the N-GRPO paper's (docs/ALGORITHM.md §4–5); reference-code choices are options.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ngrpo.config_loader import fail
from megatron_ngrpo.eval.config import EvalSamplingConfig
from megatron_ngrpo.grpo.dynamic_sampling import DynamicSamplingConfig
from megatron_ngrpo.grpo.mismatch import MismatchConfig
from megatron_ngrpo.grpo.trackers import TrackersConfig

ADVANTAGES = ("grpo", "dr_grpo")
LOSS_MODES = ("token", "gspo")
LOSS_AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_MODES = ("loss", "metric", "off")
DRA_EMBEDDERS = ("tfidf", "policy_hidden", "local_model")


@dataclass
class DRAConfig:
    """DRA reward adjustment (DRA-GRPO paper): r̃_i = r_i / (1 + Σ_{j≠i} s(o_i, o_j))."""

    enabled: bool = False
    # "tfidf": hashed bag-of-n-grams TF-IDF of the response text (lexical stand-in for the
    # paper's jina sentence embedder); "policy_hidden": the policy's final hidden states
    # mean-pooled over the response (from the replay pass); "local_model": a sentence-embedding
    # model loaded from model_path (grpo/dra.py).
    embedder: str = "tfidf"
    # local_model: a local directory holding a transformers model and its tokenizer.
    model_path: str = ""
    # local_model: tokens embedded per response.
    max_length: int = 512
    # Similarities span each prompt's group (paper rule) or every response of the local batch
    # (DRA reference code).
    scope: str = "group"
    ngram: int = 2
    hash_dim: int = 2**18

    def validate(self) -> None:
        if self.embedder not in DRA_EMBEDDERS:
            fail("embedder", self.embedder, f"expected one of {DRA_EMBEDDERS}")
        if self.embedder == "local_model" and not os.path.isfile(os.path.join(self.model_path, "config.json")):
            fail("model_path", self.model_path, "embedder = local_model needs a local model directory (config.json)")
        if self.max_length < 1:
            fail("max_length", self.max_length, "must be >= 1")
        if self.scope not in ("group", "batch"):
            fail("scope", self.scope, "expected 'group' (paper) or 'batch' (reference code)")
        if self.ngram < 1:
            fail("ngram", self.ngram, "must be >= 1")
        if self.hash_dim < 16:
            fail("hash_dim", self.hash_dim, "must be >= 16")


@dataclass
class GRPOConfig:
    # Advantage: "grpo" = (r - mean) / (std + eps) per group (unbiased std); "dr_grpo" = r - mean.
    advantage: str = "grpo"
    adv_eps: float = 1e-6
    # Policy ratio: "token" (GRPO, Eq. 13) or "gspo" (sequence ratio exp(mean_t log-ratio), N-GSPO).
    loss_mode: str = "token"
    # Aggregation over the mini-batch (global over micro-batches and DP ranks):
    # seq-mean-token-mean (paper Eq. 13), token-mean (reference code), seq-mean-token-sum-norm
    # (Dr.GRPO: token sum / (sequences × rollout.max_new_tokens)).
    loss_agg: str = "seq-mean-token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    # Dual-clip constant c for negative advantages (null = off).
    dual_clip: float | None = 3.0
    log_ratio_clamp: float = 20.0
    # KL(π_θ‖π_ref): "loss" adds kl_coef·KL to the loss, "metric" only logs it, "off" skips the
    # reference model.
    kl_mode: str = "loss"
    kl_coef: float = 0.001
    kl_estimator: str = "k3"
    # k3 values are clamped to ±this (verl's low_var_kl).
    kl_clamp: float = 10.0
    # Groups whose rewards are all equal are masked out (no gradient, not counted in the
    # normalisers). Off in the paper and the reference code (their advantage is 0 anyway).
    filter_zero_variance: bool = False
    # Old log-probs: "recompute" with the trainer before the updates (reference code) or take the
    # engine's "rollout" log-probs.
    old_logprobs: str = "recompute"
    # Truncated importance sampling: per-token weight min(π_old/π_rollout, tis_cap) (null = off);
    # short for mismatch.mode = token-tis, mismatch.cap = tis_cap.
    tis_cap: float | None = None
    # Rollout-trainer mismatch corrections (grpo/mismatch.py); its metrics are logged every step
    # with grpo.old_logprobs = recompute.
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    dra: DRAConfig = field(default_factory=DRAConfig)

    def validate(self) -> None:
        if self.advantage not in ADVANTAGES:
            fail("advantage", self.advantage, f"expected one of {ADVANTAGES}")
        if self.adv_eps < 0:
            fail("adv_eps", self.adv_eps, "must be >= 0")
        if self.loss_mode not in LOSS_MODES:
            fail("loss_mode", self.loss_mode, f"expected one of {LOSS_MODES}")
        if self.loss_agg not in LOSS_AGGS:
            fail("loss_agg", self.loss_agg, f"expected one of {LOSS_AGGS}")
        if not 0 <= self.clip_low < 1:
            fail("clip_low", self.clip_low, "must be in [0, 1)")
        if self.clip_high < 0:
            fail("clip_high", self.clip_high, "must be >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1:
            fail("dual_clip", self.dual_clip, "must be > 1 (or null to disable)")
        if self.log_ratio_clamp <= 0:
            fail("log_ratio_clamp", self.log_ratio_clamp, "must be > 0")
        if self.kl_mode not in KL_MODES:
            fail("kl_mode", self.kl_mode, f"expected one of {KL_MODES}")
        if self.kl_coef < 0:
            fail("kl_coef", self.kl_coef, "must be >= 0")
        if self.kl_estimator not in KL_ESTIMATORS:
            fail("kl_estimator", self.kl_estimator, f"expected one of {KL_ESTIMATORS}")
        if self.old_logprobs not in ("recompute", "rollout"):
            fail("old_logprobs", self.old_logprobs, "expected 'recompute' or 'rollout'")
        if self.tis_cap is not None and self.tis_cap <= 0:
            fail("tis_cap", self.tis_cap, "must be > 0 (or null to disable)")
        if self.tis_cap is not None and self.mismatch.mode != "off":
            fail("tis_cap", self.tis_cap, f"set either tis_cap or mismatch.mode (= {self.mismatch.mode!r}), not both")
        if self.mismatch.mode != "off" and self.old_logprobs != "recompute":
            fail("mismatch.mode", self.mismatch.mode, "corrects π_old (recomputed) against the engine's "
                 "log-probs: needs grpo.old_logprobs = recompute")

    @property
    def correction(self) -> MismatchConfig:
        """The mismatch correction in force (``tis_cap`` read as token-tis)."""
        if self.tis_cap is not None:
            return MismatchConfig(mode="token-tis", cap=self.tis_cap)
        return self.mismatch

    @property
    def needs_reference(self) -> bool:
        return self.kl_mode != "off"


@dataclass
class OptimConfig:
    """megatron-core optimizer (AdamW) and learning-rate schedule (reference code: constant LR,
    no warm-up, betas 0.9/0.999, weight decay 0.01, grad clip 1.0)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    # constant | linear | cosine (megatron OptimizerParamScheduler styles)
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    distributed_optimizer: bool = False

    def validate(self) -> None:
        if self.lr <= 0:
            fail("lr", self.lr, "must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            fail("min_lr", self.min_lr, "must be in [0, lr]")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            fail("lr_schedule", self.lr_schedule, "expected constant, linear or cosine")
        if self.warmup_steps < 0:
            fail("warmup_steps", self.warmup_steps, "must be >= 0")
        if self.weight_decay < 0:
            fail("weight_decay", self.weight_decay, "must be >= 0")
        if self.clip_grad < 0:
            fail("clip_grad", self.clip_grad, "must be >= 0 (0 = no clipping)")


@dataclass
class WarmstartConfig:
    """Supervised warm-start (training/warmstart.py): token-mean NLL on worked solutions before RL."""

    # JSONL rows {"problem": ..., "response": ...}; the prompt is rendered with data.template.
    path: str = ""
    steps: int = 0
    batch_size: int = 32
    lr: float = 1e-3

    def validate(self) -> None:
        if self.steps < 0:
            fail("steps", self.steps, "must be >= 0")
        if self.steps and not Path(self.path).is_file():
            fail("path", self.path, "file does not exist")
        if self.batch_size < 1:
            fail("batch_size", self.batch_size, "must be >= 1")


@dataclass
class AsyncConfig:
    """Asynchronous rollouts (training/async_rollout.py): 0 = synchronous; 1 = one-step-off, the
    engine generates step n+1 with the weights of step n while the trainer updates on step n."""

    max_staleness: int = 0
    # A rollout older than max_staleness steps: "error" stops the run (one line), "drop" discards
    # it (counted in async/dropped) and generates the step again with the current weights.
    on_stale: str = "error"

    def validate(self) -> None:
        if self.max_staleness not in (0, 1):
            fail("max_staleness", self.max_staleness, "expected 0 (synchronous) or 1 (one-step-off)")
        if self.on_stale not in ("error", "drop"):
            fail("on_stale", self.on_stale, "expected 'error' or 'drop'")


@dataclass
class TrainConfig:
    """The loop: batch arithmetic, schedule, checkpoints and logs."""

    run_dir: str = "runs/ngrpo"
    seed: int = 1234
    # Prompts per rollout step (global, all DP ranks); responses = prompts × rollout.n.
    prompts_per_step: int = 64
    # Prompts per optimizer step (global): prompts_per_step / mini_batch_prompts optimizer steps
    # per rollout batch (reference code: 16 → 4 steps).
    mini_batch_prompts: int = 16
    # Passes over each rollout batch (PPO epochs).
    epochs_per_rollout: int = 1
    # Responses per micro-batch per DP rank (upper bound with a token budget).
    micro_batch_size: int = 2
    # Pack each micro-batch's responses into one row without padding (grpo/packing.py; PP 1).
    pack_sequences: bool = False
    # > 0: token-budget micro-batches (rows × longest row ≤ this), longest sequences first.
    max_tokens_per_micro_batch: int = 0
    # Rollout steps: 0 = one pass over the training prompts (num_epochs of them).
    max_steps: int = 0
    num_epochs: int = 1
    # Initial weights: a megatron checkpoint directory (iter_* or run dir), or "" for the HF
    # weights of model.hf_path, or "random" (tests).
    load: str = ""
    # Reference policy weights: "swap" (CPU state dict swapped into the policy model) or "copy"
    # (a second model on the device).
    reference: str = "swap"
    save_every: int = 10
    # Write checkpoints in the background (megatron dist_checkpointing async save: a forked writer
    # per rank); a checkpoint becomes `latest` once every rank's writer finished.
    async_save: bool = False
    keep_last: int = 3
    # Resume from run_dir/latest when it exists.
    resume: bool = True
    log_every: int = 1
    tensorboard: bool = True
    # Weights & Biases / MLflow beside metrics.jsonl and TensorBoard (grpo/trackers.py).
    trackers: TrackersConfig = field(default_factory=TrackersConfig)
    progress: bool = True
    # Save generations (text, reward, mixes) of every step as JSONL.
    dump_generations: bool = False
    # Supervised warm-start before RL (tiny models made from scratch; real runs: steps 0).
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    # Seconds a collective waits for the slowest rank (process-group timeout): longer than the
    # longest rollout of one data-parallel group and than a checkpoint save.
    dist_timeout_s: int = 1800
    # Read and written as ``train.async`` (a Python keyword: config_loader maps ``async_``).
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    # DAPO dynamic sampling: drop uniform-reward groups and refill the batch (grpo/dynamic_sampling.py).
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)

    def validate(self) -> None:
        for name in ("prompts_per_step", "mini_batch_prompts", "epochs_per_rollout",
                     "micro_batch_size", "num_epochs", "keep_last", "log_every"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")
        if self.dist_timeout_s < 1:
            fail("dist_timeout_s", self.dist_timeout_s, "must be >= 1")
        for name in ("max_tokens_per_micro_batch", "max_steps", "save_every"):
            if getattr(self, name) < 0:
                fail(name, getattr(self, name), "must be >= 0")
        if self.prompts_per_step % self.mini_batch_prompts:
            fail("mini_batch_prompts", self.mini_batch_prompts,
                 f"must divide prompts_per_step = {self.prompts_per_step}")
        if self.reference not in ("swap", "copy"):
            fail("reference", self.reference, "expected 'swap' or 'copy'")
        if not self.run_dir:
            fail("run_dir", self.run_dir, "required")


@dataclass
class ValidationConfig:
    """Validation during training (paper: AIME24 every step, the best checkpoint kept), with the
    evaluation runner (mixing off)."""

    # Every N rollout steps (0 = never); also after the last step when > 0.
    every: int = 0
    benchmarks: list[str] = field(default_factory=lambda: ["aime24"])
    limit: int = 0
    sampling: EvalSamplingConfig = field(default_factory=EvalSamplingConfig)
    # Save a checkpoint at every improvement of mean@n and name it in run_dir/best.
    keep_best: bool = True
    # Per rank and engine call: rows × (longest prompt + max_new_tokens) ≤ this (at least one
    # problem's n samples; the problems are split over the data-parallel ranks).
    max_tokens_per_call: int = 2**18

    def validate(self) -> None:
        if self.every < 0:
            fail("every", self.every, "must be >= 0")
        if self.every and not self.benchmarks:
            fail("benchmarks", self.benchmarks, "at least one benchmark is needed when every > 0")
        if self.limit < 0:
            fail("limit", self.limit, "must be >= 0")
        if self.max_tokens_per_call < 1:
            fail("max_tokens_per_call", self.max_tokens_per_call, "must be >= 1")
