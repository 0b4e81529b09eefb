"""Training checkpoints: the shared Megatron checkpoint layout
(:mod:`megatron_ngrpo.conversion.checkpoint`: atomic directory, ``megatron_ngrpo.json``,
``latest``) plus the optimizer, every rank's RNG state, a replicated ``trainer`` entry (step,
data position, neighbour table, LR scheduler, ...) and optionally every rank's own
``rank_state`` (the one-step-off rollout in flight, training/async_rollout.py).

Every rank writes its part in parallel. Tensors replicated over DP (the model weights, torch
Adam's state) are spread over the DP ranks, each writing about 1/DP of them (megatron's fully
parallel save wrapper, sync and async saves: conversion/checkpoint.py). Optimizer state is saved
as sharded tensors in model space (one tensor per parameter and state, keyed by the parameter's
sharded key), so dist_checkpointing reshards it to any TP/PP/DP layout on load, for both
optimizers. The distributed optimizer's state is written in parallel: each rank writes only its
own DP shard, as the row-major blocks that shard's flat range of each parameter makes
(:func:`_blocks`; no data exchange), and reads the blocks its own range needs in the layout it
resumes in. The tensors' keys and shapes are those of megatron's ``fully_reshardable`` format
(which gathers every DP group's state onto DP rank 0 to write it), so checkpoints written in that
format load too. Megatron's own parallel formats do not fit here: ``dp_reshardable`` cannot
change TP/PP and ``fully_sharded_model_space`` saves ``flattened_range`` tensors, which
megatron-core 0.16.1 refuses (docs/ENVIRONMENT.md §2.3).

Loading with torch's Adam (no apex / TE here): ``DistributedOptimizer.state_dict()`` reads the
``step`` from the inner optimizer's per-parameter state and asserts there is exactly one
(``assert len(steps) == 1``); torch's Adam allocates that state lazily at its first step, so a
fresh optimizer fails. Fix: allocate Adam's state (step 0, zero moments: what Adam's first step
would allocate) before building the sharded state dict. The param groups, step and grad scaler
are loaded with megatron's ``load_state_dict`` (the step goes into every parameter's state from
the param groups), the tensors are copied into the optimizer's own shards afterwards.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_ngrpo.checkpoint_files import iter_dirs, verify_checkpoint
from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.conversion.checkpoint import (
    LATEST_FILE,
    META_FILE,
    _sharded_state_dict,
    checkpoint_meta,
    load_megatron_checkpoint,
    read_meta,
    resolve_checkpoint,
    save_megatron_checkpoint,
    save_megatron_checkpoint_async,
    write_latest,
)

# ``param_state_sharding_type`` of the distributed optimizer's entry (docstring above)
DISTOPT_FORMAT = "model_space_dp_blocks"
METRICS_FILE = "metrics.jsonl"

logger = logging.getLogger(__name__)

__all__ = [
    "RunDirError",
    "checkpoint_meta",
    "iter_dir",
    "latest_checkpoint",
    "load_training_checkpoint",
    "resume_point",
    "save_training_checkpoint",
    "read_meta",
    "resolve_checkpoint",
    "verify_checkpoint",
]


class RunDirError(ConfigError):
    """A run directory this run may not continue or start in (one line)."""


def iter_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / f"iter_{step:07d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint ``run_dir/latest`` names, or None."""
    f = Path(run_dir) / LATEST_FILE
    if not f.is_file():
        return None
    path = Path(run_dir) / f.read_text().strip()
    return path if (path / META_FILE).is_file() else None


def resume_point(run_dir: str | Path, resume: bool = True) -> Path | None:
    """The checkpoint a run in ``run_dir`` continues from, or None to start at step 0.

    ``latest`` names a verified checkpoint: that one. ``latest`` missing, empty or naming a
    checkpoint that is missing or fails :func:`verify_checkpoint`: the newest verified
    ``iter_*``, with one warning naming what was wrong. Nothing verified in a run directory that
    holds a run's history (``iter_*``, ``metrics.jsonl``): :class:`RunDirError`, one line, as
    starting at step 0 there would rewrite the history. ``resume`` False (told to start over):
    None. Reads files only (every rank, before any process group)."""
    run_dir = Path(run_dir)
    if not resume:
        return None
    pointer = run_dir / LATEST_FILE
    named = pointer.read_text().strip() if pointer.is_file() else None
    if named:
        problem = verify_checkpoint(run_dir / named)
        if problem is None:
            return run_dir / named
        problem = f"{pointer} names {named}: {problem}"
    else:
        problem = f"{pointer} is empty" if named is not None else f"{pointer} is missing"
    found = iter_dirs(run_dir)
    skipped = []
    for path in reversed(found):
        bad = verify_checkpoint(path)
        if bad is None:
            _warn(f"{problem}; resuming from {path.name}, the newest verified{_listed(skipped)}")
            return path
        skipped.append(bad)
    if named is None and not found and not (run_dir / METRICS_FILE).is_file():
        return None  # a new run
    raise RunDirError(
        f"{run_dir} holds a run ({len(found)} iter_* folder(s), "
        f"{METRICS_FILE}: {(run_dir / METRICS_FILE).is_file()}) but no checkpoint to resume: "
        f"{problem}{_listed(skipped)}; set train.resume=false to start it over"
    )


