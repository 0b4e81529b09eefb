"""Process-wide changes to vLLM that the in-process engine (:mod:`~megatron_ngrpo.rollout.vllm.engine`)
makes before it builds a ``vllm.LLM`` in the trainer's process: unique CPU shared-memory names
for colocated engines, keeping the trainer's default process group at vLLM's shutdown, and log
filters for vLLM messages that report something expected here. The private internals patched are
listed in :data:`~megatron_ngrpo.rollout.vllm.protocol.PRIVATE_TOUCH_POINTS`.
"""

from __future__ import annotations

import gc
import logging
import uuid

import torch.distributed as dist


def unique_cpu_shm_names() -> None:
    """CPU vLLM names the shared-memory segments of its TP all-reduce after the job's init method,
    which is the constant ``env://`` under external_launcher: a killed run leaves its segments
    behind and the resumed job fails to create them (EEXIST). Prefix them with a name all ranks
    agree on (a collective)."""
    # lazy: vLLM is an optional extra (heavy import)
    from vllm.distributed.device_communicators import cpu_communicator

    ident = [f"ngrpo{uuid.uuid4().hex[:12]}"]
    dist.broadcast_object_list(ident, src=0)
    shm = cpu_communicator._CPUSHMDistributed
    base = getattr(shm.make_group_name, "ngrpo_base", shm.make_group_name)

    def make_group_name(communicator) -> str:  # vLLM's name starts with "//" (from env://)
        return ident[0] + base(communicator).lstrip("/")

    make_group_name.ngrpo_base = base
    shm.make_group_name = staticmethod(make_group_name)


# Tokenizer folders given to vLLM apart from the model's (see _tokenizer_config_probe).
_SEPARATE_TOKENIZERS: set[str] = set()


def _rotary_reload(record: logging.LogRecord) -> bool:
    """vLLM's layerwise reload logs "RotaryEmbedding: Failed to load weights" at every sync on
    every rank: the rotary cos/sin cache is computed, never part of a checkpoint, so nothing is
    missing. The same warning for any other layer still shows."""
    return (
        record.msg == "%s: Failed to load weights"
        and bool(record.args)
        and str(record.args[0]).endswith("RotaryEmbedding")
    )


def _tokenizer_config_probe(record: logging.LogRecord) -> bool:
    """vLLM reads a model config from the tokenizer folder too, only to pick a tokenizer class,
    and ignores a failure there; but it logs "Error parsing config for <folder>" as an ERROR, twice
    (one retry). A tokenizer folder apart from the model (the shared tokenizers: vocab, merges and
    tokenizer_config.json only) always fails that probe; the model's own config errors still show."""
    return bool(record.args) and any(
        str(record.args[0]) == f"Error parsing config for {d}" for d in _SEPARATE_TOKENIZERS
    )


_EXPECTED = {
    "vllm.model_executor.model_loader.reload.layerwise": _rotary_reload,
    "vllm.transformers_utils.repo_utils": _tokenizer_config_probe,
}


class _ExpectedVLLMMessage(logging.Filter):
    """Drops the records of one vLLM logger that report something expected here."""

    def __init__(self, expected):
        super().__init__()
        self.expected = expected

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.expected(record)


def quiet_expected_vllm_messages(separate_tokenizer: str | None) -> None:
    """Install the filters of :data:`_EXPECTED` on vLLM's loggers, once (in this process: the
    in-process worker's messages); ``separate_tokenizer``: a tokenizer folder that is not the
    model's."""
    if separate_tokenizer:
        _SEPARATE_TOKENIZERS.add(str(separate_tokenizer))
    for name, expected in _EXPECTED.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, _ExpectedVLLMMessage) for f in log.filters):
            log.addFilter(_ExpectedVLLMMessage(expected))


def keep_trainer_process_groups() -> None:
    """vLLM's engine shutdown (``EngineCore.shutdown`` → ``cleanup_dist_env_and_memory``) destroys
    torch's default process group, which here is the trainer's: keep it (the trainer tears its
    groups down at exit) and only collect garbage."""

    # lazy: vLLM is an optional extra (heavy import)
    import vllm.v1.engine.core as core

    core.cleanup_dist_env_and_memory = lambda shutdown_ray=False: gc.collect()
