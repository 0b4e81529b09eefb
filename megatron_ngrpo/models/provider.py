"""Build megatron-core ``GPTModel``s for Qwen2, Llama and Qwen3 from a Hugging Face config.json.

The word embedding of every first-stage model is the vocab-parallel mixing embedding
(:mod:`megatron_ngrpo.mixing.embedding`), so one model serves training, replay and generation.
Transformer-Engine's layer spec is used on GPU when TE imports; megatron-core's local spec
(RMSNorm via torch) otherwise.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_ngrpo.configuration import ConfigError
from megatron_ngrpo.models.config import ModelConfig

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
    def from_hf(cls, path: str | Path) -> "ArchSpec":
        cfg_path = Path(path) / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{cfg_path}: cannot read HF config: {e}") from None
        return cls.from_dict(cfg, source=str(cfg_path))

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> "ArchSpec":
        arch = cfg.get("model_type")
        if arch not in SUPPORTED:
            raise ConfigError(f"{source}: model_type {arch!r} is not supported (expected one of {SUPPORTED})")
        heads = cfg["num_attention_heads"]
        # transformers 5 writes rope_scaling into rope_parameters (with rope_type "default" if none).
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        factor = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "llama3":
                raise ConfigError(f"{source}: rope_scaling type {kind!r} is not supported (only llama3)")
            # megatron's RotaryEmbedding takes only the factor; the rest are its fixed defaults.
            for key, fixed in (("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                               ("original_max_position_embeddings", 8192)):
                if key in scaling and float(scaling[key]) != fixed:
                    raise ConfigError(f"{source}: rope_scaling.{key} = {scaling[key]} is not supported "
                                      f"(megatron's llama3 rope scaling fixes it to {fixed})")
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


def check_layout(spec: ArchSpec, cfg: ModelConfig) -> None:
    """One-line errors for parallel layouts the architecture cannot take."""
    tp, pp = cfg.tensor_parallel, cfg.pipeline_parallel
    if spec.num_heads % tp:
        raise ConfigError(f"model.tensor_parallel = {tp}: does not divide num_attention_heads = {spec.num_heads}")
    if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        raise ConfigError(f"model.tensor_parallel = {tp}: incompatible with num_key_value_heads = {spec.num_kv_heads}")
    if spec.ffn_hidden_size % tp:
        raise ConfigError(f"model.tensor_parallel = {tp}: does not divide intermediate_size = {spec.ffn_hidden_size}")
    stages = pp * (cfg.virtual_pipeline or 1)
    if spec.num_layers % stages:
        raise ConfigError(
            f"model.pipeline_parallel = {pp} (virtual {cfg.virtual_pipeline}): does not divide "
            f"num_hidden_layers = {spec.num_layers}"
        )
    if cfg.num_real_tokens is not None and not 0 < cfg.num_real_tokens <= spec.vocab_size:
        raise ConfigError(f"model.num_real_tokens = {cfg.num_real_tokens}: must be in [1, vocab_size={spec.vocab_size}]")


def params_dtype(cfg: ModelConfig) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, cfg.dtype)


def use_te(cfg: ModelConfig) -> bool:
    if cfg.layer_spec == "local":
        return False
    try:
        import transformer_engine  # noqa: F401
        available = torch.cuda.is_available()
    except Exception:  # TE absent or its empty meta package
        available = False
    if cfg.layer_spec == "te" and not available:
        raise ConfigError("model.layer_spec = 'te': transformer-engine is not importable on a GPU here")
    return available


def transformer_config(spec: ArchSpec, cfg: ModelConfig, init_weights: bool = True):
    """megatron ``TransformerConfig`` equal to the HF architecture (no dropout, RL fine-tuning).
    ``init_weights=False``: parameters are left uninitialised (they are about to be loaded)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = params_dtype(cfg)
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=spec.init_std,
        tensor_model_parallel_size=cfg.tensor_parallel,
        pipeline_model_parallel_size=cfg.pipeline_parallel,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline,
        sequence_parallel=cfg.sequence_parallel and cfg.tensor_parallel > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=init_weights,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        recompute_granularity="full" if cfg.recompute else None,
        recompute_method="uniform" if cfg.recompute else None,
        recompute_num_layers=1 if cfg.recompute else None,
        # gloo pairs equal-shape batched p2p ops wrongly (ENVIRONMENT.md §2.3).
        batch_p2p_comm=torch.cuda.is_available(),
    )


def layer_spec(spec: ArchSpec, cfg: ModelConfig):
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te(cfg):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")


def build_gpt(spec: ArchSpec, cfg: ModelConfig, pre_process: bool, post_process: bool,
              vp_stage: int | None = None, init_weights: bool = True):
    """One GPTModel chunk for the current (TP, PP[, VPP]) rank, with the mixing embedding."""
    from megatron.core.models.gpt import GPTModel

    from megatron_ngrpo.mixing.embedding import install_mixing_embedding

    model = GPTModel(
        config=transformer_config(spec, cfg, init_weights),
        transformer_layer_spec=layer_spec(spec, cfg),
        vocab_size=padded_vocab_size(spec.vocab_size, cfg.tensor_parallel, cfg.make_vocab_size_divisible_by),
        max_sequence_length=cfg.max_seq_len or spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )
    if pre_process:
        install_mixing_embedding(model)
    if init_weights:
        zero_padded_vocab_rows(model, spec.vocab_size)
    return model


@torch.no_grad()
def zero_padded_vocab_rows(model, vocab_size: int) -> None:
    """Zero the embedding / output rows megatron adds beyond the HF vocabulary (its random init
    fills them). They are never sampled nor looked up, so they stay zero in training, and an HF
    export can strip them as padding."""
    from megatron.core import parallel_state as ps

    weights = []
    if model.pre_process:
        weights.append(model.embedding.word_embeddings.weight)
    if model.post_process and not model.share_embeddings_and_output_weights:
        weights.append(model.output_layer.weight)
    start = ps.get_tensor_model_parallel_rank()
    for w in weights:
        first = start * w.shape[0]
        if first + w.shape[0] > vocab_size:
            w[max(vocab_size - first, 0):].zero_()


def build_model(cfg: ModelConfig, wrap_ddp: bool = False, ddp_config=None,
                init_weights: bool = True) -> list:
    """Model chunks of this rank (one per virtual pipeline stage), optionally wrapped in megatron
    ``DistributedDataParallel``. Parallel state must be initialised for ``cfg``'s layout.
    ``init_weights=False`` skips megatron's random initialisation (weights loaded next)."""
    from megatron.core import parallel_state as ps

    spec = ArchSpec.from_hf(cfg.hf_path)
    check_layout(spec, cfg)
    vpp = cfg.virtual_pipeline
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(build_gpt(
            spec, cfg,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            vp_stage=stage, init_weights=init_weights,
        ))
    if torch.cuda.is_available():
        chunks = [c.cuda() for c in chunks]
    if params_dtype(cfg) != torch.float32:
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(c.config, c) for c in chunks]
    if wrap_ddp:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = ddp_config or DistributedDataParallelConfig()
        chunks = [
            DistributedDataParallel(config=unwrap(c).config, ddp_config=ddp_config, module=c,
                                    disable_bucketing=i > 0)
            for i, c in enumerate(chunks)
        ]
    return chunks


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
