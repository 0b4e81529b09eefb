"""Exact semantic-neighbour table of a (vocab-parallel) embedding matrix (N-GRPO paper Eqs. 7–8,
App. G): row v of the table is v followed by the k-1 rows most similar to E[v].

Neighbours depend only on the anchor id and the frozen weights, so one [V, k] table per weight
sync replaces the reference code's per-step [B, V] similarity matmul. The search itself (screen
matmul, certified top-k, TP merge, memory bounds) is `topk_certified`, its GEMM `gemm_cpu`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ngrpo.architecture import unwrap
from megatron_ngrpo.mixing.config import METRICS, MixingConfig
from megatron_ngrpo.mixing.gemm_cpu import PRODUCT_METRICS
from megatron_ngrpo.mixing.topk_certified import (
    Keys,
    chunk_neighbors,
    group_active,
    symmetric_neighbors,
)


def build_neighbor_table(
    weight_local: torch.Tensor,
    vocab_start: int,
    k: int,
    metric: str = "cosine",
    exclude: torch.Tensor | None = None,
    chunk_size: int = 4096,
    tp_group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Exact top-k neighbour table of the embedding whose rows ``vocab_start ..`` are
    ``weight_local``.

    Args:
        weight_local: [V_local, d] this TP rank's contiguous vocab partition (the whole matrix
            when ``tp_group`` is None or of size 1). Any float dtype; scored in fp32, certified
            in float64.
        vocab_start: global id of ``weight_local[0]``.
        k: table width, anchor included (1 <= k < V).
        metric: "cosine" (default), "l2" (-squared distance), "l1" (-L1 distance) or "dot".
        exclude: [V] bool, rows that may never be neighbours (padding, special tokens). Their
            own table rows still exist (anchor first, then allowed neighbours).
        chunk_size: query rows scored at once; bounds memory (see module docstring).
        tp_group: group over which the vocabulary is partitioned.
        dp_group: group whose ranks share the query chunks (all-gathered at the end).
        rows: optional (start, stop) global query range; default all V rows.

    Returns:
        [V, k] int64 (or [stop-start, k] with ``rows``) on ``weight_local``'s device, identical
        on every rank: row v = [v, n_1, ..., n_{k-1}] ordered by decreasing similarity, ties to
        the lower id; n_j != v and never excluded.
    """
    weight_local, vocab_size, exclude = _checked(
        weight_local, vocab_start, k, metric, exclude, chunk_size, tp_group
    )
    device = weight_local.device
    start, stop = rows if rows is not None else (0, vocab_size)
    if not 0 <= start < stop <= vocab_size:
        raise ValueError(f"rows = {rows}: must satisfy 0 <= start < stop <= {vocab_size}")

    anchors = torch.arange(start, stop, device=device)
    if k == 1:
        return anchors.unsqueeze(1)
    with torch.no_grad():
        keys = _keys(weight_local, vocab_start, metric, exclude, tp_group)
        if (
            metric in PRODUCT_METRICS
            and (start, stop) == (0, vocab_size)
            and not group_active(tp_group)
            and not group_active(dp_group)
        ):
            nbrs = symmetric_neighbors(keys, k - 1, chunk_size)
        else:
            nbrs = _chunked_neighbors(keys, start, stop, k, chunk_size, tp_group, dp_group, device)
    return torch.cat([anchors.unsqueeze(1), nbrs], dim=1)


def _chunked_neighbors(
    keys: Keys,
    start: int,
    stop: int,
    k: int,
    chunk_size: int,
    tp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None,
    device: torch.device,
) -> torch.Tensor:
    """[stop-start, k-1] neighbours of the query rows ``start:stop``: this DP rank scores its
    share chunk by chunk, then the shares are all-gathered."""
    my_start, my_stop = _dp_share(start, stop, dp_group)
    parts = [
        chunk_neighbors(
            keys,
            torch.arange(c0, min(c0 + chunk_size, my_stop), device=device),
            k - 1,
            tp_group,
        )
        for c0 in range(my_start, my_stop, chunk_size)
    ]
    mine = torch.cat(parts) if parts else torch.zeros(0, k - 1, dtype=torch.long, device=device)
    return _dp_gather(mine, stop - start, dp_group)


