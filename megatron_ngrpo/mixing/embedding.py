"""Vocab-parallel embedding that replays semantic-neighbour mixtures.

``MixingVocabParallelEmbedding`` is megatron-core's ``VocabParallelEmbedding`` with one addition:
at mixed positions the output is ``Σ_c w_c · E[c]`` instead of ``E[token]`` (plus an optional
recorded noise vector, STHT). Each TP rank looks up only the rows of its vocab partition (rows of
other partitions are masked to zero) and the usual single all-reduce (or reduce-scatter under
sequence parallelism) completes plain and mixed rows at once. How the mixed rows are formed
depends on the weight dtype (see :class:`_MixedLookup`): fp32/fp64 ranks add their partial
mixtures into that all-reduce (no extra communication); 16-bit ranks first assemble the full
candidate rows on TP rank 0 (one reduce of [M, k, h]) so that the mixture is rounded once, by
the arithmetic vLLM's hook uses (``mixing/arithmetic.py``), bit for bit at every TP size.
Gradients reach the candidate rows scaled by their weights unless ``embedding_grad`` is False
(then mixed positions contribute no embedding gradient, as in the reference code).

GPTModel builds its ``VocabParallelEmbedding`` internally (no spec hook), so
:func:`install_mixing_embedding` swaps the class of that module in place: the very ``weight``
Parameter stays (tied output layer, DDP buckets and checkpoint keys are unaffected).
Mixes reach it with :func:`mixing_inputs` around the model call, so ``GPTModel.forward`` and
megatron's pipeline schedules are used unchanged; only the first pipeline stage has an embedding.

Under megatron's DDP (the trainer) the backward adds its rows straight into ``weight.main_grad``
(fp32), megatron's own gradient-accumulation-fusion protocol: no dense [V, h] gradient is
allocated, zeroed, and added into ``main_grad`` by the DDP hook (see :class:`_MixedLookup`).

No host sync: a :class:`MixBatch` is built on the host from the rollout's record and copied to
the device asynchronously; the mixed positions come with it (no ``nonzero`` on a device mask) and
"nothing mixed" is read from shapes, so a mixed replay step waits for the device no more often
than a plain one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
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


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device`` without waiting for the copy: host tensors go through pinned memory
    with ``non_blocking`` (a plain ``.to("cuda")`` of pageable memory synchronises the stream)."""
    device = torch.device(device)
    if t.device.type != "cpu" or device.type == "cpu":
        return t.to(device)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


