"""The stage watchdog (training/watchdog.py, issue 43 item 3): deadlines from the config and the
measured stage times, the verdict read from the heartbeat files, the monitor on a stage that
sleeps past its deadline (stacks, one line, exit 76), and a 2-rank training run whose rank 1 hangs
inside a collective at step 2 (tests/support/hung_train.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_train

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.training.watchdog import (
    EXIT_WATCHDOG,
    HANG_DIR,
    REPORT_FILE,
    Deadlines,
    Watchdog,
    WatchdogConfig,
    _Open,
)
from tests.support.hung_train import HANG_VAR

REPO = Path(__file__).resolve().parents[1]
task = test_train.task  # the arithmetic task fixture (module scope)


# ---- deadlines -----------------------------------------------------------------------------------
def test_deadlines_follow_the_config(tmp_path):
    """Each field flipped changes a deadline or what the watchdog does."""
    d = Deadlines(WatchdogConfig(), dist_timeout_s=1000)
    assert d.of("rollout") == 900  # first occurrence: 0.9 × dist_timeout_s
    d.observe("rollout", 10)
    assert d.of("rollout") == 300  # floor_s
    d.observe("rollout", 100)
    assert d.of("rollout") == 500 and d.of("update") == 900  # factor × the longest; per stage
    d.observe("rollout", 50)
    assert d.of("rollout") == 500
    d.observe("rollout", 400)
    assert d.of("rollout") == 900  # never above the first occurrence's
    for stage in ("rollout", "weight_sync", "update", "save", "validation"):
        fixed = Deadlines(WatchdogConfig(**{f"{stage}_s": 42}), 1000)
        fixed.observe(stage, 1)
        assert (
            fixed.of(stage) == 42 and fixed.of("rollout" if stage != "rollout" else "save") == 900
        )
    tuned = Deadlines(WatchdogConfig(first_s=60, floor_s=5, factor=2.0), 1000)
    assert tuned.of("save") == 60
    tuned.observe("save", 4)
    assert tuned.of("save") == 8
    tuned.observe("save", 1)
    assert tuned.of("save") == 8
    # enabled: false writes no heartbeat and starts no thread
    for enabled, files in ((False, []), (True, ["rank0.json"])):
        dog = Watchdog(WatchdogConfig(enabled=enabled), 1000, tmp_path / str(enabled), 0, 1, "s")
        dog.start()
        with dog.stage("update", 1):
            assert (dog._thread is not None) == enabled
        dog.close()
        hang = tmp_path / str(enabled) / HANG_DIR
        assert sorted(p.name for p in hang.glob("*")) == files if enabled else not hang.exists()


def test_heartbeat_names_the_node_as_slurm_does(tmp_path, monkeypatch):
    """The chain passes the hosts of a hang report to ``--exclude``: Slurm's node name, which the
    host name need not be (the test cluster's n1..n3 share one host)."""
    monkeypatch.setenv("SLURMD_NODENAME", "n7")
    dog = Watchdog(WatchdogConfig(), 1000, tmp_path, 0, 1, "s")
    dog.start()
    with dog.stage("update", 1):
        beat = json.loads((tmp_path / HANG_DIR / "rank0.json").read_text())
    dog.close()
    assert beat["host"] == "n7"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.watchdog.update_s=1700"], "'train.watchdog.update_s' = 1700: must be at most 0.9"),
        (
            ["train.dist_timeout_s=100", "train.watchdog.first_s=91"],
            "'train.watchdog.first_s' = 91: must be at most 0.9 × train.dist_timeout_s = 90 s",
        ),
        (["train.watchdog.factor=0.5"], "'train.watchdog.factor' = 0.5: must be >= 1"),
        (["train.watchdog.save_s=-1"], "'train.watchdog.save_s' = -1: must be >= 0"),
    ],
)
def test_deadlines_above_the_process_group_timeout_are_refused(
    task, monkeypatch, overrides, message
):
    with pytest.raises(ConfigError) as err:
        test_train._cfg(task, *overrides, monkeypatch=monkeypatch)
    assert message in str(err.value) and "\n" not in str(err.value)
    # Disabled, nothing has to fit below the process-group timeout.
    cfg = test_train._cfg(
        task,
        "train.watchdog.enabled=false",
        "train.watchdog.update_s=1700",
        monkeypatch=monkeypatch,
    )
    assert cfg.train.watchdog.update_s == 1700


# ---- the verdict ---------------------------------------------------------------------------------
def test_verdict_names_the_ranks_behind_the_front(tmp_path):
    """Three ranks: rank 0 waits in 'update', rank 1 is still in 'rollout', rank 2 left only a
    heartbeat of an earlier job; then everyone in the same stage."""
    dogs = [Watchdog(WatchdogConfig(), 1800, tmp_path, r, 3, "now") for r in range(2)]
    (tmp_path / HANG_DIR).mkdir()
    (tmp_path / HANG_DIR / "rank2.json").write_text(
        json.dumps({"session": "old", "seq": 99, "stage": "save", "step": 9, "state": "in"})
    )
    late = _Open("update", 7, 0.0, 120.0, time.time())
    with dogs[1].stage("rollout", 7):  # rank 1 stays in it
        with dogs[0].stage("rollout", 7):
            pass
        with dogs[0].stage("update", 7):
            report = dogs[0].report(late)
            # The same verdict whichever rank's deadline expired first: the one behind, here.
            behind = dogs[1].report(_Open("rollout", 7, 0.0, 60.0, time.time()))
    assert report["line"].startswith(
        "watchdog: stage 'update' at step 7: ranks [1, 2] did not arrive (rank 1 last seen in "
        "'rollout' at step 7, 0 s ago; rank 2 never seen in this job); rank 0's 'update' deadline "
        f"of 120 s expired; stacks in {tmp_path / HANG_DIR} (none from ranks [0, 1, 2])"
    ), report["line"]
    assert report["missing"] == [1, 2] and report["stage"] == "update"
    assert behind["line"].startswith(report["line"].split("; rank 0's")[0] + "; rank 1's 'rollout'")
    dogs = dogs[:1] + [Watchdog(WatchdogConfig(), 1800, tmp_path, 1, 2, "now")]
    dogs[0]._seq = 0
    with dogs[0].stage("save", 8), dogs[1].stage("save", 8):
        report = dogs[1].report(_Open("save", 8, 0.0, 60.0, time.time()))
    assert (
        "stage 'save' at step 8: every rank arrived (the hang is inside the stage); rank 1's"
        in (report["line"])
    )


