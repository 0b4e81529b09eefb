"""Float64 single-process references that tests (and the trainer's tests) compare against.

Deliberately brute force: full V×V similarity, dense loops over the definition, no sharding.
"""

from __future__ import annotations

import numpy as np
import torch


def tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to TF32 (10 mantissa bits, round to nearest) as tensor cores do to inputs."""
    return ((x.contiguous().view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)


def similarity_matrix64(weight: torch.Tensor, metric: str, rows=None) -> torch.Tensor:
    """[R, V] float64 similarity of query rows ``rows`` (default all) to every row, one query at a
    time: cosine = q·r / (max(‖q‖, ε)·max(‖r‖, ε)) (a zero row scores 0), dot, l2 = -‖q-r‖²,
    l1 = -‖q-r‖₁."""
    w = weight.detach().double()
    norms = torch.linalg.vector_norm(w, dim=-1).clamp_min(1e-12)
    out = []
    for a in range(w.shape[0]) if rows is None else rows:
        q = w[a]
        if metric == "cosine":
            out.append((q * w).sum(-1) / (norms[a] * norms))
        elif metric == "dot":
            out.append((q * w).sum(-1))
        elif metric == "l2":
            out.append(-((q - w) ** 2).sum(-1))
        elif metric == "l1":
            out.append(-(q - w).abs().sum(-1))
        else:
            raise ValueError(f"metric {metric!r}")
    return torch.stack(out)


def neighbor_table64(
    weight: torch.Tensor,
    k: int,
    metric: str = "cosine",
    exclude: torch.Tensor | None = None,
    rows=None,
) -> torch.Tensor:
    """[V, k] table (or the rows ``rows``): row v = v then the k-1 most similar allowed rows ≠ v,
    ordered by (-score, id)."""
    rows = torch.tensor(list(range(weight.shape[0]) if rows is None else rows), dtype=torch.long)
    s = similarity_matrix64(weight, metric, rows.tolist())
    banned = (
        torch.zeros(weight.shape[0], dtype=torch.bool) if exclude is None else exclude.cpu().bool()
    )
    # A stable descending sort keeps equal scores in id order: the (-score, id) order over the
    # whole row (a Python sort of V tuples per row cost ~20 s at V = 3000).
    order = torch.sort(s, dim=1, descending=True, stable=True).indices
    allowed = ~banned[order] & (order != rows.unsqueeze(1))
    first = allowed & (allowed.cumsum(1) <= k - 1)
    assert bool((first.sum(1) == k - 1).all()), "fewer than k-1 allowed rows"
    return torch.cat([rows.unsqueeze(1), order[first].view(len(rows), k - 1)], 1)


def mixed_embedding64(
    weight: torch.Tensor,
    tokens: torch.Tensor,
    ids: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 input embeddings [B, S, d]: E[tokens], and Σ_j weights[..., j]·E[ids[..., j]]
    (+ noise) where ``mask``; the reference of the mixing embedding (differentiable in
    ``weight``)."""
    w = weight.double()
    out = w[tokens].clone()
    if mask is not None:
        b, s = mask.nonzero(as_tuple=True)
        for bi, si in zip(b.tolist(), s.tolist()):
            row = torch.zeros(w.shape[1], dtype=torch.float64)
            for c, a in zip(ids[bi, si].tolist(), weights[bi, si].double().tolist()):
                row += a * w[c]
            if noise is not None:
                row += noise[bi, si].double()
            out[bi, si] = row
    return out


def decide64(logits: torch.Tensor, table: torch.Tensor, temperature: float, num_real_tokens: int):
    """Per row of full-vocabulary logits [B, V]: (anchor [B], ids [B, k], weights [B, k] float64)
    by the definition: anchor = lowest id of the max over real tokens, α = softmax of z/τ on the
    anchor's table row (ids >= num_real_tokens weigh 0)."""
    z = logits.detach().double() / temperature
    anchors, ids, weights = [], [], []
    for row in z:
        best = max(range(num_real_tokens), key=lambda v: (float(row[v]), -v))
        cand = table[best].tolist()
        e = torch.tensor(
            [float(row[c]) if c < num_real_tokens else float("-inf") for c in cand],
            dtype=torch.float64,
        )
        weights.append(torch.softmax(e, 0))
        anchors.append(best)
        ids.append(cand)
    return torch.tensor(anchors), torch.tensor(ids), torch.stack(weights)


