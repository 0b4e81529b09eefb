"""Log-probs and entropy of the labels over a TP-split vocabulary, straight from the hidden states:
the [tokens, V/TP] logits are never formed.

``log softmax(z / τ)[label]`` and the entropy of ``softmax(z / τ)`` for the logits
z = hidden @ weight.T, with ``weight`` this rank's rows of the output matrix
(``models/output_head.py``), in the style of megatron's ``vocab_parallel_cross_entropy`` (row
max, sum of exponentials and the label's logit reduced over TP; the vocabulary is never
gathered). The logits of a chunk of rows are computed (in the weight's dtype, as megatron's output
layer does), used and dropped; the backward computes them again and turns each chunk's gradient
into the hidden states' and the weight's gradients at once. The extra output-layer GEMM costs
2·N·V·h FLOPs (at the 1.5B shape ~5 % of a step's); at that shape and 4096 tokens it avoids
4.6 GiB of logits and their gradients (bf16, a [b, s] copy, fp32) for chunk buffers of < 1 GiB.

Per chunk of rows the partial statistics are taken against the chunk's own row max m and merged
over TP with one max and one sum (all rows at once): for the global max M, S = Σ_r e^(m_r − M)·S_r
and Σ e·s = Σ_r e^(m_r − M)·(T_r + (m_r − M)·S_r), where S_r = Σ e^(z/τ − m_r) and
T_r = Σ e^(z/τ − m_r)·(z/τ − m_r) on rank r. Then log p = z_label/τ − M − log S and the entropy
H = log S − Σ e·s / S (from the same sums, no second softmax). Columns with global id ≥
``vocab_limit`` (megatron's padded rows) are left out of the softmax and get no gradient.

Why hand-written: megatron's ``vocab_parallel_cross_entropy`` needs the logits, works in place on
them and saves a full softmax, with no entropy or temperature; torch's ``log_softmax`` needs the
whole vocabulary on one rank; fused linear + cross-entropy kernels (e.g. Liger's) return a loss,
not per-token log-probs and entropy over a TP-split vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ngrpo.models.batch_invariant import BLOCK_ROWS, blocked_matmul
from megatron_ngrpo.models.invariant_logsoftmax import ordered_merge, shard_stats

# Upper bound of one float32 chunk buffer; a chunk is also at most 1/8 of the rows, so the buffers
# stay within a fraction of one float32 [rows, V/TP] tensor (launch/memory.py plans them).
CHUNK_BYTES = 256 * 2**20
CHUNK_FRACTION = 8


def chunk_rows(rows: int, cols: int) -> int:
    """Rows of one chunk of a [rows, cols] pass."""
    return max(1, min(-(-rows // CHUNK_FRACTION), CHUNK_BYTES // max(4 * cols, 1)))


def _chunks(rows: int, cols: int) -> list[tuple[int, int]]:
    step = chunk_rows(rows, cols)
    return [(i, min(i + step, rows)) for i in range(0, rows, step)]


def _localise(labels, vocab_start: int, valid: int):
    """Partition-local label columns (0 where not owned) and the owned mask."""
    local = labels - vocab_start
    owned = (local >= 0) & (local < valid)
    return torch.where(owned, local, torch.zeros_like(local)), owned


def _chunk_stats(z, inv_temp: float, local, owned, with_entropy: bool, out, a: int, b: int):
    """Partial statistics of rows a..b from their logits ``z`` [b-a, valid] (any float dtype, a
    temporary: float32 ones are overwritten) into ``out`` [4, N]: chunk row max m of z/τ, S,
    T (entropy only) and the label's z/τ (owned rows)."""
    s = z.float().mul_(inv_temp)
    m = s.max(dim=-1).values
    out[0, a:b] = m
    out[3, a:b] = s.gather(1, local[a:b, None]).view(-1) * owned[a:b]
    s.sub_(m[:, None])
    if with_entropy:
        e = s.exp()
        out[1, a:b] = e.sum(-1)
        out[2, a:b] = torch.bmm(e.unsqueeze(1), s.unsqueeze(2)).view(-1)
    else:
        out[1, a:b] = s.exp_().sum(-1)