def save_training_checkpoint(
    run_dir: str | Path,
    step: int,
    chunks: list,
    meta: dict,
    optimizer,
    trainer_state: dict,
    keep_last: int = 0,
    protect: tuple[str, ...] = (),
    rank_state: dict | None = None,
    async_queue=None,
) -> Path:
    """Write ``run_dir/iter_<step>`` atomically (collective), point ``latest`` at it and delete
    all but the newest ``keep_last`` (0 = keep all; names in ``protect`` are kept).
    ``rank_state``: this rank's own object (None on every rank, or given on every rank).
    ``async_queue``: a megatron ``AsyncCallsQueue``; the save is scheduled on it (written in the
    background) and the directory, ``latest`` and the pruning happen when the queue finalizes
    it, so ``latest`` never names an incomplete checkpoint."""
    # lazy: keeps training.checkpoint free of megatron-core at import (start-up)
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    final = iter_dir(run_dir, step)
    distopt = _is_distributed(optimizer)
    extra = {
        "rng_state": _rank_object(ShardedObject, "rng_state", _rng_state()),
        "trainer": trainer_state,
        "optimizer": _optimizer_state(optimizer, chunks, is_loading=False)[0],
    }
    if rank_state is not None:
        extra["rank_state"] = _rank_object(ShardedObject, "rank_state", rank_state)
    meta = {
        **meta,
        "step": step,
        "world_size": dist.get_world_size(),
        "distributed_optimizer": distopt,
        "rank_state": rank_state is not None,
    }
    publish = functools.partial(_publish, run_dir, final.name, keep_last, protect)
    if async_queue is not None:
        request = save_megatron_checkpoint_async(chunks, final, meta, extra=extra, overwrite=True)
        request.add_finalize_fn(publish)
        async_queue.schedule_async_request(request)
        return final
    save_megatron_checkpoint(chunks, final, meta, extra=extra, overwrite=True)
    publish()
    return final


def _publish(run_dir: str | Path, name: str, keep_last: int, protect: tuple[str, ...]) -> None:
    """Point ``latest`` at the complete checkpoint ``name``, prune (collective)."""
    if dist.get_rank() == 0:
        write_latest(run_dir, name)
        if keep_last:
            prune(run_dir, name, keep_last, protect)
    dist.barrier()


def prune(run_dir: str | Path, kept: str, keep_last: int, protect: tuple[str, ...] = ()) -> None:
    """Delete the ``iter_*`` folders older than the just written ``kept`` but the newest
    ``keep_last - 1`` verified ones and those in ``protect``. Nothing is deleted when ``kept``
    fails verification (the older ones are then the run's last good state), and nothing newer
    than ``kept`` (a run resumed from an older checkpoint rewrites those itself)."""
    run_dir = Path(run_dir)
    if verify_checkpoint(run_dir / kept) is not None:
        return
    older = [p for p in iter_dirs(run_dir) if p.name < kept]
    verified = [p for p in older if verify_checkpoint(p) is None]
    keep = set(verified[len(verified) - keep_last + 1 :]) if keep_last > 1 else set()
    for p in older:
        if p not in keep and p.name not in protect:
            shutil.rmtree(p, ignore_errors=True)


