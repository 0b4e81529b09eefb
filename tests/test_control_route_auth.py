"""The rollout control route's mutual authentication (issue #44 item 3), against the real guard
(rollout/remote/guard.py) and the real client (rollout/remote/client.py, http.py, auth.py) over
HTTP in this process (tests/support/fake_server.py): the server proves the job's secret before the
client sends it anything; a replayed or altered request is refused; the client takes this run's
fresh registrations only; secret files and the URL folder are private."""

from __future__ import annotations

import os
import stat
import time
from types import SimpleNamespace

import pytest
import requests

from megatron_ngrpo.rollout.config import RemoteConfig
from megatron_ngrpo.rollout.remote import auth
from megatron_ngrpo.rollout.remote.client import RemoteEngine
from megatron_ngrpo.rollout.remote.http import RolloutServerError
from megatron_ngrpo.rollout.vllm import wire
from megatron_ngrpo.rollout.vllm.protocol import SUPPORTED_VLLM
from tests.support.fake_server import FakeServer

SECRET = "the-jobs-secret-" + "x" * 27
SPEC = SimpleNamespace(vocab_size=32, hidden_size=16)
INFO = {
    "protocol": wire.PROTOCOL,
    "hook": "NeighborMixRunner",
    "num_real_tokens": 32,
    "vocab_size": 32,
    "hidden_size": 16,
    "max_model_len": 64,
    "tensor_parallel": 1,
    "weight_transfer": "gloo",
}
ROUTES = {
    ("GET", "/version"): lambda body: {"version": SUPPORTED_VLLM},
    ("POST", "/collective_rpc"): lambda body: {"results": [INFO]},
    ("GET", "/weight_info"): lambda body: {"weight_version": "3"},
}


@pytest.fixture(autouse=True)
def job_env(monkeypatch):
    for k in (auth.SECRET_ENV, auth.SECRET_FILE_ENV, auth.RUN_ID_ENV, "SLURM_HET_JOB_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("SLURM_JOB_ID_HET_GROUP_0", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv(auth.SECRET_ENV, SECRET)


@pytest.fixture
def servers():
    made = []

    def make(secret=SECRET, routes=ROUTES):
        made.append(FakeServer(routes, secret))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _engine(**remote) -> RemoteEngine:
    return RemoteEngine(RemoteConfig(**remote), SPEC, 32)


def _sent_bytes(server: FakeServer) -> bytes:
    return b"".join(
        repr(headers).encode() + b"".join(chunks) for _, _, headers, chunks in server.wire
    )


def test_honest_server_proves_and_serves(servers):
    server = servers()
    engine = _engine(urls=[server.url], start_timeout_s=20)
    assert engine.servers == [server.url] and engine.version == 3
    assert [k for k, _ in server.served] == [
        ("GET", "/version"),
        ("POST", "/collective_rpc"),
        ("GET", "/weight_info"),
    ]
    assert SECRET.encode() not in _sent_bytes(server)  # the secret itself never travels
    engine.close()


def test_server_without_the_secret_is_refused_before_anything_is_sent(servers):
    """A server of another job (or a stranger at a stale address) answers the handshake without
    the proof: the client stops with one line, having sent it a nonce and nothing else."""
    impostor = servers(secret="another-jobs-secret")
    with pytest.raises(RolloutServerError, match="did not prove the job's secret") as e:
        _engine(urls=[impostor.url], start_timeout_s=20)
    assert "\n" not in str(e.value)
    assert [(m, p) for m, p, _, _ in impostor.wire] == [("POST", auth.HANDSHAKE_PATH)]
    assert impostor.served == [] and SECRET.encode() not in _sent_bytes(impostor)
    # a plain HTTP server (no handshake route at all) is refused the same way
    plain = servers(secret=None, routes={})
    with pytest.raises(RolloutServerError, match="did not prove the job's secret"):
        _engine(urls=[plain.url], start_timeout_s=20)
    assert [(m, p) for m, p, _, _ in plain.wire] == [("POST", auth.HANDSHAKE_PATH)]


def _signed(server: FakeServer, method: str, route: str, **kwargs) -> requests.PreparedRequest:
    client = auth.ClientAuth(server.url, SECRET, 10)
    return client(requests.Request(method, f"{server.url}{route}", **kwargs).prepare())


def test_replayed_or_altered_requests_are_refused(servers):
    server = servers()
    with requests.Session() as s:
        req = _signed(server, "POST", "/collective_rpc", json={"method": "nbr_server_info"})
        assert s.send(req, timeout=10).status_code == 200
        replay = s.send(req, timeout=10)
        assert replay.status_code == 401 and "replayed" in replay.json()["error"]

        altered = _signed(server, "POST", "/collective_rpc", json={"method": "nbr_server_info"})
        altered.body = altered.body.replace(b"info", b"inf0")
        assert s.send(altered, timeout=10).status_code == 401
        moved = _signed(server, "GET", "/version")
        moved.url = moved.url.replace("/version", "/weight_info")
        assert s.send(moved, timeout=10).status_code == 401
        # The static secret is no credential, nor is any header without a session.
        for headers in ({"Authorization": f"Bearer {SECRET}"}, {"Authorization": SECRET}, {}):
            assert s.get(f"{server.url}/version", headers=headers, timeout=10).status_code == 401
        assert (
            s.get(f"{server.url}/health", timeout=10).status_code == 404
        )  # open, not a route here
    assert [k for k, _ in server.served] == [("POST", "/collective_rpc"), ("GET", "/health")]


def test_counters_out_of_order_are_accepted_once(servers):
    """The client sends concurrently: a later counter may arrive first; each is served once."""
    server = servers()
    client = auth.ClientAuth(server.url, SECRET, 10)
    first, second = (
        client(requests.Request("GET", f"{server.url}/version").prepare()) for _ in range(2)
    )
    with requests.Session() as s:
        assert [s.send(r, timeout=10).status_code for r in (second, first, first)] == [
            200,
            200,
            401,
        ]


def _register(folder, name: str, url: str) -> None:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    (folder / name).write_text(url)


def test_stale_registrations_are_ignored_not_waited_on(servers, tmp_path):
    """A killed server's file (its port now closed), another job's server at a registered
    address, and the previous allocation's files: none is taken or sent anything; this run's one
    live server is, at once (start_timeout_s is 60 s)."""
    live, other = servers(), servers(secret="another-jobs-secret")
    url_dir = tmp_path / "urls"
    scope = url_dir / "slurm-4242-1"
    dead = FakeServer(ROUTES, SECRET)
    dead.close()
    _register(scope, "oldnode_8000.url", dead.url)
    _register(scope, "strange_8000.url", other.url)
    _register(url_dir / "slurm-4242-0", "node_8000.url", "http://127.0.0.1:1")  # before a requeue
    _register(url_dir, "legacy_8000.url", "http://127.0.0.1:1")  # unscoped, pre-#44 layout
    _register(scope, "node1_8000.url", live.url)
    t0 = time.monotonic()
    engine = _engine(url_dir=str(url_dir), num_servers=1, start_timeout_s=60)
    assert engine.servers == [live.url] and time.monotonic() - t0 < 15
    assert other.served == [] and SECRET.encode() not in _sent_bytes(other)
    engine.close()
    # With only stale files the error says which were ignored and why, after start_timeout_s.
    (scope / "node1_8000.url").unlink()
    with pytest.raises(RolloutServerError) as e:
        _engine(url_dir=str(url_dir), num_servers=1, start_timeout_s=1)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"rollout servers: 0 of 1 registered in {scope}")
    assert "ignored oldnode_8000.url: unreachable, a stale registration" in line
    assert "ignored strange_8000.url: did not prove the job's secret" in line


