"""Megatron → vLLM weight sync through vLLM 0.32's weight-transfer API
(``vllm/distributed/weight_transfer/``).

The trainer side is a vLLM ``TrainerWeightTransferEngine`` driven through
``WeightTransferTrainerFactory`` for every route, on a :class:`MegatronSource` (the model as HF
tensors, names and shapes from :mod:`megatron_ngrpo.conversion.mapping`):

* ``gloo`` (registered here, both sides): CPU / tests. A two-member gloo group (trainer sender,
  vLLM worker) over a TCP store opened by the trainer; tensors travel in buckets of
  ``bucket_bytes`` packed into one flat byte buffer, the worker unpacks views and loads them with
  ``model.load_weights`` inside vLLM's layerwise reload (as vLLM's ``ipc`` engine does).
  ``verify``: the update info carries each tensor's SHA-256 and the worker checks what it received
  before loading (one-line :class:`WeightSyncError` naming the tensor). The store admits anyone,
  so both members prove a per-session key before any weights move (:func:`_prove_pair`).
* ``ipc`` (colocated, GPU) and ``nccl`` (disaggregated, GPU): vLLM's own engines, packed into
  buffers of ``bucket_bytes``. Not measured here (no GPU). ``nccl`` opens no rendezvous port:
  vLLM's own trainer side hosts a TCP store that anyone can read the NCCL unique id from and join
  the communicator with, so the trainer here mints the unique id itself and hands it to the
  workers over the authenticated control route only (:class:`NCCLUidTrainerWeightTransferEngine`;
  vLLM's worker engine joins from it as from a torch-free trainer's).
* ``nccl_m2n`` (vLLM's shard-to-shard engine) is not wired: its trainer engine needs vLLM's
  ``M2NWeightSource`` (DTensor-style placements per parameter of one HF tensor), while a
  Megatron shard of ``linear_qkv`` / ``linear_fc1`` fuses several; colocated shard-to-shard runs
  on the routes above instead (below).

Memory: the source gathers one Megatron parameter at a time over TP (and broadcasts it over PP),
and the sender holds at most one bucket (a tensor larger than the bucket travels alone; the
``gloo`` sender keeps that buffer between syncs), so the peak extra memory is one bucket plus
one full tensor, never the model. Every rank is the sender of its own colocated vLLM engine;
the gather is a collective of the model-parallel group. With ``MegatronSource(tp_shards=...)``
(colocated, vLLM's TP size divides the trainer's) the linear layers are not gathered: each rank
sends its vLLM worker's shards as HF slices (its own, or merged from a few ranks' slices) and the
worker's loaders take them as they are (``VLLMEngine.tp_shards``); only the vocabulary matrices
are gathered.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import base, nccl_common
from vllm.distributed.weight_transfer import factory as _factory
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferInitInfo,
)
from vllm.distributed.weight_transfer.packed_tensor import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
)

from megatron_ngrpo.conversion.hf_export import export_hf_layout, export_hf_tensors
from megatron_ngrpo.parallel import collective_timeout
from megatron_ngrpo.rollout.vllm.wire import digest, first_mismatch

_ALIGN = 16  # byte alignment of each tensor in a packed bucket (any dtype view is legal)


class WeightSyncError(RuntimeError):
    """A tensor arrived different from what the trainer sent."""


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


@dataclass
class GlooUpdateInfo(base.WeightTransferUpdateInfo):
    """One bucket: the tensors packed in order, each at a multiple of 16 bytes."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    digests: list[str] | None = None


