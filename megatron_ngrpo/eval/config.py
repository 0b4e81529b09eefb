"""Configuration of `python -m megatron_ngrpo.eval`."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.config_loader import fail, launch_world_size
from megatron_ngrpo.data.config import SourceConfig
from megatron_ngrpo.data.datasets import require_local_files
from megatron_ngrpo.data.templates import TemplateConfig
from megatron_ngrpo.data.tokenizer import tokenizer_folder
from megatron_ngrpo.mixing.config import MixingConfig
from megatron_ngrpo.models.config import ModelConfig
from megatron_ngrpo.rewards.config import RewardConfig
from megatron_ngrpo.rollout.config import (
    EngineName,
    RolloutConfig,
    check_vllm_layout,
    vllm_max_model_len,
)
from megatron_ngrpo.rollout.types import SamplingFields, SamplingParams


@dataclass
class EvalSamplingConfig(SamplingFields):
    """Paper defaults (N-GRPO §4.1, App. B.3): n = 32, T = 0.6, top-p 0.95, 8192 new tokens."""

    n: int = 32
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 8192
    seed: int = 0

    def validate(self) -> None:
        SamplingParams.from_config(self).validate(fail)


@dataclass
class EvalConfig:
    # Registry names (megatron_ngrpo.data.datasets.REGISTRY) or files. Paper: aime25, amc23,
    # math500 (+ GPQA-Diamond, not shipped); aime24 is the validation set.
    benchmarks: list[str] = field(default_factory=lambda: ["aime25", "amc23", "math500"])
    # Further benchmark files with their own field mapping, e.g. a local GPQA-Diamond:
    # {path: gpqa.jsonl, problem_key: question, answer_key: letter, kind: mcq}.
    extra_benchmarks: list[SourceConfig] = field(default_factory=list)
    # First `limit` problems of each benchmark (0 = all), for smoke runs.
    limit: int = 0
    # "" = the model folder's own tokenizer (model.hf_path); else a name or folder (as in training).
    tokenizer: str = ""
    # Policy architecture (HF config dir) and layout; required unless `regrade` is set.
    model: ModelConfig | None = None
    # Megatron checkpoint directory (engine megatron); "" = the HF weights in model.hf_path.
    checkpoint: str = ""
    # Engine choice (rollout.engine: megatron | vllm) and its options.
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # Off (the paper's evaluation) unless mixing.at_eval=true: the inference-time mixing ablation,
    # with the neighbour table of the evaluated weights.
    mixing: MixingConfig = field(default_factory=MixingConfig)
    sampling: EvalSamplingConfig = field(default_factory=EvalSamplingConfig)
    template: TemplateConfig = field(default_factory=TemplateConfig)
    # Grading: reward.name is ignored (math benchmarks use the math grader, mcq ones the letter
    # grader); shaping terms are not used.
    reward: RewardConfig = field(default_factory=RewardConfig)
    # Pass@k values; empty = 1, 2, 4, ..., n.
    ks: list[int] = field(default_factory=list)
    # Per rank and engine.generate call: rows × (longest prompt + max_new_tokens) ≤ this (at least
    # one problem's n samples); the Megatron engine's KV cache holds this many tokens.
    max_tokens_per_call: int = 2**18
    # Seconds a collective waits for the slowest rank (process-group timeout).
    dist_timeout_s: int = 1800
    output_dir: str = "outputs/eval"
    # A previous output_dir: re-grade its generations (no model, no engine).
    regrade: str = ""

    def validate(self) -> None:
        if not self.benchmarks and not self.extra_benchmarks:
            fail("benchmarks", self.benchmarks, "at least one benchmark is needed")
        if self.limit < 0:
            fail("limit", self.limit, "must be >= 0")
        if self.model is None and not self.regrade:
            fail("model", self.model, "required (model.hf_path=...) unless regrade is set")
        bad = [k for k in self.ks if not 1 <= k <= self.sampling.n]
        if bad:
            fail("ks", self.ks, f"each k must be in [1, sampling.n = {self.sampling.n}]")
        for name in ("max_tokens_per_call", "dist_timeout_s"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")
        check_vllm_layout(self.rollout, launch_world_size())
        require_local_files(self.benchmarks, "benchmarks")
        require_local_files(self.extra_benchmarks, "extra_benchmarks")
        if self.model is not None and not self.regrade:
            tokenizer_folder(self.tokenizer, self.model.hf_path)
            if self.rollout.engine == EngineName.vllm:
                vllm_max_model_len(
                    self.rollout.vllm, ArchSpec.from_hf(self.model.hf_path).max_position_embeddings
                )
