"""Data: tokenizers (offline R1-Distill rebuild), prompt templates, problem sources with answer
clean-up and row validation, the registry of data/ files, resumable prompt batches."""

from megatron_ngrpo.data.batches import PromptBatches
from megatron_ngrpo.data.config import DataConfig, SourceConfig
from megatron_ngrpo.data.datasets import (
    REGISTRY,
    DataError,
    Problem,
    PromptExample,
    build_prompts,
    load_source,
    load_train_set,
)
from megatron_ngrpo.data.templates import (
    EVAL_INSTRUCTION,
    MCQ_INSTRUCTION,
    TRAIN_INSTRUCTION,
    TemplateConfig,
)
from megatron_ngrpo.data.tokenizer import load_tokenizer

__all__ = [
    "DataConfig",
    "DataError",
    "EVAL_INSTRUCTION",
    "MCQ_INSTRUCTION",
    "Problem",
    "PromptBatches",
    "PromptExample",
    "REGISTRY",
    "SourceConfig",
    "TRAIN_INSTRUCTION",
    "TemplateConfig",
    "build_prompts",
    "load_source",
    "load_tokenizer",
    "load_train_set",
]