def load_training_checkpoint(path: str | Path, chunks: list, optimizer) -> dict:
    """Restore model, optimizer and (same world size only) RNG states from ``path`` (collective),
    in the current layout (any TP/PP/DP); returns the ``trainer`` entry, with this rank's
    ``rank_state`` under that key when saved."""
    # lazy: keeps training.checkpoint free of megatron-core at import (start-up)
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    meta = read_meta(path)
    distopt = _is_distributed(optimizer)
    if distopt != bool(meta.get("distributed_optimizer")):
        raise ValueError(
            f"{path}: saved with optim.distributed_optimizer = "
            f"{bool(meta.get('distributed_optimizer'))}, resuming with {distopt}"
        )
    same_world = meta.get("world_size") == dist.get_world_size()
    extra = {"trainer": {}}
    if meta.get("rank_state"):
        if not same_world:
            raise ValueError(
                f"{path}: holds per-rank state (a one-step-off rollout in flight) of "
                f"{meta.get('world_size')} ranks; resume with the same layout (now "
                f"{dist.get_world_size()} ranks)"
            )
        extra["rank_state"] = _rank_object(ShardedObject, "rank_state", None)
    if same_world:
        extra["rng_state"] = _rank_object(ShardedObject, "rng_state", None)
    extra["optimizer"], blocks = _optimizer_state(optimizer, chunks, is_loading=True)
    _, loaded = load_megatron_checkpoint(chunks, path, extra=extra)
    if distopt:
        _load_distopt(optimizer, loaded["optimizer"], blocks)
    else:
        optimizer.load_state_dict(loaded["optimizer"])
    if same_world:
        _set_rng_state(loaded["rng_state"])
    if "rank_state" in extra:
        return {**loaded["trainer"], "rank_state": loaded["rank_state"]}
    return loaded["trainer"]


# ---- internals -----------------------------------------------------------------------------
def _listed(skipped: list[str]) -> str:
    return f" (skipped: {'; '.join(skipped)})" if skipped else ""


def _warn(line: str) -> None:
    """One warning, from the first rank only (every rank reads the same files)."""
    if int(os.environ.get("RANK", "0")) == 0:
        logger.warning(line)


def _rank_object(sharded_object, key: str, data):
    """This rank's own ``data`` as one shard of a [world] object (restored only at the same size)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    return sharded_object(key, data, (world,), (rank,), replica_id=0)


def _is_distributed(optimizer) -> bool:
    # lazy: keeps training.checkpoint free of megatron-core at import (start-up)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in _inner(optimizer))


def _inner(optimizer) -> list:
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _allocate_adam_state(optimizer) -> None:
    """Give every parameter of the inner torch Adam its state (step 0, zero moments) if it has
    none yet: the state Adam's first step would allocate, so nothing changes numerically."""
    for o in _inner(optimizer):
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                if not o.optimizer.state[p]:
                    o.optimizer.state[p] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }


def _optimizer_state(optimizer, chunks, is_loading: bool) -> tuple[dict, list]:
    """The optimizer's sharded state dict, and for the distributed optimizer where each of its
    blocks goes on load: ``(its keys in the state dict, inner optimizer, model param, state name,
    start, end)``, ``[start, end)`` a range of the flat optimizer tensor of that param and state.

    Distributed optimizer: per inner optimizer (chained: under its index, as megatron nests them)
    its ``state_dict()`` (param groups, step, grad scaler) and ``param_state[i][name][j]``: block
    j of this rank's shard of the i-th parameter's ``name`` (``param``: the fp32 main weights,
    ``exp_avg``, ``exp_avg_sq``), a view of the optimizer's own tensor."""
    # lazy: keeps training.checkpoint free of megatron-core at import (start-up)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    model_state = _sharded_state_dict(chunks)
    if not _is_distributed(optimizer):
        return optimizer.sharded_state_dict(model_state, is_loading=is_loading), []
    _allocate_adam_state(optimizer)
    model = {
        sh.data: sh for sh in nested_values(extract_sharded_tensors_and_factories(model_state)[0])
    }
    inner = _inner(optimizer)
    parts, blocks = [], []
    for n, o in enumerate(inner):
        param_state = {}
        for i, (param, rng) in enumerate(_param_ranges(o)):
            tensors = o._get_main_param_and_optimizer_states(param)
            param_state[i] = {}
            names = sorted(tensors.keys() - {"step"})  # megatron keeps the step in param_groups
            for name in names:
                flat = tensors[name].detach().view(-1)
                param_state[i][name] = {}
                for j, (sh, lo, hi) in enumerate(_param_blocks(model[param], rng.start, rng.end)):
                    piece = flat[lo - rng.start : hi - rng.start].view(sh.local_shape)
                    rid = sh.replica_id  # (PP, TP, DP): every DP rank holds its own range
                    assert len(rid) == 3, f"expected replica_id (PP, TP, DP), got {sh}"
                    param_state[i][name][j] = replace(
                        sh,
                        key=f"optimizer.state.{name}.{sh.key}",
                        data=piece,
                        dtype=piece.dtype,
                        replica_id=(*rid[:2], o.distributed_optimizer_instance_id),
                    )
                    path = ((n,) if len(inner) > 1 else ()) + ("param_state", i, name, j)
                    blocks.append((path, o, param, name, lo - rng.start, hi - rng.start))
        parts.append(
            {
                **o.state_dict(),
                "param_state": param_state,
                "param_state_sharding_type": DISTOPT_FORMAT,
            }
        )
    return (parts[0] if len(parts) == 1 else dict(enumerate(parts))), blocks


