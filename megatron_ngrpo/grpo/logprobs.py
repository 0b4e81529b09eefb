"""Per-token log-probabilities of recorded responses, replayed through the Megatron model.

The replay batch (:class:`~megatron_ngrpo.grpo.batches.TokenBatch`) carries the recorded mixes and
the emitted tokens as labels. Log-probs are ``log softmax(logits / τ)[label]`` over the
vocab-parallel logits (:mod:`megatron_ngrpo.grpo.token_logprobs`), so TP never gathers the
vocabulary. The schedule's last stage returns the hidden states before the output layer
(:mod:`megatron_ngrpo.models.output_head`) and the log-prob pass computes the logits chunk by
chunk from them: no [tokens, V/TP] logits tensor is ever held, forward or backward.

The same micro-batch runner serves the forward-only passes (current/old/reference log-probs,
the tests' engine verification) and the training step (a loss function in
place of the collector); pipeline parallelism goes through megatron's
``get_forward_backward_func``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_ngrpo.architecture import unwrap
from megatron_ngrpo.grpo.batches import MicroBatchPlan, TokenBatch
from megatron_ngrpo.grpo.packing import pack, unpack
from megatron_ngrpo.grpo.token_logprobs import linear_vocab_parallel_logprobs
from megatron_ngrpo.mixing.embedding import mixing_inputs
from megatron_ngrpo.models.output_head import OutputHead, hidden_output, output_head


# ---- the per-token log-prob op ---------------------------------------------------------------
def token_logprobs(
    head: OutputHead,
    labels: torch.Tensor,
    temperature: float,
    vocab_limit: int | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / τ)[labels] over the full (TP-split) vocabulary.

    ``head``: what :func:`run_schedule` hands a loss function (hidden states [..., h] and this
    rank's output rows; the logits are computed chunk by chunk, never whole,
    :mod:`megatron_ngrpo.grpo.token_logprobs`); ``labels`` [...] global ids. Columns with global
    id ≥ ``vocab_limit`` (megatron's padded rows) are excluded from the softmax. Returns
    log-probs [...] (float32, differentiable) and, if asked, the entropy [...] of the same
    distribution (no gradient; a metric).
    """
    return linear_vocab_parallel_logprobs(
        head.hidden,
        head.weight,
        labels,
        temperature,
        vocab_start=head.vocab_start,
        vocab_limit=vocab_limit,
        group=head.group,
        with_entropy=with_entropy,
        invariant=head.batch_invariant,
    )


# ---- running micro-batches through megatron's schedule ---------------------------------------
LossFn = Callable[[TokenBatch, OutputHead], tuple]


def run_schedule(
    model_chunks: list,
    micro_batches: list[TokenBatch],
    plan: MicroBatchPlan,
    loss_fn: LossFn | None,
    forward_only: bool,
) -> list:
    """Run ``micro_batches`` through the model with megatron's (pipelined) schedule.

    ``loss_fn(mb, head)`` is called on the last stage with the :class:`OutputHead` of the micro-
    batch (hidden states [b, s, h] and the output rows; :func:`token_logprobs` takes it). In
    training it returns ``(loss, num_tokens, report)`` (megatron's per-token-loss convention);
    forward-only, what it returns is collected. Returns megatron's forward data store (last stage
    only; empty elsewhere).
    """

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        if plan.packing:  # PP = 1: the output is the last stage's
            kwargs, mix, index = pack(
                mb.tokens, mb.lengths, mb.mix, plan.seq_multiple, plan.packing
            )
            with mixing_inputs(model, mix), hidden_output(model):
                output = unpack(model(**kwargs), index, *mb.tokens.shape)
        else:
            with mixing_inputs(model, mb.mix), hidden_output(model):
                output = model(
                    input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None
                )
        return output, partial(_call_loss, loss_fn, mb, model)

    seq_length, mbs = plan.shape(micro_batches)
    for c in model_chunks:
        # Pipeline stages exchange activations of each micro-batch's own shape (GPU); megatron
        # otherwise assumes every micro-batch has the schedule's (seq_length, mbs).
        unwrap(c).config.variable_seq_lengths = plan.fixed_shape is None
    iters = [iter(micro_batches) for _ in model_chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iters if len(model_chunks) > 1 else iters[0],
        model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=mbs,
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
    )


def _call_loss(loss_fn, mb, model, output_tensor, non_loss_data=False):
    return loss_fn(mb, output_head(model, output_tensor))


def forward_token_values(
    model_chunks: list,
    batch: TokenBatch,
    plan: MicroBatchPlan,
    value_fn: Callable[[TokenBatch, OutputHead], torch.Tensor],
    num_values: int = 1,
) -> torch.Tensor:
    """Forward-only pass computing ``value_fn(mb, head) -> [num_values, b, s]`` per micro-batch;
    returns [num_values, B, L] label-aligned float32 values on every pipeline rank (zeros outside
    ``batch.mask``)."""
    micro_batches = plan.micro_batches(batch)
    with torch.no_grad():
        store = run_schedule(
            model_chunks,
            micro_batches,
            plan,
            lambda mb, head: value_fn(mb, head).float(),
            forward_only=True,
        )
    out = torch.zeros(
        (num_values,) + tuple(batch.tokens.shape), dtype=torch.float32, device=batch.tokens.device
    )
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for g, vals in zip(plan.groups, store):
            if g:
                n = min(vals.shape[-1], out.shape[-1])
                out[:, g, :n] = vals[:, : len(g), :n]
        out = out * batch.mask
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            out,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
    return out


def batch_logprobs(
    model_chunks: list,
    batch: TokenBatch,
    temperature: float,
    micro_batch_size: int,
    vocab_limit: int | None = None,
    max_tokens: int = 0,
    with_entropy: bool = False,
    packing: str = "",
) -> torch.Tensor:
    """[B, L] label-aligned log-probs of ``batch`` (and, with ``with_entropy``, [2, B, L] with the
    entropy as the second plane); ``packing``: see :class:`MicroBatchPlan`."""
    plan = MicroBatchPlan.make(model_chunks, batch, micro_batch_size, max_tokens, packing)

    def value_fn(mb: TokenBatch, head: OutputHead) -> torch.Tensor:
        lp, ent = token_logprobs(head, mb.labels, temperature, vocab_limit, with_entropy)
        return torch.stack([lp, ent]) if with_entropy else lp.unsqueeze(0)

    out = forward_token_values(model_chunks, batch, plan, value_fn, 2 if with_entropy else 1)
    return out if with_entropy else out[0]