@dataclass(frozen=True)
class MixBatch:
    """The mixes of a token batch of ``shape`` (B, S), over its M mixed positions only.

    ``rows`` [M] int64: flat positions b·S + s (distinct); ``ids`` [M, k] int64 (anchor first);
    ``weights`` [M, k] fp32; ``noise`` [M, h] or None; all on the device the batch is on.
    ``host_rows``: ``rows`` on the host (the same tensor for a CPU batch). Micro-batches and
    packed rows are cut from ``host_rows`` and "nothing mixed" is read from its shape, so using a
    device batch never waits for the device.
    """

    rows: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    noise: torch.Tensor | None
    shape: tuple[int, int]
    host_rows: torch.Tensor

    @classmethod
    def from_record(
        cls,
        record: MixRecord,
        offsets: torch.Tensor,
        seq_len: int,
        device: torch.device | str = "cpu",
    ) -> MixBatch:
        """The mixes of ``record`` in a right-padded [num_seqs, seq_len] batch whose response
        ``s`` starts at column ``offsets[s]``; built on the host, copied to ``device``."""
        rows = record.flat_positions(offsets, seq_len)
        noise = None if record.noise is None else record.noise.float()
        host = cls(
            rows, record.ids, record.weights.float(), noise, (record.num_seqs, seq_len), rows
        )
        return host.to(device)

    @classmethod
    def from_dense(
        cls,
        ids: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        noise: torch.Tensor | None = None,
    ) -> MixBatch:
        """From dense ``ids`` [B, S, k], ``weights`` [B, S, k], ``mask`` [B, S] bool (True =
        mixed) and ``noise`` [B, S, h] or None; on ``ids``'s device. Syncs once if ``mask`` is
        on a device (keep it on the host where that matters)."""
        b, s = mask.shape
        host_rows = torch.nonzero(mask.reshape(-1).cpu()).squeeze(1)
        rows = to_device(host_rows, ids.device)
        return cls(
            rows,
            ids.reshape(b * s, -1).index_select(0, rows),
            weights.reshape(b * s, -1).index_select(0, rows).float(),
            None if noise is None else noise.reshape(b * s, -1).index_select(0, rows).float(),
            (b, s),
            host_rows,
        )

    @property
    def num_mixed(self) -> int:
        return self.host_rows.numel()

    @property
    def mask(self) -> torch.Tensor:
        """[B, S] bool, True at mixed positions, on the batch's device."""
        b, s = self.shape
        mask = torch.zeros(b * s, dtype=torch.bool, device=self.rows.device)
        return mask.index_fill_(0, self.rows, True).view(b, s)

    def to(self, device: torch.device | str) -> MixBatch:
        """The batch on ``device`` (host → device copies do not wait)."""
        if self.rows.device == torch.device(device):
            return self
        noise = None if self.noise is None else to_device(self.noise, device)
        rows, ids, weights = (to_device(t, device) for t in (self.rows, self.ids, self.weights))
        return MixBatch(rows, ids, weights, noise, self.shape, self.host_rows)

    def select(self, batch_rows: torch.Tensor, seq_len: int, num_rows: int) -> MixBatch:
        """The mixes of batch rows ``batch_rows`` [r] (host int64), renumbered 0..r-1, in a
        [num_rows, seq_len] batch (columns from ``seq_len`` on dropped)."""
        b, s = self.shape
        where = torch.full((b,), -1, dtype=torch.long)
        where[batch_rows] = torch.arange(len(batch_rows))
        row, col = self.host_rows.div(s, rounding_mode="floor"), self.host_rows.remainder(s)
        new_row = where[row]
        keep = torch.nonzero((new_row >= 0) & (col < seq_len)).squeeze(1)
        return self._take(keep, new_row[keep] * seq_len + col[keep], (num_rows, seq_len))

    def packed(self, lengths: torch.Tensor, total: int) -> MixBatch:
        """The mixes in the one row [1, total] into which each row r's first ``lengths[r]``
        (host) tokens are concatenated in order (grpo/packing.py); other columns dropped."""
        b, s = self.shape
        lengths = lengths.to(torch.long).clamp(0, s)
        start = lengths.cumsum(0) - lengths
        row, col = self.host_rows.div(s, rounding_mode="floor"), self.host_rows.remainder(s)
        keep = torch.nonzero(col < lengths[row]).squeeze(1)
        return self._take(keep, start[row[keep]] + col[keep], (1, total))

    def _take(self, entries: torch.Tensor, host_rows: torch.Tensor, shape) -> MixBatch:
        """Entries ``entries`` [m] (host) at new positions ``host_rows`` [m] of a ``shape`` batch."""
        device = self.rows.device
        at = to_device(entries, device)
        return MixBatch(
            to_device(host_rows, device),
            self.ids.index_select(0, at),
            self.weights.index_select(0, at),
            None if self.noise is None else self.noise.index_select(0, at),
            tuple(shape),
            host_rows,
        )


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
        if mix is not None and not mix.num_mixed:  # decided on the host
            mix = None
        if mix is not None and mix.shape != tuple(input_.shape):
            raise ValueError(f"mixes of a {mix.shape} batch for input ids {tuple(input_.shape)}")
        grad_param = self._main_grad_param()
        if mix is None and grad_param is None:
            return super().forward(input_)
        with bypass():  # none of its ~40 small torch calls needs the CPU shim's redirects
            output_parallel = self._mixed_local_rows(input_, mix, grad_param)
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
        grad_param: torch.nn.Parameter | None,
    ) -> torch.Tensor:
        """This rank's share [B, S] of E[input_] with the positions of ``mix`` (None: none)
        replaced by Σ w·E[ids] (+ noise), added by TP rank 0 (see :class:`_MixedLookup`)."""
        b, s = input_.shape
        ids, outside = self._localise(input_.reshape(-1))
        if mix is None:
            rows, cand_ids, cand_outside = ids.new_empty(0), ids.new_empty(0, 1), None
            cand_w, noise = ids.new_empty(0, 1, dtype=torch.float32), None
        else:
            mix = mix.to(self.weight.device)
            rows, cand_w, noise = mix.rows, mix.weights, mix.noise
            cand_ids, cand_outside = self._localise(mix.ids)
        tp = self.tp_group if self.tp_group.size() > 1 else None
        first = self.tp_group.rank() == 0
        out = _MixedLookup.apply(
            self.weight,
            ids,
            outside,
            rows,
            cand_ids,
            cand_outside,
            cand_w,
            noise if first else None,
            self.embedding_grad,
            grad_param,
            tp,
        )
        return out.view(b, s, -1)


