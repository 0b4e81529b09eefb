"""Resumable iteration over prompt batches, epoch after epoch.

The order of an epoch is a permutation drawn from ``(seed, epoch)``, so the whole position is
two integers: a checkpoint stores :meth:`PromptBatches.state_dict` and a resumed run continues
with the very next batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PromptBatches:
    """Endless iterator of ``batch_size``-lists of ``items``.

    ``drop_last``: an epoch's incomplete tail is skipped (every batch is full, as verl's
    ``drop_last``); otherwise the last batch of an epoch may be shorter.
    """

    def __init__(
        self,
        items: Sequence,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size = {batch_size}: must be >= 1")
        if drop_last and len(items) < batch_size:
            raise ValueError(f"{len(items)} items cannot fill one batch of {batch_size}")
        if not items:
            raise ValueError("no items to iterate over")
        self.items = items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # index into the epoch's order of the next item
        self._order = self._epoch_order(0)

    @property
    def batches_per_epoch(self) -> int:
        n = len(self.items)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.items))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.items))

    def __iter__(self) -> PromptBatches:
        return self

    def __next__(self) -> list:
        remaining = len(self.items) - self.position
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        picked = self._order[self.position : self.position + self.batch_size]
        self.position += len(picked)
        return [self.items[int(i)] for i in picked]

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_items": len(self.items),
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (
            ("num_items", len(self.items)),
            ("batch_size", self.batch_size),
            ("seed", self.seed),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"prompt batches state: {key} = {state[key]} in the checkpoint, "
                    f"{mine} now; the data or its settings changed"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
