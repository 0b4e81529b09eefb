"""A run longer than its allocations, on the repository's Slurm test cluster (tests/test_slurm.py's
cluster: real slurmctld, three slurmd, CPU, the tiny model), through ``ngrpo-launch run ...
--until-done``. Marked ``slurm_campaign`` and left out of the default run (pytest.ini): several
allocations of minutes each; run them with ``pytest -m slurm_campaign tests/test_slurm_campaign.py``.

(a) a 9-step run under a 5-minute time limit per job completes over >= 3 allocations by itself
    (each allocation: the chain queues its successor, the trainer trains, stops at the warning
    signal or its deadline with a checkpoint and exits 75; at most 3 steps each, see
    tests/support/pace); its final weights, optimizer state and metrics.jsonl (steps 1..9, none
    repeated) equal an uninterrupted run's, bit for bit; ``ngrpo-launch status`` shows the chain.
(b) ``scancel --signal=USR1`` and then a plain ``scancel`` (SIGTERM) of the running allocation:
    each next allocation starts at the step the stopped one reached and saved, and the run ends
    identical to the uninterrupted one.
(c) the node of the running allocation is lost mid-step (its slurmd and the job's processes on it
    SIGKILLed): Slurm marks it DOWN and the job NODE_FAIL; the queued successor resumes on the
    other nodes at the last checkpoint, and the chain keeps its successors off the lost node.
(d) one rank hangs inside a collective (tests/support/hung_train.py's hook, once): the watchdog
    ends the allocation within its deadline + 30 s with every rank's stacks in <run_dir>/hang;
    the next allocation, off the hung rank's node, continues from the last checkpoint to the end
    (metrics.jsonl: steps contiguous, none repeated).
(e) a finished part of the run, then its newest checkpoint truncated and ``latest`` naming a missing
    one: the next chain's allocation says so in one line and resumes from the checkpoint before;
    the older checkpoints and metrics.jsonl's rows up to it are untouched, and the run ends
    identical to the uninterrupted one.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from slurm_harness import (
    REPO,
    experiment_id,
    free_port,
    slurm_options,
    start_cli,
    write_arithmetic_task,
)
from test_slurm import cluster  # noqa: F401 (the module's Slurm test cluster)

from megatron_ngrpo.launch import chain
from tests.support.hung_train import HANG_VAR, ONCE_VAR
from tests.test_train import _finish, _launch, _losses, _tensors

pytestmark = pytest.mark.slurm_campaign

STEPS = 9
TRAIN = ("model.tensor_parallel=2", f"train.max_steps={STEPS}", "train.save_every=1")
PACE = REPO / "tests" / "support" / "pace"  # sitecustomize: the trainer paced by the env below


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("arith")
    write_arithmetic_task(root)
    return root


@pytest.fixture(scope="module")
def straight(task, tmp_path_factory) -> Path:
    """The uninterrupted run: the same config under torchrun, no Slurm."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    run_dir.mkdir()
    _finish(_launch(task, run_dir, *TRAIN), run_dir, timeout=900)
    return run_dir


def _until_done(slurm, task: Path, tmp: Path, name: str, pace: dict, minutes: int, *extra: str):
    """``ngrpo-launch run tiny --until-done`` of the trainer on the test cluster (one node, two
    ranks, TP 2; ``minutes`` per allocation) paced by ``pace`` (tests/support/pace), in the
    background; returns (launch, run_dir, env)."""
    env = {
        **slurm.env,
        **pace,
        "PYTHONPATH": f"{PACE}:{REPO}",
        "NEMORUN_HOME": str(tmp / "nemorun_home"),
        "OMP_NUM_THREADS": "1",
    }
    run_dir = tmp / "run"
    argv = [
        "run",
        "tiny",
        "--title",
        f"ngrpo-{name}",
        "--module",
        "megatron_ngrpo.train",
        "--config",
        str(REPO / "configs" / "tiny_test.yaml"),
        "--config",
        str(task / "paths.yaml"),
        "--hf-path",
        str(task / "model"),
        *slurm_options(str(minutes)),
        "--rdzv-port",
        str(free_port()),
        "--until-done",
        "--max-idle-allocations",
        "3",
        *TRAIN,
        *extra,  # after TRAIN: an override here wins
        f"train.run_dir={run_dir}",
    ]
    return start_cli(argv, env, tmp / f"{name}.log"), run_dir, env


def _records(run_dir: Path) -> list[dict]:
    return chain.read_jsonl(run_dir / chain.ALLOCATIONS_FILE)


def _check_steps(run_dir: Path, last: int) -> None:
    """metrics.jsonl holds steps 1..last, contiguous, none repeated."""
    steps = [row["step"] for row in chain.read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, last + 1)), steps