def neighbor_table_for_model(
    model_chunk,
    cfg: MixingConfig,
    num_real_tokens: int,
    special_ids=(),
    output_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The [V_padded, k] table of a megatron GPT model, replicated on every rank.

    The matrix is the first stage's mixing embedding (``cfg.neighbor_source == "input"``, paper)
    or the last stage's output layer (``"output"``, reference code; pass ``output_weight`` for a
    tied/shared weight held elsewhere). Excluded rows: padded rows ``>= num_real_tokens``
    (``cfg.exclude_padded``), ``special_ids`` (``cfg.exclude_special``) and ``cfg.exclude_ids``.
    Uses megatron's TP and DP groups and broadcasts over the pipeline group from the stage that
    owns the matrix; without initialised model parallel state it runs single-process.
    ``model_chunk`` may be a list of (virtual pipeline) chunks.
    """
    # lazy: keeps mixing.neighbors free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps

    parallel = ps.model_parallel_is_initialized()
    tp_group = ps.get_tensor_model_parallel_group() if parallel else None
    dp_group = ps.get_data_parallel_group() if parallel else None
    pp_group = ps.get_pipeline_model_parallel_group() if parallel else None
    m = _model_matrix(
        model_chunk, cfg, num_real_tokens, special_ids, output_weight, tp_group, pp_group
    )
    table = None
    if m.weight is not None:
        table = build_neighbor_table(
            m.weight.detach(),
            m.vocab_start,
            cfg.k,
            cfg.metric,
            m.exclude,
            cfg.chunk_size,
            tp_group,
            dp_group,
        )
    if m.pp_src is None:
        return table
    if table is None:
        table = torch.empty(m.vocab_size, cfg.k, dtype=torch.long, device=m.device)
    dist.broadcast(table, src=m.pp_src, group=pp_group)
    return table


class NeighborLookup:
    """Exact neighbour rows on demand for one weight version: ``rows(ids)`` [n, k] equals
    ``build_neighbor_table(...)[ids]`` of the same arguments bit for bit (the same search,
    :func:`~megatron_ngrpo.mixing.topk_certified.chunk_neighbors`, on the queried ids only), and
    every row computed is kept: a [V, k] cache filled row by row. Cost per new anchor: one
    screen row against the local keys (V_l·d multiply-adds per TP rank), against V²·d/2 for the
    whole single-rank table; ``rows_computed`` counts the rows actually searched, ``seconds`` the
    wall time spent searching them.

    Collective: every rank of ``tp_group`` and ``pp_group`` calls :meth:`ensure` (or :meth:`rows`
    while some id is not cached) with the same ids, so their caches stay identical. Ranks
    without the matrix (other pipeline stages; ``weight_local`` None, ``vocab_size`` given)
    receive the rows by a broadcast from global rank ``pp_src``.

    Args as :func:`build_neighbor_table`; the key rows are prepared at the first search (an
    engine that never mixes pays nothing). A new weight version needs a new lookup.
    """

    def __init__(
        self,
        weight_local: torch.Tensor | None,
        vocab_start: int,
        k: int,
        metric: str = "cosine",
        exclude: torch.Tensor | None = None,
        chunk_size: int = 1024,
        tp_group: dist.ProcessGroup | None = None,
        pp_group: dist.ProcessGroup | None = None,
        pp_src: int | None = None,
        vocab_size: int | None = None,
        device=None,
    ):
        self.k, self.metric, self.chunk_size = k, metric, chunk_size
        self.tp_group, self.pp_group, self.pp_src = tp_group, pp_group, pp_src
        self.vocab_start, self.exclude = vocab_start, exclude
        if weight_local is not None:
            self.weight, vocab_size, self.exclude = _checked(
                weight_local, vocab_start, k, metric, exclude, chunk_size, tp_group
            )
            device = self.weight.device
        elif pp_src is None or vocab_size is None:
            raise ValueError(
                "NeighborLookup without weight_local needs pp_src and vocab_size (another stage's rows)"
            )
        else:
            self.weight = None
        self.vocab_size = vocab_size
        self._keys: Keys | None = None
        self.cache = torch.full((vocab_size, k), -1, dtype=torch.long, device=device)
        self.known = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.rows_computed = 0
        self.seconds = 0.0

    def ensure(self, ids: torch.Tensor) -> None:
        """Search the rows of the ids [n] (global, any order, repeats allowed) not cached yet."""
        ids = ids.reshape(-1).to(self.known.device)
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.vocab_size):
            raise ValueError(f"neighbour lookup: ids outside [0, {self.vocab_size})")
        new = torch.unique(ids)
        new = new[~self.known[new]]
        if not new.numel():
            return
        t0 = time.perf_counter()
        nbrs = torch.empty(new.numel(), self.k - 1, dtype=torch.long, device=new.device)
        if self.weight is not None and self.k > 1:
            with torch.no_grad():
                if self._keys is None:
                    self._keys = _keys(
                        self.weight, self.vocab_start, self.metric, self.exclude, self.tp_group
                    )
                for c0 in range(0, new.numel(), self.chunk_size):
                    nbrs[c0 : c0 + self.chunk_size] = chunk_neighbors(
                        self._keys, new[c0 : c0 + self.chunk_size], self.k - 1, self.tp_group
                    )
        if self.pp_src is not None and self.k > 1:
            dist.broadcast(nbrs, src=self.pp_src, group=self.pp_group)
        self.cache[new] = torch.cat([new.unsqueeze(1), nbrs], 1)
        self.known[new] = True
        self.rows_computed += new.numel()
        self.seconds += time.perf_counter() - t0

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[n, k] int64 rows of the ids [n] (anchor first), searched where not cached."""
        self.ensure(ids)
        return self.cache[ids.to(self.cache.device)]


