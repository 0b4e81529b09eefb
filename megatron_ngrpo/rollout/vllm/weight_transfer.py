"""Megatron → vLLM weight sync through vLLM 0.32's weight-transfer API
(``vllm/distributed/weight_transfer/``).

The trainer side is a vLLM ``TrainerWeightTransferEngine`` driven through
``WeightTransferTrainerFactory`` for every route, on a :class:`MegatronSource` (the model as HF
tensors, names and shapes from :mod:`megatron_ngrpo.conversion.mapping`):

* ``gloo`` (registered here, both sides): CPU / tests. A two-member gloo group (trainer sender,
  vLLM worker) over a TCP store opened by the trainer (bound to ``host``); tensors travel in the
  project's buckets (rollout/vllm/buckets.py: one flat byte buffer of up to ``bucket_bytes``,
  ``verify``: each tensor's SHA-256 checked by the worker before loading). The store admits
  anyone who reaches it, so both members prove a per-session key before any weights move
  (:func:`_prove_pair`).
* ``nccl`` (disaggregated, GPU; rollout/vllm/nccl_transfer.py, both sides): the same buckets,
  broadcast over an NCCL communicator whose unique id the trainer mints only after the server's
  workers proved the job's secret for this sync, and whose members prove it again over the
  communicator before any weights move. Not run on a GPU.
* ``ipc`` (colocated, GPU): vLLM's own engine, packed into buffers of ``bucket_bytes``. Not
  measured here (no GPU).
* ``nccl_m2n`` (vLLM's shard-to-shard engine) is not wired: its trainer engine needs vLLM's
  ``M2NWeightSource`` (DTensor-style placements per parameter of one HF tensor), while a
  Megatron shard of ``linear_qkv`` / ``linear_fc1`` fuses several; colocated shard-to-shard runs
  on the routes above instead (below).

Memory: the source gathers one Megatron parameter at a time over TP (and broadcasts it over PP),
and the sender holds at most one bucket (a tensor larger than the bucket travels alone; the
``gloo`` / ``nccl`` sender keeps that buffer between syncs), so the peak extra memory is one bucket plus
one full tensor, never the model. Every rank is the sender of its own colocated vLLM engine;
the gather is a collective of the model-parallel group. With ``MegatronSource(tp_shards=...)``
(colocated, vLLM's TP size divides the trainer's) the linear layers are not gathered: each rank
sends its vLLM worker's shards as HF slices (its own, or merged from a few ranks' slices) and the
worker's loaders take them as they are (``VLLMEngine.tp_shards``); only the vocabulary matrices
are gathered.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import base
from vllm.distributed.weight_transfer import factory as _factory

from megatron_ngrpo.conversion.hf_export import export_hf_layout, export_hf_tensors
from megatron_ngrpo.parallel import collective_timeout, listening_store
from megatron_ngrpo.rollout.vllm import nccl_transfer
from megatron_ngrpo.rollout.vllm.buckets import (
    BucketReceiver,
    BucketSender,
    BucketUpdateInfo,
    WeightSyncError,
    _Staging,
    in_thread,
)
from megatron_ngrpo.rollout.vllm.wire import NCCL_BACKEND

# ---------------------------------------------------------------- the trainer's weights


class MegatronSource(base.WeightSource):
    """This rank's Megatron chunks as a vLLM ``WeightSource``: ``(HF name, full tensor)`` in
    model order (:func:`~megatron_ngrpo.conversion.hf_export.export_hf_tensors`; iterating is a
    collective of the model-parallel group; ``tp_shards``: the linear layers' slices of a
    :class:`~megatron_ngrpo.conversion.hf_export.TPShard`). ``metadata()`` is the HF layout in
    export order."""

    def __init__(self, chunks, spec, tp_shards=None):
        self.chunks, self.spec, self.tp_shards = chunks, spec, tp_shards

    def metadata(self) -> list:
        return [
            base.ParamMeta(n, dtype, shape)
            for n, shape, dtype in export_hf_layout(self.chunks, self.spec, self.tp_shards)
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return export_hf_tensors(self.chunks, self.spec, tp_shards=self.tp_shards)


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an offline ``vllm.LLM`` (whose methods take
    request dicts)."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


# ---------------------------------------------------------------- gloo: the wire format


@dataclass
class GlooInitInfo(base.WeightTransferInitInfo):
    """Worker side: where the trainer's TCP store listens, and the session key both members
    prove before any weights move (:func:`_prove_pair`)."""

    host: str
    port: int
    timeout_s: float = 1800.0
    key: str = ""


def _pair_group(host: str, port: int, rank: int, timeout_s: float, key: str, store=None):
    """The two-member gloo group (rank 0 trainer, rank 1 vLLM worker), its peer proven to hold
    ``key`` (:func:`_prove_pair`)."""

    if not key:
        raise WeightSyncError(f"weight-transfer group at {host}:{port}: no session key")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, 2, is_master=False, timeout=timeout)
    group = dist.ProcessGroupGloo(store, rank, 2, timeout)
    _prove_pair(group, rank, key, f"{host}:{port}")
    return group


_ROLES = (b"trainer", b"worker")


def _prove_pair(group, rank: int, key: str, where: str) -> None:
    """Mutual challenge-response over the new pair group: each member sends a fresh nonce and
    answers the other's with HMAC-SHA256(key, role + nonce); WeightSyncError (one line) unless
    the peer's answer is right, before any weights move.

    Why: the TCP store that forms the group takes whoever reaches its port (it has no
    authentication), so a stranger could join as the worker and receive the weights, or as the
    trainer and feed them. ``key`` is fresh per transfer session and reaches the worker only
    over the authenticated control route (the rollout server's secret-guarded HTTP, or an
    in-process call). Not covered: a man in the middle who rewrites the store's addresses and
    relays the group's traffic can read the weights (gloo does not encrypt); ``verify`` (digests
    over the control route) catches any change to them."""
    mine = torch.frombuffer(bytearray(secrets.token_bytes(32)), dtype=torch.uint8)
    theirs, answer = torch.empty(32, dtype=torch.uint8), torch.empty(32, dtype=torch.uint8)
    peer = 1 - rank

    def exchange(out: torch.Tensor, into: torch.Tensor, tag: int) -> None:
        # rank 0 speaks first: gloo pairs a send with the matching receive by tag
        ops = [lambda: group.send([out], peer, tag), lambda: group.recv([into], peer, tag)]
        for op in ops if rank == 0 else ops[::-1]:
            op().wait()

    def mac(role: bytes, nonce: torch.Tensor) -> bytes:
        return hmac.new(key.encode(), role + nonce.numpy().tobytes(), hashlib.sha256).digest()

    exchange(mine, theirs, 1)
    proof = torch.frombuffer(bytearray(mac(_ROLES[rank], theirs)), dtype=torch.uint8)
    exchange(proof, answer, 2)
    if not hmac.compare_digest(answer.numpy().tobytes(), mac(_ROLES[peer], mine)):
        raise WeightSyncError(
            f"weight-transfer group at {where}: the {_ROLES[peer].decode()} that joined did not "
            "prove the session key (a process other than the job's reached the rendezvous port); "
            "no weights sent or received"
        )


class GlooWeightTransferEngine(
    BucketReceiver, base.WeightTransferEngine[GlooInitInfo, BucketUpdateInfo]
):
    """vLLM worker side of the ``gloo`` route (registered as ``"gloo"``)."""

    init_info_cls = GlooInitInfo
    update_info_cls = BucketUpdateInfo

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.group = _pair_group(
            init_info.host, init_info.port, 1, init_info.timeout_s, init_info.key
        )

    def _receive(self, size: int) -> torch.Tensor:
        buf = torch.empty(size, dtype=torch.uint8)
        self.group.recv([buf], 0, 0).wait()
        return buf

    def shutdown(self) -> None:
        self.group = None


@dataclass
class GlooTrainerInitInfo(base.TrainerInitInfo):
    """Trainer side of the ``gloo`` route: the TCP store's host (port 0: any free port), the
    bucket size and whether the worker checks each tensor's SHA-256."""

    backend: ClassVar[str] = "gloo"
    host: str = "127.0.0.1"
    port: int = 0
    bucket_bytes: int = 512 * 2**20
    verify: bool = False
    timeout_s: float = 1800.0