def _check_same_as_straight(run_dir: Path, straight: Path, scratch: Path) -> None:
    _check_steps(run_dir, STEPS)
    last = f"iter_{STEPS:07d}"
    a, b = _tensors(straight / last, scratch), _tensors(run_dir / last, scratch)
    assert a.keys() == b.keys() and any(k.startswith("optimizer.state.exp_avg.") for k in a)
    assert not [k for k in a if not torch.equal(a[k], b[k])]
    assert _losses(straight) == _losses(run_dir)


def test_run_completes_over_allocations_by_itself(cluster, task, straight, tmp_path):  # noqa: F811
    launch, run_dir, env = _until_done(
        cluster,
        task,
        tmp_path,
        "chain",
        {"NGRPO_STEPS_PER_ALLOCATION": "3"},
        5,
        "--signal-lead",
        "20",
        "train.stop.margin_s=10",
    )
    rc, out = launch.finish(timeout_s=2400)
    assert rc == 0, out[-4000:]
    entries = chain.read_jsonl(next((tmp_path / "nemorun_home").rglob(chain.CHAIN_FILE)))
    assert len(entries) >= 3, entries
    assert "allocation(s), complete; goodput" in out, out[-3000:]
    records = [r for r in _records(run_dir) if r["steps_gained"]]
    assert [r["exit_code"] for r in records] == [75] * (len(records) - 1) + [0], records
    assert records[-1]["reason"] == "done" and records[0]["first_step"] == 1
    for before, after in zip(records, records[1:]):  # each allocation resumes where one stopped
        assert after["first_step"] == before["last_step"] + 1, records
    _check_same_as_straight(run_dir, straight, tmp_path)
    rc, status = start_cli(["status", experiment_id(out)], env, tmp_path / "status.log").finish()
    assert rc == 0 and "complete; goodput" in status, status[-3000:]
    for e in entries:
        assert str(e["job_id"]) in status


def _current(tmp: Path, after: int) -> dict:
    """The chain's entry number ``after`` (0-based) once its allocation has started."""
    deadline = time.time() + 900
    while time.time() < deadline:
        files = list((tmp / "nemorun_home").rglob(chain.CHAIN_FILE))
        entries = chain.read_jsonl(files[0]) if files else []
        if len(entries) > after:
            return entries[after]
        time.sleep(2)
    raise AssertionError(f"no allocation {after + 1} within 900 s")


def _wait_for_step(run_dir: Path, step: int) -> None:
    deadline = time.time() + 900
    while chain.checkpoint_step(run_dir) < step:
        assert time.time() < deadline, f"step {step} not checkpointed within 900 s"
        time.sleep(1)


def _wait_for_rows(run_dir: Path, rows: int) -> None:
    """Until metrics.jsonl holds ``rows`` steps (the trainer has run them)."""
    deadline = time.time() + 900
    while len(chain.read_jsonl(run_dir / "metrics.jsonl")) < rows:
        assert time.time() < deadline, f"{rows} steps not run within 900 s"
        time.sleep(0.5)


def test_scancel_usr1_and_term_resume_at_the_right_step(cluster, task, straight, tmp_path):  # noqa: F811
    # No periodic save: the signal meets a step, never a save in flight (megatron's checkpoint
    # writer keeps a multiprocessing manager process, which Slurm's signal to every process of the
    # step would end); the planned stop writes the only checkpoints before the last.
    pace = {"NGRPO_STEP_PACE_S": "2"}
    launch, run_dir, env = _until_done(
        cluster, task, tmp_path, "cancel", pace, 20, "train.save_every=100"
    )
    try:
        first = _current(tmp_path, 0)
        _wait_for_rows(run_dir, 2)
        subprocess.run(["scancel", "--signal=USR1", str(first["job_id"])], env=env, check=True)
        second = _current(tmp_path, 1)
        _wait_for_rows(run_dir, second["step"] + 2)
        subprocess.run(["scancel", str(second["job_id"])], env=env, check=True)
        third = _current(tmp_path, 2)
        rc, out = launch.finish(timeout_s=1800)
    finally:
        launch.kill()
    assert rc == 0, out[-4000:]
    stops = {r["job_id"]: r for r in _records(run_dir)}
    one, two = stops[str(first["job_id"])], stops[str(second["job_id"])]
    assert one["reason"] == "signal:SIGUSR1" and one["exit_code"] == 75, one
    assert two["reason"] == "signal:SIGTERM" and two["exit_code"] == 75, two
    assert second["step"] == one["last_step"] >= 2 and third["step"] == two["last_step"], stops
    _check_same_as_straight(run_dir, straight, tmp_path)


def _sacct_state(job: str, env: dict) -> str:
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "State", "-j", str(job)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return out.split()[0] if out.split() else ""


