"""Per-token log-probabilities of recorded responses, replayed through the Megatron model.

A rollout is replayed as one right-padded token batch (prompt + response per row). The input at
the column of response token t is ``E[response[t]]``, or the recorded mixture ``Σ w·E[ids]``
where the engine mixed (docs/ALGORITHM.md §1.2); the *label* of the column before it is always the
emitted token ``response[t]`` (the anchor in paper mode, the sample in reference mode, §1.3).
Log-probs are ``log softmax(logits / τ)[label]`` computed on the vocab-parallel logits in one fused
pass (:mod:`megatron_ngrpo.grpo.token_logprobs`), so TP never gathers the vocabulary.

The same micro-batch runner serves the forward-only passes (current/old/reference log-probs,
engine verification via :func:`sequence_logprobs`) and the training step (a loss function in
place of the collector); pipeline parallelism goes through megatron's
``get_forward_backward_func``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.distributed as dist

from megatron_ngrpo.architecture import unwrap
from megatron_ngrpo.grpo.packing import pack, unpack
from megatron_ngrpo.grpo.token_logprobs import vocab_parallel_logprobs
from megatron_ngrpo.mixing.embedding import MixBatch, mixing_inputs
from megatron_ngrpo.rollout.types import RolloutBatch


@dataclass
class TokenBatch:
    """A right-padded replay batch of B rows and L columns.

    ``tokens`` [B, L] int64 (prompt then response, then ``pad_id``); ``labels`` [B, L] int64, the
    token of column j+1 (what column j predicts); ``mask`` [B, L] bool, True at columns whose label
    is a response token; ``mix`` the dense mixes (or None); ``offsets`` [B] prompt lengths (column
    of response token 0); ``lengths`` [B] prompt + response lengths; ``extras`` per-row tensors of
    shape [B, ...] (e.g. [B, L] old log-probs aligned with ``labels``, [B] advantages) that travel
    with their rows into micro-batches.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    mix: MixBatch | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_rollout(cls, batch: RolloutBatch, pad_id: int = 0, replay_mixes: bool = True,
                     device: torch.device | str = "cpu") -> "TokenBatch":
        """The replay batch of ``batch``; its mixes are replayed unless ``replay_mixes`` is False."""
        if any(len(p) == 0 for p in batch.prompt_ids):
            raise ValueError("every response needs a non-empty prompt (the first token is predicted from it)")
        tokens, offsets, lengths = batch.padded(pad_id)
        b, length = tokens.shape
        labels = torch.full_like(tokens, pad_id)
        labels[:, :-1] = tokens[:, 1:]
        cols = torch.arange(length).unsqueeze(0)
        mask = (cols >= (offsets - 1).unsqueeze(1)) & (cols < (lengths - 1).unsqueeze(1))
        mix = None
        if replay_mixes and len(batch.mixes):
            mix = MixBatch.from_record(batch.mixes, offsets, length, device)
        return cls(tokens.to(device), labels.to(device), mask.to(device), offsets, lengths, mix)

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    @property
    def position_ids(self) -> torch.Tensor:
        return torch.arange(self.seq_len, device=self.tokens.device).unsqueeze(0).expand_as(self.tokens)

    def with_extras(self, **extras: torch.Tensor) -> "TokenBatch":
        return replace(self, extras={**self.extras, **extras})

    def response_values(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split a [B, L] label-aligned tensor into one [len_r] tensor per response."""
        return [values[r, int(o) - 1: int(n) - 1] for r, (o, n) in enumerate(zip(self.offsets, self.lengths))]

    def label_aligned(self, per_response: list[list[float]] | list[torch.Tensor],
                      dtype=torch.float32) -> torch.Tensor:
        """Inverse of :meth:`response_values`: [B, L] with zeros outside ``mask``."""
        out = torch.zeros(self.tokens.shape, dtype=dtype)
        for r, vals in enumerate(per_response):
            o = int(self.offsets[r])
            out[r, o - 1: o - 1 + len(vals)] = torch.as_tensor(vals, dtype=dtype)
        return out.to(self.tokens.device)

    def micro_batch(self, rows: list[int], num_rows: int | None = None,
                    seq_len: int | None = None) -> "TokenBatch":
        """Rows ``rows``, trimmed to their longest row (or padded to ``seq_len``) and padded with
        fully masked dummy rows up to ``num_rows`` (fixed pipeline shapes)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        length = seq_len or max(int(self.lengths[idx].max()), 1)
        pad_rows = (num_rows or len(rows)) - len(rows)

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            t = t.index_select(0, idx.to(t.device))
            if t.dim() >= 2:
                t = _fit(t, 1, length)
            if pad_rows:
                t = torch.cat([t, t.new_zeros((pad_rows,) + t.shape[1:])])
            return t

        mix = None if self.mix is None else MixBatch(*(take(t) for t in self.mix))
        dummy = torch.zeros(pad_rows, dtype=self.lengths.dtype)
        return TokenBatch(
            tokens=take(self.tokens), labels=take(self.labels), mask=take(self.mask),
            offsets=torch.cat([self.offsets[idx], dummy + 1]),
            lengths=torch.cat([self.lengths[idx], dummy + 1]),
            mix=mix, extras={k: take(v) for k, v in self.extras.items()},
        )


def _fit(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    if t.shape[dim] >= length:
        return t.narrow(dim, 0, length)
    pad_shape = list(t.shape)
    pad_shape[dim] = length - t.shape[dim]
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)


# ---- micro-batch layout --------------------------------------------------------------------
def split_rows(lengths: torch.Tensor | list[int], micro_batch_size: int,
               max_tokens: int = 0) -> list[list[int]]:
    """Row groups of one forward/backward pass each.

    ``max_tokens`` 0: consecutive groups of ``micro_batch_size`` rows. Otherwise token-budget
    micro-batches: rows sorted by length (longest first) are packed greedily so that
    rows × longest row ≤ ``max_tokens`` (padded area), at most ``micro_batch_size`` rows each
    (a row longer than the budget goes alone).
    """
    lengths = [int(x) for x in lengths]
    if not max_tokens:
        return [list(range(i, min(i + micro_batch_size, len(lengths))))
                for i in range(0, len(lengths), micro_batch_size)]
    order = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
    groups: list[list[int]] = []
    for r in order:
        g = groups[-1] if groups else None
        # Sorted longest first: the group's first row is its longest.
        if g is not None and len(g) < micro_batch_size and (len(g) + 1) * lengths[g[0]] <= max_tokens:
            g.append(r)
        else:
            groups.append([r])
    return groups


@dataclass
class MicroBatchPlan:
    """How a TokenBatch is cut: row groups, and the fixed [rows, len] shape pipeline p2p needs
    (None = each micro-batch trimmed to its own longest row; no PP, or variable-shape p2p)."""

    groups: list[list[int]]
    fixed_shape: tuple[int, int] | None
    # Every micro-batch's length is a multiple of this: TP under sequence parallelism (megatron
    # scatters the sequence over TP ranks), times the context-parallel size. Padded columns are
    # masked out like right padding.
    seq_multiple: int = 1
    # Sequence packing (grpo/packing.py): "" off, "mask" (local spec) or "thd" (TE, GPU).
    packing: str = ""

    @classmethod
    def make(cls, model_chunks: list, batch: TokenBatch, micro_batch_size: int,
             max_tokens: int = 0, packing: str = "") -> "MicroBatchPlan":
        from megatron.core import parallel_state as ps

        config = unwrap(model_chunks[0]).config
        multiple = (config.tensor_model_parallel_size if config.sequence_parallel else 1) * \
            config.context_parallel_size
        groups = split_rows(batch.lengths, micro_batch_size, max_tokens)
        pp = ps.get_pipeline_model_parallel_world_size()
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
        if vpp and len(groups) % pp:
            # The interleaved schedule needs a multiple of PP micro-batches; extra ones are
            # fully masked (group [] → one dummy row).
            groups += [[] for _ in range(pp - len(groups) % pp)]
        fixed = None
        if pp > 1 and not _variable_p2p_shapes():
            fixed = (max(max(len(g) for g in groups), 1), _round_up(int(batch.lengths.max()), multiple))
        if packing and pp > 1:
            raise ValueError("sequence packing needs pipeline_parallel = 1")
        return cls(groups, fixed, multiple, packing)

    def micro_batches(self, batch: TokenBatch) -> list[TokenBatch]:
        out = []
        for g in self.groups:
            if not g:
                # Dummy micro-batch: only padding rows (zero mask and zero extras, so zero token
                # weights: no loss, no gradient).
                mb = batch.micro_batch([], *(self.fixed_shape or (1, self.seq_multiple)))
            elif self.fixed_shape:
                mb = batch.micro_batch(g, *self.fixed_shape)
            else:
                longest = max(int(batch.lengths[g].max()), 1)
                mb = batch.micro_batch(g, seq_len=_round_up(longest, self.seq_multiple))
            out.append(mb)
        return out

    def shape(self, micro_batches: list[TokenBatch]) -> tuple[int, int]:
        """(seq_length, micro_batch_size) arguments of megatron's schedule."""
        if self.fixed_shape:
            return self.fixed_shape[1], self.fixed_shape[0]
        return micro_batches[0].seq_len, micro_batches[0].num_rows


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _variable_p2p_shapes() -> bool:
    # Shape exchange uses batch_isend_irecv, which pairs equal-shape gloo messages wrongly
    # (docs/ENVIRONMENT.md §2.3): on CPU every micro-batch gets one fixed shape instead.
    return torch.cuda.is_available()


# ---- the per-token log-prob op ---------------------------------------------------------------
def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                   vocab_limit: int | None = None, with_entropy: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / τ)[labels] over the full (TP-split) vocabulary.

    ``logits`` [..., V/TP] this rank's vocab partition, ``labels`` [...] global ids. Columns with
    global id ≥ ``vocab_limit`` (megatron's padded rows) are excluded from the softmax.
    Returns log-probs [...] (float32, differentiable) and, if asked, the entropy [...] of the
    same distribution (no gradient; a metric). One fused pass, no copy of the logits
    (:mod:`megatron_ngrpo.grpo.token_logprobs`); its backward reuses ``logits`` as the gradient.
    """
    from megatron.core import parallel_state as ps

    return vocab_parallel_logprobs(
        logits, labels, temperature, vocab_start=ps.get_tensor_model_parallel_rank() * logits.shape[-1],
        vocab_limit=vocab_limit, group=ps.get_tensor_model_parallel_group(), with_entropy=with_entropy)


# ---- running micro-batches through megatron's schedule ---------------------------------------
LossFn = Callable[[TokenBatch, torch.Tensor], tuple]


def run_schedule(model_chunks: list, micro_batches: list[TokenBatch], plan: MicroBatchPlan,
                 loss_fn: LossFn | None, forward_only: bool) -> list:
    """Run ``micro_batches`` through the model with megatron's (pipelined) schedule.

    ``loss_fn(mb, logits)`` is called on the last stage with logits [b, s, V/TP]. In training it
    returns ``(loss, num_tokens, report)`` (megatron's per-token-loss convention); with
    ``loss_fn=None`` the raw logits are not kept and the caller passes a collector instead.
    Returns megatron's forward data store (last stage only; empty elsewhere).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        if plan.packing:  # PP = 1: the output is the logits
            kwargs, mix, index = pack(mb.tokens, mb.lengths, mb.mix, plan.seq_multiple, plan.packing)
            with mixing_inputs(model, mix):
                output = unpack(model(**kwargs), index, *mb.tokens.shape)
        else:
            with mixing_inputs(model, mb.mix):
                output = model(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None)
        return output, partial(_call_loss, loss_fn, mb)

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


def _call_loss(loss_fn, mb, output_tensor, non_loss_data=False):
    return loss_fn(mb, output_tensor)


def forward_token_values(model_chunks: list, batch: TokenBatch, plan: MicroBatchPlan,
                         value_fn: Callable[[TokenBatch, torch.Tensor], torch.Tensor],
                         num_values: int = 1) -> torch.Tensor:
    """Forward-only pass computing ``value_fn(mb, logits) -> [num_values, b, s]`` per micro-batch;
    returns [num_values, B, L] label-aligned float32 values on every pipeline rank (zeros outside
    ``batch.mask``)."""
    from megatron.core import parallel_state as ps

    micro_batches = plan.micro_batches(batch)
    with torch.no_grad():
        store = run_schedule(model_chunks, micro_batches, plan,
                             lambda mb, logits: value_fn(mb, logits).float(), forward_only=True)
    out = torch.zeros((num_values,) + tuple(batch.tokens.shape), dtype=torch.float32,
                      device=batch.tokens.device)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for g, vals in zip(plan.groups, store):
            if g:
                n = min(vals.shape[-1], out.shape[-1])
                out[:, g, :n] = vals[:, : len(g), :n]
        out = out * batch.mask
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(out, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return out


def batch_logprobs(model_chunks: list, batch: TokenBatch, temperature: float,
                   micro_batch_size: int, vocab_limit: int | None = None, max_tokens: int = 0,
                   with_entropy: bool = False, packing: str = "") -> torch.Tensor:
    """[B, L] label-aligned log-probs of ``batch`` (and, with ``with_entropy``, [2, B, L] with the
    entropy as the second plane); ``packing``: see :class:`MicroBatchPlan`."""
    plan = MicroBatchPlan.make(model_chunks, batch, micro_batch_size, max_tokens, packing)

    def value_fn(mb: TokenBatch, logits: torch.Tensor) -> torch.Tensor:
        lp, ent = token_logprobs(logits, mb.labels, temperature, vocab_limit, with_entropy)
        return torch.stack([lp, ent]) if with_entropy else lp.unsqueeze(0)

    out = forward_token_values(model_chunks, batch, plan, value_fn, 2 if with_entropy else 1)
    return out if with_entropy else out[0]


def sequence_logprobs(model_chunks: list, batch: RolloutBatch, temperature: float,
                      micro_batch_size: int, *, pad_id: int = 0, vocab_limit: int | None = None,
                      replay_mixes: bool = True, max_tokens: int = 0) -> list[torch.Tensor]:
    """Log-probs of every recorded response token of ``batch`` under ``model_chunks``.

    The history is replayed with the batch's mixes (unless ``replay_mixes`` is False); labels are
    the recorded ``response_ids``. Forward-only, any TP/PP layout (call it on every rank of the
    model-parallel group with the same batch). ``vocab_limit``: global ids ≥ it are left out of
    the softmax (pass the HF ``vocab_size`` to drop megatron's padded rows, as vLLM never has
    them; None keeps every row of the padded vocabulary).

    Returns one float32 tensor [len(response_ids[r])] per response, on every pipeline rank.
    """
    from megatron_ngrpo.compat.cpu import device

    tb = TokenBatch.from_rollout(batch, pad_id=pad_id, replay_mixes=replay_mixes, device=device())
    values = batch_logprobs(model_chunks, tb, temperature, micro_batch_size, vocab_limit, max_tokens)
    return [v.cpu() for v in tb.response_values(values)]
