"""The ``nccl`` weight route of a disaggregated job (GPU rollout servers), both sides: the
project's buckets (rollout/vllm/buckets.py) broadcast from the trainer's global rank 0 to a
server's workers over an NCCL communicator that admits only proven members.

Why not vLLM's own ``nccl`` engines: their trainer side hosts a TCP store that publishes the NCCL
unique id to whoever connects, and whoever holds the id can take a worker's rank in
``ncclCommInitRank`` (NCCL's bootstrap checks nothing else, and drops a peer with a wrong id
silently: no error on either side). Here, for every communicator (one per server, made on its
first sync):

1. the trainer draws a nonce and asks the server's workers, over the authenticated control route
   (rollout/remote/auth.py), for ``HMAC(secret, "nccl-worker-http", nonce, rank)``; only when
   every worker answered right does it mint the unique id (which starts NCCL's bootstrap listener
   in the trainer) and send it, with the nonce, in the workers' init info;
2. the workers answer that init at once and join in the background, so the trainer reads the
   answer (a refusal is one line) before it enters ``ncclCommInitRank`` itself;
3. once the communicator forms, every member all-gathers a 32-byte tag (rank 0
   ``HMAC(secret, "nccl-trainer", nonce)``, rank r ``HMAC(secret, "nccl-worker", nonce, r)``):
   the trainer refuses to send before every worker's tag is right, a worker refuses to load
   before rank 0's is; a process that joined with a leaked id cannot make one;
4. with ``verify``, every bucket's update info carries each tensor's SHA-256 (over the
   authenticated control route), which the worker checks before loading.

Every wait of the trainer is bounded by ``timeout_s`` (``train.dist_timeout_s``): the NCCL calls
run on a helper thread with a deadline (vLLM's ``PyNcclCommunicator`` offers no non-blocking init
nor ``ncclCommGetAsyncError``), each expiry a one-line :class:`WeightSyncError` naming the stage.
Not covered: NCCL does not encrypt, and the control route is plain HTTP, so an eavesdropper on
the job's network reads the id and the weights; the bootstrap and transport listeners NCCL opens
(NCCL_SOCKET_IFNAME) accept connections from anyone who can reach them. Not run on a GPU: the
NCCL calls (:func:`mint_nccl_uid`, :func:`join_nccl` and the communicator's collectives) are
stubbed in tests/test_weight_transfer_auth.py.
"""

from __future__ import annotations

import base64
import hmac
import secrets
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer import base, nccl_common

from megatron_ngrpo.rollout.remote.auth import mac, read_secret
from megatron_ngrpo.rollout.vllm.buckets import (
    BucketReceiver,
    BucketSender,
    BucketUpdateInfo,
    WeightSyncError,
    _Staging,
    in_thread,
)

TAG_BYTES = 32


def mint_nccl_uid() -> bytes:
    """A fresh NCCL unique id (its bootstrap address and a random value); NCCL's bootstrap root
    starts listening in this process."""
    # lazy: loads the NCCL library (GPU machines)
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    return bytes(NCCLLibrary().ncclGetUniqueId().internal)


def join_nccl(uid: bytes, rank: int, world_size: int):
    """This process's communicator of the group of ``uid`` (vLLM's ``PyNcclCommunicator``;
    blocks until every rank joined)."""
    device = torch.accelerator.current_device_index()
    return nccl_common.uid_init_process_group(uid, rank, world_size, device)


def worker_rank(parallel_config, offset: int) -> int:
    """A worker's rank in the transfer group (as vLLM's ``worker_init_process_group`` counts)."""
    per_dp = parallel_config.world_size
    return parallel_config.data_parallel_index * per_dp + parallel_config.rank + offset


def http_proof(secret: str, nonce: bytes, rank: int) -> bytes:
    """A worker's answer to the trainer's challenge over the control route."""
    return mac(secret.encode(), b"nccl-worker-http", nonce, str(rank))


def member_tag(secret: str, nonce: bytes, rank: int) -> bytes:
    """What rank ``rank`` contributes to the communicator's proof exchange."""
    role = b"nccl-trainer" if rank == 0 else b"nccl-worker"
    return mac(secret.encode(), role, nonce, str(rank))


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.accelerator.current_device_index())
    return torch.device("cpu")


def _stream():
    return torch.cuda.current_stream() if torch.cuda.is_available() else None


def exchange_tags(group, tag: bytes, world_size: int, device) -> list[bytes]:
    """Every member's tag (all-gather over the communicator), in rank order."""
    mine = torch.frombuffer(bytearray(tag), dtype=torch.uint8).to(device)
    out = torch.empty(world_size * TAG_BYTES, dtype=torch.uint8, device=device)
    group.all_gather(out, mine, stream=_stream())
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
    raw = out.cpu().numpy().tobytes()
    return [raw[r * TAG_BYTES : (r + 1) * TAG_BYTES] for r in range(world_size)]


# ---------------------------------------------------------------- the workers' side


@dataclass(kw_only=True)
class ProvenNCCLInitInfo(nccl_common.NCCLWeightTransferInitInfo):
    """vLLM's NCCL init info (the unique id) plus this communicator's nonce and deadline."""

    nonce: str = ""
    timeout_s: float = 1800.0


