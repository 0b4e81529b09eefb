"""Batch-invariant forward (``rollout.batch_invariant``): every op's output row depends only on
that row, never on how many rows were computed with it, their contents, or whether the row came
from a prefill or a KV-cached decode step. The built-in engine and the trainer then compute the
same bits for a token (docs/ALGORITHM.md, "Zero mismatch").

What :func:`enable_batch_invariant` changes in a model's chunks, in place (the weights, their
names and the checkpoints are untouched):

* every megatron ``ColumnParallelLinear`` / ``RowParallelLinear`` (QKV, projection, MLP, the
  output layer) multiplies fixed blocks of :data:`BLOCK_ROWS` rows, the last one zero-padded
  (:func:`blocked_matmul`): a CPU GEMM picks its kernel and summation order by M (an fp32 row of
  M = 1 differs from the same row in M = 37, tests/test_batch_invariant.py), a fixed M does not;
  their backward is the plain GEMMs (gradients need not be batch-invariant);
* core attention becomes :class:`TiledAttention`: fixed query tiles and key blocks aligned to
  absolute positions, so a query row meets the same kernels with the same operands in a prefill,
  in a decode step against the KV cache and in the replay (torch SDPA gives another summation
  for sq = 1 than for the same row of a causal prefill);
* the log-prob becomes one function on both sides (:mod:`megatron_ngrpo.models.invariant_logsoftmax`).

Packed micro-batches (``train.pack_sequences``: the trainer's replays and update) come in
megatron's THD form (``grpo/packing.py``: cu_seqlens, one packed row): :class:`TiledAttention`
puts each sequence back into its own entry of a zero-padded batch, from position 0, and tiles it
as an unpacked row; megatron's THD RoPE takes each sequence's angles from its start (the
unpacked row's angles through the same elementwise ops: equal bits, measured). The other ops
are row-local, so a token's bits do not depend on where the packer put its sequence.

Unchanged because already row-local and shape-independent on CPU (measured, see the tests):
torch's RMSNorm, RoPE and the residual adds (elementwise, the same dtypes on both sides: one
model code), the mixing embedding (``mixing/arithmetic.py``: fixed-order elementwise). TP
reductions: a TP 2 all-reduce adds two operands, a + b = b + a bit for bit, so its algorithm
cannot change the sum; TP > 2 would need an ordered all-gather + sum and is refused, as is
sequence parallelism (reduce-scatter has no fixed order).

CPU reference path (each op one bmm over its fixed blocks, the key blocks added in a Python
loop; cost in bench/results/zero_mismatch.md); a GPU would use megatron-core's batch-invariant
kernels instead (not run here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_ngrpo.architecture import unwrap
from megatron_ngrpo.models.config import BATCH_INVARIANT_MAX_TP

# Rows per GEMM call: every linear (and log-prob block) runs on exactly this many rows.
BLOCK_ROWS = 16
# Query rows per attention tile and keys per key block: every attention matmul is
# [Tq, hn] × [hn, Tk] or [Tq, Tk] × [Tk, hn]; Tq·Tk a multiple of the widest vector (no scalar
# tail in an elementwise exp).
QUERY_TILE = 8
KEY_BLOCK = 32


def blocked_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ → [M, N] as one bmm over fixed blocks of :data:`BLOCK_ROWS`
    rows (the last padded with zeros): every block is its own [BLOCK_ROWS, K] × [K, N] GEMM, so
    a row's bits do not depend on M (measured equal to a loop of per-block GEMMs, fp32 and
    bf16, tests/test_batch_invariant.py; one call instead of M / BLOCK_ROWS, and no cat)."""
    m = x.shape[0]
    pad = (-m) % BLOCK_ROWS
    x = F.pad(x, (0, 0, 0, pad)) if pad else x
    blocks = x.shape[0] // BLOCK_ROWS
    w = weight.t().expand(blocks, *weight.t().shape)
    return torch.bmm(x.reshape(blocks, BLOCK_ROWS, x.shape[1]), w).view(-1, weight.shape[0])[:m]


