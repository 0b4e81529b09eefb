"""Configuration of the policy model and its parallel layout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.config_loader import ConfigError, fail

# rollout.batch_invariant (models/batch_invariant.py): a TP all-reduce of two operands is
# order-free (a + b = b + a); more would need an ordered all-gather + sum (not implemented).
BATCH_INVARIANT_MAX_TP = 2


@dataclass
class ModelConfig:
    # Directory holding the HF config.json (and, for conversion, the weights).
    hf_path: str = ""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: int | None = None
    # Embedding/output rows are padded to a multiple of this × TP (megatron's rule).
    make_vocab_size_divisible_by: int = 128
    # Number of real token ids; rows at or beyond it (HF rows no tokenizer id maps to, megatron's
    # padding) are never sampled, anchors or neighbours. None = the tokenizer's id count
    # (:func:`real_token_count`); an explicit value overrides it (at most the HF vocab_size).
    num_real_tokens: int | None = None
    # "auto": bf16 on GPU, fp32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # "auto": Transformer-Engine spec when importable on GPU, else megatron's local spec.
    layer_spec: Literal["auto", "local", "te"] = "auto"
    # Core attention of the local spec: "sdpa" (torch's scaled_dot_product_attention, fused
    # kernels, no s² scores kept; models/attention.py) or "unfused" (megatron's
    # DotProductAttention). TE's spec has its own fused attention and ignores it.
    attention: Literal["sdpa", "unfused"] = "sdpa"
    sequence_parallel: bool = False
    # Context parallelism (megatron CP: each sequence split over this many ranks; TE attention,
    # GPU only). Planned for (launch/memory.py) but refused at start-up: the replay's sequence
    # split and log-prob gather over CP ranks are not written (README, peer features).
    context_parallel: int = 1
    recompute: bool = False
    max_seq_len: int | None = None

    def validate(self) -> None:
        if not self.hf_path:
            fail("hf_path", self.hf_path, "required: a directory with a Hugging Face config.json")
        if not (Path(self.hf_path) / "config.json").is_file():
            fail(
                "hf_path",
                self.hf_path,
                f"no config.json in this directory (looked for "
                f"{(Path(self.hf_path) / 'config.json').resolve()})",
            )
        if self.context_parallel < 1:
            fail("context_parallel", self.context_parallel, "must be >= 1")
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            fail("tensor_parallel", (self.tensor_parallel, self.pipeline_parallel), "must be >= 1")
        if self.layer_spec != "local" and torch.cuda.is_available():
            # On a GPU auto / te without TE is refused here; a CPU host (a launcher validating a
            # GPU job) cannot tell, the job's own validation does.
            use_te(self)
        if self.make_vocab_size_divisible_by < 1:
            fail("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by, "must be >= 1")
        if self.num_real_tokens is not None:
            real_token_count(self.num_real_tokens, ArchSpec.from_hf(self.hf_path).vocab_size)


def tokenizer_id_count(tokenizer) -> int:
    """Ids ``tokenizer`` can produce: its largest id + 1 (``len(tokenizer)`` when ids have no gaps)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)


def real_token_count(num_real_tokens: int | None, vocab_size: int, tokenizer=None) -> int:
    """``model.num_real_tokens`` resolved: the explicit value, else the tokenizer's id count, else
    (no tokenizer) the HF ``vocab_size``. Raises a one-line ConfigError when it exceeds
    ``vocab_size`` (Qwen2: 151,665 tokenizer ids in 151,936 rows)."""
    if num_real_tokens is not None:
        if not 0 < num_real_tokens <= vocab_size:
            fail("num_real_tokens", num_real_tokens, f"must be in [1, vocab_size = {vocab_size}]")
        return num_real_tokens
    if tokenizer is None:
        return vocab_size
    count = tokenizer_id_count(tokenizer)
    if count > vocab_size:
        fail(
            "tokenizer",
            getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__,
            f"has {count} token ids, more than the model's vocab_size = {vocab_size}",
        )
    return count


def transformer_engine_error() -> str | None:
    """Why Transformer Engine's PyTorch API does not import here (None: it does)."""
    try:
        # lazy: optional dependency probe (GPU only)
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # TE absent, its empty meta package, or its CUDA libraries missing
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def use_te(cfg: ModelConfig) -> bool:
    """Whether to build with TE's layer spec. ``auto`` is TE on a GPU and the local spec on CPU; on
    a GPU where TE does not import, ``auto`` and ``te`` stop with one line rather than fall back
    to the (slower, unfused-attention) local spec unseen."""
    if cfg.layer_spec == "local":
        return False
    if not torch.cuda.is_available():
        if cfg.layer_spec == "te":
            raise ConfigError("model.layer_spec = 'te': Transformer Engine's spec needs a GPU")
        return False
    why = transformer_engine_error()
    if why:
        raise ConfigError(
            f"model.layer_spec = {cfg.layer_spec!r}: Transformer Engine does not import on this "
            f"GPU machine ({why}); install it, or set model.layer_spec=local for megatron's local spec"
        )
    return True
