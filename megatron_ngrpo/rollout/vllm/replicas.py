"""Spread the generate calls of a multi-rank job over colocated engine replicas.

With vLLM colocated in a torchrun job (``distributed_executor_backend="external_launcher"``), vLLM
forms its TP groups from consecutive blocks of ``replica_size`` global ranks; each block is one
engine replica, and every rank of a replica must submit the same requests. The trainer's ranks
instead ask for their own data-parallel shard (all TP/PP ranks of a DP group ask for the same
prompts), and the layouts need not line up (vLLM TP may differ from the trainer's TP). So every
rank's ``(key, prompt)`` requests are gathered, de-duplicated by key, and replica ``r`` generates
the ``r``-th contiguous slice of the sorted keys; the replicas' results (sent by each replica's
first rank) are gathered back and each rank keeps the responses of its own keys, in its order.
Keys are global prompt indices and seed the mixing gate, so a prompt draws the same gates
whichever replica generates it.

The exchange uses ``all_gather_object`` on the default group: token ids and sparse mix records
only (no logits), a few MB per step at 7B scale.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from megatron_ngrpo.rollout.types import RolloutBatch


def gather_requests(
    prompts: list[list[int]], keys: list[int], group: dist.ProcessGroup | None = None
) -> dict[int, list[int]]:
    """Collective over ``group`` (default: all ranks): every rank's ``(key, prompt)`` requests,
    de-duplicated by key (the ranks of one data-parallel group ask for the same prompts)."""
    requests: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(requests, list(zip(keys, prompts)), group=group)
    by_key: dict[int, list[int]] = {}
    for reqs in requests:
        for key, prompt in reqs:
            if by_key.setdefault(key, prompt) != prompt:
                raise ValueError(f"generate: key {key} was asked with two different prompts")
    return by_key


def generate_on_replicas(
    generate: Callable[[list[list[int]], list[int]], RolloutBatch],
    prompts: list[list[int]],
    keys: list[int],
    replica_size: int,
) -> RolloutBatch:
    """Collective over all ranks: ``generate(prompts, keys)`` runs on this rank's replica for its
    share of every rank's requests; returns the responses of this rank's ``prompts`` (prompt-major,
    as ``generate`` returns them)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % replica_size:
        raise ValueError(
            f"engine replicas of {replica_size} ranks do not tile the world size {world}"
        )
    by_key = gather_requests(prompts, keys)
    ordered = sorted(by_key)
    replicas, replica = world // replica_size, rank // replica_size
    per = -(-len(ordered) // replicas)
    share = ordered[replica * per : (replica + 1) * per]
    batch = generate([by_key[k] for k in share], share) if share else None
    results: list = [None] * world
    leader = rank % replica_size == 0
    dist.all_gather_object(results, (share, batch) if leader and batch is not None else None)
    where = {
        k: (b, i)
        for item in results
        if item is not None
        for i, k in enumerate(item[0])
        for b in [item[1]]
    }
    return RolloutBatch.cat([where[k][0].select_prompts([where[k][1]]) for k in keys])
