"""Configuration of the training loop: optimizer, supervised warm-start, asynchronous rollouts,
batch arithmetic and schedule, in-training validation.

Defaults are the N-GRPO paper's and its reference code's (docs/ALGORITHM.md §4–5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megatron_ngrpo.config_loader import fail
from megatron_ngrpo.eval.config import EvalSamplingConfig
from megatron_ngrpo.grpo.dynamic_sampling import DynamicSamplingConfig
from megatron_ngrpo.grpo.trackers import TrackersConfig


@dataclass
class OptimConfig:
    """megatron-core optimizer (AdamW) and learning-rate schedule (reference code: constant LR,
    no warm-up, betas 0.9/0.999, weight decay 0.01, grad clip 1.0)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    # constant | linear | cosine (megatron OptimizerParamScheduler styles)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
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
    on_stale: Literal["error", "drop"] = "error"

    def validate(self) -> None:
        if self.max_staleness not in (0, 1):
            fail(
                "max_staleness", self.max_staleness, "expected 0 (synchronous) or 1 (one-step-off)"
            )


@dataclass
class StopConfig:
    """``train.stop``: planned stops at signals and at the allocation's deadline."""

    # Handle SIGUSR1/SIGTERM and the deadline (false: a signal ends the process at once).
    enabled: bool = True
    # Seconds kept free before the deadline beyond the measured step and save times.
    margin_s: float = 60.0
    # Seconds after the allocation's start (SLURM_JOB_START_TIME, else this process's start)
    # by which the run must have stopped; 0 = the job's end time Slurm reports (none outside
    # Slurm).
    time_limit_s: int = 0

    def validate(self) -> None:
        if self.margin_s < 0:
            fail("margin_s", self.margin_s, "must be >= 0")
        if self.time_limit_s < 0:
            fail("time_limit_s", self.time_limit_s, "must be >= 0 (0 = from Slurm)")


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
    reference: Literal["swap", "copy"] = "swap"
    save_every: int = 10
    # Write checkpoints in the background (megatron dist_checkpointing async save: a forked writer
    # per rank); a checkpoint becomes `latest` once every rank's writer finished.
    async_save: bool = False
    keep_last: int = 3
    # Resume from run_dir/latest (or, when that is broken, the newest verified iter_*); a run
    # directory holding a run but no resumable checkpoint is refused. false: start over at step
    # 0 in run_dir, rewriting its checkpoints (metrics.jsonl is appended to).
    resume: bool = True
    # Planned stops: a signal or the allocation's deadline saves and exits 75 (training/stop.py).
    stop: StopConfig = field(default_factory=StopConfig)
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
        for name in (
            "prompts_per_step",
            "mini_batch_prompts",
            "epochs_per_rollout",
            "micro_batch_size",
            "num_epochs",
            "keep_last",
            "log_every",
        ):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")
        if self.dist_timeout_s < 1:
            fail("dist_timeout_s", self.dist_timeout_s, "must be >= 1")
        for name in ("max_tokens_per_micro_batch", "max_steps", "save_every"):
            if getattr(self, name) < 0:
                fail(name, getattr(self, name), "must be >= 0")
        if self.prompts_per_step % self.mini_batch_prompts:
            fail(
                "mini_batch_prompts",
                self.mini_batch_prompts,
                f"must divide prompts_per_step = {self.prompts_per_step}",
            )
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
