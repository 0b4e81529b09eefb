"""The one owner of the rollouts' neighbour source: per weight version, the whole [V, k] table,
exact rows searched on demand by the engine, or none.

The mode is resolved once per run by :func:`~megatron_ngrpo.mixing.neighbor_mode.resolve_mode`
(the one resolver of ``auto``, which engines and the evaluation CLI call too) over the most
decode positions one weight version serves on a DP rank and whether the engine can search rows
itself (:attr:`~megatron_ngrpo.rollout.types.RolloutEngine.neighbors_on_demand`).
Engines receive the resolved mixing config, never ``auto``, and after every weight sync the
engine's table is set by :meth:`NeighborSource.apply`, to None too: a table handed to the engine
for another weight version (a validation pass, an earlier step) never survives into a rollout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megatron_ngrpo.mixing.config import MixingConfig
from megatron_ngrpo.mixing.neighbor_mode import NeighborMode
from megatron_ngrpo.rollout.types import RolloutEngine, active_mixing


class NeighborSource:
    """Decides and hands the engine its neighbour source for each weight version.

    Args:
        mixing: the run's mixing section.
        mode: :func:`~megatron_ngrpo.mixing.neighbor_mode.resolve_mode`'s answer.
        build_table: computes the [V, k] table of the current weights (a collective of the
            model-parallel group; called only in "table" mode when due).
    """

    def __init__(
        self,
        mixing: MixingConfig,
        mode: NeighborMode,
        build_table: Callable[[], torch.Tensor],
    ):
        self.mode = mode
        self.refresh_every = mixing.refresh_every
        # What engines generate with: the lookup resolved, None when mixing is off.
        self.mixing = active_mixing(
            mixing if mode == "none" else dataclasses.replace(mixing, neighbor_lookup=mode)
        )
        self.build_table = build_table
        self.table: torch.Tensor | None = None
        self.table_updates = -1  # optimizer updates of the weights the table was computed from

    def refresh(self, updates: int) -> bool:
        """Compute the table of the weights after ``updates`` optimizer updates when due (every
        ``mixing.refresh_every`` updates; 0: once). True if it was computed."""
        if self.mode != "table":
            self.table = None
            return False
        due = self.table is None or (
            self.refresh_every and updates - self.table_updates >= self.refresh_every
        )
        if due:
            self.table = self.build_table().cpu()
            self.table_updates = updates
        return bool(due)

    def apply(self, engine: RolloutEngine) -> None:
        """Set the engine's source after a weight sync: the table, or None (its own on-demand rows,
        or no neighbour mixing)."""
        engine.set_neighbor_table(self.table if self.mode == "table" else None)

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"neighbor_table": self.table, "table_updates": self.table_updates}

    def load_state_dict(self, state: dict) -> None:
        self.table, self.table_updates = state["neighbor_table"], int(state["table_updates"])
