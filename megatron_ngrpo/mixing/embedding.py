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

from megatron_ngrpo.compat.cpu import bypass
from megatron_ngrpo.mixing.records import MixRecord


class MixBatch(NamedTuple):
    """Dense mixes of a token batch [B, S]: ``ids`` [B, S, k] int64, ``weights`` [B, S, k],
    ``mask`` [B, S] bool (True = mixed), ``noise`` [B, S, h] or None."""

    ids: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor
    noise: torch.Tensor | None = None

    @classmethod
    def from_record(cls, record: MixRecord, offsets: torch.Tensor, seq_len: int,
                    device: torch.device | str = "cpu") -> "MixBatch":
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

    def narrow(self, dim: int, start: int, length: int) -> "MixBatch":
        """Slice along batch (0) or sequence (1), e.g. for micro-batches or one decode step."""
        return MixBatch(*(None if t is None else t.narrow(dim, start, length) for t in self))


class MixingVocabParallelEmbedding(VocabParallelEmbedding):
    """``VocabParallelEmbedding`` whose forward also takes a :class:`MixBatch`.

    Input ``input_`` [B, S] token ids; output [B, S, h] (or [S/TP, B, h] scattered under
    sequence parallelism), exactly megatron's layout. Without mixed rows it is megatron's
    forward unchanged.
    """

    embedding_grad: bool = True
    _pending: MixBatch | None = None

    def forward(self, input_: torch.Tensor, mix: MixBatch | None = None) -> torch.Tensor:
        mix = mix if mix is not None else self._pending
        rows = None if mix is None else torch.nonzero(mix.mask.reshape(-1)).squeeze(1)
        if rows is None or not rows.numel():
            return super().forward(input_)
        with bypass():  # none of its ~40 small torch calls needs the CPU shim's redirects
            output_parallel = self._mixed_local_rows(input_, mix, rows)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)

    def local_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """E[ids] restricted to this rank's partition: rows of other partitions are zero.
        ids [...] → [..., h] (differentiable)."""
        local, outside = self._localise(ids)
        out = self.weight[local] if self.deterministic_mode else F.embedding(local, self.weight)
        return out if outside is None else out.masked_fill(outside.unsqueeze(-1), 0.0)

    def _localise(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Partition-local row indices (0 outside the partition) and the outside mask (None
        without TP)."""
        if self.tp_group.size() == 1:
            return ids, None
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        return (ids - self.vocab_start_index).masked_fill(outside, 0), outside

    def _mixed_local_rows(self, input_: torch.Tensor, mix: MixBatch, rows: torch.Tensor) -> torch.Tensor:
        """This rank's share [B, S, h] of E[input_] with flat positions ``rows`` replaced by
        Σ w·E[ids] (+ noise on TP rank 0)."""
        b, s = input_.shape
        ids, outside = self._localise(input_.reshape(-1))
        cand_ids, cand_outside = self._localise(mix.ids.reshape(b * s, -1).index_select(0, rows))
        cand_w = mix.weights.reshape(b * s, -1).index_select(0, rows).float()
        if cand_outside is not None:
            cand_w = cand_w.masked_fill(cand_outside, 0.0)
        noise = None
        if mix.noise is not None and self.tp_group.rank() == 0:
            noise = mix.noise.reshape(b * s, -1).index_select(0, rows)
        out = _MixedLookup.apply(self.weight, ids, outside, rows, cand_ids, cand_w, noise,
                                 self.embedding_grad)
        return out.view(b, s, -1)


class _MixedLookup(torch.autograd.Function):
    """Rows ``weight[ids]`` (zero where ``outside``) with rows ``rows`` replaced by
    Σ_j cand_w[:, j]·weight[cand_ids[:, j]] (+ noise), as one op.

    Forward (fp32/fp64 weights): one ``embedding_bag`` whose bag per position is its token
    (weight 1, or 0 outside this TP partition) or its k candidates, so plain and mixed rows are
    gathered in a single pass, straight into the output (no [M, h] mixture to copy into place,
    no wasted lookup of the replaced token). Backward: one [V+1, h] buffer, one ``index_add_``
    of the output gradient (replaced and masked rows go to a sink row), then per candidate column
    one ``index_add_`` of the mixed rows' gradient times that column's weights, formed in one
    reused [M, h] buffer (a [M, k, h] product measured ~0.5% slower per step: more memory
    traffic, one more large allocation). Written by hand because
    the autograd composition clones the [N, h] output gradient and runs two dense [V, h]
    embedding backwards; torch's ``embedding_bag`` backward sorts the index list (slower here).
    The cost over megatron's lookup is a fixed amount per mixed position: k - 1 extra row
    reads forward, k row updates backward.

    Precision: the mixture and the gradient are accumulated in fp32 for 16-bit weights (the
    k rows are upcast before the weighted sum; the gradient buffer is fp32 and rounded once to
    the weight dtype at the end), as megatron's own embedding backward accumulates on GPU.
    Shapes: weight [V, h], ids/outside [N], rows [M], cand_ids/cand_w [M, k] (cand_w fp32),
    noise [M, h] or None → [N, h].
    """

    @staticmethod
    def forward(ctx, weight, ids, outside, rows, cand_ids, cand_w, noise, cand_grad):
        if weight.dtype in (torch.float32, torch.float64):
            out = _bag_lookup(weight, ids, outside, rows, cand_ids, cand_w)
            if noise is not None:
                out.index_add_(0, rows, noise.to(out.dtype))
        else:
            out = F.embedding(ids, weight)
            if outside is not None:
                out.masked_fill_(outside.unsqueeze(1), 0.0)
            mixed = torch.bmm(cand_w.unsqueeze(1), F.embedding(cand_ids, weight).float()).squeeze(1)
            if noise is not None:
                mixed = mixed + noise.float()
            out.index_copy_(0, rows, mixed.to(out.dtype))
        ctx.save_for_backward(ids, outside, rows, cand_ids, cand_w)
        ctx.num_rows, ctx.cand_grad, ctx.weight_dtype = weight.shape[0], cand_grad, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        with bypass():
            ids, outside, rows, cand_ids, cand_w = ctx.saved_tensors
            sink = ctx.num_rows
            acc = torch.promote_types(grad.dtype, torch.float32)
            grad = grad.contiguous().to(acc)
            grad_weight = grad.new_zeros(sink + 1, grad.shape[1])
            dest = ids.index_fill(0, rows, sink)
            if outside is not None:
                dest.masked_fill_(outside, sink)
            grad_weight.index_add_(0, dest, grad)
            if ctx.cand_grad:
                # weight-0 entries (padding, rows of other partitions) go to the sink: 0·inf is nan.
                cand_dest = cand_ids.masked_fill(cand_w == 0, sink).t()
                cand_w = cand_w.to(acc).t().unsqueeze(2)  # [k, M, 1]
                rows_grad = grad.index_select(0, rows)
                scaled = torch.empty_like(rows_grad)
                for j in range(cand_dest.shape[0]):
                    grad_weight.index_add_(0, cand_dest[j], torch.mul(rows_grad, cand_w[j], out=scaled))
            return grad_weight[:sink].to(ctx.weight_dtype), None, None, None, None, None, None, None


def _bag_lookup(weight, ids, outside, rows, cand_ids, cand_w) -> torch.Tensor:
    """Σ over each position's bag (its token, or its k candidates at ``rows``) in one
    ``embedding_bag``; bag-major index list built with O(N + M·k) index writes."""
    (m, k), n = cand_ids.shape, ids.shape[0]
    sizes = torch.ones_like(ids).index_fill_(0, rows, k)
    first = sizes.cumsum(0).sub_(sizes)  # offset of each position's bag
    slots = (first.index_select(0, rows).unsqueeze(1) + torch.arange(k, device=ids.device)).reshape(-1)
    flat = ids.new_empty(n + m * (k - 1)).index_copy_(0, first, ids).index_copy_(0, slots, cand_ids.reshape(-1))
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
    from megatron_ngrpo.architecture import unwrap

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