class _BlockedMatmul(torch.autograd.Function):
    """x [M, K] @ weight [N, K]ᵀ → [M, N], the forward on fixed row blocks
    (:func:`blocked_matmul`); the backward is the two plain GEMMs: only forward values have to be
    batch-invariant."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return blocked_matmul(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def _blocked_forward_impl(
    input,  # noqa: A002 (megatron's name)
    weight,
    bias=None,
    gradient_accumulation_fusion=False,
    allreduce_dgrad=False,
    sequence_parallel=False,
    grad_output_buffer=None,
    tp_group=None,
    **kwargs,
):
    """megatron's linear ``_forward_impl`` (input [..., K] → [..., N]) with the GEMM on fixed row
    blocks; the input-gradient all-reduce of a column-parallel layer goes through megatron's
    ``copy_to_tensor_model_parallel_region``."""
    if gradient_accumulation_fusion or sequence_parallel or grad_output_buffer is not None:
        raise ValueError(
            "rollout.batch_invariant: no gradient-accumulation fusion, sequence parallelism or "
            "deferred weight gradients in the blocked linears"
        )
    if allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)  # noqa: A001
    out = _BlockedMatmul.apply(input.reshape(-1, input.shape[-1]), weight)
    out = out.view(*input.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


class TiledAttention(DotProductAttention):
    """Causal core attention in fixed tiles aligned to absolute positions, so a query row meets
    the same kernels with the same operands in a prefill, in a KV-cached decode step and in the
    trainer's replay.

    query [sq, b, np, hn], key / value [sk, b, ng, hn]; query i (position sk − sq + i) sees keys
    0 … its position. Queries go into tiles of Tq = :data:`QUERY_TILE` rows (tile t holds
    positions t·Tq … t·Tq + Tq − 1, so a decode row sits where the prefill had it; the tile's
    other rows are zeros or other queries), keys into blocks of Tk = :data:`KEY_BLOCK`. Per (row,
    head) pair and tile, in fp32: the scores of every key block ([Tq, hn] × [hn, Tk], all pairs of
    tile and block in one bmm, masked with −inf past the row), the row max over all blocks
    (exact, order-free), e^(s − max), then per block in order its sum and its [Tq, Tk] × [Tk, hn]
    product added on. A block past a row's position adds exact zeros, so a prefill's extra blocks
    leave the row's bits as in a decode step. A small Tq keeps a decode step's tile (one live
    row) cheap; a prefill or replay computes the same scores in more, smaller tiles. Rounded once
    to the input dtype. Output [sq, b, np·hn]. Packed sequences (THD, ``packed_seq_params``):
    each tiled from its own start (:func:`_packed`).
    """

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_mask is not None or attention_bias is not None:
            raise ValueError(
                "TiledAttention (rollout.batch_invariant): causal attention without an "
                "explicit mask only (pack in THD form: packed_seq_params)"
            )
        if packed_seq_params is None:
            return _tiled(query, key, value, self.softmax_scale)
        return _packed(query, key, value, packed_seq_params, self.softmax_scale)


def _packed(query, key, value, params, scale: float) -> torch.Tensor:
    """:class:`TiledAttention` on packed sequences (THD): query [T, np, hn], key / value
    [T, ng, hn], the n sequences of ``params.cu_seqlens_q`` [n + 1] concatenated. Each sequence
    goes into its own column of a zero-padded [L, n, ·, hn] batch (L the longest), from position
    0, and is tiled there as an unpacked row is: the padding's key blocks add exact zeros to a
    row and its masked scores never move the row max, so a token gets the bits it has unpacked,
    wherever the packer put its sequence. Output [T, 1, np·hn] (the [t, b = 1, h] of megatron's
    THD attention)."""
    cu = params.cu_seqlens_q
    if (
        params.qkv_format != "thd"
        or not torch.equal(cu, params.cu_seqlens_kv)
        or params.cu_seqlens_q_padded is not None
        or params.cu_seqlens_kv_padded is not None
    ):
        raise ValueError(
            "TiledAttention (rollout.batch_invariant): THD self-attention with one "
            "cu_seqlens for queries and keys, unpadded"
        )
    lengths = (cu[1:] - cu[:-1]).to(torch.long)
    n, longest = lengths.numel(), int(lengths.max())
    seq = torch.repeat_interleave(torch.arange(n, device=cu.device), lengths)
    pos = torch.arange(query.shape[0], device=cu.device) - cu[:-1].to(torch.long)[seq]
    row = (pos * n + seq).to(query.device)  # token t's row in the [L·n] padded layout

    def padded(t):  # [T, g, hn] → [L, n, g, hn], zeros past each sequence
        out = t.new_zeros(longest * n, *t.shape[1:]).index_copy(0, row, t)
        return out.view(longest, n, *t.shape[1:])

    out = _tiled(padded(query), padded(key), padded(value), scale)
    return out.reshape(longest * n, -1)[row].unsqueeze(1)


def _tiled(query, key, value, scale: float) -> torch.Tensor:
    """query [sq, b, np, hn], key / value [sk, b, ng, hn] → [sq, b, np·hn], in the tiles of
    :class:`TiledAttention`; ``scale`` the softmax scale."""
    sq, b, heads, hn = query.shape
    sk, tq, tk = key.shape[0], QUERY_TILE, KEY_BLOCK
    first = sk - sq  # the position of query row 0
    t0 = first // tq
    nt, nk = (sk - 1) // tq - t0 + 1, -(-sk // tk)
    q = _tiles(query, heads, first - t0 * tq, nt, tq)  # [P, nt, Tq, hn]
    k, v = (_tiles(t, heads, 0, nk, tk) for t in (key, value))  # [P, nk, Tk, hn]
    pairs = q.shape[0]

    def pair_up(t, dim):  # [P, n, T, hn] → [P·nt·nk, T, hn], repeated along the other axis
        return t.unsqueeze(dim).expand(pairs, nt, nk, -1, hn).reshape(-1, t.shape[2], hn)

    qpos = torch.arange(t0 * tq, (t0 + nt) * tq, device=q.device).view(nt, 1, tq, 1)
    kpos = torch.arange(nk * tk, device=q.device).view(1, nk, 1, tk)
    # every (query tile, key block) pair is one entry of one bmm
    scores = torch.bmm(pair_up(q, 2), pair_up(k, 1).transpose(1, 2))
    scores = scores.view(pairs, nt, nk, tq, tk).masked_fill_(kpos > qpos, float("-inf"))
    top = scores.amax(dim=(2, 4), keepdim=True)  # the row max over all keys: exact
    p = ((scores - top) * scale).exp()
    sums = p.sum(-1, keepdim=True)  # [P, nt, nk, Tq, 1]
    prods = torch.bmm(p.view(-1, tq, tk), pair_up(v, 1)).view(pairs, nt, nk, tq, hn)
    # key blocks added in order (never a reduction over nk: its order could change with nk)
    total, acc = sums[:, :, 0], prods[:, :, 0]
    for j in range(1, nk):
        total, acc = total + sums[:, :, j], acc + prods[:, :, j]
    out = (acc / total).view(b, heads, nt * tq, hn)[:, :, first - t0 * tq :][:, :, :sq]
    return out.permute(2, 0, 1, 3).to(query.dtype).reshape(sq, b, heads * hn)


def _tiles(t: torch.Tensor, heads: int, offset: int, n: int, size: int) -> torch.Tensor:
    """[s, b, g, hn] → [b·heads, n, size, hn] fp32 (each KV group repeated for its query heads),
    the s rows placed from row ``offset`` on, zeros elsewhere (a new contiguous buffer)."""
    s, b, g, hn = t.shape
    out = t.new_zeros(b, heads, n * size, hn, dtype=torch.float32)
    out[:, :, offset : offset + s] = t.permute(1, 2, 0, 3).repeat_interleave(heads // g, 1)
    return out.view(b * heads, n, size, hn)


def enable_batch_invariant(chunks) -> None:
    """Switch the model chunks (possibly wrapped) to the batch-invariant forward, in place;
    idempotent. Refuses what it cannot make invariant (one line)."""
    for chunk in chunks:
        inner = unwrap(chunk)
        if getattr(inner, "batch_invariant", False):
            continue
        cfg = inner.config
        if cfg.sequence_parallel:
            raise ValueError("rollout.batch_invariant: sequence parallelism has no fixed order")
        if cfg.tensor_model_parallel_size > BATCH_INVARIANT_MAX_TP:
            raise ValueError(
                f"rollout.batch_invariant: tensor_parallel = {cfg.tensor_model_parallel_size} "
                f"(at most {BATCH_INVARIANT_MAX_TP}: a larger all-reduce is not order-fixed)"
            )
        linears = 0
        for mod in inner.modules():
            if isinstance(mod, ColumnParallelLinear | RowParallelLinear):
                mod._forward_impl = _blocked_forward_impl
                linears += 1
            elif isinstance(mod, DotProductAttention):
                if mod.attn_mask_type != AttnMaskType.causal:
                    raise ValueError("rollout.batch_invariant: causal attention only")
                mod._default_class = type(mod)
                mod.__class__ = TiledAttention
            elif type(mod).__module__.startswith("megatron.core.extensions.transformer_engine"):
                raise ValueError(
                    "rollout.batch_invariant: Transformer Engine layers (use megatron's local spec)"
                )
        if not linears:
            raise ValueError("rollout.batch_invariant: found no megatron linear layer to block")
        inner.batch_invariant = True


def disable_batch_invariant(chunks) -> None:
    """Undo :func:`enable_batch_invariant` in place (bench/bench_zero_mismatch.py compares both
    forwards on one model)."""
    for chunk in chunks:
        inner = unwrap(chunk)
        for mod in inner.modules():
            mod.__dict__.pop("_forward_impl", None)
            if isinstance(mod, TiledAttention):
                mod.__class__ = mod._default_class
        inner.batch_invariant = False
