"""Megatron → HF through THE mapping (:mod:`.mapping`), gathered over TP and PP.

* :func:`export_hf_tensors` — model chunks → ``(hf_name, full tensor)`` one tensor at a time,
  gathered over TP and PP on every rank (or on global rank 0 only).
* :func:`export_hf_tensors` with ``tp_shards`` — the same without gathering the column- and
  row-split layers: each rank yields one slice of every q/k/v, gate/up, o/down tensor, vLLM's TP
  shard of it at a TP size that divides megatron's (shard-to-shard weight sync: at equal TP a
  rank's own slice, else the merge of a few ranks' slices, exchanged all-to-all).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.conversion.mapping import (
    Kind,
    entries,
    full_shape,
    hf_layout,
    rule,
    split_dim,
    tp_merge,
    unfuse,
)


@dataclass(frozen=True)
class _Item:
    vstage: int
    index: int
    global_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _export_plan(chunks: list, spec: ArchSpec) -> tuple[list[_Item], dict[str, torch.Tensor]]:
    """The parameters of the whole model (all PP stages) in model order, known on every rank,
    and this rank's tensors by global name. Tied output layers are skipped (== the embedding)."""
    # lazy: keeps conversion.hf_export free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps

    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    mine, local = [], {}
    for e in entries(chunks, spec):
        if spec.tied_embeddings and e.global_name == "output_layer.weight":
            continue
        mine.append(
            _Item(
                e.chunk * pp + pp_rank,
                len(mine),
                e.global_name,
                tuple(e.param.shape),
                e.param.dtype,
            )
        )
        local[e.global_name] = e.param
    everything = [None] * pp
    if pp > 1:
        dist.all_gather_object(everything, mine, group=ps.get_pipeline_model_parallel_group())
    else:
        everything = [mine]
    return sorted(
        (i for stage in everything for i in stage), key=lambda i: (i.vstage, i.index)
    ), local


_TP_SPLIT = (Kind.QKV, Kind.GATE_UP, Kind.ROW)


@dataclass(frozen=True)
class TPShard:
    """The slice of every TP-split HF tensor a rank takes: slice ``rank`` of ``count`` equal
    contiguous slices (rows; columns of o_proj / down_proj), vLLM's layout at TP ``count``."""

    count: int
    rank: int


