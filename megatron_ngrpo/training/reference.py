"""The reference policy of the KL term: the weights RL starts from, frozen."""

from __future__ import annotations

import contextlib

import torch

from megatron_ngrpo.architecture import unwrap
from megatron_ngrpo.models.batch_invariant import enable_batch_invariant
from megatron_ngrpo.models.provider import build_model
from megatron_ngrpo.training.snapshot import WeightSnapshot


class ReferencePolicy:
    """The frozen initial weights: a CPU copy swapped into the policy's parameters for the
    reference pass (``swap``, no extra device memory), or a second model (``copy``), which runs
    the policy's forward: batch-invariant with ``batch_invariant`` (``rollout.batch_invariant``,
    whose packed micro-batches only its attention takes)."""

    def __init__(self, chunks: list, mode: str, model_cfg, batch_invariant: bool = False):
        self.mode = mode
        if mode == "swap":
            self.saved = WeightSnapshot(chunks)
            self.model = None
        else:
            self.model = build_model(model_cfg)
            with torch.no_grad():
                for own, src in zip(self.model, chunks, strict=True):
                    for p, q in zip(
                        unwrap(own).parameters(), unwrap(src).parameters(), strict=True
                    ):
                        p.copy_(q)
            for c in self.model:
                c.requires_grad_(False)
            if batch_invariant:
                enable_batch_invariant(self.model)

    @contextlib.contextmanager
    def active(self, chunks: list):
        """Yield model chunks computing the reference policy (restores the policy on exit)."""
        if self.model is not None:
            yield self.model
            return
        with self.saved.active(chunks):
            yield chunks
