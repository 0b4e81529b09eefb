"""Training checkpoints: the shared Megatron checkpoint layout
(:mod:`megatron_ngrpo.conversion.checkpoint`: atomic directory, ``megatron_ngrpo.json``,
``latest``) plus the optimizer, every rank's RNG state, a replicated ``trainer`` entry (step,
data position, neighbour table, LR scheduler, ...) and optionally every rank's own
``rank_state`` (the one-step-off rollout in flight, training/async_rollout.py).

Optimizer state is saved as sharded tensors in model space (one tensor per parameter and state,
keyed by the parameter's sharded key), so dist_checkpointing reshards it to any TP/PP/DP layout on
load, for both optimizers. The distributed optimizer uses megatron's ``fully_reshardable`` format:
on save its DP shards are gathered (gloo, to CPU on DP rank 0) into whole TP-local tensors; on load
every rank reads whole tensors (CPU) and keeps its own flat range.

megatron-core 0.16.1 cannot load that format with torch's Adam (no apex / TE here; reproduced;
0.19.2 too, docs/ENVIRONMENT.md §2.3), for two reasons worked around in :func:`_load_distopt`:

- ``DistributedOptimizer.state_dict()`` (called by ``sharded_state_dict(is_loading=True)``) reads
  the ``step`` from the inner optimizer's per-parameter state and asserts there is exactly one
  (``assert len(steps) == 1``); torch's Adam allocates that state lazily at its first step, so a
  fresh optimizer fails. Fix: allocate Adam's state (step 0, zero moments: what Adam's first step
  would allocate) before building the sharded state dict.
- ``_set_main_param_and_optimizer_states`` copies every key of the inner state, ``step``
  included, from the loaded tensors, which hold no ``step`` (megatron keeps it in the param
  groups, as apex / TE FusedAdam do): ``KeyError: 'step'``. Fix: load the param groups, step and
  grad scaler first, then copy the tensors with ``step`` taken out of the inner state.
"""

from __future__ import annotations

import functools
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

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

# The distributed optimizer's checkpoint format (ignored by the other optimizers): model space,
# gathered over DP with gloo onto DP rank 0's CPU (not all-gathered on every GPU).
_DISTOPT_FORMAT = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
}

__all__ = [
    "checkpoint_meta",
    "iter_dir",
    "latest_checkpoint",
    "load_training_checkpoint",
    "save_training_checkpoint",
    "read_meta",
    "resolve_checkpoint",
]


def iter_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / f"iter_{step:07d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint ``run_dir/latest`` names, or None."""
    f = Path(run_dir) / LATEST_FILE
    if not f.is_file():
        return None
    path = Path(run_dir) / f.read_text().strip()
    return path if (path / META_FILE).is_file() else None


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
    if distopt:
        _allocate_adam_state(optimizer)
    extra = {
        "rng_state": _rank_object(ShardedObject, "rng_state", _rng_state()),
        "trainer": trainer_state,
        "optimizer": optimizer.sharded_state_dict(
            _sharded_state_dict(chunks), is_loading=False, metadata=_DISTOPT_FORMAT
        ),
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
            done = sorted(p for p in Path(run_dir).glob("iter_*") if (p / META_FILE).is_file())
            for p in done[:-keep_last]:
                if p.name not in protect:
                    shutil.rmtree(p, ignore_errors=True)
    dist.barrier()


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
    if distopt:
        _allocate_adam_state(optimizer)
    extra["optimizer"] = optimizer.sharded_state_dict(
        _sharded_state_dict(chunks), is_loading=True, metadata=_DISTOPT_FORMAT
    )
    _, loaded = load_megatron_checkpoint(chunks, path, extra=extra)
    if distopt:
        _load_distopt(optimizer, loaded["optimizer"])
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


def _load_distopt(optimizer, loaded: dict) -> None:
    """Load a ``fully_reshardable`` distributed-optimizer state (megatron's
    ``load_state_dict`` in two parts, see the module docstring)."""
    inner = _inner(optimizer)
    parts = [loaded] if len(inner) == 1 else [loaded[i] for i in range(len(inner))]
    for o, part in zip(inner, parts, strict=True):
        o.load_state_dict({k: v for k, v in part.items() if k != "param_state"})
        steps = {p: s.pop("step") for p, s in o.optimizer.state.items()}
        o.load_parameter_state_from_fully_reshardable(part["param_state"])
        for p, step in steps.items():
            o.optimizer.state[p]["step"] = step.clone()


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