class _MixedLookup(torch.autograd.Function):
    """Rows ``weight[ids]`` (zero where ``outside``) with rows ``rows`` replaced by
    Σ_j cand_w[:, j]·E[cand_ids[:, j]] (+ noise), as one op; E is the whole (TP-partitioned)
    matrix, ``cand_ids`` are partition-local (0 where ``cand_outside``).

    Forward, fp32/fp64 weights: one ``embedding_bag`` whose bag per position is its token
    (weight 1, or 0 outside this TP partition) or its local candidates (weights of other
    partitions' candidates 0), so plain and mixed rows are gathered in a single pass, straight
    into the output (no [M, h] mixture to copy into place, no wasted lookup of the replaced
    token); megatron's all-reduce then adds the ranks' partial mixtures.

    Forward, 16-bit weights: the output in the engine's arithmetic, bit for bit at any TP size.
    vLLM's hook mixes full candidate rows once (:func:`~megatron_ngrpo.mixing.arithmetic.mix_rows`:
    fp32 accumulation, one rounding); partial mixtures rounded per rank and summed in 16 bits
    would differ (93 % of the rows at TP 4, by up to ~1 %). So under TP the [M, k, h] candidate
    rows are summed onto TP rank 0 first (one ``reduce`` in the weight dtype, exact: each row has
    one owner, every other rank adds -0.0, and x + -0.0 = x for every x), rank 0 forms the
    mixture, and the other ranks put -0.0 at the mixed positions, so megatron's all-reduce (or
    reduce-scatter) adds exact zeros to it. The extra traffic is M·k·h values per micro-batch,
    only when something is mixed (at ρ = 0.1, k = 3 about 0.3× the embedding's all-reduce).

    Backward (either dtype): one ``index_add_`` of the output gradient (replaced and masked rows
    excluded), then one ``index_add_`` of the M·k local candidate rows w·grad[position],
    gathered and scaled in one weighted ``embedding_bag`` pass. Written by hand because the
    autograd composition clones the [N, h] output gradient and runs two dense [V, h] embedding
    backwards; torch's ``embedding_bag`` backward sorts the index list (slower here). The cost
    over megatron's lookup is a fixed amount per mixed position: k - 1 extra row reads forward,
    k row updates backward.

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

    Precision: the gradient is accumulated in fp32 for 16-bit weights (the buffer is fp32 and
    rounded once to the weight dtype at the end, ``main_grad`` fp32 and never rounded), as
    megatron's own embedding backward accumulates on GPU.
    Shapes: weight [V_l, h], ids/outside [N], rows [M], cand_ids/cand_outside/cand_w [M, k]
    (cand_w fp32, the full weights), noise [M, h] or None (given on TP rank 0 only) → [N, h].
    ``tp_group``: the TP group, None without TP.
    """

    @staticmethod
    def forward(
        ctx,
        weight,
        ids,
        outside,
        rows,
        cand_ids,
        cand_outside,
        cand_w,
        noise,
        cand_grad,
        grad_param,
        tp_group,
    ):
        local_w = cand_w if cand_outside is None else cand_w.masked_fill(cand_outside, 0.0)
        if weight.dtype in (torch.float32, torch.float64):
            out = _bag_lookup(weight, ids, outside, rows, cand_ids, local_w)
            if noise is not None:
                out.index_add_(0, rows, noise.to(out.dtype))
        else:
            out = F.embedding(ids, weight)
            if outside is not None:
                out.masked_fill_(outside.unsqueeze(1), 0.0)
            if rows.numel():  # a shape: every TP rank of the micro-batch agrees
                out.index_copy_(
                    0, rows, _full_mixture(weight, cand_ids, cand_outside, cand_w, noise, tp_group)
                )
        ctx.save_for_backward(ids, outside, rows, cand_ids, local_w)
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
            return (grad_weight,) + (None,) * 10


def _full_mixture(weight, cand_ids, cand_outside, cand_w, noise, tp_group) -> torch.Tensor:
    """The 16-bit mixture rows [M, h] of :class:`_MixedLookup` on TP rank 0 (``mix_rows`` on
    the full candidate rows, summed onto it from their owners), -0.0 on the other ranks."""
    cand = F.embedding(cand_ids, weight)  # [M, k, h]
    if tp_group is not None:
        cand.masked_fill_(cand_outside.unsqueeze(-1), -0.0)
        dist.reduce(cand, dst=dist.get_global_rank(tp_group, 0), group=tp_group)
        if dist.get_rank(tp_group) != 0:
            return cand.new_full((cand.shape[0], cand.shape[2]), -0.0)
    return mix_rows(cand, cand_w, noise)


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
    ``target`` (``main_grad`` without an unused row: always on GPU). dest [n], src [n, h]."""
    if target.shape[0] > sink:
        target.index_add_(0, dest, src)
        return
    # The skipped entries add -0.0 to row 0 instead: exact (x + -0.0 = x for every x), and no
    # selection of the kept entries, whose count the host would have to wait for.
    skip = dest == sink
    target.index_add_(0, dest.masked_fill(skip, 0), src.masked_fill(skip.unsqueeze(1), -0.0))


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
