"""The weight-transfer groups admit no stranger. gloo (issue #29 item 11): its TCP store takes
whoever reaches the port, so both members prove the per-session key (sent to the worker over the
authenticated control route) before any weights move; the trainer's real ``trainer_init`` and the
worker's real group set-up, against a process that reached the port without the key; the store
listens on the given host only. nccl: tests/test_nccl_transfer.py."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from megatron_ngrpo.rollout.vllm.weight_transfer import (
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    WeightSyncError,
    _pair_group,
)

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


def test_gloo_store_listens_on_the_given_host_only():
    """torch binds a master TCPStore to every interface; the route's store binds ``host``."""
    import psutil

    client = _Joiner(None)
    engine = _trainer_init(client)
    port = engine.store.port
    listening = [
        c.laddr
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    assert [a.ip for a in listening] == ["127.0.0.1"], listening


def test_no_key_is_refused_before_the_group_forms():
    with pytest.raises(WeightSyncError, match="no session key"):
        _pair_group("127.0.0.1", 1, 1, TIMEOUT_S, "", store=object())
