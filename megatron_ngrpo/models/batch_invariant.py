"""Batch-invariant forward (``rollout.batch_invariant``): every op's output row depends only on
that row, never on how many rows were computed with it, their contents, or whether the row came
from a prefill or a KV-cached decode step. The built-in engine and the trainer then compute the
same bits for a token (docs/ALGORITHM.md, "Zero mismatch").

What :func:`enable_batch_invariant` changes in a model's chunks, in place (the weights, their
names and the checkpoints are untouched):

* every megatron ``ColumnParallelLinear`` / ``RowParallelLinear`` (QKV, projection, MLP, the
  output layer) multiplies fixed blocks of :data:`BLOCK_ROWS` rows, the last one zero-padded
  (:func:`row_blocks`): a CPU GEMM picks its kernel and summation order by M (an fp32 row of
  M = 1 differs from the same row in M = 37, tests/test_batch_invariant.py), a fixed M does not;
* core attention becomes :class:`RowwiseAttention`: each query row against exactly its keys
  (0 … its position), one small fp32 matmul-softmax-matmul per (row, position) with the same
  shapes in a prefill and in a decode step against the KV cache (torch SDPA gives another
  summation for sq = 1 than for the same row of a causal prefill);
* the log-prob becomes one function on both sides (:mod:`megatron_ngrpo.models.invariant_logsoftmax`).

Unchanged because already row-local and shape-independent on CPU (measured, see the tests):
torch's RMSNorm, RoPE and the residual adds (elementwise, the same dtypes on both sides: one
model code), the mixing embedding (``mixing/arithmetic.py``: fixed-order elementwise). TP
reductions: a TP 2 all-reduce adds two operands, a + b = b + a bit for bit, so its algorithm
cannot change the sum; TP > 2 would need an ordered all-gather + sum and is refused, as is
sequence parallelism (reduce-scatter has no fixed order).

CPU reference path: slow (Python loop over attention rows) and meant for parity, not speed; a GPU
would use megatron-core's batch-invariant kernels instead (not run here).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_ngrpo.architecture import unwrap
from megatron_ngrpo.models.config import BATCH_INVARIANT_MAX_TP

# Rows per GEMM call: every linear (and log-prob block) runs on exactly this many rows.
BLOCK_ROWS = 16
# (row, head) pairs per attention matmul: every call has this batch, padded.
ATTENTION_BLOCK = 64


def row_blocks(x: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` over fixed blocks of :data:`BLOCK_ROWS` rows of ``x`` [M, K] (the last padded with
    zeros) → [M, N]; differentiable."""
    m = x.shape[0]
    pad = (-m) % BLOCK_ROWS
    x = F.pad(x, (0, 0, 0, pad)) if pad else x
    out = [fn(x[a : a + BLOCK_ROWS]) for a in range(0, m + pad, BLOCK_ROWS)]
    return torch.cat(out)[:m]


def _blocked_forward_impl(module, input, weight, *args, **kwargs):  # noqa: A002 (megatron's name)
    """megatron's linear ``_forward_impl`` on fixed row blocks of ``input`` [..., K]."""
    impl = type(module)._forward_impl
    flat = input.reshape(-1, input.shape[-1])
    out = row_blocks(flat, lambda blk: impl(module, blk, weight, *args, **kwargs))
    return out.view(*input.shape[:-1], out.shape[-1])


class RowwiseAttention(DotProductAttention):
    """Core attention computed per query row against exactly the keys it attends to.

    query [sq, b, np, hn], key / value [sk, b, ng, hn]; causal: query i sees keys
    0 … sk − sq + i (a prefill: sq = sk; a decode step: sq = 1 against the cache). Per query
    position, the (row, head) pairs go through fixed batches of :data:`ATTENTION_BLOCK` (padded):
    scores, softmax and the weighted sum in fp32, rounded once to the input dtype.
    Output [sq, b, np·hn].
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
        if (
            attention_mask is not None
            or packed_seq_params is not None
            or attention_bias is not None
        ):
            raise ValueError(
                "RowwiseAttention (rollout.batch_invariant): causal attention without an "
                "explicit mask only (no packing)"
            )
        sq, b, heads, hn = query.shape
        sk = key.shape[0]

        def pairs(t):  # [s, b, g, hn] -> [b·np, s, hn] fp32, padded to whole blocks
            t = t.permute(1, 2, 0, 3).repeat_interleave(heads // t.shape[2], 1)
            t = t.reshape(b * heads, t.shape[2], hn).float()
            return F.pad(t, (0, 0, 0, 0, 0, (-b * heads) % ATTENTION_BLOCK))

        q, k, v = pairs(query), pairs(key), pairs(value)
        cols = []
        for i in range(sq):
            n = sk - sq + i + 1
            out = [
                self._block(
                    q[a : a + ATTENTION_BLOCK, i : i + 1],
                    k[a : a + ATTENTION_BLOCK, :n],
                    v[a : a + ATTENTION_BLOCK, :n],
                )
                for a in range(0, q.shape[0], ATTENTION_BLOCK)
            ]
            cols.append(torch.cat(out)[: b * heads])
        return torch.stack(cols).to(query.dtype).view(sq, b, heads * hn)

    def _block(self, q, k, v):
        """[B, 1, hn], [B, n, hn] × 2 (one fixed block) → [B, hn] fp32."""
        k, v = k.contiguous(), v.contiguous()
        p = torch.softmax(torch.bmm(q.contiguous(), k.transpose(1, 2)) * self.softmax_scale, -1)
        return torch.bmm(p, v).squeeze(1)


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
                mod._forward_impl = functools.partial(_blocked_forward_impl, mod)
                linears += 1
            elif isinstance(mod, DotProductAttention):
                if mod.attn_mask_type != AttnMaskType.causal:
                    raise ValueError("rollout.batch_invariant: causal attention only")
                mod._default_class = type(mod)
                mod.__class__ = RowwiseAttention
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
            if isinstance(mod, RowwiseAttention):
                mod.__class__ = mod._default_class
        inner.batch_invariant = False
