"""Log-probs and entropy of the labels from vocab-parallel logits in one fused, chunked pass.

``log softmax(logits / τ)[label]`` and the entropy of ``softmax(logits / τ)`` over a vocabulary
split across TP ranks, in the style of megatron's ``vocab_parallel_cross_entropy`` (row max,
sum of exponentials and the label's logit reduced over TP; the vocabulary is never gathered),
with three differences that bound memory at long sequences × large vocabularies:

* no scaled or masked copy of the logits: the temperature and megatron's padded vocabulary rows
  (global id ≥ ``vocab_limit``) are applied chunk by chunk, in float32;
* the entropy comes from the same partial sums (H = log S − Σ e·s / S with s = z − max,
  e = exp s, S = Σ e), not from a second softmax;
* the backward writes the gradient into the saved logits tensor, chunk by chunk (nothing reads the
  logits after the loss: the output layer's backward needs its input and weight only), so the
  pass holds at most two float32 chunk buffers beyond the logits, not megatron's saved softmax
  plus the scaled copies (measured before: 6.25 fp32 logits tensors at the peak).

Why hand-written: megatron's op works in place on its input and saves a full softmax, and has no
entropy or temperature; torch's ``log_softmax`` needs the whole vocabulary on one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Upper bound of one float32 chunk buffer; a chunk is also at most 1/8 of the rows, so the two
# buffers stay within a quarter of one fp32 logits tensor.
CHUNK_BYTES = 256 * 2**20
CHUNK_FRACTION = 8


def _chunks(rows: int, cols: int):
    step = max(1, min(-(-rows // CHUNK_FRACTION), CHUNK_BYTES // max(4 * cols, 1)))
    return [(i, min(i + step, rows)) for i in range(0, rows, step)]


class _VocabParallelLogProbs(torch.autograd.Function):
    """``logits`` [N, V/TP] (this rank's partition, any float dtype) and global ``labels`` [N]
    → log-probs [N] float32 (differentiable) and entropy [N] float32 (not differentiable)."""

    @staticmethod
    def forward(ctx, logits, labels, inv_temp, vocab_start, valid, group, with_entropy):
        rows = logits.shape[0]
        local = labels - vocab_start
        owned = (local >= 0) & (local < valid)
        local = torch.where(owned, local, torch.zeros_like(local))
        # Max over the valid columns (τ > 0 scales it), then the three partial sums per row.
        zmax = torch.full((rows,), float("-inf"), dtype=torch.float32, device=logits.device)
        if valid > 0:
            zmax = logits[:, :valid].max(dim=-1).values.float() * inv_temp
        if group is not None:
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        sums = torch.zeros(3, rows, dtype=torch.float32, device=logits.device)  # S, Σ e·s, s[label]
        for a, b in _chunks(rows, valid):
            if valid == 0:
                break
            s = logits[a:b, :valid].float().mul(inv_temp).sub_(zmax[a:b, None])
            e = s.exp()
            sums[0, a:b] = e.sum(-1)
            if with_entropy:
                sums[1, a:b] = torch.bmm(e.unsqueeze(1), s.unsqueeze(2)).view(-1)
            sums[2, a:b] = s.gather(1, local[a:b, None]).view(-1) * owned[a:b]
            del s, e
        if group is not None:
            dist.all_reduce(sums, group=group)
        log_s = sums[0].log()
        logprobs = sums[2] - log_s
        entropy = log_s - sums[1] / sums[0] if with_entropy else torch.zeros_like(log_s)
        ctx.save_for_backward(logits, zmax, sums[0], local, owned)
        ctx.inv_temp, ctx.valid = inv_temp, valid
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        # d lp / d x_j = (1[j = label] − p_j) / τ, written into the saved logits chunk by chunk.
        logits, zmax, total, local, owned = ctx.saved_tensors
        inv_temp, valid = ctx.inv_temp, ctx.valid
        grad = logits
        rows = logits.shape[0]
        g = grad_logprobs.float()
        for a, b in _chunks(rows, valid):
            if valid == 0:
                break
            x = grad[a:b, :valid]
            p = x if x.dtype == torch.float32 else x.float()
            p.mul_(inv_temp).sub_(zmax[a:b, None]).exp_().div_(total[a:b, None])
            p.mul_(-g[a:b, None])
            hit = owned[a:b].nonzero().view(-1)
            p[hit, local[a:b][hit]] += g[a:b][hit]
            p.mul_(inv_temp)
            if p is not x:
                x.copy_(p)
            del p
        if valid < grad.shape[1]:
            grad[:, valid:].zero_()
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    vocab_start: int = 0,
    vocab_limit: int | None = None,
    group=None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / τ)[labels] over the TP-split vocabulary, and optionally the entropy.

    ``logits`` [..., V/TP]: this rank's partition, whose first column is global id ``vocab_start``;
    ``labels`` [...] global ids; columns with global id ≥ ``vocab_limit`` are left out of the
    softmax; ``group`` the TP group (None: the whole vocabulary is here). Returns log-probs [...]
    float32 (differentiable; the backward overwrites ``logits`` with its gradient, so the caller
    must not read ``logits`` after calling backward) and entropy [...] float32 (a metric, no
    gradient) or None.
    """
    v_local = logits.shape[-1]
    valid = v_local if vocab_limit is None else max(0, min(v_local, vocab_limit - vocab_start))
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    lead = logits.shape[:-1]
    lp, ent = _VocabParallelLogProbs.apply(
        logits.reshape(-1, v_local),
        labels.reshape(-1),
        1.0 / temperature,
        vocab_start,
        valid,
        group,
        with_entropy,
    )
    return lp.view(lead), (ent.view(lead) if with_entropy else None)
