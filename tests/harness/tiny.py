"""Tiny Hugging Face models written locally (nothing downloaded): configs and random weights
(and a tiny BERT sentence encoder for DRA's local embedder); standalone megatron modules in DDP
as the trainer wraps models.

Shapes keep vLLM's CPU attention happy (head_dim 32) and TP up to 4 / PP up to 2 possible.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

_ARCH = {
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "llama": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=False, mlp_bias=False
    ),
    "qwen3": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=False, head_dim=32
    ),
}


def write_tiny_bert(path: str | Path, max_positions: int = 64) -> Path:
    """A tiny random BERT encoder (2 layers, hidden 32) and its WordPiece tokenizer over a dozen
    words, saved to ``path`` for :class:`~megatron_ngrpo.grpo.dra.LocalModelEmbedder`."""
    # lazy: torch and transformers take seconds to import; only this helper needs them
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path = Path(path)
    words = "the answer is four five x y z so we get a b c".split()
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n"
    )
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=5 + len(words),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max_positions,
    )
    BertModel(cfg).save_pretrained(path)
    return path


def tiny_hf_config(
    arch: str = "qwen2",
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    tied: bool = False,
    max_pos: int = 1024,
    **extra,
) -> dict:
    """A config.json dict of a tiny model of ``arch`` (qwen2, llama or qwen3)."""
    cfg = dict(
        _ARCH[arch],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0 if arch != "llama" else 500000.0,
        tie_word_embeddings=tied,
        hidden_act="silu",
        initializer_range=0.02,
        torch_dtype="float32",
        bos_token_id=0,
        eos_token_id=1,
        use_cache=True,
    )
    if arch == "llama":
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    cfg.update(extra)
    return cfg


def write_tiny_hf(
    path: str | Path, arch: str = "qwen2", weights: bool = True, seed: int = 0, **kwargs
) -> Path:
    """Write config.json (and random safetensors weights from transformers) to ``path``."""

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_hf_config(arch, **kwargs)
    if not weights:
        (path / "config.json").write_text(json.dumps(cfg, indent=1))
        return path
    # lazy: keeps tests.harness.tiny free of torch at import (start-up)
    import torch

    # lazy: transformers takes seconds to import; only this path needs it
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    hf_cfg.architectures = cfg["architectures"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


def random_prompts(count: int, vocab_size: int, low: int = 0, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of 16 to 48 ids drawn uniformly from ``[low, vocab_size)`` (the benchmarks'
    prompts for a tiny random model), reproducible from ``seed``."""
    # lazy: keeps tests.harness.tiny free of torch at import (start-up)
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            low, vocab_size, (int(torch.randint(16, 49, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(count)
    ]


def in_megatron_ddp(module, tp: int):
    """A standalone megatron module (e.g. one embedding) in megatron's DDP as the trainer wraps
    its models: fp32 ``main_grad`` buffers, no overlapped reduction. Its hidden size is
    ``module.embedding_dim``; the config's other fields only have to be valid at ``tp``."""
    # lazy: keeps tests.harness.tiny free of megatron-core at import (start-up)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=module.embedding_dim,
        num_attention_heads=tp,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
    )
    return DistributedDataParallel(
        cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module
    )


def tiny_checkpoint(state: dict, prefix: str, vocab_size: int, model_cfg: Callable) -> str:
    """A torchrun worker's tiny model (8 heads, 4 KV heads, HF folder without weights) as a TP=1
    megatron distributed checkpoint, written once per launch (``state["hf"]``, ``state["ckpt"]``)
    in a folder every rank sees and rank 0 removes at exit; its path. ``model_cfg()``: the TP=1
    ModelConfig, read after ``state["hf"]`` is set (collective)."""
    if "ckpt" in state:
        return state["ckpt"]
    # lazy: keeps tests.harness.tiny free of torch.distributed and megatron-core at import
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.multiproc import shared_tmpdir

    root = shared_tmpdir(prefix)
    if dist.get_rank() == 0:
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    state["hf"] = str(
        write_tiny_hf(
            os.path.join(root, "hf"),
            weights=False,
            vocab_size=vocab_size,
            num_heads=8,
            num_kv_heads=4,
            initializer_range=0.05,
        )
    )
    initialize_model_parallel(1, 1, seed=1234)
    chunks = build_model(model_cfg())
    ckpt = os.path.join(root, "ckpt")
    if dist.get_rank() == 0:
        os.makedirs(ckpt)
    dist.barrier()
    dist_checkpointing.save({"model": chunks[0].sharded_state_dict()}, ckpt)
    state["ckpt"] = ckpt
    return ckpt
