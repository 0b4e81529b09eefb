"""Process-group settings of a job (megatron_ngrpo/parallel.py): every group gets the job's
collective timeout (tests/dist/groups_worker.py; vLLM's colocated groups: test_vllm_engine.py),
and NCCL's flight recorder is on with a dump on timeout, unless the user set otherwise."""

from __future__ import annotations

import os
from pathlib import Path

from tests.harness.multiproc import check, launch


def test_every_process_group_gets_the_job_timeout():
    results = launch(
        Path(__file__).parent / "dist" / "groups_worker.py",
        nproc=2,
        timeout=300,
        env={"NGRPO_TEST_PG_TIMEOUT": "97"},
    )
    timeouts = check(results, "every_group_gets_the_job_timeout")
    # default, megatron's TP/PP/DP/MP/embedding (+ gloo) groups, the duplicates, the client's, and
    # both members of a weight-transfer pair group
    assert len(timeouts) >= 10, timeouts
    assert {"weight-transfer pair (trainer)", "weight-transfer pair (worker)"} <= set(timeouts)
    assert {name: s for name, s in timeouts.items() if s != 97.0} == {}
    assert any("DATA_PARALLEL_GROUP_GLOO" in name for name in timeouts), timeouts


def test_nccl_flight_recorder_defaults_keep_the_users(monkeypatch, tmp_path):
    from megatron_ngrpo.parallel import set_nccl_debug_defaults

    for name in (
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_FR_DUMP_TEMP_FILE",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")  # the user's
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")  # the user's, under torch's newer name
    set_nccl_debug_defaults(str(tmp_path / "traces"))
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert (
        os.environ["TORCH_FR_BUFFER_SIZE"] == "50"
        and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ
    )
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "traces" / "nccl_trace_rank_")
    assert (tmp_path / "traces").is_dir()
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT")
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    set_nccl_debug_defaults()
    assert (
        os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
        and os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    )


def test_single_process_init_leaves_no_stale_port(monkeypatch):
    """A single process without a launcher binds its own port; the torchrun variables it writes
    (vLLM's external launcher reads them) must not send a child process, or this process's next
    init, to that port while it is held (EADDRINUSE in CI: the eval CLI and a test's in-process
    init after an earlier test's)."""
    import socket
    import subprocess
    import sys

    import torch.distributed as dist

    from megatron_ngrpo.parallel import SINGLE_PROCESS_PORT_VAR, init_distributed

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(SINGLE_PROCESS_PORT_VAR, raising=False)
    if dist.is_initialized():
        dist.destroy_process_group()
    init_distributed()
    try:
        port = os.environ["MASTER_PORT"]
        assert os.environ["RANK"] == "0" and os.environ[SINGLE_PROCESS_PORT_VAR] == port
        child = (
            "from megatron_ngrpo.parallel import init_distributed; init_distributed(); print('ok')"
        )
        r = subprocess.run(
            [sys.executable, "-c", child], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
        # a launcher's variables are still obeyed: a child told port 0 binds that
        launched = dict(os.environ, MASTER_PORT="0")
        r = subprocess.run(
            [sys.executable, "-c", child], env=launched, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr[-2000:]
    finally:
        dist.destroy_process_group()
    with socket.socket() as held:  # the old port, taken by someone else since
        try:
            held.bind(("127.0.0.1", int(port)))
            held.listen()
        except OSError:
            pass  # still held by the old store: the same case
        init_distributed()  # a new port, not EADDRINUSE on the stale one
        try:
            assert os.environ["MASTER_PORT"] != port
        finally:
            dist.destroy_process_group()