def _param_ranges(o) -> list:
    """(model param, ``Range`` of its flattened elements in this DP rank's shard) of the
    distributed optimizer ``o``, in megatron's order."""
    return [
        (param, ranges["param"])
        for gbuf_range_maps in o.gbuf_ranges
        for gbuf_range_map_for_all_buckets in gbuf_range_maps.values()
        for gbuf_range_map in gbuf_range_map_for_all_buckets
        for param, ranges in gbuf_range_map["param_map"].items()
    ]


def _param_blocks(model_sh, start: int, end: int) -> list:
    """The flat range ``[start, end)`` of a model parameter as (data-less ``ShardedTensor`` of a
    block in the parameter's global tensor, block start, block end) in row-major order. A
    factory's tensors (e.g. SwiGLU's two halves) are built on a meta tensor: each is a
    contiguous view of the parameter, its storage offset its first element's flat index."""
    # lazy: keeps training.checkpoint free of megatron-core at import (start-up)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    meta = torch.empty(model_sh.data.shape, dtype=model_sh.data.dtype, device="meta")
    built = replace(model_sh, data=meta)
    if isinstance(built, ShardedTensorFactory):
        built = built.build()
    out = []
    for sh in [built] if isinstance(built, ShardedTensor) else nested_values(built):
        assert isinstance(sh, ShardedTensor) and sh.data.is_contiguous(), sh
        first = sh.data.storage_offset()
        lo, hi = max(start, first), min(end, first + sh.data.numel())
        pre = sh.prepend_axis_num  # folded into the block as size-1 axes
        for offset, size in _blocks(tuple(sh.data.shape), lo - first, hi - first):
            block = ShardedTensor(
                key=sh.key,
                data=None,
                dtype=sh.dtype,
                local_shape=(1,) * pre + size,
                global_shape=sh.global_shape,
                global_offset=sh.global_offset[:pre]
                + tuple(g + o for g, o in zip(sh.global_offset[pre:], offset, strict=True)),
                axis_fragmentations=None,
                replica_id=sh.replica_id,
            )
            out.append((block, lo, lo + math.prod(size)))
            lo += math.prod(size)
    return out


def _blocks(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """The row-major range ``[lo, hi)`` of a tensor of ``shape`` as consecutive rectangular
    blocks ``(offset, size)`` (at most 2·ndim − 1): dist_checkpointing stores rectangles only."""
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    row = math.prod(shape[1:])
    first, end = lo // row, hi // row

    def within(r: int, a: int, b: int) -> list:
        return [((r, *o), (1, *s)) for o, s in _blocks(shape[1:], a, b)]

    if first == (hi - 1) // row:
        return within(first, lo - first * row, hi - first * row)
    out = []
    if lo % row:
        out += within(first, lo % row, row)
        first += 1
    if end > first:
        out.append(((first, *(0,) * (len(shape) - 1)), (end - first, *shape[1:])))
    if hi % row:
        out += within(end, 0, hi % row)
    return out


@torch.no_grad()
def _load_distopt(optimizer, loaded: dict, blocks: list) -> None:
    """Load the distributed optimizer's state: param groups, step and grad scaler with megatron's
    ``load_state_dict``, then every loaded block into the optimizer's own tensors."""
    inner = _inner(optimizer)
    parts = [loaded] if len(inner) == 1 else [loaded[i] for i in range(len(inner))]
    for o, part in zip(inner, parts, strict=True):
        o.load_state_dict(
            {k: v for k, v in part.items() if k not in ("param_state", "param_state_sharding_type")}
        )
        # megatron gives every parameter's state one shared step tensor; torch's Adam adds 1 to
        # each parameter's in place
        for state in o.optimizer.state.values():
            state["step"] = state["step"].clone()
    for path, o, param, name, lo, hi in blocks:
        value = loaded
        for k in path:
            value = value[k]
        o._get_main_param_and_optimizer_states(param)[name].detach().view(-1)[lo:hi].copy_(
            value.reshape(-1)
        )


def _rng_state() -> dict:
    # lazy: keeps training.checkpoint free of megatron-core at import (start-up)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    # lazy: keeps training.checkpoint free of megatron-core at import (start-up)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