def export_hf_layout(
    chunks: list, spec: ArchSpec, tp_shards: TPShard | None = None
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """What :func:`export_hf_tensors` yields, in its order, without gathering: ``(hf_name, HF
    shape, dtype)`` (a collective of the PP group when PP > 1)."""
    plan, _ = _export_plan(chunks, spec)
    shapes = hf_layout(spec)
    tp = tp_shards.count if tp_shards is not None else 1
    out = []
    for item in plan:
        r = rule(spec, item.global_name)
        for n in r.hf_names:
            shape = list(shapes[n])
            if r.kind in _TP_SPLIT and tp > 1:
                shape[split_dim(r.kind)] //= tp
            out.append((n, tuple(shape), item.dtype))
    return out


def check_tp_shards(spec: ArchSpec, tp: int, pp: int, count: int | None = None) -> str | None:
    """Why :func:`export_hf_tensors` cannot yield ``count``-way TP shards (default ``tp``) for
    this layout, or None."""
    count = count or tp
    if pp != 1:
        return f"pipeline parallel size {pp} (a rank holds only its stage's layers)"
    if tp % count:
        return f"{count} shards do not merge whole slices of TP {tp}"
    if spec.num_kv_heads % tp:
        return f"{spec.num_kv_heads} KV heads do not split over TP {tp}"
    return None


@torch.no_grad()
def export_hf_tensors(
    chunks: list,
    spec: ArchSpec,
    num_vocab: int | None = None,
    rank0_only: bool = False,
    dtype: torch.dtype | None = None,
    tp_shards: TPShard | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the model as HF tensors ``(hf_name, full tensor)`` in model order, one Megatron
    parameter at a time: the owning PP stage's shard is broadcast over the PP group and
    all-gathered over TP (``rank0_only``: gathered to TP rank 0 of the owning stage and sent to
    global rank 0; other ranks yield nothing). Every rank of the model-parallel group must drive
    the iterator to the end. Vocab rows are cut to ``num_vocab`` (default: HF ``vocab_size``).
    Tensors are in the parameters' dtype unless ``dtype`` is given.

    ``tp_shards`` (PP = 1, ``count`` divides TP, KV heads divisible by TP:
    :func:`check_tp_shards`): the column- and row-split kinds are not gathered; each rank yields
    slice ``rank`` of ``count`` of each HF tensor (rows of q/k/v, gate/up; columns of
    o_proj/down_proj), the layout vLLM's linear layers hold at TP ``count``: the merge of megatron
    slices ``[rank·m, (rank+1)·m)``, m = TP / count, sent by their ranks (all-to-all over the TP
    group; nothing moves when every rank's slice is its own). Vocab tensors are still gathered
    (the padded partitions differ)."""
    # lazy: keeps conversion.hf_export free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps

    num_vocab = num_vocab or spec.vocab_size
    plan, local = _export_plan(chunks, spec)
    device = next(iter(local.values())).device
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    tp_group = ps.get_tensor_model_parallel_group()
    pp_group = ps.get_pipeline_model_parallel_group()
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    wants = _slice_wants(spec, tp_shards, rank0_only, tp, pp, tp_group)
    if rank0_only and ps.get_data_parallel_rank() != 0:
        return  # other data-parallel replicas hold the same weights
    for item in plan:
        r = rule(spec, item.global_name)
        kind, owner = r.kind, item.vstage % pp
        shard = local.get(item.global_name)
        if wants is not None and kind in _TP_SPLIT:
            pieces = unfuse(spec, kind, shard.detach(), num_vocab, tp)
            tensors = _merged_slices(pieces, kind, tp_shards.count, wants, tp_rank, tp_group)
        elif rank0_only:
            full = _gather_to_rank0(
                item, shard, kind, owner, tp, tp_rank, pp_rank, tp_group, pp_group, device
            )
            if full is None:
                continue
            tensors = unfuse(spec, kind, full, num_vocab)
        else:
            full = _gather_to_all(item, shard, kind, owner, tp, pp, tp_group, pp_group, device)
            tensors = unfuse(spec, kind, full, num_vocab)
        for name, t in zip(r.hf_names, tensors):
            yield name, (t if dtype is None else t.to(dtype))


def _slice_wants(spec, tp_shards, rank0_only: bool, tp: int, pp: int, tp_group):
    """The slice each rank of the TP group takes with ``tp_shards`` (None: whole tensors);
    ValueError when the layouts do not allow shards (:func:`check_tp_shards`)."""
    if tp_shards is None:
        return None
    why = "rank0_only gathers" if rank0_only else check_tp_shards(spec, tp, pp, tp_shards.count)
    if why:
        raise ValueError(f"export_hf_tensors(tp_shards={tp_shards}): {why}")
    if tp_shards.count == 1:
        return None
    wants = [None] * tp
    dist.all_gather_object(wants, tp_shards.rank, group=tp_group)
    return wants


def _merged_slices(
    pieces: list[torch.Tensor], kind: Kind, count: int, wants: list[int], tp_rank: int, group
) -> list[torch.Tensor]:
    """Slice ``wants[tp_rank]`` of ``count`` of each HF tensor of which ``pieces`` are this
    rank's megatron slices (:func:`unfuse` of its shard): each rank's slice goes to the ranks
    that want the merged slice containing it, in one all-to-all per piece (``all_to_all_single``
    with split sizes: gloo's list form needs equal sizes)."""
    tp = len(wants)
    m, j = tp // count, wants[tp_rank]
    if m == 1 and wants == list(range(tp)):
        return pieces  # every rank's own slice is the one it takes
    dim = 1 if kind is Kind.ROW else 0
    receivers = [r for r in range(tp) if wants[r] == tp_rank // m]
    out = []
    for piece in pieces:
        piece = piece.contiguous()
        n = piece.numel()
        send = piece.reshape(-1).repeat(len(receivers))
        recv = piece.new_empty(m * n)  # from ranks j·m .. j·m+m-1, in rank order
        dist.all_to_all_single(
            recv,
            send,
            [n if s // m == j else 0 for s in range(tp)],
            [n if r in receivers else 0 for r in range(tp)],
            group=group,
        )
        out.append(torch.cat(list(recv.view(m, *piece.shape)), dim=dim))
    return out


def _tp_gather(
    shard: torch.Tensor, kind: Kind, tp: int, group, all_ranks: bool
) -> torch.Tensor | None:
    if kind is Kind.REPLICATED or tp == 1:
        return shard
    shard = shard.detach().contiguous()
    if all_ranks:
        parts = [torch.empty_like(shard) for _ in range(tp)]
        dist.all_gather(parts, shard, group=group)
        return tp_merge(kind, parts)
    first = dist.get_global_rank(group, 0)
    parts = [torch.empty_like(shard) for _ in range(tp)] if dist.get_rank() == first else None
    dist.gather(shard, parts, dst=first, group=group)
    return tp_merge(kind, parts) if parts is not None else None


def _gather_to_all(item, shard, kind, owner, tp, pp, tp_group, pp_group, device) -> torch.Tensor:
    """Full tensor on every rank: the owning PP stage's shard broadcast over the PP group, then
    all-gathered over TP."""
    if pp > 1:
        if shard is None:
            shard = torch.empty(item.shape, dtype=item.dtype, device=device)
        shard = shard.detach().contiguous()
        dist.broadcast(shard, dist.get_global_rank(pp_group, owner), group=pp_group)
    return _tp_gather(shard, kind, tp, tp_group, all_ranks=True)


def _gather_to_rank0(item, shard, kind, owner, tp, tp_rank, pp_rank, tp_group, pp_group, device):
    """Full tensor on global rank 0 (TP rank 0 of PP stage 0 of DP replica 0); None elsewhere."""
    full = None
    if pp_rank == owner:
        full = _tp_gather(shard, kind, tp, tp_group, all_ranks=False)
    if owner == 0 or tp_rank != 0:
        return full if dist.get_rank() == 0 else None
    if pp_rank == owner:
        dist.send(full.contiguous(), dist.get_global_rank(pp_group, 0), group=pp_group)
        return None
    if pp_rank == 0:
        shape = full_shape(kind, torch.Size(item.shape), tp)
        full = torch.empty(shape, dtype=item.dtype, device=device)
        dist.recv(full, dist.get_global_rank(pp_group, owner), group=pp_group)
        return full
    return None