def test_a_lost_node_the_chain_resumes_on_the_others(cluster, task, tmp_path):  # noqa: F811
    last = 6
    launch, run_dir, env = _until_done(
        cluster, task, tmp_path, "lost", {"NGRPO_STEP_PACE_S": "2"}, 20, f"train.max_steps={last}"
    )
    lost = None
    try:
        first = _current(tmp_path, 0)
        _wait_for_step(run_dir, 2)
        lost = first["nodes"][0]
        cluster.lose_node(lost)
        second = _current(tmp_path, 1)
        # the queued successor, not a requeued first job; the lost node is kept off from now on
        assert second["job_id"] == first["next"] and lost not in second["nodes"], second
        assert second["exclude"] == [lost] and second["step"] >= 2, second
        assert _sacct_state(first["job_id"], env) == "NODE_FAIL"
        queued = subprocess.run(
            ["scontrol", "show", "job", str(second["next"])],
            env=env,
            capture_output=True,
            text=True,
        ).stdout
        assert f"ExcNodeList={lost}" in queued, queued
        rc, out = launch.finish(timeout_s=1800)
    finally:
        launch.kill()
        if lost:
            cluster.revive_node(lost)
    assert rc == 0, out[-4000:]
    _check_steps(run_dir, last)


def test_a_hung_rank_is_explained_and_the_chain_resumes(cluster, task, tmp_path):  # noqa: F811
    last = 5
    hook = {HANG_VAR: "1:3", ONCE_VAR: str(tmp_path / "hung-once")}
    launch, run_dir, env = _until_done(
        cluster,
        task,
        tmp_path,
        "hung",
        hook,
        20,
        f"train.max_steps={last}",
        "mixing.refresh_every=0",  # step 3's rollout holds no collective: rank 0 gets past it
        "train.watchdog.first_s=120",
        "train.watchdog.floor_s=10",
        "train.watchdog.factor=4",
    )
    try:
        rc, out = launch.finish(timeout_s=1800)
    finally:
        launch.kill()
    assert rc == 0, out[-4000:]
    hang = run_dir / "hang"
    report = json.loads((hang / "report.json").read_text())
    expired = report["expired"]
    assert report["missing"] == [1] and report["at"] - expired["entered_at"] <= (
        expired["deadline_s"] + 30
    ), report
    for rank in (0, 1):
        assert "Current thread" in (hang / f"stack_rank{rank}.txt").read_text()
    assert "in next_or_hang" in (hang / "stack_rank1.txt").read_text()
    entries = chain.read_jsonl(next((tmp_path / "nemorun_home").rglob(chain.CHAIN_FILE)))
    first, second = entries[:2]
    assert _sacct_state(first["job_id"], env) == "FAILED"
    logs = "".join(
        p.read_text(errors="replace") for p in (tmp_path / "nemorun_home").rglob("log-*.out")
    )
    assert report["line"] in logs and f"exitcode  : {chain.EXIT_WATCHDOG}" in logs
    # the hung rank's node (Slurm's name for it) is excluded; the run resumes at the checkpoint
    assert report["missing_hosts"] == first["nodes"] == second["exclude"], (report, second)
    assert not set(second["nodes"]) & set(first["nodes"]) and second["step"] == 2, second
    _check_steps(run_dir, last)


def _job_logs(tmp: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in (tmp / "nemorun_home").rglob("log-*.out"))


def test_a_broken_newest_checkpoint_the_chain_falls_back(cluster, task, straight, tmp_path):  # noqa: F811
    first, keep = 5, "train.keep_last=20"  # nothing pruned: every older checkpoint can be compared
    launch, run_dir, _ = _until_done(
        cluster, task, tmp_path, "part", {}, 20, f"train.max_steps={first}", keep
    )
    rc, out = launch.finish(timeout_s=1800)
    assert rc == 0, out[-4000:]
    shard = max((run_dir / f"iter_{first:07d}").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (run_dir / "latest").write_text("iter_0000009\n")
    older = {
        p.relative_to(run_dir).as_posix(): p.read_bytes()
        for p in sorted(run_dir.glob("iter_000000[1-4]/**/*"))
        if p.is_file()
    }
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()[: first - 1]
    launch, _, _ = _until_done(cluster, task, tmp_path, "rest", {}, 20, keep)
    rc, out = launch.finish(timeout_s=1800)
    assert rc == 0, out[-4000:]
    said = [ln for ln in _job_logs(tmp_path).splitlines() if "resuming from iter_0000004" in ln]
    assert len(said) == 1 and "iter_0000009" in said[0], said
    assert {k: (run_dir / k).read_bytes() for k in older} == older
    assert (run_dir / "metrics.jsonl").read_text().splitlines()[: first - 1] == rows
    _check_same_as_straight(run_dir, straight, tmp_path)
