"""Reading and writing Hugging Face checkpoint directories (safetensors, sharded with an index).

:class:`HFCheckpoint` is a lazy read-only mapping: names and shapes come from the safetensors
headers, a tensor is read only when asked for. :class:`ShardedWriter` writes a stream of tensors as
``model-0000i-of-0000n.safetensors`` shards (bounded size, so memory holds at most one shard) plus
``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.atomic import atomic_directory
from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.conversion import safetensors_header
from megatron_ngrpo.conversion.hf_export import export_hf_tensors
from megatron_ngrpo.conversion.hf_import import load_hf_tensors
from megatron_ngrpo.conversion.mapping import ConversionError, check_hf_names, hf_layout
from megatron_ngrpo.parallel import is_rank0

INDEX = "model.safetensors.index.json"
# Carried over from the source HF directory next to the weights.
AUX_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


# Any one of these makes a folder a tokenizer (vocab.json goes with merges.txt).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def tokenizer_json_id_count(path: str | Path) -> int:
    """Token ids a ``tokenizer.json`` can produce (largest model or added-token id + 1), read
    from the JSON without building the tokenizer."""
    tok = json.loads(Path(path).read_text())
    vocab = tok["model"]["vocab"]
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]  # Unigram: a list
    return max(ids + [t["id"] for t in tok.get("added_tokens", [])]) + 1


def check_hf_folder(
    path: str | Path,
    tokenizer_dir: str | Path | None = None,
    weights: bool = True,
    source: str | None = None,
) -> None:
    """One-line :class:`ConfigError` (file and field) for an HF model folder ``path`` the trainer
    cannot use, before any process group starts. With ``tokenizer_dir`` (may be ``path``): no
    tokenizer files there; a ``tokenizer.json`` with more ids than ``config.json``'s
    ``vocab_size`` (embedding rows). With ``weights``: ``tie_word_embeddings`` declared while the
    safetensors hold an ``lm_head.weight`` that differs from ``model.embed_tokens.weight`` (the
    second matrix would be silently dropped; an identical copy is accepted). ``source``: named
    in the message (e.g. the GGUF the folder was built from)."""
    path = Path(path)
    suffix = f" (from {source})" if source else ""
    cfg = json.loads((path / "config.json").read_text())
    if tokenizer_dir is not None:
        tok = Path(tokenizer_dir)
        if not any((tok / f).is_file() for f in TOKENIZER_FILES):
            raise ConfigError(
                f"{tok}{suffix}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)})"
            )
        if (tok / "tokenizer.json").is_file():
            count = tokenizer_json_id_count(tok / "tokenizer.json")
            if count > cfg.get("vocab_size", count):
                raise ConfigError(
                    f"{tok / 'tokenizer.json'}{suffix}: {count} token ids, more than "
                    f"{path / 'config.json'} field vocab_size = {cfg['vocab_size']} (embedding rows)"
                )
    if weights and cfg.get("tie_word_embeddings") and any(path.glob("*.safetensors")):
        ckpt = HFCheckpoint(path)
        if "lm_head.weight" in ckpt and not torch.equal(
            ckpt["lm_head.weight"], ckpt["model.embed_tokens.weight"]
        ):
            raise ConfigError(
                f"{path / 'config.json'}{suffix}: field tie_word_embeddings = true, but the "
                f"weights hold a separate lm_head.weight (two matrices: set it false or drop lm_head)"
            )


class HFCheckpoint(Mapping):
    """Tensors of an HF checkpoint directory, read lazily; ``shapes`` maps name → shape."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ConversionError(
                f"{self.path}: no *.safetensors files (only safetensors checkpoints are read)"
            )
        self._file: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._handles: dict[Path, object] = {}
        for f in files:
            if bad := safetensors_header.problem(f):
                raise ConversionError(bad)
            with safe_open(f, framework="pt") as h:
                for name in h.keys():
                    self._file[name] = f
                    self.shapes[name] = tuple(h.get_slice(name).get_shape())

    def __getitem__(self, name: str) -> torch.Tensor:
        f = self._file[name]
        if f not in self._handles:
            self._handles[f] = safe_open(f, framework="pt")
        return self._handles[f].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)

    def nbytes(self) -> int:
        total = 0
        for f in set(self._file.values()):
            total += f.stat().st_size
        return total


class ShardedWriter:
    """Writes tensors into safetensors shards of at most ``max_shard_bytes`` each."""

    def __init__(self, path: str | Path, max_shard_bytes: int = 2 * 1024**3):
        self.path = Path(path)
        self.max_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in s for s in self._shards):
            raise ConversionError(f"tensor {name!r} written twice")
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_bytes:
            self._flush()
        self._pending[name] = tensor.detach().cpu().contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        idx = len(self._shards)
        save_file(self._pending, str(self.path / f"shard-{idx:05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Flush, name the shards ``model-0000i-of-0000n.safetensors`` and write the index;
        returns the tensor names in write order."""
        if self._pending:
            self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.path / f"shard-{i:05d}.tmp").rename(self.path / final)
            (self.path / final).chmod(0o644)
            weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.path / INDEX).write_text(json.dumps(index, indent=2))
        return list(weight_map)


def copy_aux_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy tokenizer and generation-config files that exist in ``src`` to ``dst``."""
    copied = []
    for name in AUX_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def load_hf_into_megatron(model_chunks: list, hf_dir: str | Path, progress: bool = False) -> int:
    """Load the HF checkpoint ``hf_dir`` into this rank's ``model_chunks`` (any TP/PP/VPP layout
    built for the same config). Every rank reads only its tensors. Returns parameters set."""

    return load_hf_tensors(
        model_chunks,
        ArchSpec.from_hf(hf_dir),
        HFCheckpoint(hf_dir),
        source=str(hf_dir),
        progress=progress,
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_hf_checkpoint(
    model_chunks: list,
    out_dir: str | Path,
    hf_config: dict,
    dtype: torch.dtype | None = None,
    aux_from: str | Path | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = 2 * 1024**3,
    progress: bool = False,
) -> Path:
    """Write the model as an HF checkpoint directory (sharded safetensors + index, config.json,
    tokenizer / generation files from ``aux_from``), atomically. Every rank calls it; tensors are
    gathered to global rank 0 one at a time, which writes; names and shapes are verified against
    the config before the directory appears."""

    spec = ArchSpec.from_dict(hf_config)
    rank0 = is_rank0()
    out_dir = Path(out_dir)
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        error = None
        if rank0:
            writer, shapes = ShardedWriter(tmp, max_shard_bytes), {}
            bar = tqdm(
                total=len(hf_layout(spec)),
                desc=f"write {out_dir.name}",
                unit="tensor",
                disable=not progress,
            )
        for name, tensor in export_hf_tensors(model_chunks, spec, rank0_only=True, dtype=dtype):
            writer.add(name, tensor)
            shapes[name] = tuple(tensor.shape)
            bar.update()
        if rank0:
            bar.close()
            writer.close()
            try:
                check_hf_names(spec, shapes, f"export to {out_dir}")
            except ConversionError as e:
                error = str(e)
            cfg = dict(hf_config)
            if dtype is not None:
                cfg["dtype" if "dtype" in cfg or "torch_dtype" not in cfg else "torch_dtype"] = (
                    _dtype_name(dtype)
                )
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            if aux_from:
                copy_aux_files(aux_from, tmp)
        if dist.is_initialized():
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error:
            raise ConversionError(error)
    return out_dir
