"""Whole-checkpoint conversion (the functions behind ``tools/convert_*.py``).

Both run in the current process group (one process when none is set up; under torchrun for
sharded layouts: the world size must be a multiple of TP × PP). The model is built in the
requested layout, loaded, and written; the input layout never matters (HF has none; Megatron
checkpoints reshard on load), so converting a Megatron checkpoint to Megatron is resharding.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_ngrpo.config_loader import ConfigError, validate
from megatron_ngrpo.conversion.checkpoint import (
    LATEST_FILE,
    META_FILE,
    checkpoint_meta,
    load_megatron_checkpoint,
    model_config_for,
    read_meta,
    resolve_checkpoint,
    save_megatron_checkpoint,
)
from megatron_ngrpo.models.config import ModelConfig
from megatron_ngrpo.models.provider import build_model
from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel, is_rank0

DTYPES = ("float32", "bfloat16", "float16")


def is_megatron_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return (path / META_FILE).is_file() or (path / LATEST_FILE).is_file()


def check_args(
    src: str | Path,
    out: str | Path,
    tp: int,
    pp: int,
    vpp: int | None,
    dtype: str | None,
    overwrite: bool,
    world: int | None = None,
) -> None:
    """One-line :class:`ConfigError` for bad arguments, before any process group starts."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise ConfigError(f"input {str(src)!r}: not a directory")
    if not is_megatron_checkpoint(src) and not (src / "config.json").is_file():
        raise ConfigError(
            f"input {str(src)!r}: neither an HF directory (config.json) nor a Megatron checkpoint"
        )
    if out.exists() and not overwrite:
        raise ConfigError(f"output {str(out)!r}: exists (use --overwrite)")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r}: expected one of {DTYPES}")
    if tp < 1 or pp < 1 or (vpp is not None and (vpp < 2 or pp < 2)):
        raise ConfigError(
            f"layout tp={tp} pp={pp} vpp={vpp}: tp, pp >= 1; vpp >= 2 and only with pp >= 2"
        )
    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    if world % (tp * pp):
        raise ConfigError(f"layout tp={tp} pp={pp}: world size {world} is not a multiple of tp*pp")


def current_layout() -> tuple[int, int, int | None] | None:
    """(tp, pp, vpp) of megatron's parallel state, None when not initialised."""
    # lazy: keeps conversion.convert free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_virtual_pipeline_model_parallel_world_size(),
    )


def _build(cfg: ModelConfig) -> list:
    validate(cfg)
    init_distributed()
    layout = (cfg.tensor_parallel, cfg.pipeline_parallel, cfg.virtual_pipeline)
    if current_layout() != layout:  # re-initialising creates new process groups (and threads)
        initialize_model_parallel(*layout)
    return build_model(cfg, init_weights=False)  # every parameter is loaded next


def convert_hf_to_megatron(
    src: str | Path,
    out: str | Path,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    dtype: str | None = None,
    make_vocab_size_divisible_by: int | None = None,
    num_real_tokens: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """HF directory — or Megatron checkpoint / run directory (resharding) — → Megatron checkpoint
    written from layout (tp, pp, vpp). ``dtype`` default: float32 from HF, the checkpoint's own
    from Megatron."""
    check_args(src, out, tp, pp, vpp, dtype, overwrite)
    from_megatron = is_megatron_checkpoint(src)
    if from_megatron:
        cfg = model_config_for(src, tp, pp, vpp, dtype)
        aux = resolve_checkpoint(src)
    else:
        cfg = ModelConfig(
            hf_path=str(src),
            tensor_parallel=tp,
            pipeline_parallel=pp,
            virtual_pipeline=vpp,
            dtype=dtype or "float32",
            layer_spec="local",
        )
        aux = Path(src)
    if make_vocab_size_divisible_by is not None:
        cfg.make_vocab_size_divisible_by = make_vocab_size_divisible_by
    if num_real_tokens is not None:
        cfg.num_real_tokens = num_real_tokens
    chunks = _build(cfg)
    if from_megatron:
        load_megatron_checkpoint(chunks, src)
    else:
        # lazy: keeps conversion.convert free of safetensors at import (start-up)
        from megatron_ngrpo.conversion.hf_io import load_hf_into_megatron

        load_hf_into_megatron(chunks, src, progress=progress and is_rank0())
    meta = checkpoint_meta(cfg, source=str(Path(src).resolve()))
    if from_megatron:
        meta["hf_path"] = read_meta(src).get("hf_path")
    return save_megatron_checkpoint(chunks, out, meta, aux_from=aux, overwrite=overwrite)


def convert_megatron_to_hf(
    src: str | Path,
    out: str | Path,
    dtype: str | None = None,
    hf_source: str | Path | None = None,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = 2 * 1024**3,
    progress: bool = True,
) -> Path:
    """Megatron checkpoint / run directory → HF directory (safetensors shards + index,
    config.json, tokenizer / generation files from ``hf_source`` or the checkpoint). Loaded in
    layout (tp, pp, vpp); ``dtype`` default: the checkpoint's."""
    check_args(src, out, tp, pp, vpp, dtype, overwrite)
    if not is_megatron_checkpoint(src):
        raise ConfigError(
            f"input {str(src)!r}: not a Megatron checkpoint (no {META_FILE} or {LATEST_FILE})"
        )
    if hf_source is not None and not Path(hf_source).is_dir():
        raise ConfigError(f"hf_source {str(hf_source)!r}: not a directory")
    # lazy: keeps conversion.convert free of safetensors at import (start-up)
    from megatron_ngrpo.conversion.hf_io import save_hf_checkpoint

    ckpt = resolve_checkpoint(src)
    meta = read_meta(ckpt)
    cfg = model_config_for(ckpt, tp, pp, vpp)
    chunks = _build(cfg)
    load_megatron_checkpoint(chunks, ckpt)
    out_dtype = getattr(torch, dtype or meta.get("dtype", "float32"))
    return save_hf_checkpoint(
        chunks,
        out,
        meta["hf_config"],
        dtype=out_dtype,
        aux_from=hf_source or ckpt,
        overwrite=overwrite,
        max_shard_bytes=max_shard_bytes,
        progress=progress and is_rank0(),
    )
