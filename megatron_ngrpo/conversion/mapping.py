"""THE name/shape mapping between Hugging Face Qwen2 / Llama / Qwen3 tensors and megatron-core
GPTModel parameters:

* the rules: which HF tensors make which Megatron parameter (:func:`rule`), how they fuse
  (:func:`fuse` / :func:`unfuse`) and split over TP (:func:`tp_shard` / :func:`tp_merge`);
* :func:`hf_layout` / :func:`check_hf_names` — the HF tensors a config has;
* :func:`entries` — every parameter of this rank's model chunks with its global name and rule,
  shapes checked.

Checkpoint conversion and live weight sync apply it through :mod:`.hf_import` (an HF state dict →
this rank's Megatron tensors) and :mod:`.hf_export` (model chunks → HF tensors, gathered or as
vLLM's TP shards).

Megatron layouts (h hidden, d head_dim, nq query heads, ng query groups = KV heads, f ffn):
``linear_qkv`` [ng·(nq/ng + 2)·d, h] interleaved per query group ``[q_g0 (nq/ng·d), k_g0 (d),
v_g0 (d), q_g1, ...]`` and split contiguously over TP (megatron's column split; also when
TP > ng, where ranks all-gather and slice their group at run time); ``linear_fc1`` = ``[gate; up]``
with each half split over TP, so TP rank r holds ``[gate_r; up_r]``; ``linear_proj`` /
``linear_fc2`` split over the input dim (1); embedding / output layer rows padded with zero rows
to the padded vocab (``provider.padded_vocab_size``: a multiple of divisible_by × TP) and split over
rows. Both the local spec names (``input_layernorm``, ``pre_mlp_layernorm``) and the
Transformer-Engine names (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) map.
Tied embeddings: HF has no ``lm_head.weight``; a last-stage ``output_layer.weight`` (PP > 1) is
loaded from ``model.embed_tokens.weight`` and not exported.

Why hand-written rather than mbridge 0.15.1 (measured here with transformers 5.19, torch 2.13 CPU,
on models from :mod:`megatron_ngrpo.models.provider`): its ``load_weights``/``export_weights`` are
exact for Qwen2/Llama/Qwen3 at TP1/TP2/PP2/TP2×PP2 only after overriding private tables
(``_OTHER_MAPPING``/``_MLP_MAPPING`` for the local-spec norm names) and the ``vocab_size`` /
``padded_vocab_size`` / ``make_vocab_size_divisible_by`` attributes its own model provider sets;
two bugs remain: ``Qwen2Bridge._adjust_mapping_for_shared_weights`` mutates the *class* mapping, so
after one tied bridge every untied Qwen2/Qwen3 bridge in the process exports ``output_layer`` as
``model.embed_tokens.weight``; ``LLaMABridge`` ignores ``tie_word_embeddings`` (tied Llama at PP2:
``ValueError: Weights {'lm_head.weight'} not found``). It also has no "state dict → this rank's
tensors" function, reads whole files only from a directory, raises on the first missing tensor, and
always gathers to every rank. The tables and fuse/split functions below are the same facts, small
and tested against HF transformers here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from megatron_ngrpo.architecture import ArchSpec, unwrap


class ConversionError(ValueError):
    """Missing, unexpected or wrongly shaped tensors; the message lists all of them."""


class Kind(Enum):
    """How a Megatron parameter is fused from HF tensors and split over TP."""

    REPLICATED = "replicated"  # norms: same on every TP rank
    QKV = "qkv"  # [q; k; v] interleaved per query group, split dim 0
    GATE_UP = "gate_up"  # [gate; up], each half split dim 0
    ROW = "row"  # split dim 1
    VOCAB = "vocab"  # rows padded to the padded vocab, split dim 0


@dataclass(frozen=True)
class Rule:
    hf_names: tuple[str, ...]
    kind: Kind


_LAYER = {  # megatron suffix after "decoder.layers.{i}." -> (HF suffixes after "model.layers.{i}.", kind)
    "input_layernorm.weight": (("input_layernorm.weight",), Kind.REPLICATED),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), Kind.REPLICATED),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        Kind.QKV,
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        Kind.QKV,
    ),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), Kind.REPLICATED),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), Kind.REPLICATED),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), Kind.ROW),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), Kind.REPLICATED),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), Kind.REPLICATED),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), Kind.GATE_UP),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), Kind.ROW),
}
_TOP = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), Kind.VOCAB),
    "decoder.final_layernorm.weight": (("model.norm.weight",), Kind.REPLICATED),
    "output_layer.weight": (("lm_head.weight",), Kind.VOCAB),
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Present in some HF checkpoints, never needed.
_IGNORED_HF = re.compile(r"(rotary_emb\.inv_freq|\._extra_state)$")


def rule(spec: ArchSpec, global_name: str) -> Rule:
    """The HF tensors and kind of one Megatron parameter (``global_name`` has the global layer
    index). Raises :class:`ConversionError` for names outside the tables."""
    if global_name == "output_layer.weight" and spec.tied_embeddings:
        return Rule(("model.embed_tokens.weight",), Kind.VOCAB)
    if global_name in _TOP:
        names, kind = _TOP[global_name]
        return Rule(names, kind)
    m = _LAYER_RE.match(global_name)
    if m and m.group(2) in _LAYER:
        names, kind = _LAYER[m.group(2)]
        return Rule(tuple(f"model.layers.{m.group(1)}.{n}" for n in names), kind)
    raise ConversionError(f"no HF mapping for Megatron parameter {global_name!r} ({spec.arch})")


def hf_layout(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    """The HF state dict of ``spec``: name → shape, in HF's order."""
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    out = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (q, h)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        if spec.qkv_bias:
            out.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
        if spec.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        out[p + "self_attn.o_proj.weight"] = (h, q)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (f, h)
        out[p + "mlp.up_proj.weight"] = (f, h)
        out[p + "mlp.down_proj.weight"] = (h, f)
    out["model.norm.weight"] = (h,)
    if not spec.tied_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, h)
    return out


