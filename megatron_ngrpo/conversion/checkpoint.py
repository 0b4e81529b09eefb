"""The Megatron checkpoint layout shared by trainer, conversion and engines (docs/DEVELOPING.md).

A checkpoint directory holds ``megatron_ngrpo.json`` (metadata: HF config dict, writer layout,
padded vocab, ...), ``config.json`` (the HF config, so the directory builds its own model), the
tokenizer / generation-config files when known, and a megatron ``dist_checkpointing`` checkpoint of
``{"model": chunk.sharded_state_dict()}`` (VPP: ``model0``, ``model1``, ...) plus any extra sharded
entries (optimizer, RNG, ...), and ``manifest.json`` (every file's size, written last). A run
directory holds ``iter_0000010/``... and a ``latest`` file
naming the newest complete one. Everything is written to a hidden sibling directory and renamed
into place, so a directory that exists is complete.

At data parallelism > 1 the writes are spread over the data-parallel (× context-parallel) group
(megatron's ``FullyParallelSaveStrategyWrapper``): every tensor replicated over DP (the model
weights; a non-distributed optimizer's state) is written by one DP rank, the ranks taking about
equal shares, instead of all by DP rank 0. Only which rank writes a tensor changes, not the
checkpoint's content, so it loads in any layout as before.

dist_checkpointing reshards on load (any TP/PP/VPP), with one exception handled here: the padded
vocab size is a multiple of ``make_vocab_size_divisible_by × TP``, so it can differ between the
writer's and the reader's TP. Then the embedding / output rows are read whole and re-padded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_ngrpo.architecture import padded_vocab_size, unwrap
from megatron_ngrpo.atomic import (
    atomic_directory,
    atomic_write,
    begin_directory,
    commit_directory,
)
from megatron_ngrpo.checkpoint_files import LATEST_FILE, MANIFEST_FILE, META_FILE
from megatron_ngrpo.conversion.mapping import ConversionError, Kind, raise_if, tp_shard
from megatron_ngrpo.models.config import ModelConfig
from megatron_ngrpo.models.provider import params_dtype
from megatron_ngrpo.parallel import is_rank0

FORMAT_VERSION = 1
_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


# ---------------------------------------------------------------- metadata and paths


def checkpoint_meta(cfg: ModelConfig, **extra) -> dict:
    """Metadata of a checkpoint of a model built from ``cfg`` by this process group (``extra``:
    e.g. ``step=10``)."""

    hf_config = json.loads((Path(cfg.hf_path) / "config.json").read_text())
    tp = cfg.tensor_parallel
    return {
        "format_version": FORMAT_VERSION,
        "hf_config": hf_config,
        "hf_path": str(cfg.hf_path),
        "tensor_parallel": tp,
        "pipeline_parallel": cfg.pipeline_parallel,
        "virtual_pipeline": cfg.virtual_pipeline,
        "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by,
        "padded_vocab_size": padded_vocab_size(
            hf_config["vocab_size"], tp, cfg.make_vocab_size_divisible_by
        ),
        "num_real_tokens": cfg.num_real_tokens,
        "dtype": str(params_dtype(cfg)).removeprefix("torch."),
        **extra,
    }


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the one named by ``latest`` in a run directory."""
    path = Path(path)
    if (path / LATEST_FILE).is_file():
        name = (path / LATEST_FILE).read_text().strip()
        path = path / name
    if not (path / META_FILE).is_file():
        raise ConversionError(
            f"{path}: not a megatron_ngrpo checkpoint (no {META_FILE}, no {LATEST_FILE})"
        )
    return path


def read_meta(path: str | Path) -> dict:
    """A checkpoint's metadata; an unreadable or invalid file is one :class:`ConversionError`
    line naming it."""
    file = resolve_checkpoint(path) / META_FILE
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        why = " ".join(str(e).split())[:120]
        raise ConversionError(f"{file}: unreadable checkpoint metadata ({why})") from None
    if not isinstance(meta, dict):
        raise ConversionError(f"{file}: checkpoint metadata is not a JSON object")
    return meta


def check_parts(directory: Path) -> None:
    """Every data file the checkpoint's index (torch DCP's ``.metadata``, which megatron-core's
    ``torch_dist`` format writes) names is present and long enough for the byte ranges it lists:
    a corrupt index, or a missing or truncated part, is one :class:`ConversionError` line naming
    the file, before anything is read (instead of an ``EOFError`` traceback mid-load)."""
    # lazy: torch.distributed.checkpoint is only needed where a checkpoint is loaded
    from torch.distributed.checkpoint import FileSystemReader

    try:
        index = FileSystemReader(str(directory)).read_metadata()
    except Exception as e:  # pickle's errors of a corrupt index are of many types
        raise ConversionError(
            f"{directory / '.metadata'}: unreadable checkpoint index ({type(e).__name__})"
        ) from None
    ends: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        part = directory / name
        if not part.is_file():
            raise ConversionError(f"{part}: missing (the checkpoint's index names it)")
        if (size := part.stat().st_size) < end:
            raise ConversionError(f"{part}: {size} bytes, its tensors end at byte {end}: truncated")


