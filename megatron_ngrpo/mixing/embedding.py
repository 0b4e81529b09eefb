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
    sequence parallelism), exactly megatron's layout.
    """

    embedding_grad: bool = True
    _pending: MixBatch | None = None

    def forward(self, input_: torch.Tensor, mix: MixBatch | None = None) -> torch.Tensor:
        mix = mix if mix is not None else self._pending
        output_parallel = self.local_rows(input_)
        if mix is not None:
            rows = torch.nonzero(mix.mask, as_tuple=True)
            if rows[0].numel():
                output_parallel[rows] = self._local_mixture(mix, rows).to(output_parallel.dtype)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)

    def local_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """E[ids] restricted to this rank's partition: rows of other partitions are zero.
        ids [...] → [..., h]."""
        if self.tp_group.size() > 1:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        else:
            local = ids
        out = self.weight[local] if self.deterministic_mode else F.embedding(local, self.weight)
        if self.tp_group.size() > 1:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return out

    def _local_mixture(self, mix: MixBatch, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """This rank's share of Σ w·E[ids] (+ noise, added on TP rank 0 only) at mixed rows [N, h]."""
        cand = self.local_rows(mix.ids[rows])  # [N, k, h]
        weights = mix.weights[rows].to(cand.dtype).unsqueeze(-1)
        mixed = (weights * cand).sum(1)
        if not self.embedding_grad:
            mixed = mixed.detach()
        if mix.noise is not None and self.tp_group.rank() == 0:
            mixed = mixed + mix.noise[rows].to(mixed.dtype)
        return mixed


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
    from megatron_ngrpo.models.provider import unwrap

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
