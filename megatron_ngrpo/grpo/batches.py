"""The replay batch of a rollout and how it is cut into micro-batches.

A rollout is replayed as one right-padded token batch (prompt + response per row,
:class:`TokenBatch`); the input at the column of response token t is ``E[response[t]]``, or the
recorded mixture ``Σ w·E[ids]`` where the engine mixed (docs/ALGORITHM.md §1.2, carried as a dense
:class:`~megatron_ngrpo.mixing.embedding.MixBatch`); the *label* of the column before it is always
the emitted token ``response[t]`` (§1.3). :class:`MicroBatchPlan` cuts it into the row groups of
one forward/backward pass each (row count or token budget; fixed shapes under pipeline
parallelism).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Self

import torch
from megatron.core import parallel_state as ps

from megatron_ngrpo.architecture import unwrap
from megatron_ngrpo.mixing.embedding import MixBatch, to_device
from megatron_ngrpo.rollout.types import RolloutBatch


@dataclass
class RowTensors:
    """Base of the per-row inputs a loss reads (e.g. :class:`~megatron_ngrpo.grpo.loss_inputs.LossInputs`):
    every tensor field is [B, ...], row-aligned with the :class:`TokenBatch` that carries it, and
    travels with its rows into micro-batches; None fields stay None."""

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Self:
        """The same inputs with ``fn`` applied to every tensor field."""
        return replace(
            self,
            **{
                f.name: fn(getattr(self, f.name))
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )


@dataclass
class TokenBatch:
    """A right-padded replay batch of B rows and L columns.

    ``tokens`` [B, L] int64 (prompt then response, then ``pad_id``); ``labels`` [B, L] int64, the
    token of column j+1 (what column j predicts); ``mask`` [B, L] bool, True at columns whose label
    is a response token; ``mix`` the dense mixes (or None); ``offsets`` [B] prompt lengths (column
    of response token 0); ``lengths`` [B] prompt + response lengths; ``inputs`` the loss's per-row
    inputs (a :class:`RowTensors`, e.g. [B, L] old log-probs aligned with ``labels``, [B]
    advantages), which travel with their rows into micro-batches.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    mix: MixBatch | None = None
    inputs: RowTensors | None = None

    @classmethod
    def from_rollout(
        cls,
        batch: RolloutBatch,
        pad_id: int = 0,
        replay_mixes: bool = True,
        device: torch.device | str = "cpu",
    ) -> TokenBatch:
        """The replay batch of ``batch``; its mixes are replayed unless ``replay_mixes`` is False."""
        if any(len(p) == 0 for p in batch.prompt_ids):
            raise ValueError(
                "every response needs a non-empty prompt (the first token is predicted from it)"
            )
        tokens, offsets, lengths = batch.padded(pad_id)
        b, length = tokens.shape
        labels = torch.full_like(tokens, pad_id)
        labels[:, :-1] = tokens[:, 1:]
        cols = torch.arange(length).unsqueeze(0)
        mask = (cols >= (offsets - 1).unsqueeze(1)) & (cols < (lengths - 1).unsqueeze(1))
        mix = None
        if replay_mixes and len(batch.mixes):
            mix = MixBatch.from_record(batch.mixes, offsets, length, device)
        tokens, labels, mask = (to_device(t, device) for t in (tokens, labels, mask))
        return cls(tokens, labels, mask, offsets, lengths, mix)

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    @property
    def position_ids(self) -> torch.Tensor:
        return (
            torch.arange(self.seq_len, device=self.tokens.device)
            .unsqueeze(0)
            .expand_as(self.tokens)
        )

    def with_inputs(self, inputs: RowTensors) -> TokenBatch:
        return replace(self, inputs=inputs)

    def response_values(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split a [B, L] label-aligned tensor into one [len_r] tensor per response."""
        return [
            values[r, int(o) - 1 : int(n) - 1]
            for r, (o, n) in enumerate(zip(self.offsets, self.lengths))
        ]

    def label_aligned(
        self, per_response: list[list[float]] | list[torch.Tensor], dtype=torch.float32
    ) -> torch.Tensor:
        """Inverse of :meth:`response_values`: [B, L] with zeros outside ``mask``."""
        out = torch.zeros(self.tokens.shape, dtype=dtype)
        for r, vals in enumerate(per_response):
            o = int(self.offsets[r])
            out[r, o - 1 : o - 1 + len(vals)] = torch.as_tensor(vals, dtype=dtype)
        return to_device(out, self.tokens.device)

    def micro_batch(
        self, rows: list[int], num_rows: int | None = None, seq_len: int | None = None
    ) -> TokenBatch:
        """Rows ``rows``, trimmed to their longest row (or padded to ``seq_len``) and padded with
        fully masked dummy rows up to ``num_rows`` (fixed pipeline shapes). Cut on the tensors'
        device with indices and sizes from the host: no host sync."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        length = seq_len or max(int(self.lengths[idx].max()), 1)
        total = num_rows or len(rows)
        pad_rows = total - len(rows)
        on_device = {}  # idx copied once per device

        def take(t: torch.Tensor) -> torch.Tensor:
            if t.device not in on_device:
                on_device[t.device] = to_device(idx, t.device)
            t = t.index_select(0, on_device[t.device])
            if t.dim() >= 2:
                t = _fit(t, 1, length)
            if pad_rows:
                t = torch.cat([t, t.new_zeros((pad_rows,) + t.shape[1:])])
            return t

        mix = None if self.mix is None else self.mix.select(idx, length, total)
        dummy = torch.zeros(pad_rows, dtype=self.lengths.dtype)
        return TokenBatch(
            tokens=take(self.tokens),
            labels=take(self.labels),
            mask=take(self.mask),
            offsets=torch.cat([self.offsets[idx], dummy + 1]),
            lengths=torch.cat([self.lengths[idx], dummy + 1]),
            mix=mix,
            inputs=None if self.inputs is None else self.inputs.map_rows(take),
        )


def _fit(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    if t.shape[dim] >= length:
        return t.narrow(dim, 0, length)
    pad_shape = list(t.shape)
    pad_shape[dim] = length - t.shape[dim]
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)


# ---- micro-batch layout --------------------------------------------------------------------
def split_rows(
    lengths: torch.Tensor | list[int], micro_batch_size: int, max_tokens: int = 0
) -> list[list[int]]:
    """Row groups of one forward/backward pass each.

    ``max_tokens`` 0: consecutive groups of ``micro_batch_size`` rows. Otherwise token-budget
    micro-batches: rows sorted by length (longest first) are packed greedily so that
    rows × longest row ≤ ``max_tokens`` (padded area), at most ``micro_batch_size`` rows each
    (a row longer than the budget goes alone).
    """
    lengths = [int(x) for x in lengths]
    if not max_tokens:
        return [
            list(range(i, min(i + micro_batch_size, len(lengths))))
            for i in range(0, len(lengths), micro_batch_size)
        ]
    order = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
    groups: list[list[int]] = []
    for r in order:
        g = groups[-1] if groups else None
        # Sorted longest first: the group's first row is its longest.
        if (
            g is not None
            and len(g) < micro_batch_size
            and (len(g) + 1) * lengths[g[0]] <= max_tokens
        ):
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
    def make(
        cls,
        model_chunks: list,
        batch: TokenBatch,
        micro_batch_size: int,
        max_tokens: int = 0,
        packing: str = "",
    ) -> MicroBatchPlan:
        config = unwrap(model_chunks[0]).config
        multiple = (
            config.tensor_model_parallel_size if config.sequence_parallel else 1
        ) * config.context_parallel_size
        groups = split_rows(batch.lengths, micro_batch_size, max_tokens)
        pp = ps.get_pipeline_model_parallel_world_size()
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
        if vpp and len(groups) % pp:
            # The interleaved schedule needs a multiple of PP micro-batches; extra ones are
            # fully masked (group [] → one dummy row).
            groups += [[] for _ in range(pp - len(groups) % pp)]
        fixed = None
        if pp > 1 and not _variable_p2p_shapes():
            fixed = (
                max(max(len(g) for g in groups), 1),
                _round_up(int(batch.lengths.max()), multiple),
            )
        if packing and pp > 1:
            raise ValueError("sequence packing needs pipeline_parallel = 1")
        return cls(groups, fixed, multiple, packing)

    def micro_batches(self, batch: TokenBatch) -> list[TokenBatch]:
        out = []
        for g in self.groups:
            if not g:
                # Dummy micro-batch: only padding rows (zero mask and zero inputs, so zero token
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
