"""What travels between the trainer's rollout client (rollout/remote/client.py) and the rollout
servers' worker extension (rollout/remote/server_worker.py) besides vLLM's own payloads: safetensors
bytes for tensors (weight buckets, the neighbour table; base64 inside JSON, as vLLM's
``/collective_rpc`` route takes strings), SHA-256 digests, the protocol version.

JSON keeps every value exact: token ids are ints, log-probs and mix weights are float32 values,
which a Python float (float64) holds exactly and ``json`` writes with a round-tripping repr.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping

import torch

# Bumped whenever a payload or a worker-extension method changes: a server and a client of
# different protocols refuse each other at start-up.
PROTOCOL = 3
# The servers' vLLM weight-transfer backend of each route (rollout/vllm/nccl_transfer.py: the
# proven NCCL engine, not vLLM's stock "nccl").
NCCL_BACKEND = "ngrpo_nccl"
BACKENDS = {"gloo": "gloo", "nccl": NCCL_BACKEND}


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (weight verification after a sync)."""
    return hashlib.sha256(
        t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    ).hexdigest()


def first_mismatch(
    named: Iterable[tuple[str, torch.Tensor]], expected: Mapping[str, str]
) -> str | None:
    """One line naming the first tensor of ``named`` whose SHA-256 differs from ``expected``
    (names it lacks are not checked), or None when all match."""
    for name, t in named:
        if name in expected and (got := digest(t)) != expected[name]:
            return (
                f"weight sync: {name} {list(t.shape)} arrived with SHA-256 {got[:16]}…, "
                f"the trainer sent {expected[name][:16]}…"
            )
    return None


def pack_tensors(named: list[tuple[str, torch.Tensor]], with_digests: bool = False) -> bytes:
    """safetensors bytes of ``named`` (copies: exported HF tensors may be views of one fused
    tensor, which safetensors refuses); ``with_digests`` adds each tensor's SHA-256 to the
    metadata for the receiver to check."""
    tensors = {n: t.detach().cpu().clone(memory_format=torch.contiguous_format) for n, t in named}
    meta = (
        {"sha256": json.dumps({n: digest(t) for n, t in tensors.items()})} if with_digests else None
    )
    # lazy: keeps rollout.vllm.wire free of safetensors at import (start-up)
    from safetensors.torch import save

    return save(tensors, metadata=meta)


def unpack_tensors(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and expected digests (empty when the sender sent none) of :func:`pack_tensors`
    bytes."""
    # lazy: keeps rollout.vllm.wire free of safetensors at import (start-up)
    from safetensors.torch import load

    (size,) = struct.unpack("<Q", data[:8])  # safetensors: u64 header length, then a JSON header
    meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    return load(data), json.loads(meta.get("sha256", "{}"))
