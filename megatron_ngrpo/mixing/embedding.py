"""Vocab-parallel embedding that replays semantic-neighbour mixtures.

``MixingVocabParallelEmbedding`` is megatron-core's ``VocabParallelEmbedding`` with one addition:
at mixed positions the output is ``Σ_c w_c · E[c]`` instead of ``E[token]`` (plus an optional
recorded noise vector, STHT). Each TP rank looks up only the rows of its vocab partition (rows of
other partitions are masked to zero), forms its partial mixture, and the usual single all-reduce
(or reduce-scatter under sequence parallelism) completes plain and mixed rows at once: mixing adds
no communication. Gradients reach the candidate rows scaled by their weights unless
``embedding_grad`` is False (then mixed positions contribute no embedding gradient, as in the
reference code).

GPTModel builds its ``VocabParallelEmbedding`` internally (no spec hook), so
:func:`install_mixing_embedding` swaps the class of that module in place: the very ``weight``
Parameter stays (tied output layer, DDP buckets and checkpoint keys are unaffected).
Mixes reach it with :func:`mixing_inputs` around the model call, so ``GPTModel.forward`` and
megatron's pipeline schedules are used unchanged; only the first pipeline stage has an embedding.

Under megatron's DDP (the trainer) the backward adds its rows straight into ``weight.main_grad``
(fp32), megatron's own gradient-accumulation-fusion protocol: no dense [V, h] gradient is
allocated, zeroed, and added into ``main_grad`` by the DDP hook (see :class:`_MixedLookup`).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from megatron_ngrpo.architecture import unwrap
from megatron_ngrpo.compat.cpu import bypass
from megatron_ngrpo.mixing.arithmetic import mix_rows
from megatron_ngrpo.mixing.records import MixRecord


class MixBatch(NamedTuple):
    """Dense mixes of a token batch [B, S]: ``ids`` [B, S, k] int64, ``weights`` [B, S, k],
    ``mask`` [B, S] bool (True = mixed), ``noise`` [B, S, h] or None."""

    ids: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor
    noise: torch.Tensor | None = None

    @classmethod
    def from_record(
        cls,
        record: MixRecord,
        offsets: torch.Tensor,
        seq_len: int,
        device: torch.device | str = "cpu",
    ) -> MixBatch:
        """Dense form of ``record`` for a right-padded batch whose response ``s`` starts at
        column ``offsets[s]``."""
        ids, weights, mask = record.to_dense(offsets, seq_len)
        noise = None
        if record.noise is not None and len(record):
            noise = torch.zeros(record.num_seqs, seq_len, record.noise.shape[1])
            col = torch.as_tensor(offsets, dtype=torch.long)[record.seq] + record.pos
            noise[record.seq, col] = record.noise
            noise = noise.to(device)
        return cls(ids.to(device), weights.to(device), mask.to(device), noise)

    def narrow(self, dim: int, start: int, length: int) -> MixBatch:
        """Slice along batch (0) or sequence (1), e.g. for micro-batches or one decode step."""
        return MixBatch(*(None if t is None else t.narrow(dim, start, length) for t in self))


class MixingVocabParallelEmbedding(VocabParallelEmbedding):
    """``VocabParallelEmbedding`` whose forward also takes a :class:`MixBatch`.

    Input ``input_`` [B, S] token ids; output [B, S, h] (or [S/TP, B, h] scattered under
    sequence parallelism), exactly megatron's layout. Without mixed rows it is megatron's
    forward unchanged (under DDP the same values through :class:`_MixedLookup`, whose backward
    writes ``main_grad``).
    """

    embedding_grad: bool = True
    _pending: MixBatch | None = None

    def forward(self, input_: torch.Tensor, mix: MixBatch | None = None) -> torch.Tensor:
        mix = mix if mix is not None else self._pending
        rows = None if mix is None else torch.nonzero(mix.mask.reshape(-1)).squeeze(1)
        rows = rows if rows is not None and rows.numel() else None  # None: nothing mixed
        grad_param = self._main_grad_param()
        if rows is None and grad_param is None:
            return super().forward(input_)
        with bypass():  # none of its ~40 small torch calls needs the CPU shim's redirects
            output_parallel = self._mixed_local_rows(input_, mix, rows, grad_param)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)

    def _localise(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Partition-local row indices (0 outside the partition) and the outside mask (None
        without TP)."""
        if self.tp_group.size() == 1:
            return ids, None
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        return (ids - self.vocab_start_index).masked_fill(outside, 0), outside

    def _main_grad_param(self) -> torch.nn.Parameter | None:
        """The weight when this forward's backward adds straight into megatron DDP's
        ``main_grad``: with grad enabled and an fp32-or-wider ``main_grad`` (a 16-bit one would
        round every row addition; the dense path rounds once)."""
        w = self.weight
        if not (
            torch.is_grad_enabled() and w.requires_grad and hasattr(w, "grad_added_to_main_grad")
        ):
            return None
        return w if w.main_grad.dtype in (torch.float32, torch.float64) else None

    def _mixed_local_rows(
        self,
        input_: torch.Tensor,
        mix: MixBatch | None,
        rows: torch.Tensor | None,
        grad_param: torch.nn.Parameter | None,
    ) -> torch.Tensor:
        """This rank's share [B, S, h] of E[input_] with flat positions ``rows`` [M] (None: no
        position) replaced by Σ w·E[ids] (+ noise on TP rank 0)."""
        b, s = input_.shape
        ids, outside = self._localise(input_.reshape(-1))
        if rows is None:
            rows = ids.new_empty(0)
            cand_ids, cand_outside, cand_w = (
                ids.new_empty(0, 1),
                None,
                ids.new_empty(0, 1, dtype=torch.float32),
            )
        else:
            cand_ids, cand_outside = self._localise(
                mix.ids.reshape(b * s, -1).index_select(0, rows)
            )
            cand_w = mix.weights.reshape(b * s, -1).index_select(0, rows).float()
        if cand_outside is not None:
            cand_w = cand_w.masked_fill(cand_outside, 0.0)
        noise = None
        if mix is not None and mix.noise is not None and self.tp_group.rank() == 0:
            noise = mix.noise.reshape(b * s, -1).index_select(0, rows)
        out = _MixedLookup.apply(
            self.weight,
            ids,
            outside,
            rows,
            cand_ids,
            cand_w,
            noise,
            self.embedding_grad,
            grad_param,
        )
        return out.view(b, s, -1)