def neighbor_lookup_for_model(
    model_chunks,
    cfg: MixingConfig,
    num_real_tokens: int,
    special_ids=(),
    tp_group=None,
    pp_group=None,
) -> NeighborLookup:
    """The on-demand :class:`NeighborLookup` of a megatron GPT model's matrix (the one
    :func:`neighbor_table_for_model` tabulates, same exclusions), over the given TP and PP
    groups (an engine's own, which may duplicate megatron's; None = single process)."""
    m = _model_matrix(model_chunks, cfg, num_real_tokens, special_ids, None, tp_group, pp_group)
    weight = None if m.weight is None else m.weight.detach()
    return NeighborLookup(
        weight,
        m.vocab_start,
        cfg.k,
        cfg.metric,
        m.exclude,
        cfg.chunk_size,
        tp_group,
        pp_group,
        m.pp_src,
        m.vocab_size,
        m.device,
    )


@dataclass
class _ModelMatrix:
    weight: torch.Tensor | None  # this rank's partition, None on stages without the matrix
    vocab_start: int
    vocab_size: int
    exclude: torch.Tensor
    pp_src: int | None  # global rank of the stage holding it; None without pipeline parallelism
    device: torch.device


def _model_matrix(
    model_chunk,
    cfg: MixingConfig,
    num_real_tokens: int,
    special_ids,
    output_weight,
    tp_group,
    pp_group,
) -> _ModelMatrix:
    """The neighbour matrix of a megatron model on this rank and where it lives."""
    # lazy: mixing.embedding imports megatron-core (start-up)
    from megatron_ngrpo.mixing.embedding import mixing_embedding

    chunks = list(model_chunk) if isinstance(model_chunk, (list, tuple)) else [model_chunk]
    weight, vocab_start = _source_weight(
        chunks, cfg.neighbor_source, output_weight, mixing_embedding, unwrap, tp_group
    )
    vocab_size = unwrap(chunks[0]).vocab_size
    exclude = exclusion_mask(vocab_size, cfg, num_real_tokens, special_ids)
    device = next(chunks[0].parameters()).device
    pp_src = None
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        last = dist.get_world_size(pp_group) - 1
        pp_src = dist.get_global_rank(pp_group, 0 if cfg.neighbor_source == "input" else last)
    elif weight is None:
        raise ValueError(
            f"neighbor_source {cfg.neighbor_source!r}: this model chunk holds no such matrix"
        )
    return _ModelMatrix(weight, vocab_start, vocab_size, exclude, pp_src, device)


def exclusion_mask(
    vocab_size: int, cfg: MixingConfig, num_real_tokens: int, special_ids=()
) -> torch.Tensor:
    """[vocab_size] bool: rows that may never be neighbours under ``cfg``."""
    if not 0 < num_real_tokens <= vocab_size:
        raise ValueError(f"num_real_tokens = {num_real_tokens}: must be in [1, {vocab_size}]")
    exclude = torch.zeros(vocab_size, dtype=torch.bool)
    if cfg.exclude_padded:
        exclude[num_real_tokens:] = True
    ids = list(cfg.exclude_ids) + (list(special_ids) if cfg.exclude_special else [])
    bad = [i for i in ids if not 0 <= int(i) < vocab_size]
    if bad:
        raise ValueError(f"mixing.exclude_ids / special ids {bad}: outside [0, {vocab_size})")
    if ids:
        exclude[torch.as_tensor(ids, dtype=torch.long)] = True
    return exclude


