"""Configuration of rollout generation and of the engines."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from megatron_ngrpo.config_loader import fail
from megatron_ngrpo.rollout.types import SamplingParams

DEFAULT_MAX_MODEL_LEN = 4096


class EngineName(StrEnum):
    """The rollout engines (``rollout.engine``; rollout/factory.py builds each)."""

    megatron = "megatron"  # built-in, default, runs anywhere
    vllm = "vllm"  # colocated: one in-process vLLM worker per rank
    remote = "remote"  # rollout servers on other nodes (rollout.remote)


@dataclass
class VLLMConfig:
    """Construction options of the vLLM engine (``vllm.LLM`` arguments)."""

    tensor_parallel: int = 1
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    # Longest prompt + response (tokens); 0 = the model's max_position_embeddings, at most
    # DEFAULT_MAX_MODEL_LEN (vllm_max_model_len).
    max_model_len: int = 0
    gpu_memory_utilization: float = 0.6
    # On CPU the memory fraction is applied to node RAM: give the KV cache in bytes instead.
    kv_cache_memory_bytes: int = 512 * 2**20
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = True
    # In-process engine (no worker subprocess); required for in-process weight sync on CPU and
    # for colocated engines in multi-rank jobs.
    in_process: bool = True
    # vLLM sleep mode between rollouts (GPU only; 0 = off, 1 = offload weights, 2 = discard them:
    # the next weight sync reloads them). CPU vLLM has no sleep mode: the calls are no-ops there.
    sleep_level: int = 1
    # Weight sync route (rollout/vllm/weight_transfer.py): vLLM's weight-transfer API with the gloo
    # engine registered here (CPU, any layout) or its "ipc" engine (GPU, a worker process of its
    # own: in_process=false); "reload" streams the tensors through collective_rpc("reload_weights")
    # (in-process worker) or a safetensors directory (worker processes): the fallback. "nccl" is
    # refused here (colocated: the worker shares the trainer's GPU); it is rollout.remote's route.
    weight_transfer: str = "reload"
    # Largest bucket of tensors sent at once (MiB): the sender's extra memory beyond one tensor.
    sync_bucket_mb: float = 512.0
    # gloo route: the worker checks each received tensor's SHA-256 against the trainer's.
    verify_weights: bool = False
    # Rollout weights quantized by vLLM: null (the trainer's dtype) or "fp8" (vLLM's online
    # per-tensor FP8 of the linear layers; GPU only, Hopper+). Training refuses it until a
    # weight-sync round trip verifies the re-quantized weights (job_config.check_not_run).
    quantization: str | None = None

    def validate(self) -> None:
        if self.tensor_parallel < 1:
            fail("tensor_parallel", self.tensor_parallel, "must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            fail("gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        if self.max_model_len < 0:
            fail(
                "max_model_len",
                self.max_model_len,
                f"must be >= 0 (0 = the model's limit, at most {DEFAULT_MAX_MODEL_LEN})",
            )
        if self.sleep_level not in (0, 1, 2):
            fail("sleep_level", self.sleep_level, "expected 0, 1 or 2")
        if self.weight_transfer == "nccl_m2n":
            fail(
                "weight_transfer",
                self.weight_transfer,
                "not wired: vLLM's shard-to-shard engine needs "
                "per-parameter placements, and Megatron's fused QKV / gate-up shards are not slices of one HF "
                "tensor (use nccl)",
            )
        if self.weight_transfer not in ("gloo", "ipc", "nccl", "reload"):
            fail("weight_transfer", self.weight_transfer, "expected gloo, ipc, nccl or reload")
        # Colocated engines only (rollout.engine=vllm, evaluation): routes that cannot work there.
        if self.weight_transfer == "nccl":
            fail(
                "weight_transfer",
                self.weight_transfer,
                "cannot work colocated: the trainer rank and its "
                "vLLM worker share one GPU and NCCL refuses two ranks on one device (use ipc with "
                "in_process=false, gloo or reload; nccl is rollout.remote.weight_transfer's route)",
            )
        if self.weight_transfer == "ipc" and self.in_process:
            fail(
                "weight_transfer",
                self.weight_transfer,
                "cannot work with in_process=true: the CUDA IPC "
                "handle would be opened in the process that made it, which CUDA refuses (use "
                "in_process=false on one rank, gloo or reload)",
            )
        if self.sync_bucket_mb <= 0:
            fail("sync_bucket_mb", self.sync_bucket_mb, "must be > 0")
        if self.verify_weights and self.weight_transfer != "gloo":
            fail(
                "verify_weights",
                self.verify_weights,
                "checks tensors on the gloo route only (rollout.vllm.weight_transfer=gloo)",
            )
        if self.quantization not in (None, "fp8"):
            fail("quantization", self.quantization, "expected null or 'fp8'")
        if not self.enforce_eager:
            # CUDA-graph replay would bypass the hook's per-step overwrite of input embeddings.
            fail(
                "enforce_eager",
                self.enforce_eager,
                "must be true: CUDA graphs bypass the mixing hook",
            )


@dataclass
class RemoteConfig:
    """The rollout servers of a disaggregated job (``python -m megatron_ngrpo.rollout.remote.server``),
    used by ``rollout.engine=remote`` (rollout/remote/client.py)."""

    # Base URLs (http://host:port) of the servers; or, in a hetjob, the directory where each
    # server registers its URL once its engine is up (``--url-dir``), and how many to wait for.
    urls: list[str] = field(default_factory=list)
    url_dir: str = ""
    num_servers: int = 0
    # Seconds to wait for the servers to come up (registrations, then /info) before training.
    start_timeout_s: float = 900.0
    # Per HTTP call: connecting, and a whole request (a generate call, one weight bucket).
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 1800.0
    # Weight push: "http" (safetensors bytes per HTTP request, the fallback), or vLLM's
    # weight-transfer API with the servers' backend ("gloo" on CPU servers, "nccl" on GPU ones):
    # global rank 0 sends buckets straight to each server's worker (rollout/vllm/weight_transfer.py).
    weight_transfer: Literal["http", "gloo", "nccl"] = "http"
    # Address the gloo route's store binds on global rank 0 and the servers dial (default: its host
    # name); on nccl, NCCL's bootstrap listener (started when the unique id is minted) picks its own
    # interface (NCCL_SOCKET_IFNAME).
    transfer_host: str = ""
    # Tensors per HTTP request / transfer bucket up to this size (MiB).
    bucket_mb: int = 512
    # The servers check a SHA-256 per received tensor against the trainer's before loading it
    # (every route; costs hashing time).
    verify_weights: bool = False
    # File holding the job's shared secret the servers require (rollout/remote/auth.py); empty:
    # $NGRPO_ROLLOUT_SECRET, else the file $NGRPO_ROLLOUT_SECRET_FILE.
    secret_file: str = ""

    def validate(self) -> None:
        for u in self.urls:
            if not u.startswith(("http://", "https://")):
                fail("urls", u, "expected http://host:port")
        if self.url_dir and self.num_servers < 1:
            fail("num_servers", self.num_servers, "must be >= 1 with url_dir")
        for name in ("start_timeout_s", "connect_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                fail(name, getattr(self, name), "must be > 0")
        if self.bucket_mb < 1:
            fail("bucket_mb", self.bucket_mb, "must be >= 1")
        if self.weight_transfer not in ("http", "gloo", "nccl"):
            fail("weight_transfer", self.weight_transfer, "expected http, gloo or nccl")


@dataclass
class RolloutConfig:
    engine: EngineName = EngineName.megatron
    n: int = 4  # G, responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 8192
    stop: list[str] = field(default_factory=list)
    # Megatron engine: generate with a separate copy of the weights instead of the policy itself.
    separate_copy: bool = False
    # Megatron engine: max sequences decoded at once (0 = whole batch).
    max_batch_size: int = 0
    # Megatron engine: batch-invariant forward on both sides (models/batch_invariant.py), so every
    # sampled token's log-prob equals the trainer's replay bit for bit (CPU reference path).
    batch_invariant: bool = False
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)

    def validate(self) -> None:
        if self.engine not in EngineName.__members__:
            fail("engine", self.engine, f"expected one of {', '.join(EngineName)}")
        self.engine = EngineName(self.engine)
        if self.batch_invariant and self.engine != EngineName.megatron:
            fail(
                "batch_invariant",
                True,
                f"needs rollout.engine = megatron (the trainer's own model code), not {self.engine}",
            )
        if self.temperature <= 0:
            fail("temperature", self.temperature, "must be > 0 for RL rollouts")
        SamplingParams.from_config(self).validate(fail)
        if self.engine == EngineName.remote and bool(self.remote.urls) == bool(self.remote.url_dir):
            fail(
                "remote.urls",
                self.remote.urls,
                "rollout.engine=remote needs either rollout.remote.urls or rollout.remote.url_dir",
            )


def check_vllm_layout(rollout: RolloutConfig, world_size: int) -> None:
    """The one rule for vLLM layouts (training and evaluation configs): colocated under torchrun,
    each of the ``world_size`` ranks runs one in-process vLLM worker and vLLM's TP groups are
    consecutive blocks of ``rollout.vllm.tensor_parallel`` ranks."""
    if rollout.engine != EngineName.vllm:
        return
    tp = rollout.vllm.tensor_parallel
    if world_size > 1 and world_size % tp:
        fail(
            "rollout.vllm.tensor_parallel",
            tp,
            f"must divide the world size {world_size} "
            f"(each block of {tp} ranks is one colocated vLLM engine)",
        )
    if world_size > 1 and not rollout.vllm.in_process:
        fail(
            "rollout.vllm.in_process",
            rollout.vllm.in_process,
            "colocated vLLM in a multi-rank job runs in-process (one worker per rank)",
        )


def vllm_max_model_len(
    cfg: VLLMConfig, max_positions: int, field: str = "rollout.vllm.max_model_len"
) -> int:
    """The engine's max_model_len: ``cfg.max_model_len``, or for 0 the model's
    ``max_position_embeddings`` capped at :data:`DEFAULT_MAX_MODEL_LEN`. A length beyond the
    model's positions is a one-line ConfigError here, not vLLM's pydantic traceback on every rank."""
    if not cfg.max_model_len:
        return min(DEFAULT_MAX_MODEL_LEN, max_positions)
    if cfg.max_model_len > max_positions:
        fail(
            field,
            cfg.max_model_len,
            f"above the model's max_position_embeddings {max_positions} "
            f"(config.json); set at most {max_positions}, or 0 for that",
        )
    return cfg.max_model_len
