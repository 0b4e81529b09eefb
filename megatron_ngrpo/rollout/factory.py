"""Build the configured rollout engine for a policy (trainer and evaluation use this)."""

from __future__ import annotations

from dataclasses import replace

from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.data.tokenizer import special_token_ids
from megatron_ngrpo.models.batch_invariant import enable_batch_invariant
from megatron_ngrpo.models.config import real_token_count
from megatron_ngrpo.parallel import duplicate_model_parallel_groups
from megatron_ngrpo.rollout.config import EngineName
from megatron_ngrpo.rollout.megatron_engine import MegatronEngine
from megatron_ngrpo.rollout.remote.client import RemoteEngine
from megatron_ngrpo.rollout.types import RolloutEngine
from megatron_ngrpo.rollout.vllm.engine import VLLMEngine


def tokenizer_kwargs(tokenizer) -> dict:
    """What the engines need from a HF tokenizer: EOS ids, decoding, special ids (never
    neighbours)."""
    if tokenizer is None:
        return {}
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return {
        "eos_token_ids": eos,
        "decode": lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        "special_ids": special_token_ids(tokenizer),
    }


def build_engine(
    cfg, model_chunks, tokenizer=None, seed: int = 0, beside_trainer: bool = False
) -> RolloutEngine:
    """The engine of ``cfg.rollout`` (any config with ``rollout`` and ``model`` sections: the
    trainer's or the evaluation's) for the policy ``model_chunks``.

    "megatron" generates with ``model_chunks`` themselves, or, ``beside_trainer`` (one-step-off
    rollouts on a second thread, training/async_rollout.py), with a separate copy of their
    weights whose layers and collectives use duplicates of megatron's model-parallel groups
    (a collective); "vllm" starts a vLLM engine on
    ``cfg.model.hf_path`` (one per rank, colocated, in a multi-rank job: a collective); "remote"
    connects to the rollout servers of ``cfg.rollout.remote`` (a collective; one-line errors for
    unusable servers). Both load ``model_chunks``' weights into vLLM (so a randomly initialised
    or resumed policy is what vLLM samples from)."""
    kwargs = tokenizer_kwargs(tokenizer)
    # Every engine samples the ids the trainer's tokenizer knows (model.num_real_tokens resolved).
    model_cfg = replace(
        cfg.model,
        num_real_tokens=real_token_count(
            cfg.model.num_real_tokens, ArchSpec.from_hf(cfg.model.hf_path).vocab_size, tokenizer
        ),
    )
    if beside_trainer and cfg.rollout.engine == EngineName.vllm:
        raise ValueError(
            "colocated vLLM adopts the trainer's devices and process groups: it cannot "
            "generate beside the trainer (rollout.engine = megatron or remote)"
        )
    if cfg.rollout.engine == EngineName.megatron:
        if cfg.rollout.batch_invariant:  # the trainer's replay too, not only the engine's copy
            enable_batch_invariant(model_chunks)
        if beside_trainer:
            return MegatronEngine.from_config(
                replace(cfg.rollout, separate_copy=True),
                model_chunks,
                model_cfg,
                groups=duplicate_model_parallel_groups(),
                **kwargs,
            )
        return MegatronEngine.from_config(cfg.rollout, model_chunks, model_cfg, **kwargs)
    if cfg.rollout.engine == EngineName.remote:
        # Beside the trainer as it is: the servers hold their own weights, the client's
        # collectives have a group of their own.

        engine = RemoteEngine.from_config(cfg.rollout, model_cfg, tokenizer)
    else:
        # Colocated in a multi-rank job every rank builds its engine here, at the same point
        # (vLLM creates its groups collectively over the trainer's world group).
        tok_path = getattr(tokenizer, "name_or_path", None) or None
        engine = VLLMEngine.from_config(cfg.rollout, model_cfg, tokenizer=tok_path, seed=seed)
    engine.sync_weights(model_chunks)
    return engine
