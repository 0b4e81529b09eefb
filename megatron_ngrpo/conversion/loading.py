"""Where a policy's weights come from: a Megatron checkpoint (or run directory), the HF weights
next to its config.json, or megatron's seeded random initialisation."""

from __future__ import annotations

import torch

from megatron_ngrpo.conversion.checkpoint import load_megatron_checkpoint
from megatron_ngrpo.models.config import ModelConfig
from megatron_ngrpo.models.provider import build_model
from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel


def load_weights(chunks: list, model_cfg: ModelConfig, checkpoint: str = "") -> None:
    """``checkpoint``: "random" keeps the seeded initialisation (tests, tiny demos); a Megatron
    checkpoint or run directory (resharded to this layout); "" loads ``model_cfg.hf_path``'s HF
    safetensors."""
    # lazy: keeps conversion.loading free of safetensors at import (start-up)
    from megatron_ngrpo.conversion.hf_io import load_hf_into_megatron

    if checkpoint == "random":
        return
    if checkpoint:
        load_megatron_checkpoint(chunks, checkpoint)
        return
    with torch.no_grad():
        load_hf_into_megatron(chunks, model_cfg.hf_path)


def build_policy(model_cfg: ModelConfig, checkpoint: str = "", seed: int = 1234) -> list:
    """Process groups for ``model_cfg``'s layout, this rank's model chunks, and their weights."""

    init_distributed()
    initialize_model_parallel(
        model_cfg.tensor_parallel,
        model_cfg.pipeline_parallel,
        model_cfg.virtual_pipeline,
        seed=seed,
    )
    chunks = build_model(model_cfg)
    load_weights(chunks, model_cfg, checkpoint)
    return chunks
