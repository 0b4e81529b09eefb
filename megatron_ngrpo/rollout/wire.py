"""What travels between the trainer's rollout client (rollout/remote_engine.py) and the rollout
servers (rollout/server.py): JSON for requests and :class:`RolloutBatch` answers, safetensors
bytes for tensors (weight buckets, the neighbour table).

JSON keeps every value exact: token ids are ints, log-probs and mix weights are float32 values,
which a Python float (float64) holds exactly and ``json`` writes with a round-tripping repr.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.rollout.types import RolloutBatch

# Bumped whenever a route or payload changes: a server and a client of different protocols refuse
# each other at start-up.
PROTOCOL = 1
SERVER_NAME = "megatron_ngrpo.rollout.server"


def batch_to_json(batch: RolloutBatch) -> dict:
    return {"prompt_ids": batch.prompt_ids, "response_ids": batch.response_ids,
            "logprobs": batch.logprobs, "finish_reasons": batch.finish_reasons,
            "prompt_index": batch.prompt_index, "texts": batch.texts, "mixes": batch.mixes.to_json(),
            "k": batch.mixes.k}


def batch_from_json(d: dict) -> RolloutBatch:
    m, k = d["mixes"], d["k"]
    noise = m.get("noise")
    mixes = MixRecord(
        seq=torch.tensor(m["seq"], dtype=torch.long), pos=torch.tensor(m["pos"], dtype=torch.long),
        ids=torch.tensor(m["ids"], dtype=torch.long).reshape(-1, k),
        weights=torch.tensor(m["weights"], dtype=torch.float32).reshape(-1, k), num_seqs=m["num_seqs"],
        noise=None if noise is None else torch.tensor(noise, dtype=torch.float32))
    return RolloutBatch(prompt_ids=d["prompt_ids"], response_ids=d["response_ids"], logprobs=d["logprobs"],
                        finish_reasons=d["finish_reasons"], mixes=mixes, prompt_index=d["prompt_index"],
                        texts=d["texts"])


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (weight verification after a sync)."""
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def pack_tensors(named: list[tuple[str, torch.Tensor]], with_digests: bool = False) -> bytes:
    """safetensors bytes of ``named`` (copies: exported HF tensors may be views of one fused
    tensor, which safetensors refuses); ``with_digests`` adds each tensor's SHA-256 to the
    metadata for the receiver to check."""
    tensors = {n: t.detach().cpu().clone(memory_format=torch.contiguous_format) for n, t in named}
    meta = {"sha256": json.dumps({n: digest(t) for n, t in tensors.items()})} if with_digests else None
    from safetensors.torch import save

    return save(tensors, metadata=meta)


def unpack_tensors(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and expected digests (empty when the sender sent none) of :func:`pack_tensors`
    bytes."""
    from safetensors.torch import load

    (size,) = struct.unpack("<Q", data[:8])  # safetensors: u64 header length, then a JSON header
    meta = json.loads(data[8:8 + size]).get("__metadata__") or {}
    return load(data), json.loads(meta.get("sha256", "{}"))