class ProvenNCCLWeightTransferEngine(
    BucketReceiver, base.WeightTransferEngine[ProvenNCCLInitInfo, BucketUpdateInfo]
):
    """vLLM worker side of the ``nccl`` route (registered as ``wire.NCCL_BACKEND``)."""

    init_info_cls = ProvenNCCLInitInfo
    update_info_cls = BucketUpdateInfo

    def init_transfer_engine(self, init_info: ProvenNCCLInitInfo) -> None:
        """Answers at once: the join and the proof exchange run on a helper thread (the trainer
        enters its own NCCL init only after this answer); the first bucket waits for them."""
        if len(init_info.nonce) != 2 * TAG_BYTES:
            raise WeightSyncError("nccl init: no sync nonce in the init info")
        self.group, self.timeout_s = None, init_info.timeout_s
        rank = worker_rank(self.parallel_config, init_info.rank_offset)
        self._joined = in_thread(self._join, init_info, rank, read_secret())

    def _join(self, info: ProvenNCCLInitInfo, rank: int, secret: str):
        group = join_nccl(info.nccl_unique_id_bytes, rank, info.world_size)
        nonce = bytes.fromhex(info.nonce)
        tags = exchange_tags(group, member_tag(secret, nonce, rank), info.world_size, self.device)
        if not hmac.compare_digest(tags[0], member_tag(secret, nonce, 0)):
            group.destroy()
            raise WeightSyncError(
                "nccl group: rank 0 did not prove the job's secret (not this job's trainer); "
                "no weights received"
            )
        return group

    def _receive(self, size: int) -> torch.Tensor:
        if self.group is None:
            self.group = self._joined(self.timeout_s, "nccl init (worker)")
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.group.broadcast(buf, 0, stream=_stream())
        return buf

    def shutdown(self) -> None:
        if getattr(self, "group", None) is not None:
            self.group.destroy()
        self.group = None


# ---------------------------------------------------------------- the trainer's side


@dataclass
class NCCLUidTrainerInitInfo(base.TrainerInitInfo):
    """Trainer side of the ``nccl`` route: the group's size (1 + the server's workers), the
    bucket size, the per-tensor check, every wait's deadline and the job's secret."""

    backend: ClassVar[str] = "nccl_uid"  # the trainer-side registry's name
    world_size: int = 2
    bucket_bytes: int = 512 * 2**20
    verify: bool = False
    timeout_s: float = 1800.0
    secret: str = field(default="", repr=False)


class NCCLUidTrainerWeightTransferEngine(
    BucketSender, base.TrainerWeightTransferEngine[NCCLUidTrainerInitInfo]
):
    """Broadcasts the source in buckets to one server's workers; ``client`` is the server's
    weight client (``prove_workers`` and vLLM's weight-transfer routes)."""

    init_info_cls = NCCLUidTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: NCCLUidTrainerInitInfo, *, client, source=None):
        if not init_info.secret:
            raise WeightSyncError("nccl init: no job secret to prove the workers with")
        engine = cls(client=client, source=source, is_sender=True)
        engine.info, engine.stats = init_info, {}
        secret, t, world = init_info.secret, init_info.timeout_s, init_info.world_size
        nonce = secrets.token_bytes(TAG_BYTES)
        _check_proofs(client.prove_workers(nonce.hex()), secret, nonce, world)
        uid = mint_nccl_uid()
        worker = ProvenNCCLInitInfo(
            rank_offset=1,
            world_size=world,
            nccl_unique_id_b64=base64.b64encode(uid).decode(),
            nonce=nonce.hex(),
            timeout_s=t,
        )
        # the workers answer before they join: a refusal surfaces here, before NCCL is entered
        client.init_weight_transfer_engine(nccl_common.worker_init_payload(worker))
        group = in_thread(join_nccl, uid, 0, world)(
            t, "nccl init: ncclCommInitRank (a worker never joined with the unique id)"
        )
        tags = in_thread(exchange_tags, group, member_tag(secret, nonce, 0), world, _device())(
            t, "nccl proof exchange"
        )
        strangers = [
            r
            for r in range(1, world)
            if not hmac.compare_digest(tags[r], member_tag(secret, nonce, r))
        ]
        if strangers:
            group.destroy()
            raise WeightSyncError(
                f"nccl group: rank(s) {strangers} did not prove the job's secret (a process "
                f"other than the server's workers joined with the unique id); no weights sent"
            )
        engine.group, engine.staging = group, _Staging(_device())
        return engine

    def _transmit(self, buf: torch.Tensor) -> None:
        def broadcast():
            self.group.broadcast(buf, 0, stream=_stream())
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()

        in_thread(broadcast)(self.info.timeout_s, "nccl broadcast")

    def shutdown(self) -> None:
        if getattr(self, "group", None) is not None:
            self.group.destroy()
        self.group = self.staging = None


def _check_proofs(answers: list, secret: str, nonce: bytes, world_size: int) -> None:
    """WeightSyncError (one line) unless ``answers`` holds a right proof from each worker rank
    ``1 .. world_size - 1`` (the id is then neither minted nor sent)."""
    proven = set()
    for answer in answers:
        try:
            rank, tag = int(answer[0]), bytes.fromhex(answer[1])
        except (TypeError, ValueError, IndexError):
            continue
        if hmac.compare_digest(tag, http_proof(secret, nonce, rank)):
            proven.add(rank)
    if proven != set(range(1, world_size)):
        raise WeightSyncError(
            f"nccl init: the server's workers did not prove the job's secret for this sync "
            f"(proven ranks {sorted(proven)} of 1..{world_size - 1}); the NCCL unique id was "
            f"neither minted nor sent"
        )
