"""The ``nccl`` weight route (issue #44 items 1 and 2), the real code path up to NCCL: the
trainer's sender (rollout/remote/weights.py's weight client, the authenticated HTTP session, the
route's trainer engine) against a rollout server's HTTP surface in this process (the real guard,
tests/support/fake_server.py) whose workers run the route's real worker engine and the worker
extension's real proof method. Only the NCCL calls are stubbed, by :class:`FakeNCCL`, which
behaves as NCCL does where it matters here: ``ncclCommInitRank`` returns once every rank joined
with the id (no timeout of its own), a peer with a wrong id is dropped silently (it never joins,
nobody gets an error), a collective waits for every member.

Not run on a GPU."""

from __future__ import annotations

import base64
import secrets
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from megatron_ngrpo.rollout.config import RemoteConfig
from megatron_ngrpo.rollout.remote import auth
from megatron_ngrpo.rollout.remote.http import RolloutServerError, ServerHTTP
from megatron_ngrpo.rollout.remote.server_worker import RolloutServerExtension
from megatron_ngrpo.rollout.remote.weights import ServerWeights, _Fan
from megatron_ngrpo.rollout.vllm import buckets, nccl_transfer
from tests.support.fake_server import FakeServer
from tests.support.vllm_weights import NamedSource

SECRET = "the-jobs-secret-" + "y" * 27
TIMEOUT_S = 3.0  # train.dist_timeout_s of these tests: every hang below ends within it


class FakeNCCL:
    """NCCL's unique-id rendezvous and collectives among threads of this process."""

    def __init__(self):
        self.groups: dict[bytes, dict] = {}
        self.joins: list[tuple[bytes, int]] = []
        self.lock = threading.Lock()

    def mint(self) -> bytes:
        uid = secrets.token_bytes(128)
        self.groups[uid] = {}
        return uid

    def join(self, uid: bytes, rank: int, world_size: int):
        self.joins.append((uid, rank))
        with self.lock:
            group = self.groups.get(uid)
            if group is not None and "barrier" not in group:
                group.update(barrier=threading.Barrier(world_size), ranks=set(), data={})
        if group is None:  # NCCL's root drops a wrong magic and accepts again: no error, no join
            threading.Event().wait()
        group["ranks"].add(rank)
        group["barrier"].wait()  # ncclCommInitRank: every rank, no timeout of its own
        return _FakeComm(group, rank, world_size)


class _FakeComm:
    def __init__(self, group: dict, rank: int, world_size: int):
        self.g, self.rank, self.world_size, self.destroyed = group, rank, world_size, False

    def broadcast(self, tensor, src, stream=None):
        if self.rank == src:
            self.g["data"]["bcast"] = tensor.clone()
        self.g["barrier"].wait()
        if self.rank != src:
            tensor.copy_(self.g["data"]["bcast"])
        self.g["barrier"].wait()

    def all_gather(self, out, inp, stream=None):
        self.g["data"][self.rank] = inp.clone()
        self.g["barrier"].wait()
        out.copy_(torch.cat([self.g["data"][r] for r in range(self.world_size)]))
        self.g["barrier"].wait()

    def destroy(self):
        self.destroyed = True


