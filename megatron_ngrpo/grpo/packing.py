"""Sequence packing of a micro-batch: its rows' real tokens concatenated into one row without
padding, run through the model, and the logits put back in the rows' [b, s] places, so the loss
and the log-prob code see the unpacked shapes.

Two ways to keep the sequences apart inside the packed row:

- ``mask`` (megatron's local layer spec, CPU and GPU): a block-diagonal causal attention mask
  [1, 1, T, T] (megatron's convention: True = masked), which the unfused local attention applies
  as given. RoPE needs no reset: a rotary score depends only on the query-key offset, which
  packing leaves unchanged within a sequence (the absolute angles differ, so log-probs agree to
  float rounding, not bit for bit). The mask is dense: T² bytes.
- ``thd``: megatron's ``PackedSeqParams`` with cumulative sequence lengths; megatron applies
  RoPE per sequence from position 0 (the angles of the unpacked row, bit for bit on CPU:
  tests/test_batch_invariant.py). Taken by TE's fused attention (TE spec, GPU only; written,
  not run here) and by the batch-invariant mode's tiled attention (``rollout.batch_invariant``,
  local spec, run here on CPU: each sequence tiled from its own start, models/batch_invariant.py).

The packed row is padded to a multiple of ``multiple`` (TP under sequence parallelism) with a
padding block of its own. Pipeline parallelism is not supported (the stages would exchange
packed activations of varying length; job_config refuses it).
"""

from __future__ import annotations

import torch

from megatron_ngrpo.mixing.embedding import MixBatch


def packing_mode(pack_sequences: bool, te: bool, batch_invariant: bool) -> str:
    """The mode the trainer packs its micro-batches in: "" with ``train.pack_sequences`` off,
    ``thd`` for TE's fused attention (``te``) and the batch-invariant tiled attention (each
    sequence tiled from its own start), else ``mask`` (the local spec's attention)."""
    if not pack_sequences:
        return ""
    return "thd" if te or batch_invariant else "mask"


def pack(
    tokens: torch.Tensor, lengths: torch.Tensor, mix: MixBatch | None, multiple: int, mode: str
) -> tuple[dict, MixBatch | None, torch.Tensor]:
    """Pack the real tokens of ``tokens`` [b, s] (row r's first ``lengths[r]``).

    Returns the model's keyword arguments (``input_ids`` [1, T], ``position_ids`` [1, T] reset
    per sequence, and ``attention_mask`` or ``packed_seq_params``), ``mix`` packed alike, and
    ``index`` [n] (n = Σ lengths ≤ T): the flat [b·s] position of each packed token.
    """
    b, s = tokens.shape
    lengths = lengths.to(torch.long).clamp(min=0, max=s)
    cols = torch.arange(s, device=tokens.device)
    valid = cols.unsqueeze(0) < lengths.to(tokens.device).unsqueeze(1)
    index = torch.nonzero(valid.flatten()).flatten()
    n = index.numel()
    total = max(-(-n // multiple) * multiple, multiple)
    pad = total - n
    flat_tokens = tokens.flatten()[index]
    input_ids = torch.cat([flat_tokens, flat_tokens.new_zeros(pad)]).unsqueeze(0)
    seg_lengths = [int(x) for x in lengths if int(x) > 0] + ([pad] if pad else [])
    positions = torch.cat([torch.arange(x, device=tokens.device) for x in seg_lengths]).unsqueeze(0)
    kwargs = {"input_ids": input_ids, "position_ids": positions}
    if mode == "mask":
        seg = torch.repeat_interleave(
            torch.arange(len(seg_lengths), device=tokens.device),
            torch.tensor(seg_lengths, device=tokens.device),
        )
        allowed = (seg.unsqueeze(0) == seg.unsqueeze(1)) & torch.ones(
            total, total, dtype=torch.bool, device=tokens.device
        ).tril()
        kwargs["attention_mask"] = (~allowed).view(1, 1, total, total)
    elif mode == "thd":
        # lazy: keeps grpo.packing free of megatron-core at import (start-up); THD path only
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.zeros(len(seg_lengths) + 1, dtype=torch.int32, device=tokens.device)
        cu[1:] = torch.cumsum(torch.tensor(seg_lengths, device=tokens.device), 0)
        longest = max(seg_lengths)
        kwargs["attention_mask"] = None
        kwargs["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
    else:
        raise ValueError(f"packing mode {mode!r}")
    packed_mix = None if mix is None else mix.packed(lengths, total)
    return kwargs, packed_mix, index


def unpack(packed: torch.Tensor, index: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """Packed per-token outputs [1, T, ...] back to [b, s, ...] (zeros at padding; differentiable)."""
    rest = packed.shape[2:]
    out = packed.new_zeros((b * s,) + rest)
    out = out.index_copy(0, index.to(packed.device), packed[0, : index.numel()])
    return out.view(b, s, *rest)
