"""Configuration of embedding-level exploration (N-GRPO mixing and its baselines).

Defaults follow the N-GRPO paper; reference-code choices are options (docs/ALGORITHM.md §2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ngrpo.config_loader import fail

STRATEGIES = ("none", "neighbor", "stht", "soft_thinking", "gumbel")
METRICS = ("cosine", "l2", "l1", "dot")


@dataclass
class MixingConfig:
    # none (plain GRPO) | neighbor (N-GRPO) | stht (Gaussian noise) | soft_thinking | gumbel
    strategy: str = "neighbor"
    # ρ: per sequence and decode step, the probability that the next input is a mixture.
    rate: float = 0.1
    # |C_t|, anchor included (paper 3; reference 1.5B config 2).
    k: int = 3
    metric: str = "cosine"
    # Matrix whose rows define neighbours: "input" embedding (paper) or "output" layer (reference).
    neighbor_source: str = "input"
    # Temperature of α; None = the rollout's sampling temperature (reference code).
    temperature: float | None = None
    # Token emitted at a mixed step: "anchor" (paper) or "sample" (reference code).
    emit: str = "anchor"
    # Stop mixing once the response contains this text (reference code: "</think>"); "" = never.
    stop_after: str = ""
    # Rows never chosen as neighbours: special/added tokens and padded vocab rows ("real tokens
    # only"), plus explicit ids. The reference code allows every row (set both False).
    exclude_special: bool = True
    exclude_padded: bool = True
    exclude_ids: list[int] = field(default_factory=list)
    # Gradient into the embedding rows through mixed positions (reference code: probably none).
    embedding_grad: bool = True
    # Recompute the neighbour table every N optimizer steps (0 = only at start).
    refresh_every: int = 1
    # Query rows scored per chunk when building the table (bounds peak memory).
    chunk_size: int = 1024
    # Baselines: STHT σ = noise_scale × RMS embedding norm; soft_thinking/gumbel use top-`k`.
    noise_scale: float = 0.33
    gumbel_temperature: float = 1.0
    # Mixing at evaluation and in-training validation, the inference-time ablation (paper: off;
    # eval.runner.eval_mixing).
    at_eval: bool = False

    def validate(self) -> None:
        if self.strategy not in STRATEGIES:
            fail("strategy", self.strategy, f"expected one of {STRATEGIES}")
        if not 0.0 <= self.rate <= 1.0:
            fail("rate", self.rate, "must be in [0, 1]")
        if self.k < 1:
            fail("k", self.k, "must be >= 1 (it counts the anchor)")
        if self.metric not in METRICS:
            fail("metric", self.metric, f"expected one of {METRICS}")
        if self.neighbor_source not in ("input", "output"):
            fail("neighbor_source", self.neighbor_source, "expected 'input' or 'output'")
        if self.temperature is not None and self.temperature <= 0:
            fail("temperature", self.temperature, "must be > 0 (or null for the sampling temperature)")
        if self.emit not in ("anchor", "sample"):
            fail("emit", self.emit, "expected 'anchor' (paper) or 'sample' (reference code)")
        if self.refresh_every < 0:
            fail("refresh_every", self.refresh_every, "must be >= 0")
        if self.chunk_size < 1:
            fail("chunk_size", self.chunk_size, "must be >= 1")
        if self.noise_scale < 0:
            fail("noise_scale", self.noise_scale, "must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.strategy != "none" and self.rate > 0