def _merge(stats, group, with_entropy: bool):
    """Per-rank statistics [4, N] → log-probs, entropy (zeros without), max M and total S, all
    [N] float32, the same on every rank of ``group``."""
    m, total, t, label = stats
    if group is None:
        top = m
    else:
        top = m.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    has = total > 0  # a rank with no valid columns has m = -inf
    shift = torch.where(has, m - top, torch.zeros_like(m))
    scale = torch.where(has, shift.exp(), torch.zeros_like(m))
    sums = torch.stack([total * scale, scale * (t + shift * total), label])
    if group is not None:
        dist.all_reduce(sums, group=group)
    log_s = sums[0].log()
    logprobs = sums[2] - top - log_s
    entropy = log_s - sums[1] / sums[0] if with_entropy else torch.zeros_like(log_s)
    return logprobs, entropy, top, sums[0]


def _grad_logits_(p, top, total, local, owned, g, inv_temp: float) -> None:
    """In place: fp32 logits ``p`` [c, valid] of a chunk → d(g·log p(label)) / dz
    = g·(1[j = label] − p_j) / τ."""
    p.mul_(inv_temp).sub_(top[:, None]).exp_().div_(total[:, None])
    p.mul_(-g[:, None])
    # + g at the label's column where this rank owns it (0 elsewhere; no host sync)
    p.scatter_add_(1, local[:, None], (g * owned)[:, None])
    p.mul_(inv_temp)


