"""THE resolution of ``mixing.neighbor_lookup`` (``table | on_demand | auto``) to the neighbour
source a run's rollouts use: the trainer's owner (training/neighbor_source.py), an engine
generating without the trainer's table (rollout/megatron_engine.py, rollout/vllm/engine.py) and
the evaluation CLI (eval/runner.py ``eval_mixing``) all call :func:`resolve_mode`, so one config
gives one source wherever it runs. It sits in mixing/ because rollout/ and eval/ are below
training/ in the layer order (docs/ARCHITECTURE.md)."""

from __future__ import annotations

from typing import Literal

from megatron_ngrpo.mixing.config import MixingConfig

NeighborMode = Literal["none", "table", "on_demand"]


def resolve_mode(
    mixing: MixingConfig,
    engine_searches: bool,
    positions: int,
    vocab_size: int,
    device_type: str,
) -> NeighborMode:
    """The neighbour source of rollouts that decode at most ``positions`` tokens per DP rank and
    weight version over a ``vocab_size`` (padded) vocabulary on ``device_type``, on an engine
    that can (``engine_searches``) or cannot search rows itself: "none" without neighbour
    mixing, else ``auto`` by :meth:`MixingConfig.lookup_mode`'s cost rule."""
    if not (mixing.enabled and mixing.strategy == "neighbor"):
        return "none"
    if not engine_searches:
        if mixing.neighbor_lookup == "on_demand":
            raise ValueError(
                "mixing.neighbor_lookup = on_demand: this engine mixes with the trainer's table "
                "only (use table or auto)"
            )
        return "table"
    return mixing.lookup_mode(positions, vocab_size, device_type)