class Workers:
    """A server's TP workers: the route's real worker engine and the extension's proof method;
    ``loaded`` what each loaded. ``uid``: what the workers join with (None: the one sent)."""

    def __init__(self, tp: int, uid: bytes | None = None, refuse_init: bool = False):
        self.tp, self.uid, self.refuse_init, self.loaded = tp, uid, refuse_init, []
        self.engines = []
        for rank in range(tp):
            parallel = SimpleNamespace(rank=rank, world_size=tp, data_parallel_index=0)
            vllm_config = SimpleNamespace(parallel_config=parallel, model_config=None)
            model = SimpleNamespace(load_weights=lambda named: self.loaded.extend(named))
            engine = nccl_transfer.ProvenNCCLWeightTransferEngine(
                None, vllm_config, torch.device("cpu"), model
            )
            engine.model_runner = SimpleNamespace(vllm_config=vllm_config)  # the extension's view
            self.engines.append(engine)

    def _all(self, fn) -> list:
        out, errors = [None] * self.tp, []

        def one(i):
            try:
                out[i] = fn(self.engines[i])
            except Exception as e:  # noqa: BLE001 - the server's 500
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(self.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out

    def rpc(self, body):
        assert body["method"] == "nbr_server_prove"
        prove = RolloutServerExtension.nbr_server_prove
        return {"results": self._all(lambda e: prove(e, *body["args"]))}

    def init(self, body):
        if self.refuse_init:
            raise RuntimeError("this server refuses the init")
        info = dict(body["init_info"])
        if self.uid is not None:  # a worker that joins with another id than it was sent
            info["nccl_unique_id_b64"] = base64.b64encode(self.uid).decode()
        self._all(lambda e: e.init_transfer_engine(e.parse_init_info(info)))
        return {}

    def routes(self) -> dict:
        def on_all(call):
            return lambda body: self._all(lambda e: call(e, body)) and {}

        return {
            ("POST", "/collective_rpc"): self.rpc,
            ("POST", "/init_weight_transfer_engine"): self.init,
            ("POST", "/start_weight_update"): on_all(lambda e, b: e.start_weight_update()),
            ("POST", "/update_weights"): on_all(lambda e, b: e.update_weights(b["update_info"])),
            ("POST", "/finish_weight_update"): on_all(lambda e, b: e.finish_weight_update()),
        }


@pytest.fixture
def nccl(monkeypatch):
    fake = FakeNCCL()
    monkeypatch.setattr(nccl_transfer, "mint_nccl_uid", fake.mint)
    monkeypatch.setattr(nccl_transfer, "join_nccl", fake.join)
    # vLLM's layerwise reload needs a real vLLM model: the transfer is what is under test
    monkeypatch.setattr(buckets, "begin_reload", lambda model: None)
    monkeypatch.setattr(buckets, "end_reload", lambda model, config: None)
    monkeypatch.setenv(auth.SECRET_ENV, SECRET)  # the server's workers inherit it
    return fake


@pytest.fixture
def serve():
    made = []

    def make(workers: Workers, secret: str = SECRET, routes: dict | None = None):
        made.append(FakeServer(routes or workers.routes(), secret))
        return made[-1]

    yield make
    for s in made:
        s.close()


NAMED = [
    ("model.embed_tokens.weight", torch.arange(12.0).view(4, 3)),
    ("model.norm.weight", torch.ones(5, dtype=torch.bfloat16)),
    ("lm_head.weight", torch.full((2, 3), 7.0)),
]


def _weights(url: str, tp: int, verify: bool = False, timeout_s: float = TIMEOUT_S):
    """The trainer's weight pushes to the server at ``url`` (TP ``tp``)."""
    cfg = RemoteConfig(
        urls=[url],
        weight_transfer="nccl",
        bucket_mb=1,
        verify_weights=verify,
        request_timeout_s=timeout_s,
    )
    http = ServerHTTP(cfg)
    http.secret = SECRET
    weights = ServerWeights(cfg, None, http, None)
    weights.workers[url], weights.version = tp, 1
    return weights


def _sender(url: str, tp: int, verify: bool = False, timeout_s: float = TIMEOUT_S):
    sender = _weights(url, tp, verify, timeout_s)._sender(url)
    sender.timeout_s = timeout_s  # train.dist_timeout_s
    return sender


def _push(url: str, monkeypatch) -> object:
    """One sync through ServerWeights (the fan-out, its one-line error naming the server) of
    ``NAMED`` as the model's export; the error or None."""
    from megatron_ngrpo.rollout.remote import weights as remote_weights
    from megatron_ngrpo.rollout.vllm import weight_transfer

    monkeypatch.setattr(remote_weights, "export_hf_tensors", lambda *a, **k: iter(NAMED))
    monkeypatch.setattr(weight_transfer, "MegatronSource", lambda *a: NamedSource(NAMED))
    monkeypatch.setattr(remote_weights, "collective_timeout", lambda: timedelta(seconds=TIMEOUT_S))
    weights = _weights(url, 1)
    weights._senders[url] = _sender(url, 1)
    try:
        weights._transfer(None, [url])
    except RolloutServerError as e:
        return e
    return None


def _bounded(fn, *args):
    """``fn(*args)``'s result or exception, and the seconds it took."""
    t0 = time.monotonic()
    try:
        out = fn(*args)
    except Exception as e:  # noqa: BLE001 - handed to the test
        out = e
    return out, time.monotonic() - t0


def test_proven_workers_receive_checked_weights(nccl, serve):
    workers = Workers(tp=2)
    server = serve(workers)
    stats = _sender(server.url, 2, verify=True, timeout_s=60).send(NamedSource(NAMED))
    assert stats["tensors"] == 3 and stats["buckets"] == 1
    got = {n: t for n, t in workers.loaded}
    assert len(workers.loaded) == 6  # both workers
    for name, t in NAMED:
        assert torch.equal(got[name], t), name
    # one communicator of the trainer and both workers, from the one id minted
    [uid] = list(nccl.groups)
    assert sorted(r for u, r in nccl.joins if u == uid) == [0, 1, 2]


def test_the_id_is_minted_and_sent_only_after_the_workers_prove_the_secret(
    nccl, serve, monkeypatch
):
    """Workers started with another secret fail the challenge: no id is minted (no bootstrap
    listener), none is sent, nothing joins."""
    workers = Workers(tp=1)
    server = serve(workers, secret=SECRET)
    monkeypatch.setenv(auth.SECRET_ENV, "another-jobs-secret")  # the workers' (read at the proof)
    err, seconds = _bounded(_sender(server.url, 1).send, NamedSource(NAMED))
    assert "did not prove the job's secret for this sync" in str(err), err
    assert "neither minted nor sent" in str(err) and "\n" not in str(err)
    assert nccl.groups == {} and nccl.joins == [] and seconds < TIMEOUT_S
    assert ("POST", "/init_weight_transfer_engine") not in [k for k, _ in server.served]


def test_a_stranger_with_the_id_cannot_take_a_workers_rank(nccl, serve, monkeypatch):
    """A process that got the unique id (an eavesdropper) joins as worker rank 1 before the
    real worker: the communicator forms, but its tag is wrong; the trainer sends nothing."""
    workers = Workers(tp=1)
    sent_ids = []

    def init_and_leak(body):
        uid = base64.b64decode(body["init_info"]["nccl_unique_id_b64"])
        sent_ids.append(uid)

        def stranger():
            comm = nccl.join(uid, 1, 2)
            nccl_transfer.exchange_tags(comm, b"\0" * 32, 2, "cpu")

        threading.Thread(target=stranger, daemon=True).start()
        return {}  # the real worker never gets to join

    routes = workers.routes()
    routes[("POST", "/init_weight_transfer_engine")] = init_and_leak
    server = serve(workers, routes=routes)
    err, seconds = _bounded(_sender(server.url, 1).send, NamedSource(NAMED))
    assert str(err).startswith("nccl group: rank(s) [1] did not prove the job's secret"), err
    assert workers.loaded == [] and sent_ids and seconds < TIMEOUT_S


def test_a_worker_with_a_wrong_id_is_dropped_silently_and_the_wait_is_bounded(
    nccl, serve, monkeypatch
):
    """NCCL drops a peer with a wrong id without an error: the trainer's ncclCommInitRank would
    wait forever; it is given up after train.dist_timeout_s with one line naming the server and
    the stage."""
    workers = Workers(tp=1, uid=secrets.token_bytes(128))
    server = serve(workers)
    err, seconds = _bounded(_push, server.url, monkeypatch)
    assert str(err) == (
        f"rollout server {server.url}: weight transfer failed: nccl init: ncclCommInitRank (a "
        f"worker never joined with the unique id): no answer within {TIMEOUT_S:g} s "
        f"(train.dist_timeout_s)"
    ), err
    assert TIMEOUT_S <= seconds < TIMEOUT_S + 5


def test_a_refused_init_is_one_line_before_nccl_is_entered(nccl, serve):
    workers = Workers(tp=1, refuse_init=True)
    server = serve(workers)
    err, seconds = _bounded(_sender(server.url, 1).send, NamedSource(NAMED))
    assert isinstance(err, RolloutServerError) and "\n" not in str(err)
    assert str(err).startswith(
        f"rollout server {server.url}: weight transfer init_weight_transfer_engine failed: HTTP 500"
    ), err
    assert all(rank != 0 for _, rank in nccl.joins) and seconds < TIMEOUT_S  # never entered


def test_a_server_that_never_answers_is_bounded(nccl, serve, monkeypatch):
    workers = Workers(tp=1)
    routes = workers.routes()
    routes[("POST", "/init_weight_transfer_engine")] = lambda body: {"hang": True}
    server = serve(workers, routes=routes)
    err, seconds = _bounded(_push, server.url, monkeypatch)
    assert str(err) == (
        f"rollout server {server.url}: weight transfer init_weight_transfer_engine failed: no "
        f"answer within {TIMEOUT_S:g} s (rollout.remote.request_timeout_s)"
    ), err
    assert nccl.joins == [] and seconds < TIMEOUT_S + 5


def test_a_worker_that_stops_mid_sync_is_bounded(nccl, serve):
    """The broadcast of the second sync meets no worker (it never calls update_weights)."""
    workers = Workers(tp=1)
    routes = workers.routes()
    server = serve(workers, routes=routes)
    sender = _sender(server.url, 1, timeout_s=60)
    sender.send(NamedSource(NAMED))
    sender.engine.info.timeout_s = TIMEOUT_S  # train.dist_timeout_s from here
    routes[("POST", "/update_weights")] = lambda body: {"hang": True}
    err, seconds = _bounded(sender.send, NamedSource(NAMED))
    assert str(err) == f"nccl broadcast: no answer within {TIMEOUT_S:g} s (train.dist_timeout_s)"
    assert seconds < TIMEOUT_S + 5


def test_a_tampered_bucket_is_refused_before_loading(nccl, serve, monkeypatch):
    """With verify_weights, a bucket changed on the wire (here: by the broadcast) is named and
    not loaded."""
    workers = Workers(tp=1)
    server = serve(workers)
    broadcast = _FakeComm.broadcast

    def tampering(self, tensor, src, stream=None):
        broadcast(self, tensor, src, stream)
        if self.rank != src:
            tensor[0] ^= 1

    monkeypatch.setattr(_FakeComm, "broadcast", tampering)
    err, _ = _bounded(_sender(server.url, 1, verify=True, timeout_s=60).send, NamedSource(NAMED))
    assert "weight sync: model.embed_tokens.weight [4, 3] arrived with SHA-256" in str(err), err
    assert workers.loaded == []


def test_fan_gives_up_on_a_sender_that_hangs():
    class Hung:
        def send(self, source):
            threading.Event().wait()

    fan = _Fan("http://x:1", Hung(), [], deadline_s=0.5)
    t0 = time.monotonic()
    for _ in range(10):
        fan.put(("t", torch.zeros(1)))
    fan.close()
    assert str(fan.error) == (
        "rollout server http://x:1: weight transfer: the sender took no tensor within 0.5 s "
        "(train.dist_timeout_s + rollout.remote.request_timeout_s)"
    )
    assert time.monotonic() - t0 < 5