def check_hf_names(spec: ArchSpec, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    """One :class:`ConversionError` listing every missing, unexpected and wrongly shaped tensor of
    an HF checkpoint (``shapes``: name → shape) against ``spec``."""
    want = hf_layout(spec)
    missing = [n for n in want if n not in shapes]
    extra = [
        n
        for n in shapes
        if n not in want
        and not _IGNORED_HF.search(n)
        and not (spec.tied_embeddings and n == "lm_head.weight")
    ]
    wrong = [
        f"{n} {tuple(shapes[n])} (expected {want[n]})"
        for n in want
        if n in shapes and tuple(shapes[n]) != want[n]
    ]
    raise_if(source, missing=missing, unexpected=extra, wrong_shape=wrong)


def raise_if(source: str, group=None, **problems: list[str]) -> None:
    """Raise one :class:`ConversionError` listing ``problems`` (kind → names). With ``group``, the
    problems of all its ranks are pooled first, so every rank raises the same error (a rank
    raising alone would leave the others hanging in the next collective)."""
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        pooled = [None] * dist.get_world_size(group)
        dist.all_gather_object(pooled, problems, group=group)
        problems = {k: list(dict.fromkeys(n for p in pooled for n in p[k])) for k in problems}
    parts = [f"{k.replace('_', ' ')} ({len(v)}): {', '.join(v)}" for k, v in problems.items() if v]
    if parts:
        raise ConversionError(f"{source}: " + "; ".join(parts))


# ---------------------------------------------------------------- fuse / split (pure tensor ops)


def fuse(spec: ArchSpec, kind: Kind, hf: list[torch.Tensor], padded_vocab: int) -> torch.Tensor:
    """HF tensors → the full (TP-unsplit) Megatron tensor."""
    if kind is Kind.QKV:
        q, k, v = hf
        ng, d = spec.num_kv_heads, spec.head_dim
        rest = q.shape[1:]
        return torch.cat(
            [q.reshape(ng, -1, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1
        ).reshape(-1, *rest)
    if kind is Kind.GATE_UP:
        return torch.cat(hf, dim=0)
    (t,) = hf
    if kind is Kind.VOCAB and t.shape[0] < padded_vocab:
        t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
    return t


def unfuse(
    spec: ArchSpec, kind: Kind, full: torch.Tensor, num_vocab: int, tp: int = 1
) -> list[torch.Tensor]:
    """The full Megatron tensor → HF tensors (inverse of :func:`fuse`; vocab rows cut to
    ``num_vocab``). With ``tp`` > 1, ``full`` is one TP rank's shard of a column- or row-split
    kind and the result its slices of the HF tensors (a rank holds whole query groups)."""
    if kind is Kind.QKV:
        ng, d = spec.num_kv_heads // tp, spec.head_dim
        rest = full.shape[1:]
        grouped = full.reshape(ng, -1, *rest)
        q, k, v = grouped.split([grouped.shape[1] - 2 * d, d, d], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    if kind is Kind.GATE_UP:
        return list(full.chunk(2, dim=0))
    if kind is Kind.VOCAB:
        return [full[:num_vocab]]
    return [full]


def split_dim(kind: Kind) -> int | None:
    return None if kind is Kind.REPLICATED else 1 if kind is Kind.ROW else 0


def tp_shard(kind: Kind, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s slice of a full Megatron tensor (contiguous)."""
    if kind is Kind.REPLICATED or tp == 1:
        return full
    if kind is Kind.GATE_UP:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return full.chunk(tp, dim=split_dim(kind))[rank].contiguous()


def tp_merge(kind: Kind, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`tp_shard` over all TP ranks' slices."""
    if kind is Kind.REPLICATED or len(shards) == 1:
        return shards[0]
    if kind is Kind.GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=split_dim(kind))


def full_shape(kind: Kind, local_shape: torch.Size, tp: int) -> tuple[int, ...]:
    dim = split_dim(kind)
    shape = list(local_shape)
    if dim is not None:
        shape[dim] *= tp
    return tuple(shape)


# ---------------------------------------------------------------- model chunks


@dataclass(frozen=True)
class Entry:
    """One parameter of this rank: chunk index, local and global names, rule."""

    chunk: int
    local_name: str
    global_name: str
    rule: Rule
    param: torch.Tensor


def global_names(chunk) -> dict[str, str]:
    """Local parameter name → global name (decoder layer index offset by the chunk's PP/VPP
    position, from megatron's 1-based ``layer_number``)."""

    model = unwrap(chunk)
    offset = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    out = {}
    for name, _ in model.named_parameters():
        m = _LAYER_RE.match(name)
        out[name] = f"decoder.layers.{offset[int(m.group(1))]}.{m.group(2)}" if m else name
    return out


def entries(chunks: list, spec: ArchSpec) -> list[Entry]:
    """Every parameter of ``chunks`` with its rule, shapes checked against ``spec`` (one
    :class:`ConversionError` listing every mismatch)."""
    # lazy: keeps conversion.mapping free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    hf = hf_layout(spec)
    out, wrong, unknown = [], [], []
    for c, chunk in enumerate(chunks):
        params = dict(unwrap(chunk).named_parameters())
        padded = _padded_vocab(params, tp)
        for local, glob in global_names(chunk).items():
            try:
                r = rule(spec, glob)
            except ConversionError:
                unknown.append(glob)
                continue
            p = params[local]
            want = _megatron_shape(hf, r, spec.hidden_size, padded)
            got = full_shape(r.kind, p.shape, tp)
            if got != want:
                wrong.append(f"{glob} {got} (expected {want})")
            out.append(Entry(c, local, glob, r, p))
    raise_if(
        f"Megatron model vs {spec.arch} config",
        ps.get_model_parallel_group(),
        unmapped=unknown,
        wrong_shape=wrong,
    )
    return out


def _padded_vocab(params: dict, tp: int) -> int:
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in params:
            return params[name].shape[0] * tp
    return 0


def _megatron_shape(hf: dict, r: Rule, hidden: int, padded_vocab: int) -> tuple[int, ...]:
    """Full Megatron shape of a parameter from the HF shapes of its tensors (``hf_layout``)."""
    if r.kind is Kind.VOCAB:
        return (padded_vocab, hidden)
    shapes = [hf.get(n) for n in r.hf_names]
    if None in shapes:  # a parameter the config does not have (e.g. a QKV bias)
        return ()
    if r.kind is Kind.QKV:
        return (sum(s[0] for s in shapes), *shapes[0][1:])
    if r.kind is Kind.GATE_UP:
        return (2 * shapes[0][0], *shapes[0][1:])
    return shapes[0]
