"""The trainer's log-probs of an engine's responses: the tests' check that what an engine reports
is what the trainer recomputes (the Megatron engine, vLLM, GRPO's replay)."""

from __future__ import annotations

import torch

from megatron_ngrpo.compat.cpu import device
from megatron_ngrpo.grpo.batches import TokenBatch
from megatron_ngrpo.grpo.logprobs import batch_logprobs
from megatron_ngrpo.rollout.types import RolloutBatch


def sequence_logprobs(
    model_chunks: list,
    batch: RolloutBatch,
    temperature: float,
    micro_batch_size: int,
    *,
    pad_id: int = 0,
    vocab_limit: int | None = None,
    replay_mixes: bool = True,
    max_tokens: int = 0,
    packing: str = "",
) -> list[torch.Tensor]:
    """Log-probs of every recorded response token of ``batch`` under ``model_chunks``.

    The history is replayed with the batch's mixes (unless ``replay_mixes`` is False); labels are
    the recorded ``response_ids``. Forward-only, any TP/PP layout (call it on every rank of the
    model-parallel group with the same batch). ``vocab_limit``: global ids ≥ it are left out of
    the softmax (pass the HF ``vocab_size`` to drop megatron's padded rows, as vLLM never has
    them; None keeps every row of the padded vocabulary). ``packing``: each micro-batch packed
    into one row (grpo/packing.py: "mask" or "thd"), "" unpacked.

    Returns one float32 tensor [len(response_ids[r])] per response, on every pipeline rank.
    """
    tb = TokenBatch.from_rollout(batch, pad_id=pad_id, replay_mixes=replay_mixes, device=device())
    values = batch_logprobs(
        model_chunks, tb, temperature, micro_batch_size, vocab_limit, max_tokens, packing=packing
    )
    return [v.cpu() for v in tb.response_values(values)]
