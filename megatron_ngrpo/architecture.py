"""Architecture facts of a Hugging Face checkpoint and model-wrapper helpers.

The lightweight layer below every package that needs to know a model's shape without building it
(mixing, models, conversion, launch): no megatron-core import here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_ngrpo.config_loader import ConfigError

SUPPORTED = ("qwen2", "llama", "qwen3")


@dataclass(frozen=True)
class ArchSpec:
    """The architecture facts of one HF checkpoint that the Megatron model and the name
    mapping need."""

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None
    qkv_bias: bool
    qk_norm: bool
    tied_embeddings: bool
    max_position_embeddings: int
    init_std: float

    @classmethod
    def from_hf(cls, path: str | Path) -> ArchSpec:
        cfg_path = Path(path) / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{cfg_path}: cannot read HF config: {e}") from None
        return cls.from_dict(cfg, source=str(cfg_path))

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> ArchSpec:
        arch = cfg.get("model_type")
        if arch not in SUPPORTED:
            raise ConfigError(
                f"{source}: model_type {arch!r} is not supported (expected one of {SUPPORTED})"
            )
        heads = cfg["num_attention_heads"]
        # transformers 5 writes rope_scaling into rope_parameters (with rope_type "default" if none).
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        factor = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "llama3":
                raise ConfigError(
                    f"{source}: rope_scaling type {kind!r} is not supported (only llama3)"
                )
            # megatron's RotaryEmbedding takes only the factor; the rest are its fixed defaults.
            for key, fixed in (
                ("low_freq_factor", 1.0),
                ("high_freq_factor", 4.0),
                ("original_max_position_embeddings", 8192),
            ):
                if key in scaling and float(scaling[key]) != fixed:
                    raise ConfigError(
                        f"{source}: rope_scaling.{key} = {scaling[key]} is not supported "
                        f"(megatron's llama3 rope scaling fixes it to {fixed})"
                    )
            factor = float(scaling["factor"])
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5 nests it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            arch=arch,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            ffn_hidden_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling_factor=factor,
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            init_std=cfg.get("initializer_range", 0.02),
        )


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int) -> int:
    """Megatron's rule: pad to a multiple of ``divisible_by × tp`` so every TP shard is equal."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