def _checked(
    weight_local, vocab_start: int, k: int, metric: str, exclude, chunk_size: int, tp_group
):
    """The arguments of a neighbour search, checked: (detached weight, V, exclude [V] bool)."""
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r}: expected one of {METRICS}")
    if weight_local.dim() != 2:
        raise ValueError(
            f"weight_local: expected [V_local, d], got shape {tuple(weight_local.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size {chunk_size}: must be >= 1")
    weight_local = weight_local.detach()
    device = weight_local.device
    vocab_size = _check_partitions(weight_local.shape[0], vocab_start, tp_group, device)
    if not 1 <= k < vocab_size:
        raise ValueError(
            f"k = {k}: must satisfy 1 <= k < vocabulary size {vocab_size} (k counts the anchor)"
        )
    if exclude is None:
        exclude = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    exclude = exclude.to(device=device, dtype=torch.bool)
    if exclude.shape != (vocab_size,):
        raise ValueError(f"exclude: expected shape ({vocab_size},), got {tuple(exclude.shape)}")
    allowed = vocab_size - int(exclude.sum())
    if k > allowed:
        raise ValueError(f"k = {k}: only {allowed} of {vocab_size} rows are not excluded")
    return weight_local, vocab_size, exclude


def _keys(weight_local, vocab_start: int, metric: str, exclude, tp_group) -> Keys:
    keys = Keys(weight_local, vocab_start, metric, exclude)
    if not _all_ranks(keys.finite, tp_group, weight_local.device):
        raise ValueError("weight_local: contains non-finite values")
    return keys


# ---- partitions and groups ---------------------------------------------------------------------


def _check_partitions(v_local: int, vocab_start: int, group, device) -> int:
    """Global vocabulary size; checks the TP partitions are contiguous and cover [0, V)."""
    if not group_active(group):
        if vocab_start != 0:
            raise ValueError(
                f"vocab_start = {vocab_start}: must be 0 without a tensor-parallel group"
            )
        return v_local
    mine = torch.tensor([vocab_start, v_local], dtype=torch.long, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    spans = sorted((int(p[0]), int(p[1])) for p in parts)
    end = 0
    for s, n in spans:
        if s != end:
            raise ValueError(f"vocab partitions {spans}: not contiguous from 0")
        end = s + n
    return end


def _dp_share(start: int, stop: int, group) -> tuple[int, int]:
    if not group_active(group):
        return start, stop
    n, world, rank = stop - start, dist.get_world_size(group), dist.get_rank(group)
    share = -(-n // world)
    return min(start + rank * share, stop), min(start + (rank + 1) * share, stop)


def _dp_gather(mine: torch.Tensor, total: int, group) -> torch.Tensor:
    if not group_active(group):
        return mine
    world = dist.get_world_size(group)
    share = -(-total // world)
    padded = F.pad(mine, (0, 0, 0, share - mine.shape[0]), value=-1)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts)[:total]


def _all_ranks(flag: bool, group, device=None) -> bool:
    """``flag`` and-ed over the group, so that every rank raises together."""
    if not group_active(group):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item() > 0)


def _source_weight(chunks, source: str, output_weight, mixing_embedding, unwrap, tp_group):
    """(weight_local, vocab_start) of the neighbour matrix held by these chunks, or (None, 0)."""
    if source == "input":
        for chunk in chunks:
            emb = mixing_embedding(chunk)
            if emb is not None:
                return emb.weight, emb.vocab_start_index
        return None, 0
    if output_weight is None:
        for chunk in chunks:
            inner = unwrap(chunk)
            if getattr(inner, "post_process", False):
                output_weight = (
                    inner.shared_embedding_or_output_weight()
                    if inner.share_embeddings_and_output_weights
                    else inner.output_layer.weight
                )
                break
    if output_weight is None:
        return None, 0
    rank = dist.get_rank(tp_group) if group_active(tp_group) else 0
    return output_weight, rank * output_weight.shape[0]