class _LinearVocabParallelLogProbs(torch.autograd.Function):
    """``hidden`` [N, h] and ``weight`` [V/TP, h] (logits = hidden @ weight.T, this rank's
    partition) with global ``labels`` [N] → log-probs [N] float32 (differentiable in hidden and
    weight) and entropy [N] float32 (not differentiable).

    The hidden gradient is this rank's partial sum (the caller's TP mapping reduces it, as for
    megatron's column-parallel input). The weight gradient goes, like megatron's fused linear
    layers, straight into ``weight.main_grad`` under megatron DDP (fp32; the returned gradient is
    a dummy, zeros where autograd adds it to another), else into an fp32 buffer returned in the
    weight's dtype."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_temp, vocab_start, valid, group, with_entropy):
        local, owned = _localise(labels, vocab_start, valid)
        w = weight[:valid]
        stats = hidden.new_zeros(4, hidden.shape[0], dtype=torch.float32)
        stats[0] = float("-inf")
        for a, b in _chunks(hidden.shape[0], valid) if valid else ():
            z = hidden[a:b] @ w.t()
            _chunk_stats(z, inv_temp, local, owned, with_entropy, stats, a, b)
            del z
        logprobs, entropy, top, total = _merge(stats, group, with_entropy)
        ctx.save_for_backward(hidden, weight, top, total, local, owned)
        ctx.inv_temp, ctx.valid = inv_temp, valid
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, top, total, local, owned = ctx.saved_tensors
        valid, g = ctx.valid, grad_logprobs.float()
        w = weight[:valid]
        grad_hidden = torch.zeros_like(hidden)
        into_main = _main_grad_target(weight)
        acc = None
        if into_main is None:
            acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        target = (into_main if into_main is not None else acc)[:valid]
        for a, b in _chunks(hidden.shape[0], valid) if valid else ():
            p = (hidden[a:b] @ w.t()).float()
            _grad_logits_(p, top[a:b], total[a:b], local[a:b], owned[a:b], g[a:b], ctx.inv_temp)
            dz = p.to(hidden.dtype)
            del p
            grad_hidden[a:b] = dz @ w
            target.add_(dz.t() @ hidden[a:b])
            del dz
        if into_main is None:
            grad_weight = acc.to(weight.dtype)
        else:
            weight.grad_added_to_main_grad = True
            # zeros where autograd adds it to a gradient: a tied consumer's (the word
            # embedding), or a ``param.grad`` that an optimizer step left aliasing ``main_grad``
            zero = getattr(weight, "zero_out_wgrad", False) or weight.grad is not None
            grad_weight = (torch.zeros_like if zero else torch.empty_like)(weight)
        return grad_hidden, grad_weight, None, None, None, None, None, None


class _InvariantLogProbs(_LinearVocabParallelLogProbs):
    """The batch-invariant mode's forward (``rollout.batch_invariant``): the logits of the whole
    shard (padded columns included, as the output layer computes them) on fixed row blocks, the
    stats of :func:`~megatron_ngrpo.models.invariant_logsoftmax.shard_stats`, all-gathered over
    TP and merged in rank order: the engine's sampler computes the same bits from its gathered
    logits. The backward is the base class's."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_temp, vocab_start, valid, group, with_entropy):
        local, owned = _localise(labels, vocab_start, valid)
        n = hidden.shape[0]
        stats = hidden.new_zeros(4, n, dtype=torch.float32)
        step = max(BLOCK_ROWS, chunk_rows(n, weight.shape[0]) // BLOCK_ROWS * BLOCK_ROWS)
        for a in range(0, n, step):
            b = min(a + step, n)
            z = blocked_matmul(hidden[a:b], weight)
            stats[:, a:b] = shard_stats(z, inv_temp, local[a:b], owned[a:b], valid, with_entropy)
            del z
        if group is None:
            shards = stats.unsqueeze(0)
        else:
            parts = [torch.empty_like(stats) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, stats, group=group)
            shards = torch.stack(parts)
        logprobs, entropy, top, total = ordered_merge(shards)
        if not with_entropy:
            entropy = torch.zeros_like(logprobs)
        ctx.save_for_backward(hidden, weight, top, total, local, owned)
        ctx.inv_temp, ctx.valid = inv_temp, valid
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy


def _main_grad_target(weight) -> torch.Tensor | None:
    """``weight.main_grad`` when the backward adds straight into megatron DDP's fp32 (or wider)
    gradient buffer; None otherwise (a 16-bit one would round every chunk's addition)."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    main = weight.main_grad
    return main if main.dtype in (torch.float32, torch.float64) else None


def _valid_columns(v_local: int, vocab_start: int, vocab_limit: int | None) -> int:
    return v_local if vocab_limit is None else max(0, min(v_local, vocab_limit - vocab_start))


def _tp_group(group):
    return None if group is None or dist.get_world_size(group) == 1 else group


def linear_vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    vocab_start: int = 0,
    vocab_limit: int | None = None,
    group=None,
    with_entropy: bool = False,
    invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(z / τ)[labels] over the TP-split vocabulary, and optionally the entropy, for
    the logits z = hidden @ weight.T, never formed whole.

    ``hidden`` [..., h] (cast to the weight's dtype, as the output layer computes); ``weight``
    [V/TP, h] this rank's rows, the first being global id ``vocab_start``; ``labels`` [...]
    global ids; columns with global id ≥ ``vocab_limit`` are left out of the softmax; ``group``
    the TP group (None: the whole vocabulary is here); ``invariant``: the batch-invariant
    forward (:class:`_InvariantLogProbs`). Returns log-probs [...] float32,
    differentiable in ``hidden`` (this rank's partial sum: the caller reduces it over TP) and in
    ``weight``, and entropy [...] float32 (a metric, no gradient) or None."""
    h = hidden.shape[-1]
    lead = hidden.shape[:-1]
    fn = _InvariantLogProbs if invariant else _LinearVocabParallelLogProbs
    lp, ent = fn.apply(
        hidden.reshape(-1, h).to(weight.dtype),
        weight,
        labels.reshape(-1),
        1.0 / temperature,
        vocab_start,
        _valid_columns(weight.shape[0], vocab_start, vocab_limit),
        _tp_group(group),
        with_entropy,
    )
    return lp.view(lead), (ent.view(lead) if with_entropy else None)
