"""Process-group settings of a job (megatron_ngrpo/parallel.py): every group gets the job's
collective timeout (tests/dist/groups_worker.py; vLLM's colocated groups: test_vllm_engine.py),
and NCCL's flight recorder is on with a dump on timeout, unless the user set otherwise."""

from __future__ import annotations

import os
from pathlib import Path

from megatron_ngrpo.testing.multiproc import check, launch


def test_every_process_group_gets_the_job_timeout():
    results = launch(
        Path(__file__).parent / "dist" / "groups_worker.py",
        nproc=2,
        timeout=300,
        env={"NGRPO_TEST_PG_TIMEOUT": "97"},
    )
    timeouts = check(results, "every_group_gets_the_job_timeout")
    # default, megatron's TP/PP/DP/MP/embedding (+ gloo) groups, the duplicates, the client's
    assert len(timeouts) >= 8, timeouts
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