class GlooTrainerWeightTransferEngine(
    BucketSender, base.TrainerWeightTransferEngine[GlooTrainerInitInfo]
):
    """Sends the source in buckets over the pair group; the worker receives inside
    ``update_weights``, which runs on a helper thread meanwhile (both sides meet in the same
    send/recv)."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=True)
        engine.info = init_info
        store = listening_store(
            init_info.host, init_info.port, 2, datetime.timedelta(seconds=init_info.timeout_s)
        )
        key = secrets.token_hex(32)
        worker = asdict(GlooInitInfo(init_info.host, store.port, init_info.timeout_s, key))
        join = in_thread(client.init_weight_transfer_engine, worker)
        engine.group = _pair_group(
            init_info.host, store.port, 0, init_info.timeout_s, key, store=store
        )
        join(init_info.timeout_s, "init_weight_transfer_engine")
        engine.store = store
        engine.stats = {}
        engine.staging = _Staging()
        return engine

    def _transmit(self, buf: torch.Tensor) -> None:
        self.group.send([buf], 1, 0).wait()

    def shutdown(self) -> None:
        self.group = self.store = self.staging = None


def register() -> None:
    """Register the project's engines with vLLM's factories, both sides (idempotent; call before
    building an ``LLM`` with ``weight_transfer_config={"backend": "gloo"}`` in this process, and
    in every server worker: rollout/remote/server_worker.py)."""
    engines = _factory.WeightTransferEngineFactory
    trainers = _factory.WeightTransferTrainerFactory
    for name, cls in (
        ("gloo", GlooWeightTransferEngine),
        (NCCL_BACKEND, nccl_transfer.ProvenNCCLWeightTransferEngine),
    ):
        if name not in engines._registry:
            engines.register_engine(name, cls)
    for cls in (GlooTrainerWeightTransferEngine, nccl_transfer.NCCLUidTrainerWeightTransferEngine):
        if cls.init_info_cls.backend not in trainers._registry:
            trainers.register_engine(cls.init_info_cls.backend, cls)


# ---------------------------------------------------------------- the sender


class WeightSender:
    """Trainer side of one vLLM engine's weight sync over ``route`` (``gloo``, ``ipc``,
    ``nccl``), built on the first :meth:`send` (the rendezvous) and reused after.

    Args:
        llm: the vLLM engine (``vllm.LLM``, built with ``weight_transfer_config={"backend":
            route}``) or any ``VLLMWeightSyncClient``.
        route: the backend.
        bucket_bytes: the largest bucket / packed buffer.
        verify: per-tensor SHA-256 check on the worker before loading (``gloo``, ``nccl``;
            vLLM's ``ipc`` engine has none).
        num_workers: vLLM workers behind ``llm`` (``nccl``: the transfer group is 1 + this).
        host: address the trainer's ``gloo`` rendezvous store binds and the worker dials
            (``nccl``: NCCL's bootstrap listener, started when the unique id is minted, picks its
            own interface, ``NCCL_SOCKET_IFNAME``).
        timeout_s: the deadline of every wait of a transfer (rendezvous, proofs, each bucket);
            default: the job's collective timeout (``train.dist_timeout_s``), as every other
            process group of the job.
        secret: the job's shared secret (``nccl``: the workers prove it before the unique id is
            minted, and every member proves it again over the communicator).
    """

    def __init__(
        self,
        llm,
        route: str,
        bucket_bytes: int,
        verify: bool = False,
        num_workers: int = 1,
        host: str = "127.0.0.1",
        timeout_s: float | None = None,
        secret: str = "",
    ):
        if route not in ("gloo", "ipc", "nccl"):
            raise ValueError(f"weight_transfer = {route!r}: expected gloo, ipc or nccl")
        self.client = LLMClient(llm) if hasattr(llm, "llm_engine") else llm
        self.route, self.bucket_bytes, self.verify = route, bucket_bytes, verify
        self.num_workers, self.host, self.secret = num_workers, host, secret
        self.timeout_s = collective_timeout().total_seconds() if timeout_s is None else timeout_s
        self.engine = None
        self.current = None

    def _init_info(self):
        if self.route == "gloo":
            return GlooTrainerInitInfo(
                rank=0,
                host=self.host,
                bucket_bytes=self.bucket_bytes,
                verify=self.verify,
                timeout_s=self.timeout_s,
            )
        if self.route == "ipc":
            # lazy: vLLM is an optional extra (heavy import)
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            return IPCTrainerInitInfo(
                rank=0, packed=True, packed_buffer_size_bytes=self.bucket_bytes
            )
        return nccl_transfer.NCCLUidTrainerInitInfo(
            rank=0,
            world_size=1 + self.num_workers,
            bucket_bytes=self.bucket_bytes,
            verify=self.verify,
            timeout_s=self.timeout_s,
            secret=self.secret,
        )

    def send(self, source) -> dict:
        """Push every tensor of ``source`` (a ``WeightSource``); returns seconds, tensors,
        params, bytes and buckets of this sync."""
        t0 = time.perf_counter()
        if self.engine is None:
            register()
            self.engine = _factory.WeightTransferTrainerFactory.trainer_init(
                self._init_info(), client=self.client, source=_Deferred(self)
            )
        self.current = source
        self.engine.send_weights()
        stats = dict(getattr(self.engine, "stats", {}) or {})
        if not stats:  # vLLM's engines count nothing: the layout says what travelled
            meta = source.metadata()
            stats = {
                "tensors": len(meta),
                "params": sum(torch.Size(m.shape).numel() for m in meta),
                "bytes": sum(torch.Size(m.shape).numel() * m.dtype.itemsize for m in meta),
            }
        stats["seconds"] = time.perf_counter() - t0
        return stats

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class _Deferred(base.WeightSource):
    """The source of the sender's current sync (vLLM's trainer engines keep the source given at
    ``trainer_init``; each sync here brings its own)."""

    def __init__(self, sender: WeightSender):
        self.sender = sender

    def metadata(self):
        return self.sender.current.metadata()

    def __iter__(self):
        return iter(self.sender.current)