def model_config_for(
    path: str | Path, tp: int = 1, pp: int = 1, vpp: int | None = None, dtype: str | None = None
) -> ModelConfig:
    """A ModelConfig building the checkpoint's model in layout (tp, pp, vpp)."""
    path = resolve_checkpoint(path)
    meta = read_meta(path)
    return ModelConfig(
        hf_path=str(path),
        tensor_parallel=tp,
        pipeline_parallel=pp,
        virtual_pipeline=vpp,
        make_vocab_size_divisible_by=meta["make_vocab_size_divisible_by"],
        num_real_tokens=meta.get("num_real_tokens"),
        dtype=dtype or meta.get("dtype", "auto"),
        layer_spec="local",
    )


def write_latest(run_dir: str | Path, name: str) -> None:
    """Atomically point ``run_dir/latest`` at checkpoint ``name`` (call on one rank)."""
    atomic_write(Path(run_dir) / LATEST_FILE, name + "\n")


# ---------------------------------------------------------------- save / load


def _model_keys(chunks: list) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _sharded_state_dict(chunks: list) -> dict:
    return {k: unwrap(c).sharded_state_dict() for k, c in zip(_model_keys(chunks), chunks)}


def save_megatron_checkpoint(
    model_chunks: list,
    directory: str | Path,
    meta: dict,
    extra: dict | None = None,
    aux_from: str | Path | None = None,
    overwrite: bool = False,
    parallel_save: bool = True,
) -> Path:
    """Write a checkpoint of ``model_chunks`` (+ ``extra`` sharded entries) atomically. Every rank
    calls it. ``meta`` from :func:`checkpoint_meta`; tokenizer / generation files are copied from
    ``aux_from`` (default ``meta["hf_path"]``) when present. ``parallel_save``: spread the writes
    over the DP group (module docstring); False: DP rank 0 writes every replicated tensor."""
    # lazy: keeps conversion.checkpoint free of megatron-core at import (start-up)
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    state = _checkpoint_state(model_chunks, meta, extra)
    with atomic_directory(directory, overwrite=overwrite, manifest=MANIFEST_FILE) as tmp:
        dist_checkpointing.save(state, str(tmp), sharded_strategy=_save_strategy(parallel_save))
        _write_files(tmp, directory, meta, aux_from)
    return directory


def save_megatron_checkpoint_async(
    model_chunks: list,
    directory: str | Path,
    meta: dict,
    extra: dict | None = None,
    overwrite: bool = False,
):
    """:func:`save_megatron_checkpoint` with megatron's asynchronous save: the tensors are copied
    now (a forked writer process holds its own copy), written in the background, and the
    directory appears under its final name only when the returned ``AsyncRequest`` is
    finalized (megatron's ``AsyncCallsQueue``: every rank, after every rank's writer finished).
    Callers append their own finalize functions (e.g. pointing ``latest`` at it) after ours."""
    # lazy: keeps conversion.checkpoint free of megatron-core at import (start-up)
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    state = _checkpoint_state(model_chunks, meta, extra)
    tmp = begin_directory(directory, overwrite=overwrite)
    request = dist_checkpointing.save(
        state, str(tmp), sharded_strategy=_save_strategy(True), async_sharded_save=True
    )
    _write_files(tmp, directory, meta, None)
    request.add_finalize_fn(lambda: commit_directory(tmp, directory, manifest=MANIFEST_FILE))
    return request


def _save_strategy(parallel: bool):
    """megatron's default save strategy wrapped to spread the writes of DP-replicated tensors over
    the DP (× CP) group, as megatron-LM's ``--ckpt-fully-parallel-save``; None (megatron's
    default: DP rank 0 writes them) at DP 1, without initialized parallel state (single-process
    conversion) or when not ``parallel``. The distribution is recomputed per save (one metadata
    all-gather), not cached: one process saves several structures (the trainer's model-only
    warm-start checkpoint, its training checkpoints)."""
    # lazy: keeps conversion.checkpoint free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    if not (parallel and ps.model_parallel_is_initialized()):
        return None
    if ps.get_data_parallel_world_size(with_context_parallel=True) == 1:
        return None
    return FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(),
        ps.get_data_parallel_group(with_context_parallel=True),
    )


def _checkpoint_state(model_chunks: list, meta: dict, extra: dict | None) -> dict:
    if "hf_config" not in meta:
        raise ConversionError(
            "checkpoint metadata lacks 'hf_config' (build it with checkpoint_meta)"
        )
    return {**_sharded_state_dict(model_chunks), **(extra or {})}


