"""Configuration of the policy model and its parallel layout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_ngrpo.config_loader import fail


@dataclass
class ModelConfig:
    # Directory holding the HF config.json (and, for conversion, the weights).
    hf_path: str = ""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: int | None = None
    # Embedding/output rows are padded to a multiple of this × TP (megatron's rule).
    make_vocab_size_divisible_by: int = 128
    # Number of real token ids (tokenizer length); rows at or beyond it are never sampled and
    # never neighbours. None = the HF vocab_size.
    num_real_tokens: int | None = None
    # "auto": bf16 on GPU, fp32 on CPU.
    dtype: str = "auto"
    # "auto": Transformer-Engine spec when importable on GPU, else megatron's local spec.
    layer_spec: str = "auto"
    sequence_parallel: bool = False
    recompute: bool = False
    max_seq_len: int | None = None

    def validate(self) -> None:
        if not self.hf_path:
            fail("hf_path", self.hf_path, "required: a directory with a Hugging Face config.json")
        if not (Path(self.hf_path) / "config.json").is_file():
            fail("hf_path", self.hf_path, "no config.json in this directory")
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            fail("tensor_parallel", (self.tensor_parallel, self.pipeline_parallel), "must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            fail("dtype", self.dtype, "expected auto, float32, bfloat16 or float16")
        if self.layer_spec not in ("auto", "local", "te"):
            fail("layer_spec", self.layer_spec, "expected auto, local or te")
        if self.make_vocab_size_divisible_by < 1:
            fail("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by, "must be >= 1")
