"""A frozen CPU copy of a policy's parameters, swapped into the live model chunks for a pass:
the reference policy (the initial weights) and the weights that generated a one-step-off
rollout (its old log-probs) use it, without a second model on the device."""

from __future__ import annotations

import contextlib

import torch

from megatron_ngrpo.architecture import unwrap


class WeightSnapshot:
    """The parameters of ``chunks`` (this rank's shards, possibly wrapped) at construction, or
    ``saved`` (a list per chunk of CPU tensors, e.g. from a checkpoint)."""

    def __init__(self, chunks: list | None = None, saved: list[list[torch.Tensor]] | None = None):
        self.saved = (
            saved
            if saved is not None
            else [[p.detach().to("cpu", copy=True) for p in ps] for ps in _params(chunks)]
        )

    @contextlib.contextmanager
    def active(self, chunks: list):
        """Within the block ``chunks`` hold the snapshot's weights (the current ones on exit)."""
        params = _params(chunks)
        current = [[p.detach().to("cpu", copy=True) for p in ps] for ps in params]
        _load(params, self.saved)
        try:
            yield chunks
        finally:
            _load(params, current)


def _params(chunks: list) -> list[list[torch.Tensor]]:
    return [list(unwrap(c).parameters()) for c in chunks]


@torch.no_grad()
def _load(params: list[list[torch.Tensor]], values: list[list[torch.Tensor]]) -> None:
    for ps, vs in zip(params, values, strict=True):
        for p, v in zip(ps, vs, strict=True):
            p.copy_(v)
