"""Planned stops (training/stop.py): the allocation's deadline from Slurm or the config, the margin
learned from measured step and save times, the signal flag agreed by all-reduce, the
allocations.jsonl line. The trainer's side (a signal or a deadline mid-run saves, exits 75 and
resumes identically) is in tests/test_train.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime

import pytest
import torch.distributed as dist

from megatron_ngrpo.launch.torchrun import node_status
from megatron_ngrpo.training import outcome
from megatron_ngrpo.training.config import StopConfig
from megatron_ngrpo.training.stop import (
    ALLOCATIONS_FILE,
    EXIT_CONTINUE,
    SAFETY,
    StopControl,
    allocation_deadline,
    error_reason,
)
from megatron_ngrpo.training.watchdog import EXIT_WATCHDOG


@pytest.fixture
def group(tmp_path):
    """A one-process gloo group (the all-reduce of :meth:`StopControl.agreed`)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def control():
    made = []

    def make(**fields) -> StopControl:
        made.append(StopControl(StopConfig(**fields), env={}))
        return made[-1]

    yield make
    for c in made:
        c.restore()


def _squeue(out: str, calls: list):
    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=out)

    return run


def test_deadline_comes_from_the_allocation():
    cfg, calls = StopConfig(), []
    assert allocation_deadline(cfg, 100.0, {"SLURM_JOB_END_TIME": "5000"}) == 5000.0
    end = datetime(2026, 12, 2, 3, 4, 5)
    got = allocation_deadline(cfg, 100.0, {"SLURM_JOB_ID": "42"}, _squeue(f"{end:%FT%T}\n", calls))
    assert got == end.timestamp() and calls == [["squeue", "-h", "-j", "42", "-o", "%e"]]
    assert allocation_deadline(cfg, 100.0, {"SLURM_JOB_ID": "42"}, _squeue("N/A\n", [])) is None
    assert allocation_deadline(cfg, 100.0, {}, _squeue("", calls)) is None  # outside Slurm
    assert len(calls) == 1
    limited = StopConfig(time_limit_s=600)
    assert allocation_deadline(limited, 100.0, {"SLURM_JOB_START_TIME": "50"}) == 650.0
    assert allocation_deadline(limited, 100.0, {}) == 700.0  # from the process's start


def test_switched_off_nothing_is_handled(control):
    before = signal.getsignal(signal.SIGUSR1)
    off = control(enabled=False, time_limit_s=1)
    assert signal.getsignal(signal.SIGUSR1) is before and off.deadline is None
    assert off.agreed() is None  # no collective either: no process group here
    on = control(time_limit_s=1)
    assert signal.getsignal(signal.SIGUSR1) == on._on_signal and on.deadline is not None


def test_a_signal_is_a_flag_acted_on_at_the_boundary(group, control):
    c = control()
    assert c.agreed() is None
    for s in (signal.SIGUSR1, signal.SIGTERM):  # else the kills below would end this test run
        assert signal.getsignal(s) == c._on_signal
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)  # the first signal names the stop
    assert c.signal_name == "SIGUSR1" and c.agreed() == "signal:SIGUSR1"


def test_the_margin_is_learned_from_step_and_save_times(group, control):
    c = control(margin_s=10.0)
    c.deadline = time.time() + 5
    assert c.agreed() is None  # nothing measured yet: no step of this process to save
    c.deadline = time.time() + 90
    c.step_done(4, 20.0)
    c.step_done(5, 50.0)
    c.save_s = 5.0
    assert c.margin() == SAFETY * (50.0 + 5.0) + 10.0
    assert c.agreed() == "deadline"  # 92.5 s of margin, < 90 s left
    c.deadline = time.time() + 200
    assert c.agreed() is None


def test_each_exit_appends_one_line(tmp_path, control, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    c = control()
    c.step_done(5, 2.0)
    c.step_done(6, 3.0)
    c.record(tmp_path, "signal:SIGTERM", EXIT_CONTINUE)
    c.record(tmp_path, error_reason(ValueError("bad\nsecond line")), 1)
    first, second = map(json.loads, (tmp_path / ALLOCATIONS_FILE).read_text().splitlines())
    assert first["job_id"] == "77" and first["restart"] == 2
    assert (first["first_step"], first["last_step"], first["steps_gained"]) == (5, 6, 2)
    assert first["step_seconds"] == 5.0 and first["started"] <= first["ended"] <= time.time()
    assert (first["reason"], first["exit_code"]) == ("signal:SIGTERM", 75)
    assert (second["reason"], second["exit_code"]) == ("error: ValueError: bad", 1)
    monkeypatch.setenv("RANK", "1")
    c.record(tmp_path, "done", 0)  # other ranks write nothing
    assert len((tmp_path / ALLOCATIONS_FILE).read_text().splitlines()) == 2


def test_a_save_holds_the_signals_its_helpers_would_die_of(control):
    """Slurm signals every process of the step: a helper started during a save (megatron's
    checkpoint writer) keeps the signals blocked, the trainer gets its signal after the save."""
    c = control()
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    with c.signals_held():
        helper = subprocess.Popen(sleeper)
        os.kill(os.getpid(), signal.SIGUSR1)  # held by this thread until the save ends
    time.sleep(0.2)
    assert c.signal_name == "SIGUSR1"
    outside = subprocess.Popen(sleeper)
    try:
        time.sleep(0.5)  # both interpreters started
        for p in (helper, outside):
            p.send_signal(signal.SIGUSR1)
        assert outside.wait(timeout=10) == -signal.SIGUSR1
        time.sleep(0.5)
        assert helper.poll() is None, "the helper started inside the save died of SIGUSR1"
    finally:
        for p in (helper, outside):
            p.kill()
            p.wait()


def test_the_torchrun_wrapper_maps_its_workers_statuses(tmp_path):
    """launch/torchrun.py: every worker of the node at 75 is 75, any 76 (the watchdog) is 76,
    anything else leaves torchrun's own status; the statuses come from training/outcome.py."""
    for rank, code in ((0, EXIT_CONTINUE), (1, EXIT_CONTINUE)):
        env = {outcome.OUTCOME_ENV: str(tmp_path), "RANK": str(rank)}
        outcome.write(code, env)
    outcome.write(1, {"RANK": "2"})  # no directory set: nothing written
    codes = outcome.read(tmp_path)
    assert codes == {0: EXIT_CONTINUE, 1: EXIT_CONTINUE}
    assert node_status(codes, 2) == EXIT_CONTINUE
    assert node_status(codes, 4) is None  # two workers said nothing: torchrun's status stands
    assert node_status({0: EXIT_CONTINUE, 1: 1}, 2) is None
    assert node_status({0: EXIT_WATCHDOG}, 2) == EXIT_WATCHDOG
