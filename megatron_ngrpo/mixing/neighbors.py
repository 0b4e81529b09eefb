"""Exact semantic-neighbour table of a (vocab-parallel) embedding matrix (N-GRPO paper Eqs. 7–8,
App. G): row v of the table is v followed by the k-1 rows most similar to E[v].

Neighbours depend only on the anchor id and the frozen weights, so one [V, k] table per weight
sync replaces the reference code's per-step [B, V] similarity matmul. The search itself (screen
matmul, certified top-k, TP merge, memory bounds) is `topk_certified`, its GEMM `gemm_cpu`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ngrpo.mixing.config import METRICS, MixingConfig
from megatron_ngrpo.mixing.gemm_cpu import PRODUCT_METRICS
from megatron_ngrpo.mixing.topk_certified import Keys, chunk_neighbors, group_active, symmetric_neighbors


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
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r}: expected one of {METRICS}")
    if weight_local.dim() != 2:
        raise ValueError(f"weight_local: expected [V_local, d], got shape {tuple(weight_local.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size {chunk_size}: must be >= 1")
    weight_local = weight_local.detach()
    device = weight_local.device
    vocab_size = _check_partitions(weight_local.shape[0], vocab_start, tp_group, device)
    if not 1 <= k < vocab_size:
        raise ValueError(f"k = {k}: must satisfy 1 <= k < vocabulary size {vocab_size} (k counts the anchor)")
    if exclude is None:
        exclude = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    exclude = exclude.to(device=device, dtype=torch.bool)
    if exclude.shape != (vocab_size,):
        raise ValueError(f"exclude: expected shape ({vocab_size},), got {tuple(exclude.shape)}")
    allowed = vocab_size - int(exclude.sum())
    if k > allowed:
        raise ValueError(f"k = {k}: only {allowed} of {vocab_size} rows are not excluded")
    start, stop = rows if rows is not None else (0, vocab_size)
    if not 0 <= start < stop <= vocab_size:
        raise ValueError(f"rows = {rows}: must satisfy 0 <= start < stop <= {vocab_size}")

    anchors = torch.arange(start, stop, device=device)
    if k == 1:
        return anchors.unsqueeze(1)
    with torch.no_grad():
        keys = Keys(weight_local, vocab_start, metric, exclude)
        if not _all_ranks(keys.finite, tp_group, device):
            raise ValueError("weight_local: contains non-finite values")
        if metric in PRODUCT_METRICS and (start, stop) == (0, vocab_size) and not group_active(tp_group) \
                and not group_active(dp_group):
            nbrs = symmetric_neighbors(keys, k - 1, chunk_size)
        else:
            my_start, my_stop = _dp_share(start, stop, dp_group)
            parts = [
                chunk_neighbors(keys, torch.arange(c0, min(c0 + chunk_size, my_stop), device=device), k - 1,
                                 tp_group)
                for c0 in range(my_start, my_stop, chunk_size)
            ]
            mine = torch.cat(parts) if parts else torch.zeros(0, k - 1, dtype=torch.long, device=device)
            nbrs = _dp_gather(mine, stop - start, dp_group)
    return torch.cat([anchors.unsqueeze(1), nbrs], dim=1)


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
    from megatron.core import parallel_state as ps

    from megatron_ngrpo.architecture import unwrap
    from megatron_ngrpo.mixing.embedding import mixing_embedding

    chunks = list(model_chunk) if isinstance(model_chunk, (list, tuple)) else [model_chunk]
    weight, vocab_start = _source_weight(chunks, cfg.neighbor_source, output_weight, mixing_embedding, unwrap)
    vocab_size = unwrap(chunks[0]).vocab_size
    parallel = ps.model_parallel_is_initialized()
    tp_group = ps.get_tensor_model_parallel_group() if parallel else None
    dp_group = ps.get_data_parallel_group() if parallel else None
    pp_group = ps.get_pipeline_model_parallel_group() if parallel else None
    exclude = exclusion_mask(vocab_size, cfg, num_real_tokens, special_ids)

    table = None
    if weight is not None:
        table = build_neighbor_table(weight.detach(), vocab_start, cfg.k, cfg.metric, exclude,
                                     cfg.chunk_size, tp_group, dp_group)
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        if table is None:
            raise ValueError(f"neighbor_source {cfg.neighbor_source!r}: this model chunk holds no such matrix")
        return table
    src = ps.get_pipeline_model_parallel_first_rank() if cfg.neighbor_source == "input" \
        else ps.get_pipeline_model_parallel_last_rank()
    if table is None:
        device = next(chunks[0].parameters()).device
        table = torch.empty(vocab_size, cfg.k, dtype=torch.long, device=device)
    dist.broadcast(table, src=src, group=pp_group)
    return table


def exclusion_mask(vocab_size: int, cfg: MixingConfig, num_real_tokens: int, special_ids=()) -> torch.Tensor:
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


# ---- partitions and groups ---------------------------------------------------------------------


def _check_partitions(v_local: int, vocab_start: int, group, device) -> int:
    """Global vocabulary size; checks the TP partitions are contiguous and cover [0, V)."""
    if not group_active(group):
        if vocab_start != 0:
            raise ValueError(f"vocab_start = {vocab_start}: must be 0 without a tensor-parallel group")
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



def _source_weight(chunks, source: str, output_weight, mixing_embedding, unwrap):
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
                output_weight = inner.shared_embedding_or_output_weight() \
                    if inner.share_embeddings_and_output_weights else inner.output_layer.weight
                break
    if output_weight is None:
        return None, 0
    from megatron.core import parallel_state as ps

    rank = ps.get_tensor_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    return output_weight, rank * output_weight.shape[0]
