"""The weight-transfer groups admit no stranger. gloo (issue #29 item 11): its TCP store takes
whoever reaches the port, so both members prove the per-session key (sent to the worker over the
authenticated control route) before any weights move; the trainer's real ``trainer_init`` and the
worker's real group set-up, against a process that reached the port without the key. nccl (issue
#40 item 3): no port is opened; the NCCL unique id travels over the control route only."""

from __future__ import annotations

import datetime
import secrets
import threading

import pytest
import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import factory
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo

from megatron_ngrpo.rollout.vllm import weight_transfer
from megatron_ngrpo.rollout.vllm.weight_transfer import (
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    WeightSender,
    WeightSyncError,
    _pair_group,
)
from tests.support.vllm_weights import NamedSource

TIMEOUT_S = 30.0


class _Joiner:
    """Stands where the trainer's control route reaches the worker: joins the group from the init
    info it is handed, with ``key`` (None: the info's own, the honest worker's)."""

    def __init__(self, key: str | None):
        self.key, self.error = key, None

    def init_weight_transfer_engine(self, info: dict) -> None:
        try:
            _pair_group(info["host"], info["port"], 1, TIMEOUT_S, self.key or info["key"])
        except WeightSyncError as e:
            self.error = e


def _trainer_init(client):
    info = GlooTrainerInitInfo(rank=0, host="127.0.0.1", port=0, timeout_s=TIMEOUT_S)
    return GlooTrainerWeightTransferEngine.trainer_init(info, client=client)


def test_worker_with_the_session_key_joins():
    client = _Joiner(None)
    engine = _trainer_init(client)
    assert client.error is None and engine.group.size() == 2


def test_stranger_as_worker_is_refused():
    stranger = _Joiner("a guess")
    with pytest.raises(
        WeightSyncError,
        match=r"^weight-transfer group at 127\.0\.0\.1:\d+: the worker that joined did not prove "
        r"the session key .*no weights sent or received$",
    ):
        _trainer_init(stranger)
    assert "the trainer that joined did not prove" in str(stranger.error)  # it learnt nothing


def test_stranger_as_trainer_is_refused():
    """A worker handed a rendezvous where a stranger holds the trainer's place refuses it."""
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        2,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    out: dict = {}

    def stranger():
        try:
            _pair_group("127.0.0.1", store.port, 0, TIMEOUT_S, "a guess", store=store)
        except WeightSyncError as e:
            out["stranger"] = e

    th = threading.Thread(target=stranger, daemon=True)
    th.start()
    with pytest.raises(WeightSyncError, match="the trainer that joined did not prove"):
        _pair_group("127.0.0.1", store.port, 1, TIMEOUT_S, "the session key")
    th.join(TIMEOUT_S)
    assert "the worker that joined did not prove" in str(out["stranger"])


def test_no_key_is_refused_before_the_group_forms():
    with pytest.raises(WeightSyncError, match="no session key"):
        _pair_group("127.0.0.1", 1, 1, TIMEOUT_S, "", store=object())


def test_nccl_route_admits_only_holders_of_the_control_routes_unique_id(monkeypatch):
    """The ``nccl`` route opens no rendezvous port (vLLM's own trainer side hosts a TCP store
    from which anyone could read the NCCL unique id and join the communicator): the trainer mints
    the unique id and it reaches the workers only inside their init info, over the control route.
    The NCCL calls themselves need a GPU; here they record what they are given."""
    from vllm.distributed import utils as vllm_dist_utils

    uid = secrets.token_bytes(128)
    joined = {}
    monkeypatch.setattr(weight_transfer, "mint_nccl_uid", lambda: uid)
    monkeypatch.setattr(
        weight_transfer, "join_nccl", lambda u, rank, size: joined.update(trainer=(u, rank, size))
    )

    def rendezvous_port(*args, **kwargs):
        raise AssertionError("a rendezvous port was opened: a stranger could reach it")

    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)  # GPU 0, as it were
    monkeypatch.setattr(dist, "TCPStore", rendezvous_port)
    monkeypatch.setattr(vllm_dist_utils.StatelessProcessGroup, "create", rendezvous_port)

    class ControlRoute:
        """Where the rollout server's secret-guarded HTTP route reaches its workers."""

        def init_weight_transfer_engine(self, payload: dict) -> None:
            info = NCCLWeightTransferInitInfo(**payload)  # vLLM's worker side parses it
            joined["workers"] = (info.nccl_unique_id_bytes, info.master_address, info.rank_offset)

    sender = WeightSender(ControlRoute(), "nccl", 2**20, num_workers=2)
    weight_transfer.register()
    factory.WeightTransferTrainerFactory.trainer_init(
        sender._init_info(), client=sender.client, source=NamedSource([])
    )
    assert joined == {"trainer": (uid, 0, 3), "workers": (uid, None, 1)}
