"""One policy-gradient pass over a mini-batch: globally normalised loss, gradients through
megatron's schedule (micro-batches, PP), DP reduction by megatron DDP.

The batch is a :class:`~megatron_ngrpo.grpo.batches.TokenBatch` of this DP rank's responses
carrying its :class:`~megatron_ngrpo.grpo.loss_inputs.LossInputs` (old and reference log-probs,
advantages, active rows, the mismatch correction's weight and kept tokens). The aggregation weights are fixed
for the whole mini-batch before the first micro-batch runs, so micro-batch losses add up to the
mini-batch objective (megatron's ``calculate_per_token_loss`` mode: no division by the number of
micro-batches or DP ranks; the loss function reports ``num_tokens = 0`` so megatron's per-token
rescaling is skipped).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)

from megatron_ngrpo.architecture import unwrap
from megatron_ngrpo.compat.cpu import device
from megatron_ngrpo.grpo.batches import MicroBatchPlan, TokenBatch
from megatron_ngrpo.grpo.config import GRPOConfig
from megatron_ngrpo.grpo.logprobs import run_schedule, token_logprobs
from megatron_ngrpo.grpo.loss import STAT_KEYS, aggregation_weights, micro_batch_loss
from megatron_ngrpo.grpo.loss_inputs import LossInputs


@dataclass
class UpdateSettings:
    temperature: float
    micro_batch_size: int
    max_tokens: int = 0
    vocab_limit: int | None = None
    # Dr.GRPO normaliser: the longest response the engine may produce.
    max_response_len: int = 1
    # Sequence packing of the micro-batches (grpo/packing.py): "", "mask" or "thd".
    packing: str = ""


def wrap_for_training(chunks: list, ddp_config=None) -> list:
    """Wrap unwrapped model chunks in megatron DDP for this loss: micro-batch and DP losses are
    summed, not averaged (``calculate_per_token_loss``, read by DDP at construction, so it is set
    before wrapping), and gradients are finalised (DP all-reduce, tied/PP embedding sync) after
    the last micro-batch."""

    for c in chunks:  # each virtual-pipeline chunk has its own config object
        unwrap(c).config.calculate_per_token_loss = True
        unwrap(c).config.finalize_model_grads_func = finalize_model_grads
    config = unwrap(chunks[0]).config
    ddp_config = ddp_config or DistributedDataParallelConfig()
    wrapped = [
        DistributedDataParallel(
            config=unwrap(c).config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0
        )
        for i, c in enumerate(chunks)
    ]
    config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def update_step(
    model_chunks: list,
    batch: TokenBatch,
    loss_fn,
    micro_batch_size: int,
    max_tokens: int = 0,
    optimizer=None,
    scheduler=None,
    step: bool = True,
    packing: str = "",
) -> tuple[list[dict], float]:
    """One update of the GRPO loss and of the supervised warm-start: zero the gradient buffers (and
    ``optimizer``'s gradients: after a step megatron's optimizers leave ``param.grad`` aliasing
    ``main_grad``, which the next backward would add in twice), forward + backward ``batch``
    through megatron's schedule with ``loss_fn(mb, logits) -> (loss, num_tokens, stats)`` (the
    gradients end in the DDP ``main_grad`` buffers, reduced over DP), then the ``optimizer`` step
    when ``step`` (False: gradients only, e.g. no signal to step on) and a ``scheduler`` step.
    Returns the last pipeline stage's per-micro-batch statistics and the gradient norm (0.0
    without a step)."""
    for c in model_chunks:
        c.zero_grad_buffer()
    if optimizer is not None:
        optimizer.zero_grad()
    plan = MicroBatchPlan.make(model_chunks, batch, micro_batch_size, max_tokens, packing)
    store = run_schedule(model_chunks, plan.micro_batches(batch), plan, loss_fn, forward_only=False)
    grad_norm = None
    if step and optimizer is not None:
        _, grad_norm, _ = optimizer.step()
    if scheduler is not None:
        scheduler.step(1)
    return store, float(grad_norm or 0.0)


def loss_and_grads(
    model_chunks: list,
    batch: TokenBatch,
    cfg: GRPOConfig,
    settings: UpdateSettings,
    optimizer=None,
    with_entropy: bool = True,
    *,
    scheduler=None,
    step: bool = False,
) -> dict[str, float]:
    """The GRPO loss through :func:`update_step`: gradients of ``batch`` (carrying its
    :class:`LossInputs`), and with ``step`` the
    optimizer step (skipped when nothing is active anywhere: no signal) and ``scheduler``'s.
    Returns mini-batch statistics reduced over DP (on every rank): ``loss``/``pg_loss``/
    ``kl_loss`` (the aggregated objective), per-token means ``clip_frac``, ``kl``, ``entropy``,
    ``ratio``, max ``ratio_max``, the global ``normaliser`` (0: nothing active, the gradients
    are zero) and ``grad_norm`` (0.0 without a step)."""

    dp_group = ps.get_data_parallel_group()
    inputs: LossInputs = batch.inputs
    # Tokens a mismatch correction rejected ("keep" False) leave the normaliser too.
    kept = batch.mask if inputs.keep is None else batch.mask & inputs.keep
    weights, norm = aggregation_weights(
        kept, inputs.active, cfg.loss_agg, settings.max_response_len, dp_group
    )
    batch = batch.with_inputs(replace(inputs, token_weight=weights))

    def loss_fn(mb: TokenBatch, logits: torch.Tensor):
        lp, ent = token_logprobs(
            logits, mb.labels, settings.temperature, settings.vocab_limit, with_entropy
        )
        loss, stats = micro_batch_loss(lp, ent, mb.inputs, mb.mask, cfg)
        # num_tokens 0: the loss is already globally normalised (see module docstring).
        return loss, torch.zeros((), dtype=torch.int, device=loss.device), stats

    store, grad_norm = update_step(
        model_chunks,
        batch,
        loss_fn,
        settings.micro_batch_size,
        settings.max_tokens,
        optimizer,
        scheduler,
        step=step and norm != 0,
        packing=settings.packing,
    )
    return {**_reduce_stats(store, norm), "grad_norm": grad_norm}


def _reduce_stats(store: list[dict], norm: float) -> dict[str, float]:
    """Sum the micro-batch statistics (max for ``ratio_max``) of the last pipeline stage, over DP,
    and share them with the whole pipeline."""

    sums = torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=device())
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for stats in store:
            for i, k in enumerate(STAT_KEYS):
                sums[i] = (
                    torch.maximum(sums[i], stats[k]) if k == "ratio_max" else sums[i] + stats[k]
                )
    i_max = STAT_KEYS.index("ratio_max")
    mx = sums[i_max].clone()
    sums[i_max] = 0
    dist.all_reduce(sums, group=ps.get_data_parallel_group())
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        both = torch.cat([sums, mx.view(1)])
        dist.broadcast(
            both,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
        sums, mx = both[:-1], both[-1]
    s = dict(zip(STAT_KEYS, sums.tolist()))
    tokens = max(s["tokens"], 1.0)
    return {
        "loss": s["loss"],
        "pg_loss": s["pg_loss"],
        "kl_loss": s["kl_loss"],
        "clip_frac": s["clipped"] / tokens,
        "kl": s["kl"] / tokens,
        "entropy": s["entropy"] / tokens,
        "ratio": s["ratio"] / tokens,
        "abs_log_ratio": s["abs_log_ratio"] / tokens,
        "ratio_max": float(mx),
        "tokens": s["tokens"],
        "normaliser": norm,
    }
