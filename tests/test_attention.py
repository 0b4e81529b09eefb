"""The local spec's core attention on torch SDPA (megatron_ngrpo/models/attention.py) against
megatron's unfused ``DotProductAttention`` in fp32, forward and gradients: causal, GQA, the masks
the project uses (a bool padding + causal mask, grpo/packing.py's block-diagonal mask) and a
KV-cached decode step; ``model.attention`` selects and validates the path. TP 2 and whole models
(logits, gradients, the engine's KV-cached decode) run in tests/dist/packing_worker.py."""

from __future__ import annotations

import pytest
import torch

from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.config_loader import ConfigError, load
from megatron_ngrpo.grpo.packing import pack
from megatron_ngrpo.models.config import ModelConfig
from tests.harness.tiny import tiny_hf_config, write_tiny_hf


@pytest.fixture(scope="module")
def modules():
    """(SDPA, unfused) core attention of one layer: 4 query heads in 2 groups, head dim 32."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ngrpo.models.attention import SDPAttention
    from megatron_ngrpo.models.provider import transformer_config
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel

    init_distributed()
    initialize_model_parallel(1, 1)
    spec = ArchSpec.from_dict(tiny_hf_config(num_heads=4, num_kv_heads=2))
    config = transformer_config(spec, ModelConfig(dtype="float32"))
    return tuple(
        cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        for cls in (SDPAttention, DotProductAttention)
    )


def _qkv(sq: int, sk: int, b: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, 4, 32, generator=g)
    k, v = (torch.randn(sk, b, 2, 32, generator=g) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def _run(module, qkv, mask):
    qkv = [t.detach().clone().requires_grad_() for t in qkv]
    out = module(*qkv, mask)
    g = torch.Generator().manual_seed(1)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    return out.detach(), [t.grad for t in qkv]


def _padding_causal_mask(lengths: list[int], s: int) -> torch.Tensor:
    """[b, 1, s, s], True = masked: later positions and each row's right padding."""
    cols = torch.arange(s)
    pad = cols.unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)  # [b, s] padded keys
    future = cols.unsqueeze(1) < cols.unsqueeze(0)  # [s, s] key after query
    return (future.unsqueeze(0) | pad.unsqueeze(1)).unsqueeze(1)


def _packing_mask(s: int) -> torch.Tensor:
    kwargs, _, _ = pack(
        torch.ones(3, s, dtype=torch.long), torch.tensor([s - 2, 3, 4]), None, 4, "mask"
    )
    return kwargs["attention_mask"]


@pytest.mark.parametrize("case", ["causal", "padding_causal_mask", "packing_mask", "decode"])
def test_sdpa_attention_equals_megatron_unfused(modules, case):
    sdpa, unfused = modules
    if case == "causal":
        qkv, mask = _qkv(9, 9), None
    elif case == "padding_causal_mask":
        qkv, mask = _qkv(9, 9), _padding_causal_mask([9, 5], 9)
    elif case == "packing_mask":
        mask = _packing_mask(9)
        qkv = _qkv(mask.shape[-1], mask.shape[-1], b=1)
    else:  # one KV-cached decode step: one query against 6 cached keys, no mask
        qkv, mask = _qkv(1, 6), None
    out, grads = _run(sdpa, qkv, mask)
    ref, ref_grads = _run(unfused, qkv, mask)
    assert out.shape == ref.shape == (qkv[0].shape[0], qkv[0].shape[1], 128)
    assert torch.allclose(out, ref, atol=1e-5, rtol=0), float((out - ref).abs().max())
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=1e-5, rtol=0), float((g - r).abs().max())


def test_sdpa_attention_is_the_default_and_unfused_selectable(tmp_path):
    """The local spec's layers get SDPA attention unless ``model.attention: unfused``; a bad value
    is one line naming the field."""
    from megatron_ngrpo.models.attention import SDPAttention
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel

    init_distributed()
    initialize_model_parallel(1, 1)
    hf = write_tiny_hf(tmp_path / "hf", weights=False, num_layers=1)
    kinds = {}
    for attention in ("sdpa", "unfused"):
        cfg = load(ModelConfig, overrides=[f"hf_path={hf}", f"attention={attention}"])
        (chunk,) = build_model(cfg)
        kinds[attention] = type(chunk.decoder.layers[0].self_attention.core_attention).__name__
    assert kinds == {"sdpa": SDPAttention.__name__, "unfused": "DotProductAttention"}
    with pytest.raises(ConfigError, match=r"^config field 'attention' = 'flash': expected one of"):
        load(ModelConfig, overrides=[f"hf_path={hf}", "attention=flash"])