def _layout(dtypes: list[torch.dtype], shapes: list[list[int]]) -> tuple[list[int], int]:
    """Byte offsets of the tensors in a bucket and its total size."""
    offsets, size = [], 0
    for dt, shape in zip(dtypes, shapes):
        offsets.append(size)
        n = torch.Size(shape).numel() * dt.itemsize
        size += -(-n // _ALIGN) * _ALIGN
    return offsets, size


def _views(buf: torch.Tensor, dtypes, shapes, offsets) -> list[torch.Tensor]:
    return [
        buf[o : o + torch.Size(s).numel() * dt.itemsize].view(dt).view(s)
        for o, dt, s in zip(offsets, dtypes, shapes)
    ]


class _Staging:
    """The sender's reused bucket buffer: a fresh multi-MiB tensor for every bucket costs the
    page faults of zero-filled pages at every sync (~1 ms per M fp32 params here), more than
    the copy into it. The receiver cannot reuse one: vLLM's layerwise reload keeps the loaded
    tensors (views of the bucket) until each layer is complete, some until the reload ends."""

    def __init__(self):
        self.buf = torch.empty(0, dtype=torch.uint8)

    def get(self, size: int) -> torch.Tensor:
        if self.buf.numel() < size:
            self.buf = torch.empty(size, dtype=torch.uint8)
        return self.buf[:size]


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


def begin_reload(model) -> None:
    """Open a sync of ``model``'s weights in buckets (vLLM's layerwise reload: each layer is
    processed once all its tensors arrived; the receiver holds a bucket, not the model)."""
    # lazy: vLLM internals, resolved inside the worker
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def load_bucket(model, named: list[tuple[str, torch.Tensor]]) -> None:
    """Load one bucket of HF-named tensors inside :func:`begin_reload` / :func:`end_reload`."""
    # lazy: vLLM internals, resolved inside the worker
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    with disable_mtp_completeness_check():
        model.load_weights(named)


def end_reload(model, model_config) -> None:
    """Close the sync (layers no bucket touched get their previous weights back)."""
    # lazy: vLLM internals, resolved inside the worker
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


class GlooWeightTransferEngine(base.WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """vLLM worker side of the ``gloo`` route (registered as ``"gloo"``)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.group = _pair_group(
            init_info.host, init_info.port, 1, init_info.timeout_s, init_info.key
        )

    def start_weight_update(self) -> None:
        begin_reload(self.model)

    def finish_weight_update(self) -> None:
        end_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU; the gloo
        # receive is synchronous and load_weights copies on the current stream.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # Close vLLM's layerwise reload (the worker ends the session on errors): untouched
            # layers get their previous weights back, so the next full sync can start.
            self.finish_weight_update()
            raise
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        offsets, size = _layout(dtypes, update_info.shapes)
        buf = torch.empty(size, dtype=torch.uint8)  # a fresh one: see _Staging
        self.group.recv([buf], 0, 0).wait()
        tensors = self._unpack(buf, dtypes, update_info.shapes, offsets)
        if update_info.digests is not None:
            bad = first_mismatch(
                zip(update_info.names, tensors), dict(zip(update_info.names, update_info.digests))
            )
            if bad:
                raise WeightSyncError(bad)
        load_bucket(self.model, list(zip(update_info.names, tensors)))

    def _unpack(self, buf, dtypes, shapes, offsets) -> list[torch.Tensor]:
        return _views(buf, dtypes, shapes, offsets)

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


class GlooTrainerWeightTransferEngine(base.TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Sends the source in buckets over the pair group; the worker receives inside
    ``update_weights``, which runs on a helper thread meanwhile (both sides meet in the same
    send/recv)."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=True)
        engine.info = init_info
        store = dist.TCPStore(
            init_info.host,
            init_info.port,
            2,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=init_info.timeout_s),
        )
        key = secrets.token_hex(32)
        worker = asdict(GlooInitInfo(init_info.host, store.port, init_info.timeout_s, key))
        join = _in_thread(client.init_weight_transfer_engine, worker)
        engine.group = _pair_group(
            init_info.host, store.port, 0, init_info.timeout_s, key, store=store
        )
        join()
        engine.store = store
        engine.stats = {}
        engine.staging = _Staging()
        return engine

    def send_weights(self) -> None:
        stats = {"tensors": 0, "params": 0, "bytes": 0, "buckets": 0}
        self.client.start_weight_update()
        bucket, size = [], 0
        for name, t in self.source:
            n = t.numel() * t.element_size()
            if bucket and size + n > self.info.bucket_bytes:
                self._send(bucket, stats)
                bucket, size = [], 0
            bucket.append((name, t.detach()))
            size += n
            stats["tensors"] += 1
            stats["params"] += t.numel()
            stats["bytes"] += n
        if bucket:
            self._send(bucket, stats)
        self.client.finish_weight_update()
        self.stats = stats

    def _send(self, bucket: list[tuple[str, torch.Tensor]], stats: dict) -> None:
        dtypes = [t.dtype for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        offsets, size = _layout(dtypes, shapes)
        buf = self.staging.get(size)
        for view, (_, t) in zip(_views(buf, dtypes, shapes, offsets), bucket):
            view.copy_(t)
        info = GlooUpdateInfo(
            names=[n for n, _ in bucket],
            dtype_names=[str(d).split(".")[-1] for d in dtypes],
            shapes=shapes,
            digests=[digest(t) for _, t in bucket] if self.info.verify else None,
        )
        join = _in_thread(self.client.update_weights, asdict(info))
        self.group.send([buf], 1, 0).wait()
        join()
        stats["buckets"] += 1

    def shutdown(self) -> None:
        self.group = self.store = self.staging = None


def _in_thread(fn, *args):
    """Run ``fn(*args)`` on a helper thread; the returned callable joins it and re-raises."""
    out: dict = {}

    def run():
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()

    def join():
        th.join()
        if "error" in out:
            raise out["error"]

    return join


# ---------------------------------------------------------------- nccl: no open rendezvous


@dataclass
class NCCLUidTrainerInitInfo(base.TrainerInitInfo):
    """Trainer side of the ``nccl`` route: the group's size (1 + the workers) and vLLM's packed
    buffers. No address: nothing listens for the workers (:class:`NCCLUidTrainerWeightTransferEngine`)."""

    backend: ClassVar[str] = "nccl_uid"  # the trainer-side registry's name; the workers' is "nccl"
    world_size: int = 2
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS


def mint_nccl_uid() -> bytes:
    """A fresh NCCL unique id (its bootstrap address and a random value)."""
    # lazy: loads the NCCL library (GPU machines)
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    return bytes(NCCLLibrary().ncclGetUniqueId().internal)


def join_nccl(uid: bytes, rank: int, world_size: int):
    """This process's communicator of the group of ``uid`` (vLLM's ``PyNcclCommunicator``)."""
    device = torch.accelerator.current_device_index()
    return nccl_common.uid_init_process_group(uid, rank, world_size, device)


class NCCLUidTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """vLLM's NCCL trainer engine (packed broadcasts from rank 0), but the communicator forms from
    an NCCL unique id minted here and sent to the workers only inside their init info, i.e. over
    the control route (the rollout server's secret-guarded HTTP).

    Why: vLLM's own trainer side opens a TCP store at ``master_port`` and publishes the unique id
    there; the store has no authentication, so whoever reaches the port could read it and join the
    communicator as a worker (and receive the weights), or take a worker's place and stall the
    sync. Here no port is opened for the rendezvous, and the unique id, the one thing that admits a
    process to the group, never leaves the authenticated route. The workers are vLLM's stock
    ``nccl`` engine, which joins from a unique id as it does for a torch-free trainer."""

    init_info_cls = NCCLUidTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: NCCLUidTrainerInitInfo, *, client, source=None):
        engine = cls(
            client=client,
            source=source,
            packed=True,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            packed_num_buffers=init_info.packed_num_buffers,
        )
        uid = mint_nccl_uid()
        worker = NCCLWeightTransferInitInfo(
            rank_offset=1,
            world_size=init_info.world_size,
            nccl_unique_id_b64=base64.b64encode(uid).decode(),
            packed=True,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            packed_num_buffers=init_info.packed_num_buffers,
        )
        # the workers block in their init until every rank joined: both at once
        join = _in_thread(
            client.init_weight_transfer_engine, nccl_common.worker_init_payload(worker)
        )
        engine.model_update_group = join_nccl(uid, 0, init_info.world_size)
        join()
        return engine


def register() -> None:
    """Register the ``gloo`` engines and the ``nccl`` trainer engine with vLLM's factories
    (idempotent; call before building an ``LLM`` with ``weight_transfer_config={"backend":
    "gloo"}`` in this process)."""
    engines = _factory.WeightTransferEngineFactory
    trainers = _factory.WeightTransferTrainerFactory
    if "gloo" not in engines._registry:
        engines.register_engine("gloo", GlooWeightTransferEngine)
    for cls in (GlooTrainerWeightTransferEngine, NCCLUidTrainerWeightTransferEngine):
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
        verify: per-tensor SHA-256 check on the worker (``gloo``; vLLM's engines have none).
        num_workers: vLLM workers behind ``llm`` (``nccl``: the transfer group is 1 + this).
        host: address the trainer's rendezvous listens on (``gloo``; ``nccl`` opens none: NCCL's
            bootstrap uses its own interface, ``NCCL_SOCKET_IFNAME``).
        timeout_s: how long a ``gloo`` transfer waits for the worker (rendezvous, each bucket);
            default: the job's collective timeout (``train.dist_timeout_s``), as every other
            process group of the job.
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
    ):
        if route not in ("gloo", "ipc", "nccl"):
            raise ValueError(f"weight_transfer = {route!r}: expected gloo, ipc or nccl")
        self.client = LLMClient(llm) if hasattr(llm, "llm_engine") else llm
        self.route, self.bucket_bytes, self.verify = route, bucket_bytes, verify
        self.num_workers, self.host = num_workers, host
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
        return NCCLUidTrainerInitInfo(
            rank=0,
            world_size=1 + self.num_workers,
            packed_buffer_size_bytes=self.bucket_bytes,
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