def test_exactly_num_servers_fresh_registrations_are_taken(servers, tmp_path):
    a, b, c = servers(), servers(), servers()
    scope = tmp_path / "slurm-4242-1"
    for i, s in enumerate((a, b, c)):
        _register(scope, f"node{i}_8000.url", s.url)
    engine = _engine(url_dir=str(tmp_path), num_servers=2, start_timeout_s=20)
    assert len(engine.servers) == 2 and set(engine.servers) < {a.url, b.url, c.url}
    engine.close()


def test_run_scope_names_the_allocation(monkeypatch):
    assert auth.run_scope() == "slurm-4242-1"
    monkeypatch.setenv("SLURM_JOB_ID_HET_GROUP_0", "4240")  # a hetjob: the leader's id
    assert auth.run_scope() == "slurm-4240-1"
    monkeypatch.setenv(auth.RUN_ID_ENV, "abc")
    assert auth.run_scope() == "run-abc"
    for k in (auth.RUN_ID_ENV, "SLURM_JOB_ID_HET_GROUP_0", "SLURM_JOB_ID"):
        monkeypatch.delenv(k)
    assert auth.run_scope() == "local"


def test_url_dir_and_secret_files_are_private(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV)
    old = os.umask(0o002)  # a cluster's usual umask: group-writable by default
    try:
        folder = auth.registration_dir(tmp_path / "urls")
        secret = auth.read_secret(url_dir=str(tmp_path / "urls"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and len(secret) >= 43
    assert stat.S_IMODE((tmp_path / "urls" / auth.URL_DIR_SECRET).stat().st_mode) == 0o600

    path = tmp_path / "secret"
    path.write_text("s3cret")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"^rollout server secret file .*mode 644; .*chmod 600\)$"):
        auth.read_secret(str(path))
    path.chmod(0o600)
    assert auth.read_secret(str(path)) == "s3cret"
    (tmp_path / "urls" / auth.URL_DIR_SECRET).chmod(0o640)
    with pytest.raises(ValueError, match="mode 640"):
        auth.read_secret(url_dir=str(tmp_path / "urls"))
    folder.chmod(0o770)
    with pytest.raises(ValueError, match=r"^rollout url dir .*mode 770; .*\(chmod 700\)$"):
        auth.registration_dir(tmp_path / "urls")
    if os.getuid() == 0:  # another user's file: only root can make one here
        path.chmod(0o600)
        os.chown(path, 12345, -1)
        with pytest.raises(ValueError, match="owned by uid 12345"):
            auth.read_secret(str(path))
