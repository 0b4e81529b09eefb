"""Core attention of megatron's local layer spec on torch's ``scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` computes attention unfused: it materialises the
[b, heads/TP, sq, sk] scores and keeps the softmax for the backward (s² memory per head, the
bulk of a long sequence's activations). Without Transformer Engine this module takes its place:
the same inputs, outputs and masking rules, computed by torch SDPA, which picks a fused kernel
(flash / cuDNN / memory-efficient on a GPU, flash on CPU) and keeps O(s) per head.

Masking, as megatron's local attention applies it:

* an explicit ``attention_mask`` (bool, True = masked, broadcastable to [b, 1, sq, sk]; the
  block-diagonal mask of ``grpo/packing.py``'s ``mask`` mode) is applied as given;
* no mask on a causal layer: causal when sq > 1 (sq must equal sk, as megatron asserts; the
  prefill of the KV-cached engine), none when sq = 1 (a KV-cached decode step attends to every
  cached key);
* a row whose keys are all masked (never produced by the trainer, packing or the engine) gives
  zeros here, where megatron's -10000 fill gives the mean of all values.

GQA: the kv heads are shared by groups of query heads (``enable_gqa``; expanded only with an
explicit mask, where torch's memory-efficient kernel takes no grouped heads). Heads arrive split
over TP (this rank's heads), so TP needs nothing beyond megatron's column/row-parallel projections.
Dropout is refused (RL fine-tuning runs without it; ``transformer_config`` sets 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """megatron's ``DotProductAttention`` with the forward on torch SDPA.

    Inputs as megatron's: query [sq, b, np, hn], key / value [sk, b, ng, hn] (np = heads and
    ng = query groups of this TP rank), ``attention_mask`` bool or None. Output [sq, b, np·hn].
    The constructor (head split, softmax scale) is megatron's.
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if self.attention_dropout.p:
            raise ValueError(f"SDPAttention: attention dropout {self.attention_dropout.p} (use 0)")
        if (
            self.softmax_offset is not None
            or self.scale_mask_softmax.window_size is not None
            or config.apply_query_key_layer_scaling
        ):
            raise ValueError(
                "SDPAttention: softmax offsets, window attention and query-key layer scaling "
                "are megatron's unfused attention only (model.attention=unfused)"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        # ``attn_mask_type`` is ignored, as by megatron's local attention (the layer's own type
        # and the rules of the module docstring decide).
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention: packed_seq_params / attention_bias are TE-only")
        sq, b = query.shape[:2]
        sk = key.shape[0]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        groups = q.shape[1] // k.shape[1]
        causal = attention_mask is None and self.attn_mask_type == AttnMaskType.causal and sq > 1
        if causal and sq != sk:
            raise ValueError(f"SDPAttention: causal attention needs sq == sk, got {sq} and {sk}")
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask  # torch: True = attend
            if groups > 1:
                k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
                groups = 1
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=groups > 1,
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
