"""The trainer's configuration: every package's section composed, plus the checks that span
sections (parallel layout vs the architecture and the world size, batch arithmetic, files).

Everything here runs before any process group starts; each problem is one :class:`ConfigError`
line naming the field and value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_ngrpo import pins
from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.config_loader import fail, launch_world_size, load
from megatron_ngrpo.conversion.hf_io import check_hf_folder
from megatron_ngrpo.data.config import DataConfig
from megatron_ngrpo.data.datasets import require_local_files
from megatron_ngrpo.data.tokenizer import tokenizer_folder
from megatron_ngrpo.grpo.config import GRPOConfig
from megatron_ngrpo.mixing.config import MixingConfig
from megatron_ngrpo.models.config import BATCH_INVARIANT_MAX_TP, ModelConfig, use_te
from megatron_ngrpo.models.provider import check_layout
from megatron_ngrpo.rewards.config import RewardConfig
from megatron_ngrpo.rollout.config import (
    EngineName,
    RolloutConfig,
    check_vllm_layout,
    vllm_max_model_len,
)
from megatron_ngrpo.training.config import OptimConfig, TrainConfig, ValidationConfig


@dataclass
class NGRPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    mixing: MixingConfig = field(default_factory=MixingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    # In-training validation (benchmarks every few steps), not the evaluation CLI's config.
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    # "" = the model folder's own tokenizer and chat template (model.hf_path); else a name
    # (megatron_ngrpo.data.tokenizer: deepseek-r1-distill-qwen, qwen2: data/tokenizers) or a folder.
    tokenizer: str = ""

    # Old section names still read (with a one-line deprecation message), new name.
    RENAMED = {"eval": "validation"}

    def validate(self) -> None:
        """Cross-section checks (each section validated itself already), in this order: the
        parallel layout, the rollout engine's and one-step-off options, the batch arithmetic,
        the files."""
        self._check_layout()
        self._check_rollout_options()
        self._check_batch_arithmetic()
        self._check_files()

    def _check_layout(self) -> None:
        """The options no trainer runs; the model's and vLLM's layouts vs the architecture and
        the world size."""
        check_not_run(self)
        spec = ArchSpec.from_hf(self.model.hf_path)
        check_layout(spec, self.model)
        if self.mixing.enabled and self.mixing.k > (self.model.num_real_tokens or spec.vocab_size):
            fail("mixing.k", self.mixing.k, "larger than the vocabulary")
        check_vllm_layout(self.rollout, launch_world_size())
        r = self.reward
        counted = (
            "reward.max_response_tokens" if r.max_response_tokens else "rollout.max_new_tokens"
        )
        length = r.max_response_tokens or self.rollout.max_new_tokens
        if r.overlong == "soft" and length <= r.overlong_buffer:
            fail(
                "reward.overlong_buffer",
                r.overlong_buffer,
                f"the soft overlong penalty's buffer must be shorter than the length it counts to "
                f"({counted} = {length})",
            )
        if self.rollout.engine == EngineName.vllm:
            vllm_max_model_len(self.rollout.vllm, spec.max_position_embeddings)

    def _check_rollout_options(self) -> None:
        """What the rollout engine and one-step-off rollouts allow with the other options."""
        if self.train.async_.max_staleness and self.rollout.engine == EngineName.vllm:
            fail(
                "train.async.max_staleness",
                self.train.async_.max_staleness,
                "one-step-off rollouts need an engine beside the trainer's groups: rollout.engine = "
                "megatron (a separate weight copy) or remote (rollout servers), not colocated vllm",
            )
        if self.rollout.engine == EngineName.remote and self.mixing.neighbor_lookup == "on_demand":
            fail(
                "mixing.neighbor_lookup",
                "on_demand",
                "rollout servers mix with the trainer's table only (rollout.engine = remote): "
                "use table or auto",
            )
        if self.rollout.batch_invariant:
            self._check_batch_invariant()
        if self.train.pack_sequences and self.model.pipeline_parallel > 1:
            fail(
                "train.pack_sequences",
                True,
                "needs model.pipeline_parallel = 1 (stages would exchange "
                "packed activations of varying length)",
            )
        if self.train.async_save and self.train.async_.max_staleness:
            fail(
                "train.async_save",
                True,
                "forks a writer process per save, which would copy this process "
                "while its one-step-off rollout thread runs: with train.async.max_staleness = 0 only",
            )
        if self.train.dynamic_sampling.enabled and self.train.async_.max_staleness:
            fail(
                "train.dynamic_sampling.enabled",
                True,
                "refills a step by generating more with the "
                "current weights: synchronous rollouts only (train.async.max_staleness = 0)",
            )
        if (
            self.train.async_.max_staleness
            and self.rollout.engine == EngineName.megatron
            and torch.cuda.is_available()
        ):
            fail(
                "train.async.max_staleness",
                self.train.async_.max_staleness,
                "the one-step-off Megatron engine is not measured on GPU (its second thread shares the "
                "device, two NCCL communicators per group, CUDA RNG-tracker forks unguarded): use "
                "rollout.engine=remote, or max_staleness=0",
            )

    def _check_batch_invariant(self) -> None:
        """What ``rollout.batch_invariant`` cannot make order-fixed (models/batch_invariant.py)."""
        m = self.model
        if m.sequence_parallel and m.tensor_parallel > 1:
            fail(
                "model.sequence_parallel",
                True,
                "rollout.batch_invariant: reduce-scatter has no fixed order (set it false)",
            )
        if m.tensor_parallel > BATCH_INVARIANT_MAX_TP:
            fail(
                "model.tensor_parallel",
                m.tensor_parallel,
                f"rollout.batch_invariant: at most {BATCH_INVARIANT_MAX_TP} (a larger all-reduce is not "
                "order-fixed)",
            )
        if use_te(m):
            fail("model.layer_spec", m.layer_spec, "rollout.batch_invariant: the local spec only")

    def _check_batch_arithmetic(self) -> None:
        """Prompts per step and per mini-batch split over DP ranks, responses over micro-batches."""
        t = self.train
        dp = data_parallel_size(self.model)
        for name in ("prompts_per_step", "mini_batch_prompts"):
            if getattr(t, name) % dp:
                fail(
                    f"train.{name}",
                    getattr(t, name),
                    f"must be divisible by the data-parallel size {dp} (world {launch_world_size()} / "
                    f"TP {self.model.tensor_parallel} / PP {self.model.pipeline_parallel})",
                )
        per_rank = t.mini_batch_prompts // dp * self.rollout.n
        if not t.max_tokens_per_micro_batch and per_rank % t.micro_batch_size:
            fail(
                "train.micro_batch_size",
                t.micro_batch_size,
                f"must divide the {per_rank} responses per DP rank of a mini-batch "
                f"(mini_batch_prompts / DP × rollout.n)",
            )

    def _check_files(self) -> None:
        """The weights to load, the HF folder and tokenizer, the data and benchmark files."""
        t = self.train
        if t.load and t.load != "random":
            _require_checkpoint("train.load", t.load)
        elif not t.load and not any(Path(self.model.hf_path).glob("*.safetensors")):
            fail(
                "train.load",
                t.load,
                f"empty means the HF weights of model.hf_path, but "
                f"{self.model.hf_path} has no *.safetensors (use a checkpoint or 'random')",
            )
        tokenizer_dir = tokenizer_folder(self.tokenizer, self.model.hf_path)
        check_hf_folder(self.model.hf_path, tokenizer_dir=tokenizer_dir, weights=not t.load)
        require_local_files(self.data.train, "data.train")
        if self.validation.every:
            require_local_files(self.validation.benchmarks, "validation.benchmarks")


def data_parallel_size(model: ModelConfig) -> int:
    mp = model.tensor_parallel * model.pipeline_parallel * model.context_parallel
    if launch_world_size() % mp:
        fail(
            "model.tensor_parallel",
            model.tensor_parallel,
            f"TP {model.tensor_parallel} × PP {model.pipeline_parallel}"
            f"{f' × CP {model.context_parallel}' if model.context_parallel > 1 else ''} does not divide the "
            f"world size {launch_world_size()}",
        )
    return launch_world_size() // mp


def check_not_run(cfg: NGRPOConfig) -> None:
    """Options the config accepts but this trainer cannot run yet, refused wherever a training
    config is checked: its validation (the trainer's start-up, pre-flight on every node,
    ``ngrpo-launch plan``) and ``ngrpo-launch run`` before it submits (on the composed files), so
    that such a job never queues. The memory plan still counts them (launch/memory.py)."""
    if cfg.model.context_parallel > 1:
        fail(
            "model.context_parallel",
            cfg.model.context_parallel,
            "not run by this trainer: the replay's sequence split and log-prob gather over CP ranks are "
            "not written (memory planning only: launch/memory.py)",
        )
    v = cfg.rollout.vllm
    if v.quantization and cfg.rollout.engine == EngineName.vllm:
        fail(
            "rollout.vllm.quantization",
            v.quantization,
            "FP8 rollouts are refused until a weight-sync round trip verifies the quantized weights "
            "(whether vLLM re-quantizes them at each sync is unverified: rollouts could come from "
            "stale or mis-scaled weights)",
        )


def check_device(cfg: NGRPOConfig, gpu: bool | None = None) -> None:
    """Start-up refusals of options this machine (``gpu``: default, whether CUDA is available)
    cannot run, and of a vLLM other than the hook's (:data:`megatron_ngrpo.pins.VLLM`) before
    the model is built; called by the training entry point and by pre-flight before any process
    group. Kept out of :meth:`NGRPOConfig.validate` so that ``ngrpo-launch plan`` checks GPU
    configs on a machine without GPUs (or vLLM)."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    if cfg.rollout.engine == EngineName.vllm and (problem := pins.vllm_mismatch()):
        fail("rollout.engine", "vllm", problem)
    if cfg.train.pack_sequences and cfg.model.layer_spec == "te" and not gpu:
        fail(
            "train.pack_sequences",
            True,
            "with model.layer_spec = te packs in TE's THD layout, which "
            "needs a GPU (on CPU use the local spec: block-diagonal attention mask)",
        )


def load_config(paths: list[str] | str | None, overrides: list[str] | None = None) -> NGRPOConfig:
    """YAML file(s) + ``a.b=c`` overrides → a validated :class:`NGRPOConfig` (ConfigError)."""
    return load(NGRPOConfig, paths, overrides)


def _require_checkpoint(field_name: str, path: str) -> None:
    p = Path(path)
    if not ((p / "megatron_ngrpo.json").is_file() or (p / "latest").is_file()):
        fail(field_name, path, "not a megatron_ngrpo checkpoint or run directory")