def _write_files(tmp: Path, directory: Path, meta: dict, aux_from: str | Path | None) -> None:
    """Rank 0: config.json, the tokenizer / generation files and the metadata into ``tmp``."""
    # lazy: keeps conversion.checkpoint free of safetensors at import (start-up)
    from megatron_ngrpo.conversion.hf_io import copy_aux_files

    if is_rank0():
        (tmp / "config.json").write_text(json.dumps(meta["hf_config"], indent=2))
        aux = aux_from or meta.get("hf_path")
        if aux and Path(aux).is_dir() and Path(aux).resolve() != directory.resolve():
            copy_aux_files(aux, tmp)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))


def _flat_sharded_tensors(state: dict) -> list:
    """(parent dict, key, ShardedTensor) for every ShardedTensor, factories expanded."""
    # lazy: keeps conversion.checkpoint free of megatron-core at import (start-up)
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
    )

    out = []

    def walk(d):
        for k, v in d.items() if isinstance(d, dict) else enumerate(d):
            if isinstance(v, ShardedTensor):
                out.append((d, k, v))
            elif isinstance(v, ShardedTensorFactory):
                walk({k: v.build()})
            elif isinstance(v, (dict, list)):
                walk(v)

    walk(state)
    return out


def _check_against(stored: dict, state: dict, source: str) -> list:
    """One error (on every rank of the model-parallel group) listing missing / wrongly shaped
    tensors; returns the vocab tensors whose only difference is the padded row count."""
    # lazy: keeps conversion.checkpoint free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps

    missing, wrong, repad = [], [], []
    seen = set()
    for parent, k, sh in _flat_sharded_tensors(state):
        if sh.key in seen and sh.key not in _VOCAB_KEYS:
            continue
        seen.add(sh.key)
        if sh.key not in stored:
            missing.append(sh.key)
            continue
        got = tuple(stored[sh.key].global_shape)
        if got == tuple(sh.global_shape):
            continue
        if sh.key in _VOCAB_KEYS and got[1:] == tuple(sh.global_shape[1:]):
            repad.append((parent, k, sh, got))
        else:
            wrong.append(f"{sh.key} {got} (expected {tuple(sh.global_shape)})")
    raise_if(source, ps.get_model_parallel_group(), missing=missing, wrong_shape=wrong)
    return repad


@torch.no_grad()
def load_megatron_checkpoint(
    model_chunks: list, directory: str | Path, extra: dict | None = None, strict: bool = True
) -> tuple[dict, dict]:
    """Load a checkpoint (or a run directory's ``latest``) into ``model_chunks`` in their current
    layout. ``extra``: further sharded entries to load (returned loaded). Returns ``(meta, loaded
    extra)``. Missing / wrongly shaped tensors raise one :class:`ConversionError` listing them
    before anything is loaded."""
    # lazy: keeps conversion.checkpoint free of megatron-core at import (start-up)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.validation import StrictHandling

    directory = resolve_checkpoint(directory)
    meta = read_meta(directory)
    check_parts(directory)
    state = {**_sharded_state_dict(model_chunks), **(extra or {})}
    stored = dist_checkpointing.load_tensors_metadata(str(directory))
    repad = _check_against(stored, state, str(directory))
    whole = []
    for parent, k, sh, shape in repad:  # read the whole (other-padded) rows, re-pad after load
        buf = torch.empty(shape, dtype=sh.data.dtype, device=sh.data.device)
        # The whole tensor is now replicated over TP too: extend megatron's replica id with the TP
        # rank, so exactly one rank still holds the main replica (all-zero id).
        rid = sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
        parent[k] = ShardedTensor.from_rank_offsets(
            sh.key, buf, replica_id=(*rid, ps.get_tensor_model_parallel_rank())
        )
        whole.append((sh.key, buf, sh.data))
    # megatron names mismatches from the checkpoint's side: its "missing" keys are stored but not
    # requested (e.g. a training checkpoint's optimizer: fine), its "unexpected" keys are
    # requested but not stored (what is missing for us).
    loaded, _, absent = dist_checkpointing.load(
        state, str(directory), strict=StrictHandling.RETURN_ALL
    )
    raise_if(str(directory), ps.get_model_parallel_group(), missing=sorted(absent))
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    lost = []
    for key, buf, target in whole:
        padded = target.shape[0] * tp
        if buf[padded:].any():
            lost.append(f"{key} (rows {padded}..{buf.shape[0]} are not padding)")
        full = (
            buf[:padded]
            if buf.shape[0] >= padded
            else torch.cat([buf, buf.new_zeros(padded - buf.shape[0], *buf.shape[1:])])
        )
        target.copy_(tp_shard(Kind.VOCAB, full, tp, rank))
    raise_if(str(directory), ps.get_model_parallel_group(), vocab_larger_than_model=lost)
    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        model = unwrap(chunk)
        current = model.state_dict()
        sd = loaded[key]
        for name in _VOCAB_KEYS:  # re-padded rows were copied into the parameters above
            if isinstance(sd.get(name), torch.Tensor) and sd[name].shape != current[name].shape:
                sd[name] = current[name]
        model.load_state_dict(sd, strict=strict)
    return meta, {k: loaded[k] for k in (extra or {})}
