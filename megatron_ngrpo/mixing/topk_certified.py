"""Certified exact top-k of the neighbour search (N-GRPO paper Eqs. 7–8, App. G): scoring query
rows against one rank's key rows and certifying the result. `neighbors` builds the whole table
and the on-demand rows from these parts (:func:`chunk_neighbors` for any set of query ids).

Algorithm (never materialises V×V):

1. The query rows are split into chunks of ``chunk_size`` ids (and, with a data-parallel group,
   the chunks are shared out among the DP ranks). Each chunk's embedding rows are assembled on
   every TP rank from the partitions that own them (one all-reduce of [chunk, d]).
2. Each TP rank scores the chunk against its local rows with a *screen* matmul over blocks of
   key rows (fp32; bf16 with fp32 accumulation for cosine/dot on CUDA and on CPUs where that
   GEMM measures faster than fp32's, see `gemm_cpu.screen_dtype`; ``cdist`` for L1), masks excluded
   rows and the anchor itself, and takes a local top-(k-1+margin) in two stages (maxima of
   32-row blocks, then the best blocks' rows).
3. A rigorous error bound ``tol`` of one screen score certifies the result (`_upper`,
   `_lower`). A query whose first k candidates are apart (each one's lower bound above the
   next one's upper bound; under the bf16 screen, after re-scoring the candidates in fp32)
   is exact as it stands (most queries; single-rank and DP paths, which need no scores). The
   others (and, under TP, every query: the ranks' lists are merged by score) are re-scored in
   float64: if the weakest candidate's upper bound lies below the (k-1)-th float64 score, no
   other local row can reach the true top-(k-1); otherwise every local row whose upper bound
   reaches it is re-scored in float64 too (rare: near-ties at the candidate boundary). Sorting
   by (-score64, id) gives the exact local top-(k-1), ties broken by the lower id.
4. The local lists are all-gathered over TP (one all-gather of (score, id) pairs) and merged
   in the same order (the global top-(k-1) is contained in the union of the local ones); the
   DP shares are all-gathered at the end.

The result equals the float64 definition :func:`pair_scores64` evaluated for every pair and
sorted by (-score, id) (the tests' ``tests/harness/reference.py`` ``neighbor_table64``), and is
replicated on every rank.

Peak extra memory per rank, with ``c = chunk_size``, ``V_l`` local rows, width ``d`` and ``b``
bytes per screen value (4 for fp32, 2 for bf16): ``b·c·V_l`` bytes of chunk scores (one reused
buffer), ``b·V_l·d`` for the screen (normalised under cosine) copy of the local rows (none for
fp32 weights under dot/l2 with the fp32 screen), ``4·c·d`` for the query chunk, small
[c, k+margin] candidate buffers and their fp32 rows (``4·c·(k+margin)·d``), float64
re-scoring in blocks of at most 32 MiB, and ``~40`` bytes per above-threshold (query, row) pair
of the near-tie fallback (bounded by ``c·V_l`` pairs in the degenerate all-ties case). E.g.
Qwen2.5-1.5B (V_l = 151936, d = 1536) at c = 1024: 0.31 GB of scores + 0.47 GB bf16 copy
(0.62 + 0.93 GB with the fp32 screen).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ngrpo.mixing import gemm_cpu

# Extra candidates per query beyond k-1, per screen dtype: enough that the certificate almost
# always holds, so the fallback re-scoring runs only on genuine near-ties. The bf16 screen's
# error bound is ~30× the fp32 one, hence its wider margin (fallback on 0 of 4096 random 32768 × 512
# queries and 1 of 1024 random 151936 × 1536 ones at k = 3). The symmetric path's running top-m merge costs grow with m
# while its fallback is one cheap row of scores: a narrower margin there (~0.5% fallback).
_MARGIN = {torch.float32: 2, torch.bfloat16: 14}
_SYMMETRIC_MARGIN = {torch.float32: 2, torch.bfloat16: 6}
# Unit roundoff of a bf16 value (8 significant bits).
_U_BF16 = 2.0**-8
_NORM_EPS = 1e-12
# Id of "no candidate" (-inf score) entries: above every id, exact in float64.
_SENTINEL = 2**53
# Key rows scored per matmul (the output block stays in cache); a multiple of _TOPK_BLOCK.
_KEY_BLOCK = 1024
# Keys per block of the two-stage top-k.
_TOPK_BLOCK = 32
# Bound on the float64 candidate rows gathered at once for re-scoring.
_BLOCK_BYTES = 32 * 2**20


class Keys:
    """This rank's key rows in the forms the scoring needs (the screen dtype for scoring, float64
    for the certificate) and the error bound of one screen score."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, metric: str, exclude: torch.Tensor):
        self.metric = metric
        self.start = vocab_start
        self.n, self.dim = weight.shape
        self.raw = weight
        self.screen = gemm_cpu.screen_dtype(weight.device.type, metric)
        if self.screen == torch.float32:
            w32 = weight.float()
            norms = w32.norm(dim=1)
            self.wmm = w32 / norms.clamp_min(_NORM_EPS).unsqueeze(1) if metric == "cosine" else w32
        else:
            norms = self._prepare_bf16(weight)
        self.norm32 = norms
        self.sq32 = norms * norms if metric == "l2" else None
        self.excluded = exclude[vocab_start : vocab_start + self.n].nonzero().squeeze(1)
        # Largest key magnitude (L2 for dot/l2, L1 for l1) for the error bound, from fp32 sums
        # (relative error < 1e-4 even for d = 10^4, absorbed by the slack below).
        self.max_l2 = float(norms.max()) * (1 + 1e-4) if self.n else 0.0
        self.max_l1 = (
            float(weight.float().abs().sum(1).max()) * (1 + 1e-4)
            if metric == "l1" and self.n
            else 0.0
        )
        self.finite = math.isfinite(self.max_l2) and math.isfinite(self.max_l1)
        # |fl(q·r) - q·r| ≤ (γ_d + (1+γ_d)(2u_in + u_in²))·Σ|q_i r_i|, Σ|q_i r_i| ≤ ‖q‖‖r‖: fp32
        # accumulation (γ_d = d·2^-24 / (1 - d·2^-24)) of products of inputs first rounded to a
        # unit roundoff u_in (TF32 / bf16 matmul modes on GPU; 0 for IEEE fp32 products).
        # ``gamma``: γ_d with a safety factor 4 (any summation order, normalisation rounding);
        # ``u_mm``: the input-rounding term, exact as stated (2.02 covers u² and (1+γ_d)).
        self.gamma = 4.0 * (self.dim + 8) * 2.0**-24
        self.u_mm = 2.02 * gemm_cpu.input_roundoff(weight.device.type)
        self._buf: torch.Tensor | None = None

    def _prepare_bf16(self, weight: torch.Tensor) -> torch.Tensor:
        """The bf16 key rows ``wmm`` (normalised in fp32 first under cosine), in blocks (no fp32
        copy of the matrix), and per row for `_bound_bf16`: ‖r‖ before and ‖r̂‖ after rounding
        and the rounding error ‖r̂ - r‖ (the difference is exact in fp32); fp32 sums, slack
        1e-4 as below. Returns the raw rows' fp32 norms [V_l]."""
        n, dev = self.n, weight.device
        self.wmm = torch.empty(n, self.dim, dtype=self.screen, device=dev)
        norms, key_norm, self.wmm_norm, self.round_err = (
            torch.empty(n, device=dev) for _ in range(4)
        )
        for i in range(0, n, _KEY_BLOCK):
            rows = slice(i, min(i + _KEY_BLOCK, n))
            b = weight[rows].float()
            norms[rows] = b.norm(dim=1)
            if self.metric == "cosine":
                b = b / norms[rows].clamp_min(_NORM_EPS).unsqueeze(1)
            self.wmm[rows] = b
            lo = self.wmm[rows].float()
            key_norm[rows], self.wmm_norm[rows], self.round_err[rows] = (
                b.norm(dim=1),
                lo.norm(dim=1),
                (lo - b).norm(dim=1),
            )
        key_norm, self.wmm_norm, self.round_err = (
            t.double() * (1 + 1e-4) for t in (key_norm, self.wmm_norm, self.round_err)
        )
        self.key_max, self.wmm_max, self.round_max = (
            float(t.max()) if n else 0.0 for t in (key_norm, self.wmm_norm, self.round_err)
        )
        return norms

    def _out(self, c: int) -> torch.Tensor:
        """Reused [V_l, c] score buffer (fresh pages for every chunk cost page faults)."""
        if self._buf is None or self._buf.shape[1] < c:
            self._buf = torch.empty(self.n, c, dtype=self.screen, device=self.raw.device)
        return (
            self._buf[:, :c]
            if self._buf.shape[1] == c
            else self._buf.view(-1)[: self.n * c].view(self.n, c)
        )

    def bound(
        self, q32: torch.Tensor, own: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """For query rows q32 [c, d]: the right-hand side of the score matmul qt [d, c] in the
        screen dtype (None for l1), the per-query shift [c] (float64, score ≈ screen score +
        shift) and the error bound tol [c] (float64) of one screen score (before its rounding
        to the screen dtype: see :func:`_upper`). ``own`` [c]: the queries are these local key
        rows, scored as the very vectors the keys are (the symmetric path reads each product
        from both sides; cosine, dot)."""
        if self.screen != torch.float32:
            return self._bound_bf16(q32, own)
        return self._bound_fp32(q32, own)

    def _bound_fp32(
        self, q32: torch.Tensor, own: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        q64 = q32.double()
        shift = torch.zeros(q32.shape[0], dtype=torch.float64, device=q32.device)
        if self.metric == "cosine":  # unit rows (to within the slack of 3γ)
            tol = 3.0 * self.gamma + 1.01 * self.u_mm
            qt = self.wmm[own].T if own is not None else F.normalize(q32, dim=1, eps=_NORM_EPS).T
            return qt, shift, torch.full_like(shift, tol)
        if self.metric == "dot":
            return q32.T, shift, (self.gamma + self.u_mm) * q64.norm(dim=1) * self.max_l2
        if self.metric == "l2":  # -|q-r|² = 2q·r - |r|² - |q|²; |q|² is a per-query shift
            qn = q64.norm(dim=1)
            tol = (
                self.gamma * (2.0 * qn * self.max_l2 + self.max_l2**2 + qn * qn)
                + 2.0 * self.u_mm * qn * self.max_l2
            )
            return q32.T, -(q64 * q64).sum(1), tol
        return None, shift, self.gamma * (q64.abs().sum(1) + self.max_l1)  # cdist: no matmul

    def _bound_bf16(
        self, q32: torch.Tensor, own: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`bound` of the bf16 screen (cosine, dot): q̂·r̂ accumulated in fp32 (products of bf16
        values are exact in fp32), then rounded once to bf16 (checked on oneDNN's kernels; cuBLAS
        with its reduced-precision reductions off, `gemm_cpu.mm_into`). With
        q, r the fp32 rows (normalised under cosine), |q̂·r̂ - q·r| ≤ ‖q̂ - q‖‖r‖ + ‖q̂‖‖r̂ - r‖
        (Cauchy-Schwarz), measured per query and maximised over keys: ~1.3 u_bf16 on random
        rows where the a-priori (2u + u²)‖q‖‖r‖ is 2 u; plus fp32 accumulation γ‖q̂‖‖r̂‖ and,
        under cosine, the fp32 normalisation (2γ, as in the fp32 bound). The symmetric path's
        queries are the key rows themselves, so the bound of a product holds from both sides."""
        if own is not None:
            qlo, qn, dq = self.wmm[own], self.wmm_norm[own], self.round_err[own]
        else:
            q = F.normalize(q32, dim=1, eps=_NORM_EPS) if self.metric == "cosine" else q32
            qlo = q.to(self.screen)
            qn = qlo.double().norm(dim=1) * (1 + 1e-12)
            dq = (qlo.float() - q).double().norm(dim=1) * (1 + 1e-12)
        tol = dq * self.key_max + qn * self.round_max + self.gamma * qn * self.wmm_max
        if self.metric == "cosine":
            tol = tol + 2.0 * self.gamma
        return qlo.T, torch.zeros_like(tol), tol

    def rescore32(self, q32: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 scores [c, m] of queries q32 [c, d] against local rows ``cols`` [c, m], from the
        raw rows (cosine: divided by their fp32 norms; no normalised copy is kept), and their
        error bound [c] (float64): the fp32 screen's, which covers one more rounding (3γ holds
        a factor 4 of slack). Cheaper than float64 re-scoring: the bf16 screen's interval is
        too wide to separate neighbours, this one usually is."""
        qt, _, tol = self._bound_fp32(q32)
        s = torch.bmm(self.raw[cols].float(), qt.T.unsqueeze(2)).squeeze(2)
        if self.metric == "cosine":
            s = s / self.norm32[cols].clamp_min(_NORM_EPS)
        return s, tol

    def screen_scores(
        self, q32: torch.Tensor, ids: torch.Tensor, first: int = 0, own: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Screen scores of queries with global ids ``ids`` [c] (rows q32 [c, d]) against the
        local keys ``first ..`` (``own``: the queries are local key rows, see `bound`).

        Returns transposed screen-dtype scores st [V_l - first, c] (shifted by a per-query constant;
        excluded keys and each query's own row set to -inf), the maxima of every _TOPK_BLOCK
        keys [(V_l - first) // _TOPK_BLOCK, c] (or None), the shift [c] (float64, score ≈ st +
        shift) and the per-query error bound tol [c] (float64). Keys-major, in blocks of
        _KEY_BLOCK rows: each block's output is a contiguous row range, masked and reduced while
        in cache.
        """
        c, n = q32.shape[0], self.n - first
        qt, shift, tol = self.bound(q32, ids - self.start if own else None)
        out = self._out(c)[:n]
        own = ids - self.start - first
        cols = ((own >= 0) & (own < n)).nonzero().squeeze(1)
        own, order = torch.sort(own[cols])
        cols = cols[order]
        excluded = self.excluded[self.excluded >= first] - first  # sorted
        # Where each key block's own / excluded rows start (one host sync, not one per block).
        starts = torch.arange(0, n + _KEY_BLOCK, _KEY_BLOCK, device=q32.device).clamp_max_(n)
        own_at = torch.searchsorted(own, starts).tolist()
        ex_at = torch.searchsorted(excluded, starts).tolist()
        nb = n // _TOPK_BLOCK
        maxima = torch.empty(nb, c, dtype=self.screen, device=q32.device) if nb else None
        for bi, j in enumerate(range(0, n, _KEY_BLOCK)):
            blk = slice(j, min(j + _KEY_BLOCK, n))
            keys = slice(first + blk.start, first + blk.stop)
            o = out[blk]
            if self.metric == "l1":
                o.copy_(
                    torch.cdist(self.wmm[keys].unsqueeze(0), q32.unsqueeze(0), p=1).squeeze(0)
                ).neg_()
            else:
                gemm_cpu.mm_into(self.wmm[keys], qt, o)
                if self.metric == "l2":
                    o.mul_(2.0).sub_(self.sq32[keys].unsqueeze(1))
            if ex_at[bi + 1] > ex_at[bi]:
                out.index_fill_(0, excluded[ex_at[bi] : ex_at[bi + 1]], float("-inf"))
            if own_at[bi + 1] > own_at[bi]:
                out[own[own_at[bi] : own_at[bi + 1]], cols[own_at[bi] : own_at[bi + 1]]] = float(
                    "-inf"
                )
            full = (blk.stop - blk.start) // _TOPK_BLOCK
            if full:
                b0 = blk.start // _TOPK_BLOCK
                torch.amax(
                    o[: full * _TOPK_BLOCK].view(full, _TOPK_BLOCK, c),
                    1,
                    out=maxima[b0 : b0 + full],
                )
        return out, maxima, shift, tol

    def scores64(self, q: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """float64 scores of queries q [n, d] against local rows ``cols`` [n, m] → [n, m], in
        blocks of queries so the gathered float64 rows stay within ~_BLOCK_BYTES."""
        if not q.shape[0]:
            return torch.zeros(cols.shape, dtype=torch.float64, device=q.device)
        step = max(1, _BLOCK_BYTES // (8 * max(1, cols.shape[1]) * self.dim))
        # Key norms (cosine) from the gathered rows: a query slice needs few of the V_l rows.
        return torch.cat(
            [
                pair_scores64(
                    q[i : i + step].double().unsqueeze(-2),
                    self.raw[cols[i : i + step]].double(),
                    self.metric,
                )
                for i in range(0, q.shape[0], step)
            ]
        )


def pair_scores64(q: torch.Tensor, r: torch.Tensor, metric: str) -> torch.Tensor:
    """Similarity of broadcastable float64 vectors q [..., d] and r [..., d] → [...]: the
    definition every table is exact against. cosine = q·r / (max(‖q‖, ε)·max(‖r‖, ε)), so a
    zero row scores 0."""
    if metric == "cosine":
        qn = torch.linalg.vector_norm(q, dim=-1).clamp_min(_NORM_EPS)
        rn = torch.linalg.vector_norm(r, dim=-1).clamp_min(_NORM_EPS)
        return (q * r).sum(-1) / (qn * rn)
    if metric == "dot":
        return (q * r).sum(-1)
    if metric == "l2":
        return -((q - r) ** 2).sum(-1)
    return -(q - r).abs().sum(-1)


def chunk_neighbors(keys: Keys, ids: torch.Tensor, kk: int, tp_group) -> torch.Tensor:
    """Global ids [c, kk] of the kk nearest allowed rows ≠ self of the queries with global ids
    ``ids`` [c]."""
    q32 = _query_rows(keys, ids, tp_group)
    tp = group_active(tp_group)
    local_scores, local_ids = _local_topk(keys, q32, ids, kk, exact_scores=tp)
    if not tp:
        return local_ids
    # One all-gather of (score, id) pairs; ids < 2^53 are exact in float64.
    packed = torch.cat([local_scores, local_ids.double()], 1)
    parts = [torch.empty_like(packed) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, packed, group=tp_group)
    scores = torch.cat([p[:, :kk] for p in parts], 1)
    ids = torch.cat([p[:, kk:] for p in parts], 1).long()
    order = _order_by_score_then_id(scores, ids)
    return torch.gather(ids, 1, order[:, :kk])


def _query_rows(keys: Keys, ids: torch.Tensor, tp_group) -> torch.Tensor:
    """fp32 embedding rows [c, d] of global ids ``ids`` [c], assembled from their owners."""
    local = ids - keys.start
    inside = (local >= 0) & (local < keys.n)
    q = torch.zeros(ids.shape[0], keys.dim, dtype=torch.float32, device=keys.raw.device)
    if bool(inside.any()):
        q[inside] = keys.raw[local[inside]].float()
    if group_active(tp_group):
        dist.all_reduce(q, group=tp_group)  # exact: every entry has one non-zero contributor
    return q


def _local_topk(
    keys: Keys, q32: torch.Tensor, ids: torch.Tensor, kk: int, exact_scores: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Exact local top-kk of the queries ``ids`` [c] (rows q32): float64 scores [c, kk] (-inf
    where fewer allowed local rows; None unless ``exact_scores``) and global ids [c, kk]
    (ordered by (-score, id); id = _SENTINEL for -inf entries)."""
    st, maxima, shift, tol = keys.screen_scores(q32, ids)  # [V_l, c]
    vals, cols = _blocked_topk(st, maxima, min(kk + _MARGIN[keys.screen], keys.n))
    return _certify(keys, q32, vals, cols, shift, tol, kk, lambda r: st[:, r].T, exact_scores)


def _certify(
    keys: Keys, q32, vals, cols, shift, tol, kk: int, screen_rows, exact_scores: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Exact top-kk ids [c, kk] (and, with ``exact_scores``, their float64 scores) from the
    screen top-m candidates ``vals``/``cols`` [c, m] (sorted by decreasing value; m ≥ kk unless
    the partition is smaller) of queries q32 [c, d].

    A row whose first kk+1 scores are apart (each one's lower bound, :func:`_lower`, above the
    next one's upper bound, and the kk-th's above every other key's, ≤ the weakest candidate's)
    is exact as it stands: the order of the kk and their lead hold exactly, without ties (81%
    of the rows of a random Gaussian 32768 × 512 matrix at k = 3 under the fp32 screen; the
    bf16 screen's interval is too wide for that, so its candidates are re-scored in fp32 first,
    `Keys.rescore32`). Only the others are re-scored in float64 (:func:`_certify64`). Scores
    (float64, of the kk only on rows that are apart) are needed when TP ranks merge their
    local lists."""
    m = vals.shape[1]
    if m <= kk:
        return _certify64(keys, q32, vals, cols, shift, tol, kk, screen_rows)
    # Every other key scores at most the weakest candidate's upper bound.
    ceiling = _upper(vals[:, m - 1], tol) if m < keys.n else torch.full_like(tol, float("-inf"))
    v, c, t = vals, cols, tol
    if vals.dtype == torch.bfloat16:
        s, t = keys.rescore32(q32, cols)
        v, pos = torch.sort(
            s.masked_fill_(torch.isneginf(vals), float("-inf")), dim=1, descending=True
        )
        c = torch.gather(cols, 1, pos)
    t = t.unsqueeze(1)
    apart = (_lower(v[:, :kk], t) > _upper(v[:, 1 : kk + 1], t)) | torch.isneginf(v[:, 1 : kk + 1])
    lead = _lower(v[:, kk - 1], t.squeeze(1)) > ceiling
    fast = apart.all(1) & lead & torch.isfinite(v[:, kk - 1])
    slow = (~fast).nonzero().squeeze(1)
    ids = c[:, :kk] + keys.start
    scores = None
    if exact_scores:
        scores = torch.empty(ids.shape, dtype=torch.float64, device=ids.device)
        scores[fast] = keys.scores64(q32[fast], c[fast, :kk])
    if slow.numel():
        s64, ids[slow] = _certify64(
            keys,
            q32[slow],
            vals[slow],
            cols[slow],
            shift[slow],
            tol[slow],
            kk,
            lambda r: screen_rows(slow[r]),
        )
        if exact_scores:
            scores[slow] = s64
    return scores, ids


def _certify64(
    keys: Keys, q32, vals, cols, shift, tol, kk: int, screen_rows
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_certify` by float64 re-scoring of the candidates, and the near-tie fallback on
    the rows the certificate does not cover (``screen_rows(r)`` → their screen scores
    [len(r), V_l] against every local key, excluded keys and self at -inf)."""
    m = vals.shape[1]
    cand64 = keys.scores64(q32, cols).masked_fill_(torch.isneginf(vals), float("-inf"))
    if m < kk:  # fewer local rows than kk: pad
        pad = kk - m
        cand64 = F.pad(cand64, (0, pad), value=float("-inf"))
        cols = F.pad(cols, (0, pad), value=0)
        vals = F.pad(vals, (0, pad), value=float("-inf"))
    # The kk-th best float64 score among candidates is a lower bound of the true kk-th score;
    # no other key can reach it if the weakest candidate's upper bound stays below.
    bound = torch.topk(cand64, kk, dim=1).values[:, -1]
    ceiling = _upper(vals[:, m - 1], tol) + shift
    certified = (m == keys.n) | torch.isneginf(vals[:, m - 1]) | (ceiling < bound)

    sentinel = _SENTINEL
    ids = torch.where(torch.isneginf(cand64), torch.full_like(cols, sentinel), cols + keys.start)
    order = _order_by_score_then_id(cand64, ids)[:, :kk]
    out_scores, out_ids = torch.gather(cand64, 1, order), torch.gather(ids, 1, order)

    retry = (~certified).nonzero().squeeze(1)
    if retry.numel():
        out_scores[retry], out_ids[retry] = _rescore_above(
            keys, q32[retry], screen_rows(retry), (bound - shift)[retry], tol[retry], kk, sentinel
        )
    return out_scores, out_ids


def symmetric_neighbors(keys: Keys, kk: int, chunk: int) -> torch.Tensor:
    """Global ids [V, kk] of the whole single-rank table of a symmetric metric, scoring each
    pair once: half the matmul FLOPs of scoring every query against every key.

    Chunk i (queries c0..c1) is scored against keys c0..V only, as the transposed block
    [V-c0, c] (one reused buffer). Its columns give the queries' candidates among keys ≥ c0
    (two-stage top-m); its rows below the chunk give keys c1..V their candidates among the
    chunk's queries, merged into a running top-m [V, m] (only rows whose block maximum beats
    their running m-th value are ranked). Excluded ids are masked as keys and as queries of
    the row pass; their own rows (excluded queries keep a table row) are redone by the general
    path. Then each query's top-m is certified exactly as in :func:`_local_topk`.
    """
    n, dev = keys.n, keys.raw.device
    m = min(kk + _SYMMETRIC_MARGIN[keys.screen], n)
    run_v = torch.full((n, m), float("-inf"), dtype=keys.screen, device=dev)
    run_i = torch.zeros(n, m, dtype=torch.long, device=dev)
    excluded = torch.zeros(n, dtype=torch.bool, device=dev)
    excluded[keys.excluded] = True
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        c = c1 - c0
        st, maxima, _, _ = keys.screen_scores(
            keys.raw[c0:c1].float(), torch.arange(c0, c1, device=dev), c0, own=True
        )
        vals, cols = _blocked_topk(st, maxima, min(m, n - c0))
        _merge_topk(run_v, run_i, slice(c0, c1), vals, cols + c0)
        if c1 == n:
            break
        ex_q = excluded[c0:c1].nonzero().squeeze(1)
        below = st[c:]  # keys c1.. × queries of this chunk
        if ex_q.numel():
            below.index_fill_(1, ex_q, float("-inf"))
        hit = (below.amax(1) > run_v[c1:, m - 1]).nonzero().squeeze(1)
        if hit.numel():
            v, j = torch.topk(below[hit], min(m, c), dim=1)
            _merge_topk(run_v, run_i, hit + c1, v, j + c0)
    out = torch.empty(n, kk, dtype=torch.long, device=dev)
    for c0 in range(0, n, chunk):  # certify in chunks: bounded float64 / fp32 copies
        c1 = min(c0 + chunk, n)
        q32 = keys.raw[c0:c1].float()
        ids = torch.arange(c0, c1, device=dev)
        _, shift, tol = keys.bound(q32, ids)
        _, out[c0:c1] = _certify(
            keys,
            q32,
            run_v[c0:c1],
            run_i[c0:c1],
            shift,
            tol,
            kk,
            lambda r: keys.screen_scores(q32[r], ids[r], own=True)[0].T,
            exact_scores=False,
        )
    ex = keys.excluded
    for i in range(0, ex.numel(), chunk):
        out[ex[i : i + chunk]] = chunk_neighbors(keys, ex[i : i + chunk], kk, None)
    return out


def _merge_topk(
    run_v: torch.Tensor, run_i: torch.Tensor, rows, vals: torch.Tensor, ids: torch.Tensor
) -> None:
    """run_v/run_i[rows] ← the top-m of their union with candidates vals/ids [r, ≤m]."""
    m = run_v.shape[1]
    v = torch.cat([run_v[rows], vals], 1)
    i = torch.cat([run_i[rows], ids], 1)
    top, pos = torch.topk(v, m, dim=1)
    run_v[rows], run_i[rows] = top, torch.gather(i, 1, pos)


def _rescore_above(keys: Keys, q32, s, bound, tol, kk: int, sentinel: int):
    """Near-tie fallback: float64 re-scoring of every local row whose screen score ``s``
    [r, V_l] has an upper bound reaching ``bound`` [r] (a lower bound of the true kk-th score,
    shift removed: contains the true top-kk); exact top-kk per query."""
    row, col = (_upper(s, tol.unsqueeze(1)) >= bound.unsqueeze(1)).nonzero(as_tuple=True)
    s64 = keys.scores64(q32[row], col.unsqueeze(1)).squeeze(1)
    ids = col + keys.start
    # Sort pairs by (row, -score, id) with stable sorts, least significant key first.
    order = torch.argsort(ids, stable=True)
    order = order[torch.argsort(-s64[order], stable=True)]
    order = order[torch.argsort(row[order], stable=True)]
    row, s64, ids = row[order], s64[order], ids[order]
    n = q32.shape[0]
    counts = torch.bincount(row, minlength=n)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(row.numel(), device=row.device) - first[row]
    keep = rank < kk
    scores = torch.full((n, kk), float("-inf"), dtype=torch.float64, device=q32.device)
    out = torch.full((n, kk), sentinel, dtype=torch.long, device=q32.device)
    scores[row[keep], rank[keep]] = s64[keep]
    out[row[keep], rank[keep]] = ids[keep]
    return scores, out


def _upper(v: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """float64 upper bound of the true (shifted) score of screen scores ``v`` whose error bound
    is ``tol`` (broadcastable). A bf16 value is also off by up to u_bf16·|v| (its own rounding:
    x = fl(x)(1 + δ), |δ| ≤ u) and by less than 2^-133 where it is subnormal; an fp32 value's
    rounding is inside ``tol``."""
    if v.dtype != torch.bfloat16:
        return v.double() + tol
    v = v.double()
    return v * torch.where(v >= 0, 1 + _U_BF16, 1 - _U_BF16) + (tol + 2.0**-120)


def _lower(v: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """float64 lower bound, the counterpart of :func:`_upper`."""
    if v.dtype != torch.bfloat16:
        return v.double() - tol
    v = v.double()
    return v * torch.where(v >= 0, 1 - _U_BF16, 1 + _U_BF16) - (tol + 2.0**-120)


def _blocked_topk(
    st: torch.Tensor, maxima: torch.Tensor | None, m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-m values [c, m] and key indices [c, m] per query (column) of contiguous transposed
    scores st [n, c], from the maxima [n // _TOPK_BLOCK, c] of its key blocks: the m blocks
    with the largest maxima (plus the ragged tail) contain a top-m set (any other key scores ≤
    the m-th block maximum ≤ the m-th value taken), so only ~m·_TOPK_BLOCK keys per query are
    ranked, several times faster than ``torch.topk`` over long rows on CPU. Ties may resolve
    to any top-m set (the float64 certificate does not rely on which)."""
    n, c = st.shape
    if maxima is None or maxima.shape[0] < 4 * m:
        vals, idx = torch.topk(st, m, dim=0)
        return vals.T, idx.T
    nb = maxima.shape[0]
    if nb * _TOPK_BLOCK < n:
        maxima = torch.cat([maxima, st[nb * _TOPK_BLOCK :].amax(0, keepdim=True)], 0)
    blocks = torch.topk(maxima.T, m, dim=1).indices  # [c, m]
    keys = (
        blocks.unsqueeze(-1) * _TOPK_BLOCK + torch.arange(_TOPK_BLOCK, device=st.device)
    ).reshape(c, -1)
    inside = keys < n
    flat = keys.clamp_max(n - 1) * c + torch.arange(c, device=st.device).unsqueeze(1)
    vals, pos = torch.topk(st.reshape(-1)[flat].masked_fill_(~inside, float("-inf")), m, dim=1)
    return vals, torch.gather(keys, 1, pos)


def _order_by_score_then_id(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Column order per row by decreasing score, ties by increasing id. [c, m] → [c, m]."""
    by_id = torch.argsort(ids, dim=1, stable=True)
    by_score = torch.argsort(-torch.gather(scores, 1, by_id), dim=1, stable=True)
    return torch.gather(by_id, 1, by_score)


def group_active(group) -> bool:
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