# ---- the monitor -----------------------------------------------------------------------------------
STALLED = """
import sys, time
from pathlib import Path
from megatron_ngrpo.training.watchdog import Watchdog, WatchdogConfig
run_dir, rank = Path(sys.argv[1]), int(sys.argv[2])
dog = Watchdog(WatchdogConfig(rollout_s=30, update_s=2), 1800, run_dir, rank, 2, "job1")
dog.start()
peer = run_dir / "hang" / "rank1.json"
while rank == 0 and '"rollout"' not in (peer.read_text() if peer.exists() else ""):
    time.sleep(0.05)  # rank 1 is in 'rollout' first (the test's own bound: 60 s)
with dog.stage("rollout", 7):
    if rank == 1:
        time.sleep(120)  # stuck: rank 0 goes on and waits in 'update'
with dog.stage("update", 7):
    time.sleep(120)
"""


def test_stage_past_its_deadline_dumps_stacks_reports_and_exits_76(tmp_path):
    """Two processes (no process group): rank 0 waits in 'update' past its 2 s deadline while
    rank 1 sleeps in 'rollout' (30 s deadline): rank 0 reports, rank 1 dumps on its request."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STALLED, str(tmp_path), str(r)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (1, 0)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60))
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [EXIT_WATCHDOG, EXIT_WATCHDOG], outs
    err0 = outs[1][1].strip().splitlines()
    hang = tmp_path / HANG_DIR
    assert err0 == [
        "watchdog: stage 'update' at step 7: ranks [1] did not arrive (rank 1 last seen in "
        f"'rollout' at step 7, {err0[0].split(', ')[1].split(' s ago')[0]} s ago); rank 0's "
        f"'update' deadline of 2 s expired; stacks in {hang}"
    ], outs
    assert outs[0][1] == "", outs  # one line in all: rank 1 only dumps
    report = json.loads((hang / REPORT_FILE).read_text())
    assert report["missing"] == [1] and report["reporter"] == 0 and report["missing_hosts"]
    assert report["at"] - report["expired"]["entered_at"] < 2 + 10
    for rank, reason in ((0, "'update' at step 7 exceeded its 2 s deadline"), (1, "requested")):
        stacks = (hang / f"stack_rank{rank}.txt").read_text()
        assert f"rank {rank} " in stacks.splitlines()[0] and reason in stacks.splitlines()[0]
        assert "in <module>" in stacks and "Current thread" in stacks  # the main thread's sleep


# ---- a 2-rank run with a rank hung in a collective --------------------------------------------------
def test_a_rank_hung_in_a_collective_is_named_and_the_job_exits_76(task, tmp_path):
    """Rank 1 blocks in a collective no other rank joins at step 2's rollout; rank 0 goes on to
    'update' and waits in its gradient all-reduce. Deadlines learned from step 1 (floor 10 s)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = test_train._launch(
        task,
        run_dir,
        "mixing.refresh_every=0",  # step 2's rollout holds no collective: rank 0 gets past it
        "train.watchdog.first_s=120",
        "train.watchdog.floor_s=10",
        "train.watchdog.factor=4",
        module="tests.support.hung_train",
        env={HANG_VAR: "1:2"},
    )
    log = run_dir.parent / f"{run_dir.name}.log"
    try:
        rc = proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        test_train._sigkill(proc)
        pytest.fail("no watchdog within 240 s: " + log.read_text()[-3000:])
    text = log.read_text()
    hang = run_dir / HANG_DIR
    report = json.loads((hang / REPORT_FILE).read_text())
    lines = [line for line in text.splitlines() if line.startswith("watchdog: ")]
    assert rc != 0 and text.count(f"exitcode  : {EXIT_WATCHDOG}") == 2, text[-3000:]
    assert lines == [report["line"]], text[-3000:]
    assert lines[0].startswith(
        "watchdog: stage 'update' at step 2: ranks [1] did not arrive (rank 1 last seen in "
        "'rollout' at step 2, "
    ), lines
    expired = report["expired"]
    assert report["at"] - expired["entered_at"] <= expired["deadline_s"] + 30, report
    for rank in (0, 1):
        assert "Current thread" in (hang / f"stack_rank{rank}.txt").read_text()
    assert "in next_or_hang" in (hang / "stack_rank1.txt").read_text()  # the barrier's caller
    stack0 = (hang / "stack_rank0.txt").read_text()
    assert "in all_reduce" in stack0 and "in train_step" in stack0  # waiting for rank 1