class _MixedLookup(torch.autograd.Function):
    """Rows ``weight[ids]`` (zero where ``outside``) with rows ``rows`` replaced by
    Σ_j cand_w[:, j]·weight[cand_ids[:, j]] (+ noise), as one op.

    Forward (fp32/fp64 weights): one ``embedding_bag`` whose bag per position is its token
    (weight 1, or 0 outside this TP partition) or its k candidates, so plain and mixed rows are
    gathered in a single pass, straight into the output (no [M, h] mixture to copy into place,
    no wasted lookup of the replaced token). Backward: one ``index_add_`` of the output gradient
    (replaced and masked rows excluded), then one ``index_add_`` of the M·k candidate rows
    w·grad[position], gathered and scaled in one weighted ``embedding_bag`` pass. Written by hand
    because the autograd composition clones the [N, h] output gradient and runs two dense [V, h]
    embedding backwards; torch's ``embedding_bag`` backward sorts the index list (slower here).
    The cost over megatron's lookup is a fixed amount per mixed position: k - 1 extra row reads
    forward, k row updates backward.

    Where the rows go: without DDP, a fresh [V+1, h] buffer whose last row is a sink for the
    excluded positions, returned as the weight's gradient. Under megatron DDP (``grad_param``,
    the weight Parameter), straight into ``weight.main_grad`` as megatron's fused linear
    layers do (``grad_added_to_main_grad`` set; the returned gradient is a dummy, zeros when
    the weight is tied to another consumer on this stage, ``zero_out_wgrad``, so that the DDP
    hook adds only that consumer's gradient). That skips the dense gradient megatron's embedding
    allocates and zeroes each micro-batch (a [V/TP, h] temporary: at a 7B model's V=152k,
    h=3584, 1.1 GB in bf16 over TP, 2.2 GB in the fp32 of the path above) and the hook's add.
    Every micro-batch of the weight must then take this path (it does: the forward routes here
    under DDP even without mixes), or the hook would skip a dense gradient once the flag is set.

    Precision: the mixture and the gradient are accumulated in fp32 for 16-bit weights (the
    mixture by :func:`~megatron_ngrpo.mixing.arithmetic.mix_rows`, vLLM's hook's arithmetic
    too, so a bf16 engine and trainer build the same bits; the gradient buffer is fp32 and rounded once to
    the weight dtype at the end, ``main_grad`` fp32 and never rounded), as megatron's own
    embedding backward accumulates on GPU.
    Shapes: weight [V, h], ids/outside [N], rows [M], cand_ids/cand_w [M, k] (cand_w fp32),
    noise [M, h] or None → [N, h].
    """

    @staticmethod
    def forward(ctx, weight, ids, outside, rows, cand_ids, cand_w, noise, cand_grad, grad_param):
        if weight.dtype in (torch.float32, torch.float64):
            out = _bag_lookup(weight, ids, outside, rows, cand_ids, cand_w)
            if noise is not None:
                out.index_add_(0, rows, noise.to(out.dtype))
        else:
            out = F.embedding(ids, weight)
            if outside is not None:
                out.masked_fill_(outside.unsqueeze(1), 0.0)
            out.index_copy_(0, rows, mix_rows(F.embedding(cand_ids, weight), cand_w, noise))
        ctx.save_for_backward(ids, outside, rows, cand_ids, cand_w)
        ctx.num_rows, ctx.cand_grad, ctx.weight_dtype = weight.shape[0], cand_grad, weight.dtype
        ctx.grad_param = grad_param
        return out

    @staticmethod
    def backward(ctx, grad):
        with bypass():
            ids, outside, rows, cand_ids, cand_w = ctx.saved_tensors
            sink, param, saved = ctx.num_rows, ctx.grad_param, None
            if param is None:  # the extra last row takes the excluded positions
                acc = torch.promote_types(grad.dtype, torch.float32)
                target = grad.new_zeros(sink + 1, grad.shape[1], dtype=acc)
            else:
                target = param.main_grad
                free = _unused_row(target, ids, cand_ids)
                if free is not None:
                    sink, saved = free, target[free].clone()
            grad = grad.contiguous().to(target.dtype)
            dest = ids.index_fill(0, rows, sink)
            if outside is not None:
                dest.masked_fill_(outside, sink)
            _add_rows(target, dest, grad, sink)
            if ctx.cand_grad and rows.numel():
                # weight-0 entries (padding, rows of other partitions) go to the sink: 0·inf is nan.
                cand_dest = cand_ids.masked_fill(cand_w == 0, sink).reshape(-1)
                # w·grad[row] of every (position, candidate) in one pass: one-row bags of a weighted
                # embedding_bag over the output gradient (torch has no weighted scatter-add). Same
                # step time as a select, then a multiply and a scatter per candidate column, in
                # two ops instead of 2 + 2k.
                scaled = F.embedding_bag(
                    rows.repeat_interleave(cand_ids.shape[1]).unsqueeze(1),
                    grad,
                    mode="sum",
                    per_sample_weights=cand_w.to(grad.dtype).reshape(-1, 1),
                )
                _add_rows(target, cand_dest, scaled, sink)
            if param is None:
                grad_weight = target[:sink].to(ctx.weight_dtype)
            else:
                if saved is not None:
                    target[sink] = saved
                param.grad_added_to_main_grad = True
                # zeros where autograd adds it to a gradient: a tied consumer's, or a
                # ``param.grad`` that a step left aliasing ``main_grad``
                zero = getattr(param, "zero_out_wgrad", False) or param.grad is not None
                make = torch.zeros if zero else torch.empty
                grad_weight = make(param.shape, dtype=param.dtype, device=param.device)
            return grad_weight, None, None, None, None, None, None, None, None


