"""Who wrote what in a megatron ``dist_checkpointing`` checkpoint (tests of parallel writes)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

# per-rank ShardedObjects of training checkpoints (training/checkpoint.py), neither model nor optimizer
_RANK_OBJECTS = ("rng_state", "rank_state")


def written_bytes(checkpoint: str | Path) -> dict[str, dict[int, int]]:
    """Bytes of ``optimizer`` / ``model`` tensors (``objects``: per-rank RNG / rank state) in each
    rank's files (``__<rank>_<n>.distcp``), from the checkpoint's torch.distributed.checkpoint
    metadata: ``{kind: {rank: bytes}}``."""
    out = {"optimizer": defaultdict(int), "model": defaultdict(int), "objects": defaultdict(int)}
    for index, info in FileSystemReader(str(checkpoint)).read_metadata().storage_data.items():
        rank = int(info.relative_path.split("_")[2])
        if index.fqn.startswith("optimizer."):
            kind = "optimizer"
        elif index.fqn.startswith(_RANK_OBJECTS):
            kind = "objects"
        else:
            kind = "model"
        out[kind][rank] += info.length
    return out