def topk_mixture64(logits: torch.Tensor, k: int, temperature: float, num_real_tokens: int):
    """Per row of full-vocabulary logits [B, V]: ids [B, k] = the k largest z/τ over real ids by
    (-z, id), weights [B, k] float64 = softmax of z/τ on them (Soft Thinking / STHT)."""
    z = logits.detach().double() / temperature
    ids, weights = [], []
    for row in z:
        order = sorted(range(num_real_tokens), key=lambda v: (-float(row[v]), v))[:k]
        ids.append(order)
        weights.append(torch.softmax(row[order], 0))
    return torch.tensor(ids), torch.stack(weights)


def splitmix_uniform64(seed: int, key, position):
    """numpy uint64 splitmix64 specification of the gate's counter-based uniform draw."""

    m1, m2, golden = (
        np.uint64(0xBF58476D1CE4E5B9),
        np.uint64(0x94D049BB133111EB),
        np.uint64(0x9E3779B97F4A7C15),
    )

    def mix(x):
        x = x + golden
        x = (x ^ (x >> np.uint64(30))) * m1
        x = (x ^ (x >> np.uint64(27))) * m2
        return x ^ (x >> np.uint64(31))

    with np.errstate(over="ignore"):
        k = np.asarray(key, dtype=np.int64).astype(np.uint64)
        p = np.asarray(position, dtype=np.int64).astype(np.uint64)
        h = mix(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ mix(k * m1 + mix(p)))
    return torch.from_numpy((h >> np.uint64(11)).astype(np.float64) / float(1 << 53))


def full_state(model) -> dict[str, torch.Tensor]:
    """float64 copies of a model's parameters keyed by their checkpoint (global) key, in the
    global shape (layer-stacked where megatron stacks them). ``model`` must hold every shard
    (TP=1, PP=1): the single-process reference. Pair with :func:`local_shards`."""
    # lazy: keeps tests.harness.reference free of megatron-core at import (start-up)
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sd = model.sharded_state_dict()
    apply_factories(sd)
    full: dict[str, torch.Tensor] = {}
    for st in _leaves(sd):
        if isinstance(st, ShardedTensor):
            t = full.setdefault(st.key, torch.zeros(st.global_shape, dtype=torch.float64))
            t[st.global_slice()] = st.data.detach().double()
    return full


def local_shards(model, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's pieces of ``full`` (from :func:`full_state`) for ``model`` at the current
    TP/PP layout, keyed like ``model.state_dict()``: megatron's own sharding metadata (incl. the
    SwiGLU split of fc1) maps full tensors to shards, with no checkpoint on disk. Load weights
    with ``model.load_state_dict(local_shards(...), strict=False)``."""
    # lazy: keeps tests.harness.reference free of megatron-core at import (start-up)
    from megatron.core.dist_checkpointing.dict_utils import (
        dict_list_map_inplace,
        extract_matching_values,
    )
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
        apply_factories,
        apply_factory_merges,
    )

    factories, _ = extract_matching_values(
        model.sharded_state_dict(), lambda x: isinstance(x, ShardedTensorFactory)
    )
    sd = model.sharded_state_dict()
    apply_factories(sd)
    sd = {k: v for k, v in sd.items() if any(isinstance(x, ShardedTensor) for x in _leaves(v))}
    loaded = dict_list_map_inplace(
        lambda x: full[x.key][x.global_slice()].clone() if isinstance(x, ShardedTensor) else x, sd
    )
    return apply_factory_merges(loaded, factories)


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree
