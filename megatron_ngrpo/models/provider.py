"""Build megatron-core ``GPTModel``s for Qwen2, Llama and Qwen3 from a Hugging Face config.json.

The word embedding of every first-stage model is the vocab-parallel mixing embedding
(:mod:`megatron_ngrpo.mixing.embedding`) and the output layer of every last-stage model can hand
back its input instead of the logits (:mod:`megatron_ngrpo.models.output_head`), so one model
serves training, replay and generation.
Transformer-Engine's layer spec is used on GPU when TE imports; megatron-core's local spec
(RMSNorm via torch, attention on torch SDPA unless ``model.attention: unfused``) otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ngrpo.architecture import ArchSpec, padded_vocab_size
from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.models.config import ModelConfig, use_te


def check_layout(spec: ArchSpec, cfg: ModelConfig) -> None:
    """One-line errors for parallel layouts the architecture cannot take."""
    tp, pp = cfg.tensor_parallel, cfg.pipeline_parallel
    if spec.num_heads % tp:
        raise ConfigError(
            f"model.tensor_parallel = {tp}: does not divide num_attention_heads = {spec.num_heads}"
        )
    if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        raise ConfigError(
            f"model.tensor_parallel = {tp}: incompatible with num_key_value_heads = {spec.num_kv_heads}"
        )
    if spec.ffn_hidden_size % tp:
        raise ConfigError(
            f"model.tensor_parallel = {tp}: does not divide intermediate_size = {spec.ffn_hidden_size}"
        )
    stages = pp * (cfg.virtual_pipeline or 1)
    if spec.num_layers % stages:
        raise ConfigError(
            f"model.pipeline_parallel = {pp} (virtual {cfg.virtual_pipeline}): does not divide "
            f"num_hidden_layers = {spec.num_layers}"
        )
    if cfg.num_real_tokens is not None and not 0 < cfg.num_real_tokens <= spec.vocab_size:
        raise ConfigError(
            f"model.num_real_tokens = {cfg.num_real_tokens}: must be in [1, vocab_size={spec.vocab_size}]"
        )


def params_dtype(cfg: ModelConfig) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, cfg.dtype)


def transformer_config(spec: ArchSpec, cfg: ModelConfig, init_weights: bool = True):
    """megatron ``TransformerConfig`` equal to the HF architecture (no dropout, RL fine-tuning).
    ``init_weights=False``: parameters are left uninitialised (they are about to be loaded)."""
    # lazy: keeps models.provider free of megatron-core at import (start-up)
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
        # gloo pairs equal-shape batched p2p ops wrongly (docs/ENVIRONMENT.md §2.3).
        batch_p2p_comm=torch.cuda.is_available(),
    )


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm behind megatron's norm constructor, usable under sequence parallelism:
    megatron's local-spec ``WrappedTorchNorm`` refuses SP. Under SP each TP rank normalises its
    own sequence slice with the full weight, so the weight is marked ``sequence_parallel`` and
    megatron all-reduces its gradient over TP (as for TE's norms)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def layer_spec(spec: ArchSpec, cfg: ModelConfig, config, vp_stage: int | None):
    """TE's layer spec on GPU; otherwise megatron's local spec as a block spec for this stage
    (``config``: the ``TransformerConfig``) whose layer norms and final norm are
    :class:`SequenceParallelRMSNorm` and whose core attention is torch SDPA
    (:class:`~megatron_ngrpo.models.attention.SDPAttention`) unless ``model.attention`` is
    ``unfused``."""
    # lazy: keeps models.provider free of megatron-core at import (start-up)
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    # lazy: imports megatron-core (start-up)
    from megatron_ngrpo.models.attention import SDPAttention

    if use_te(cfg):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    local = gpt_layer_specs.get_gpt_layer_local_spec(
        qk_layernorm=spec.qk_norm, normalization="RMSNorm"
    )
    if cfg.attention == "sdpa":
        local.submodules.self_attention.submodules.core_attention = SDPAttention
    local.submodules.input_layernorm = SequenceParallelRMSNorm
    local.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=[local] * layers, layer_norm=SequenceParallelRMSNorm
    )


def build_gpt(
    spec: ArchSpec,
    cfg: ModelConfig,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    init_weights: bool = True,
    pg_collection=None,
):
    """One GPTModel chunk for the current (TP, PP[, VPP]) rank, with the mixing embedding;
    ``pg_collection``: its process groups (default megatron's)."""
    # lazy: keeps models.provider free of megatron-core at import (start-up)
    from megatron.core.models.gpt import GPTModel

    # lazy: keeps models.provider free of megatron-core at import (start-up)
    from megatron_ngrpo.mixing.embedding import install_mixing_embedding
    from megatron_ngrpo.models.output_head import install_output_head

    config = transformer_config(spec, cfg, init_weights)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec, cfg, config, vp_stage),
        vocab_size=padded_vocab_size(
            spec.vocab_size, cfg.tensor_parallel, cfg.make_vocab_size_divisible_by
        ),
        max_sequence_length=cfg.max_seq_len or spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    if pre_process:
        install_mixing_embedding(model)
    if post_process:
        install_output_head(model)
    if init_weights:
        zero_padded_vocab_rows(model, spec.vocab_size)
    return model


@torch.no_grad()
def zero_padded_vocab_rows(model, vocab_size: int) -> None:
    """Zero the embedding / output rows megatron adds beyond the HF vocabulary (its random init
    fills them). They are never sampled nor looked up, so they stay zero in training, and an HF
    export can strip them as padding."""
    # lazy: keeps models.provider free of megatron-core at import (start-up)
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
            w[max(vocab_size - first, 0) :].zero_()


def build_model(cfg: ModelConfig, init_weights: bool = True, pg_collection=None) -> list:
    """Model chunks of this rank (one per virtual pipeline stage), unwrapped (training wraps them
    with :func:`megatron_ngrpo.grpo.update.wrap_for_training`). Parallel state must be initialised
    for ``cfg``'s layout.
    ``init_weights=False`` skips megatron's random initialisation (weights loaded next);
    ``pg_collection``: the chunks' process groups (default megatron's)."""
    # lazy: keeps models.provider free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps

    spec = ArchSpec.from_hf(cfg.hf_path)
    check_layout(spec, cfg)
    vpp = cfg.virtual_pipeline
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(
            build_gpt(
                spec,
                cfg,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                vp_stage=stage,
                init_weights=init_weights,
                pg_collection=pg_collection,
            )
        )
    if torch.cuda.is_available():
        chunks = [c.cuda() for c in chunks]
    if params_dtype(cfg) != torch.float32:
        # lazy: keeps models.provider free of megatron-core at import (start-up)
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(c.config, c) for c in chunks]
    return chunks
