"""What the GRPO loss reads besides the model's log-probs: one typed object per replay batch.

Built once per rollout step (the trainer's loss-input stage: old and reference log-probs,
advantages, the mismatch correction), carried by the
:class:`~megatron_ngrpo.grpo.batches.TokenBatch` into every micro-batch, read by
:func:`~megatron_ngrpo.grpo.loss.micro_batch_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ngrpo.grpo.batches import RowTensors


@dataclass
class LossInputs(RowTensors):
    """Per-row inputs of the GRPO loss for a batch of B rows and L label-aligned columns.

    ``old_logprobs`` [B, L] log π_old of each label (the ratio's denominator); ``advantages`` [B]
    (sequence level); ``active`` [B] bool (False: a filtered group, no loss); ``ref_logprobs``
    [B, L] log π_ref (None without a KL term); ``tis_weight`` [B, L] the mismatch correction's
    per-token weight and ``keep`` [B, L] bool its kept tokens (None without a correction:
    grpo/mismatch.py); ``token_weight`` [B, L] the aggregation weights, set by
    :func:`~megatron_ngrpo.grpo.update.loss_and_grads` for the whole mini-batch.
    """

    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    active: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    tis_weight: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    token_weight: torch.Tensor | None = None