def _unused_row(target: torch.Tensor, *used: torch.Tensor) -> int | None:
    """A row of ``target`` [V, h] that no id in ``used`` names: it takes the excluded positions
    of the scatter into ``main_grad``, its value saved and restored around it (exact), instead of
    copying the kept rows of the gradient out (N·h, the costlier part on CPU). None on GPU, where
    that copy is cheap and finding the row would wait for the device, and when every row is named."""
    if target.device.type != "cpu":
        return None
    free = torch.ones(target.shape[0], dtype=torch.uint8)
    for ids in used:
        free.index_fill_(0, ids.reshape(-1), 0)
    row = int(free.argmax())
    return row if free[row] else None


def _add_rows(target: torch.Tensor, dest: torch.Tensor, src: torch.Tensor, sink: int) -> None:
    """target[dest[i]] += src[i], skipping ``dest == sink`` when ``sink`` is no row of
    ``target`` (``main_grad`` without an unused row). dest [n], src [n, h]."""
    if target.shape[0] > sink:
        target.index_add_(0, dest, src)
        return
    keep = torch.nonzero(dest != sink).squeeze(1)
    target.index_add_(0, dest.index_select(0, keep), src.index_select(0, keep))


def _bag_lookup(weight, ids, outside, rows, cand_ids, cand_w) -> torch.Tensor:
    """Σ over each position's bag (its token, or its k candidates at ``rows``) in one
    ``embedding_bag``; bag-major index list built with O(N + M·k) index writes."""
    (m, k), n = cand_ids.shape, ids.shape[0]
    sizes = torch.ones_like(ids).index_fill_(0, rows, k)
    first = sizes.cumsum(0).sub_(sizes)  # offset of each position's bag
    slots = (first.index_select(0, rows).unsqueeze(1) + torch.arange(k, device=ids.device)).reshape(
        -1
    )
    flat = (
        ids.new_empty(n + m * (k - 1))
        .index_copy_(0, first, ids)
        .index_copy_(0, slots, cand_ids.reshape(-1))
    )
    per_sample = weight.new_ones(flat.shape[0])
    if outside is not None:
        per_sample.index_copy_(0, first, (~outside).to(weight.dtype))
    per_sample.index_copy_(0, slots, cand_w.reshape(-1).to(weight.dtype))
    return F.embedding_bag(flat, weight, first, mode="sum", per_sample_weights=per_sample)


def install_mixing_embedding(model, embedding_grad: bool = True) -> MixingVocabParallelEmbedding:
    """Turn the word embedding of a first-stage GPTModel into the mixing embedding, in place."""
    emb = model.embedding.word_embeddings
    if not isinstance(emb, VocabParallelEmbedding):
        raise TypeError(f"expected a VocabParallelEmbedding, found {type(emb).__name__}")
    emb.__class__ = MixingVocabParallelEmbedding
    emb.embedding_grad = embedding_grad
    return emb


def mixing_embedding(model) -> MixingVocabParallelEmbedding | None:
    """The mixing embedding of a (possibly wrapped) model chunk; None off the first stage."""

    inner = unwrap(model)
    emb = getattr(getattr(inner, "embedding", None), "word_embeddings", None)
    return emb if isinstance(emb, MixingVocabParallelEmbedding) else None


@contextlib.contextmanager
def mixing_inputs(model, mix: MixBatch | None):
    """Within the block, forward passes of ``model`` replay ``mix`` at its mixed positions."""
    emb = mixing_embedding(model)
    if emb is None or mix is None:
        yield
        return
    emb._pending = mix
    try:
        yield
    finally:
        emb._pending = None
