"""The ``vllm.LLM`` of :class:`~megatron_ngrpo.rollout.vllm.engine.VLLMEngine`, with the mixing
hook installed, and whether its weight syncs hand the workers TP shards.

Engine settings: prefix caching is off (block hashes see token ids only, so a later prompt could
reuse KV computed from mixed embeddings), async scheduling is off (the hook reads sampled ids on
the host every step), and ``VLLM_USE_V2_MODEL_RUNNER=0`` is pinned: on GPU vLLM 0.32 defaults to
Model Runner V2, which the V1 hook does not patch (V2 route: hook module docstring).
``VLLM_ENABLE_V1_MULTIPROCESSING`` follows ``VLLMConfig.in_process`` (process-wide environment;
set it before the first ``vllm.LLM`` of the process).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.conversion.hf_export import TPShard, check_tp_shards
from megatron_ngrpo.data.tokenizer import special_token_ids
from megatron_ngrpo.parallel import adopt_timeout
from megatron_ngrpo.rollout.config import VLLMConfig
from megatron_ngrpo.rollout.vllm.patches import (
    keep_trainer_process_groups,
    quiet_expected_vllm_messages,
    unique_cpu_shm_names,
)
from megatron_ngrpo.rollout.vllm.protocol import HookVocab, check_vllm_version

logger = logging.getLogger(__name__)

HOOK = "megatron_ngrpo.rollout.vllm.hook.NeighborMixExtension"


def build_llm(
    cfg: VLLMConfig,
    hf_path: str,
    tokenizer,
    max_model_len: int,
    num_real_tokens: int,
    colocated: bool,
    seed: int,
):
    """The ``vllm.LLM`` on ``hf_path`` with the mixing hook installed (``num_real_tokens``, the
    tokenizer's special ids);
    ``colocated``: one in-process worker per rank of the trainer's job (external launcher)."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if cfg.in_process else "1"
    check_vllm_version()
    # lazy: vLLM is an optional extra (heavy import)
    from vllm import LLM

    if dist.is_initialized():
        keep_trainer_process_groups()
    if colocated and not torch.cuda.is_available():
        unique_cpu_shm_names()
    name = tokenizer.name_or_path if tokenizer is not None else None
    quiet_expected_vllm_messages(name if name != hf_path else None)
    llm = LLM(**llm_arguments(cfg, hf_path, tokenizer, max_model_len, colocated, seed))
    if colocated:
        adopt_timeout()  # vLLM made its TP / PP / DP groups with torch's default timeout
    vocab = HookVocab(num_real_tokens, tuple(special_token_ids(tokenizer)))
    llm.collective_rpc("nbr_mix_install", args=tuple(vocab.install_args()))
    return llm


def llm_arguments(
    cfg: VLLMConfig, hf_path: str, tokenizer, max_model_len: int, colocated: bool, seed: int
) -> dict:
    """``vllm.LLM``'s keyword arguments (registers N-GRPO's weight-transfer engines when
    ``cfg.weight_transfer`` uses vLLM's weight-transfer API)."""
    gpu = torch.cuda.is_available()
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if gpu else "float32")
    memory = (
        {"gpu_memory_utilization": cfg.gpu_memory_utilization}
        if gpu
        else {"kv_cache_memory_bytes": cfg.kv_cache_memory_bytes}
    )
    kwargs = dict(
        model=hf_path,
        tokenizer=tokenizer.name_or_path if tokenizer is not None else None,
        skip_tokenizer_init=tokenizer is None,
        dtype=dtype,
        tensor_parallel_size=cfg.tensor_parallel,
        max_model_len=max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        enforce_eager=cfg.enforce_eager,
        seed=seed,
        enable_prefix_caching=False,
        async_scheduling=False,
        logprobs_mode="raw_logits",
        worker_extension_cls=HOOK,
        **memory,
    )
    if cfg.quantization:  # training refuses it (job_config.check_not_run): syncs unverified
        kwargs["quantization"] = cfg.quantization
    if cfg.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if colocated:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if not any(Path(hf_path).glob("*.safetensors")):
        # A policy without HF weights (train.load=random or a Megatron checkpoint): the first
        # weight sync fills the randomly initialised engine.
        kwargs["load_format"] = "dummy"
    if gpu and cfg.sleep_level:
        # CPU vLLM refuses sleep mode: sleep()/wake_up() are no-ops there
        kwargs["enable_sleep_mode"] = True
    if cfg.weight_transfer != "reload":
        # lazy: keeps rollout.vllm.llm free of vllm at import (start-up)
        from megatron_ngrpo.rollout.vllm.weight_transfer import register

        register()
        kwargs["weight_transfer_config"] = {"backend": cfg.weight_transfer}
    return kwargs


def tp_shards_for(llm, spec: ArchSpec, cfg: VLLMConfig, colocated: bool) -> TPShard | None:
    """The :class:`~megatron_ngrpo.conversion.hf_export.TPShard` weight syncs hand this rank's
    vLLM worker where the layouts allow it (shard-to-shard): colocated, a vLLM TP > 1 that
    divides the trainer's, PP = 1, KV heads divisible by the trainer's TP
    (``conversion.hf_export.check_tp_shards``). Each worker then gets its TP rank's slice of
    every linear layer (at equal TP over the same ranks, the rank's own slices; else merged
    from the ranks that hold them) and only the vocabulary matrices are gathered; the
    workers' linear loaders are switched to take shards. None: every rank loads full
    tensors gathered over TP."""
    if not colocated or cfg.tensor_parallel == 1:
        return None
    # lazy: keeps rollout.vllm.llm free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps

    # lazy: vLLM is an optional extra (heavy import)
    from vllm.distributed.parallel_state import get_tp_group

    if not ps.model_parallel_is_initialized() or check_tp_shards(
        spec,
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        cfg.tensor_parallel,
    ):
        return None
    llm.collective_rpc("nbr_load_tp_shards", args=(True,))
    logger.info(
        "vLLM weight sync: shard-to-shard, vLLM TP %d from trainer TP %d (vocabulary "
        "matrices gathered)",
        cfg.tensor_parallel,
        ps.get_tensor_model_parallel_world_size(),
    )
    return TPShard(cfg.tensor_parallel, get_tp_group().rank_in_group)
