"""Training checkpoints: the shared Megatron checkpoint layout
(:mod:`megatron_ngrpo.conversion.checkpoint`: atomic directory, ``megatron_ngrpo.json``,
``latest``) plus the optimizer, every rank's RNG state, a replicated ``trainer`` entry (step,
data position, neighbour table, LR scheduler, ...) and optionally every rank's own
``rank_state`` (the one-step-off rollout in flight, training/async_rollout.py).

Optimizer state: the non-distributed optimizer is saved as sharded tensors (reshardable). The
distributed optimizer's dist-checkpointing formats save but do not load in megatron-core 0.16
(docs/ENVIRONMENT.md §2.3), and its legacy ``save/load_parameter_state`` (dp_zero) fails to load with
torch's Adam (no ``step`` in the saved tensors: ``KeyError: 'step'``). So each rank saves its own
shard (``distopt/rankNNNNN.pt``: inner optimizer state, fp32 master shards, grad scaler):
resuming the distributed optimizer needs the same world size and layout.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_ngrpo.conversion.checkpoint import (
    LATEST_FILE,
    META_FILE,
    checkpoint_meta,
    load_megatron_checkpoint,
    read_meta,
    resolve_checkpoint,
    save_megatron_checkpoint,
    write_latest,
)

__all__ = ["checkpoint_meta", "iter_dir", "latest_checkpoint", "load_training_checkpoint",
           "save_training_checkpoint", "read_meta", "resolve_checkpoint"]


def iter_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / f"iter_{step:07d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint ``run_dir/latest`` names, or None."""
    f = Path(run_dir) / LATEST_FILE
    if not f.is_file():
        return None
    path = Path(run_dir) / f.read_text().strip()
    return path if (path / META_FILE).is_file() else None


def save_training_checkpoint(run_dir: str | Path, step: int, chunks: list, meta: dict, optimizer,
                             trainer_state: dict, keep_last: int = 0, protect: tuple[str, ...] = (),
                             rank_state: dict | None = None) -> Path:
    """Write ``run_dir/iter_<step>`` atomically (collective), point ``latest`` at it and delete
    all but the newest ``keep_last`` (0 = keep all; names in ``protect`` are kept).
    ``rank_state``: this rank's own object (None on every rank, or given on every rank)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_ngrpo.conversion.checkpoint import _sharded_state_dict

    final = iter_dir(run_dir, step)
    distopt = _is_distributed(optimizer)
    extra = {"rng_state": _rank_object(ShardedObject, "rng_state", _rng_state()), "trainer": trainer_state}
    if rank_state is not None:
        extra["rank_state"] = _rank_object(ShardedObject, "rank_state", rank_state)
    if not distopt:
        extra["optimizer"] = optimizer.sharded_state_dict(_sharded_state_dict(chunks), is_loading=False)
    meta = {**meta, "step": step, "world_size": dist.get_world_size(), "distributed_optimizer": distopt,
            "rank_state": rank_state is not None}
    save_megatron_checkpoint(chunks, final, meta, extra=extra, overwrite=True)
    if distopt:
        _save_distopt(optimizer, final)
    if dist.get_rank() == 0:
        write_latest(run_dir, final.name)
        if keep_last:
            done = sorted(p for p in Path(run_dir).glob("iter_*") if (p / META_FILE).is_file())
            for p in done[:-keep_last]:
                if p.name not in protect:
                    shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    return final


def load_training_checkpoint(path: str | Path, chunks: list, optimizer) -> dict:
    """Restore model, optimizer and (same world size only) RNG states from ``path`` (collective);
    returns the ``trainer`` entry, with this rank's ``rank_state`` under that key when saved."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_ngrpo.conversion.checkpoint import _sharded_state_dict

    meta = read_meta(path)
    distopt = _is_distributed(optimizer)
    if distopt != bool(meta.get("distributed_optimizer")):
        raise ValueError(f"{path}: saved with optim.distributed_optimizer = "
                         f"{bool(meta.get('distributed_optimizer'))}, resuming with {distopt}")
    same_world = meta.get("world_size") == dist.get_world_size()
    extra = {"trainer": {}}
    if meta.get("rank_state"):
        if not same_world:
            raise ValueError(f"{path}: holds per-rank state (a one-step-off rollout in flight) of "
                             f"{meta.get('world_size')} ranks; resume with the same layout (now "
                             f"{dist.get_world_size()} ranks)")
        extra["rank_state"] = _rank_object(ShardedObject, "rank_state", None)
    if same_world:
        extra["rng_state"] = _rank_object(ShardedObject, "rng_state", None)
    if not distopt:
        extra["optimizer"] = optimizer.sharded_state_dict(_sharded_state_dict(chunks), is_loading=True)
    _, loaded = load_megatron_checkpoint(chunks, path, extra=extra)
    if distopt:
        _load_distopt(optimizer, Path(path))
    else:
        optimizer.load_state_dict(loaded["optimizer"])
    if same_world:
        _set_rng_state(loaded["rng_state"])
    if "rank_state" in extra:
        return {**loaded["trainer"], "rank_state": loaded["rank_state"]}
    return loaded["trainer"]


# ---- internals -----------------------------------------------------------------------------
def _rank_object(sharded_object, key: str, data):
    """This rank's own ``data`` as one shard of a [world] object (restored only at the same size)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    return sharded_object(key, data, (world,), (rank,), replica_id=0)


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in inner)


def _distopt_file(path: Path) -> Path:
    return path / "distopt" / f"rank{dist.get_rank():05d}.pt"


def _save_distopt(optimizer, path: Path) -> None:
    """This rank's optimizer shard: the inner torch optimizer's state (moments, step), the fp32
    master shards of low-precision parameters and the grad scaler. Written into the already
    renamed checkpoint, before ``latest`` points at it."""
    f = _distopt_file(path)
    if dist.get_rank() == 0:
        f.parent.mkdir(exist_ok=True)
    dist.barrier()
    shards = []
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        shards.append({
            "inner": o.optimizer.state_dict(),
            "masters": [p.detach().clone() for g in o.shard_fp32_from_float16_groups for p in g],
            "grad_scaler": o.grad_scaler.state_dict() if o.grad_scaler else None,
        })
    torch.save(shards, f)
    dist.barrier()


def _load_distopt(optimizer, path: Path) -> None:
    f = _distopt_file(path)
    saved_world = read_meta(path).get("world_size")
    if saved_world != dist.get_world_size() or not f.is_file():
        raise ValueError(f"{path}: distributed-optimizer state was saved by {saved_world} ranks; resume "
                         f"with the same layout (now {dist.get_world_size()} ranks)")
    shards = torch.load(f, weights_only=False)
    with torch.no_grad():
        for o, shard in zip(getattr(optimizer, "chained_optimizers", [optimizer]), shards, strict=True):
            o.optimizer.load_state_dict(shard["inner"])
            masters = [p for g in o.shard_fp32_from_float16_groups for p in g]
            for p, q in zip(masters, shard["masters"], strict=True):
                p.copy_(q)
            if o.grad_scaler and shard["grad_scaler"]:
                o.grad_scaler.load_state_dict(shard["grad_scaler"])


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
