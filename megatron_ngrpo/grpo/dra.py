"""DRA reward adjustment (DRA-GRPO paper, docs/ALGORITHM.md §7): r̃_i = r_i / (1 + Σ_{j≠i} s(o_i, o_j)),
s the cosine similarity of response embeddings, over each prompt's group (paper rule) or over the
whole local batch (DRA reference code).

The paper embeds responses with a sentence-embedding model (jina-embeddings-v2-small), which is
not available offline here. Two offline embedders are offered instead:

* :class:`TfidfEmbedder` (default): a hashed bag-of-word-n-grams TF-IDF vector of the response
  text. It is a lexical stand-in for the paper's semantic embedder, not a reproduction of it.
  Written by hand (a dozen lines) because scikit-learn is not a dependency; the hash is
  ``zlib.crc32`` so vectors do not depend on Python's per-process hash seed.
* :func:`policy_embeddings`: the mean of the policy's own input-embedding rows over the response
  tokens (TP-split rows gathered by one all-reduce).

Any callable ``texts -> [N, d]`` tensor can be passed as the embedder.
"""

from __future__ import annotations

import math
import re
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

_WORD = re.compile(r"\w+|[^\w\s]")


class TfidfEmbedder:
    """Hashed TF-IDF of word 1..``ngram``-grams in ``dim`` buckets; IDF over the texts of one
    call (smoothed: log((1+N)/(1+df)) + 1). Returns a sparse [N, dim] float64 tensor with
    L2-normalised rows."""

    def __init__(self, ngram: int = 2, dim: int = 2**18):
        self.ngram, self.dim = ngram, dim

    def _counts(self, text: str) -> dict[int, int]:
        words = _WORD.findall(text.lower())
        counts: dict[int, int] = {}
        for n in range(1, self.ngram + 1):
            for i in range(len(words) - n + 1):
                h = zlib.crc32(" ".join(words[i:i + n]).encode()) % self.dim
                counts[h] = counts.get(h, 0) + 1
        return counts

    def __call__(self, texts: list[str]) -> torch.Tensor:
        docs = [self._counts(t) for t in texts]
        df: dict[int, int] = {}
        for d in docs:
            for h in d:
                df[h] = df.get(h, 0) + 1
        n = len(docs)
        rows, cols, vals = [], [], []
        for i, d in enumerate(docs):
            vec = {h: c * (math.log((1 + n) / (1 + df[h])) + 1.0) for h, c in d.items()}
            norm = math.sqrt(sum(v * v for v in vec.values())) or 1.0
            for h, v in vec.items():
                rows.append(i)
                cols.append(h)
                vals.append(v / norm)
        return torch.sparse_coo_tensor([rows, cols], vals, (n, self.dim), dtype=torch.float64,
                                       check_invariants=True).coalesce()


def similarity(embeddings: torch.Tensor) -> torch.Tensor:
    """[N, N] float64 cosine similarities of the rows of a dense or sparse [N, d] tensor."""
    if embeddings.is_sparse:
        # One sparse × dense column at a time: never a dense [N, d] matrix.
        e = embeddings.double().coalesce()
        s = torch.stack([torch.sparse.mm(e, e[i].to_dense().unsqueeze(1)).squeeze(1)
                         for i in range(e.shape[0])], dim=1)
        norms = s.diagonal().sqrt().clamp(min=1e-12)
        return s / norms.unsqueeze(0) / norms.unsqueeze(1)
    e = F.normalize(embeddings.double(), dim=-1, eps=1e-12)
    return e @ e.t()


def dra_rewards(rewards: torch.Tensor, sim: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
    """r / (1 + Σ_{j≠i} s_ij) with j over the group of i (``groups`` [N]) or over all rows
    (``groups`` None). The denominator is floored at 1e-6 (cosines of dense embeddings can be
    negative). Returns float32 [N]."""
    s = sim.clone()
    s.fill_diagonal_(0.0)
    if groups is not None:
        s = s * (groups.unsqueeze(0) == groups.unsqueeze(1))
    denom = (1.0 + s.sum(1)).clamp(min=1e-6)
    return (rewards.double() / denom).float()


def policy_embeddings(model_chunks: list, response_ids: list[list[int]]) -> torch.Tensor:
    """[N, h] float32 mean input-embedding row of each response's tokens, on every rank
    (computed on the first pipeline stage, broadcast over the pipeline group)."""
    from megatron.core import parallel_state as ps

    from megatron_ngrpo.architecture import unwrap
    from megatron_ngrpo.compat.cpu import device
    from megatron_ngrpo.mixing.embedding import mixing_embedding

    emb = mixing_embedding(model_chunks[0])
    hidden = unwrap(model_chunks[0]).config.hidden_size
    out = torch.zeros(len(response_ids), hidden, dtype=torch.float32, device=device())
    if emb is not None:
        with torch.no_grad():
            for i, ids in enumerate(response_ids):
                if ids:
                    rows = emb.local_rows(torch.tensor(ids, device=out.device))
                    out[i] = rows.float().mean(0)
            tp = ps.get_tensor_model_parallel_group()
            if tp.size() > 1:
                dist.all_reduce(out, group=tp)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(out, src=ps.get_pipeline_model_parallel_first_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return out.cpu()

