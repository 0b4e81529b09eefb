"""Configuration of embedding-level exploration (N-GRPO mixing and its baselines).

Defaults follow the N-GRPO paper; reference-code choices are options (docs/ALGORITHM.md §2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from megatron_ngrpo.config_loader import fail

Strategy = Literal["none", "neighbor", "stht", "soft_thinking", "gumbel"]
Metric = Literal["cosine", "l2", "l1", "dot"]
METRICS = get_args(Metric)
# Cost of one on-demand neighbour row in rows of the full table, at the worst batch (one new
# anchor per search: a pass over the key rows for one query), per device type. Measured with
# bench/bench_neighbor_lookup.py --row-cost (bench/results/neighbor_lookup.md): CPU, SmolLM2-135M
# (49,152 × 576): 40 (8.6 at 4 anchors per search, 2.6 at 16); H100, random 49,152 × 576: 1,417
# (the whole table takes 0.15 s there; 195 at 16 anchors), random 152,064 × 3,584 (7B shape): 345
# (table 4.2 s; 23 at 16 anchors).
ON_DEMAND_ROW_COST = {"cpu": 40, "cuda": 1400}


@dataclass
class MixingConfig:
    # none (plain GRPO) | neighbor (N-GRPO) | stht (Gaussian noise) | soft_thinking | gumbel
    strategy: Strategy = "neighbor"
    # ρ: per sequence and decode step, the probability that the next input is a mixture.
    rate: float = 0.1
    # |C_t|, anchor included (paper 3; reference 1.5B config 2).
    k: int = 3
    metric: Metric = "cosine"
    # Matrix whose rows define neighbours: "input" embedding (paper) or "output" layer (reference).
    neighbor_source: Literal["input", "output"] = "input"
    # Temperature of α; None = the rollout's sampling temperature (reference code).
    temperature: float | None = None
    # Token emitted at a mixed step: "anchor" (paper) or "sample" (reference code).
    emit: Literal["anchor", "sample"] = "anchor"
    # Stop mixing once the response contains this text (reference code: "</think>"); "" = never.
    stop_after: str = ""
    # Rows never chosen as neighbours: special/added tokens and padded vocab rows ("real tokens
    # only"), plus explicit ids. The reference code allows every row (set both False).
    exclude_special: bool = True
    exclude_padded: bool = True
    exclude_ids: list[int] = field(default_factory=list)
    # A gated step whose anchor is a special/added token (end of turn, EOS) stays unmixed in every
    # engine (so the replay has no record there): its neighbours carry no meaning. Paper: mixes
    # reasoning tokens; reference code: mixes every anchor (false).
    skip_special_anchors: bool = True
    # Gradient into the embedding rows through mixed positions (reference code: probably none).
    embedding_grad: bool = True
    # Recompute the neighbour table every N optimizer steps (0 = only at start).
    refresh_every: int = 1
    # Neighbour rows: "table" (the whole [V, k] table per weight version), "on_demand" (only the
    # anchors a decode step mixes, exact and cached per weight version), "auto" (see lookup_mode).
    neighbor_lookup: Literal["table", "on_demand", "auto"] = "auto"
    # Query rows scored per chunk when building the table (bounds peak memory).
    chunk_size: int = 1024
    # Baselines: STHT σ = noise_scale × RMS embedding norm; soft_thinking/gumbel use top-`k`.
    noise_scale: float = 0.33
    gumbel_temperature: float = 1.0
    # Mixing at evaluation and in-training validation, the inference-time ablation (paper: off;
    # eval.runner.eval_mixing).
    at_eval: bool = False

    def validate(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            fail("rate", self.rate, "must be in [0, 1]")
        if self.k < 1:
            fail("k", self.k, "must be >= 1 (it counts the anchor)")
        if self.temperature is not None and self.temperature <= 0:
            fail(
                "temperature",
                self.temperature,
                "must be > 0 (or null for the sampling temperature)",
            )
        if self.refresh_every < 0:
            fail("refresh_every", self.refresh_every, "must be >= 0")
        if self.neighbor_lookup == "on_demand" and self.refresh_every != 1:
            fail(
                "neighbor_lookup",
                self.neighbor_lookup,
                f"on-demand rows are always the current weights' (refresh_every = {self.refresh_every} "
                "keeps a table across updates): set refresh_every: 1 or neighbor_lookup: table",
            )
        if self.chunk_size < 1:
            fail("chunk_size", self.chunk_size, "must be >= 1")
        if self.noise_scale < 0:
            fail("noise_scale", self.noise_scale, "must be >= 0")

    def lookup_mode(self, positions: int, vocab_size: int, device_type: str = "cpu") -> str:
        """ "table" or "on_demand" for a weight version whose rollouts decode at most
        ``positions`` tokens (sequences × max_new_tokens) over a ``vocab_size`` vocabulary,
        searched on a ``device_type`` ("cpu", "cuda") device.

        ``auto``: on-demand when its worst-case cost stays below the table's, i.e. when
        ``rate · positions · ON_DEMAND_ROW_COST[device_type] < vocab_size`` (rate · positions
        bounds the distinct anchors; each costs at most that many table rows), and only with
        ``refresh_every == 1`` (a table kept across updates is the table's option). SmolLM2-135M,
        16 rollouts × 48 tokens at ρ = 0.1: 77 · 40 = 3,080 < 49,152 → on_demand on CPU, 77 ·
        1,400 > 49,152 → table on a GPU (0.15 s); a 7B run (V = 152,064) with 512 rollouts ×
        4,096 tokens: table on either.
        """
        if self.neighbor_lookup != "auto":
            return self.neighbor_lookup
        if self.refresh_every != 1:
            return "table"
        cost = ON_DEMAND_ROW_COST.get(device_type, ON_DEMAND_ROW_COST["cuda"])
        return "on_demand" if self.rate * positions * cost < vocab_size else "table"

    @property
    def enabled(self) -> bool:
        return self.strategy != "none" and self.rate > 0
