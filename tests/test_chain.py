"""Runs longer than one allocation, without a cluster: the partition's MaxTime checked before
anything queues (fake ``sinfo``), the save-interval note, the chain's decisions (continue, stop,
exclude) from fake ``allocations.jsonl`` / ``chain.jsonl`` / ``sacct`` / ``sinfo`` output, what
``status`` shows, and the lines ``--until-done`` and ``--signal-lead`` put in the script. The
chain on a real Slurm is tests/test_slurm_campaign.py."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ngrpo.atomic import commit_directory
from megatron_ngrpo.checkpoint_files import MANIFEST_FILE, META_FILE
from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.launch import chain, cli, time_limit

REPO = Path(__file__).resolve().parents[1]


def fake_slurm(outputs: dict[str, str], calls: list | None = None):
    """A runner answering each command by its first word (``sbatch``, ``sacct``, ...)."""

    def run(argv: list[str]) -> str:
        if calls is not None:
            calls.append(argv)
        key = argv[0] if argv[0] != "scontrol" else f"scontrol {argv[1]}"
        return outputs[key]

    return run


# ---- MaxTime and the save interval -------------------------------------------------------------


def _checkpoint(run_dir: Path, step: int) -> Path:
    """A checkpoint as the trainer commits it: metadata, a shard, the manifest of their sizes."""
    tmp = run_dir / f".iter_{step:07d}.partial"
    tmp.mkdir(parents=True)
    (tmp / META_FILE).write_text(json.dumps({"step": step}))
    (tmp / "__0_0.distcp").write_bytes(bytes(100))
    final = run_dir / f"iter_{step:07d}"
    commit_directory(tmp, final, collective=False, manifest=MANIFEST_FILE)
    return final


def _published(run_dir: Path, step: int) -> None:
    """A verified checkpoint at ``step`` that ``latest`` names (what the chain counts)."""
    _checkpoint(run_dir, step)
    (run_dir / "latest").write_text(f"iter_{step:07d}\n")


@pytest.mark.parametrize(
    "limit,time,refused",
    [
        ("4:00:00", "48:00:00", True),
        ("4:00:00\n4:00:00", "04:00:00", False),
        ("1-00:00:00", "24:00:00", False),
        ("1-00:00:00", "1-00:00:01", True),
        ("infinite", "72:00:00", False),
        ("UNLIMITED", "7-00:00:00", False),
        ("30:00", "45", True),  # Slurm's minutes
    ],
)
def test_time_is_checked_against_the_partitions_max_time(limit, time, refused):
    run = fake_slurm({"sinfo": limit})
    if not refused:
        time_limit.check_time(time, "gpu", run)
        return
    with pytest.raises(ConfigError) as e:
        time_limit.check_time(time, "gpu", run)
    assert str(e.value).startswith(f"--time {time}: above partition gpu's MaxTime")
    assert "--until-done" in str(e.value) and "\n" not in str(e.value)


def test_unknown_partition_and_bad_time_are_one_line():
    with pytest.raises(ConfigError, match="sinfo lists no such partition"):
        time_limit.check_time("1:00:00", "nosuch", fake_slurm({"sinfo": ""}))
    with pytest.raises(ConfigError, match="--time: time '1h'"):
        time_limit.check_time("1h", "gpu", fake_slurm({"sinfo": "infinite"}))


def test_run_and_plan_refuse_a_time_above_max_time_before_anything_queues(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(time_limit, "_sinfo", fake_slurm({"sinfo": "4:00:00"}))
    monkeypatch.setattr(time_limit.shutil, "which", lambda name: f"/usr/bin/{name}")
    config = str(REPO / "configs" / "ngrpo_r1_7b.yaml")
    common = ["--partition", "gpu", "--config", config, "train.run_dir=/lustre/r"]
    assert cli.main(["run", "r1-7b", "--executor", "slurm", *common, "--dryrun"]) == 2
    assert cli.main(["plan", "r1-7b", *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err
        == [
            "error: --time 48:00:00: above partition gpu's MaxTime 04:00:00; ask for --time "
            "04:00:00 or less (--until-done continues the run in the next allocation)"
        ]
        * 2
    ), err
    assert not (tmp_path / "home" / "experiments").exists()


def test_save_interval_that_cannot_fit_one_allocation_is_said(tmp_path):
    note = time_limit.save_interval_note("04:00:00", 10, 1800.0)
    assert note.startswith("note: train.save_every=10 × 1800 s per step = 05:00:00 does not fit")
    assert note.endswith("train.save_every=7 would")
    assert time_limit.save_interval_note("04:00:00", 7, 1800.0) is None
    assert time_limit.save_interval_note("infinite", 10, 1800.0) is None
    rows = [{"steps_gained": 3, "step_seconds": 30.0}, {"steps_gained": 1, "step_seconds": 14.0}]
    (tmp_path / "allocations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert time_limit.measured_step_seconds(str(tmp_path)) == 11.0


# ---- the chain's decisions ---------------------------------------------------------------------


def _rec(job, gained, reason, code, **extra) -> dict:
    return dict(job_id=job, steps_gained=gained, reason=reason, exit_code=code, **extra)


def test_decide_continues_stops_and_excludes():
    entries = [{"job_id": "11", "step": 0}, {"job_id": "12", "step": 3}]
    records = [_rec("11", 3, "signal:SIGUSR1", 75), _rec("12", 0, "error: hang", 76)]
    d = chain.decide(entries, records, 3, 8, 2, [])
    assert d.code == chain.RUN and d.exclude == []  # one idle allocation, nothing named
    records[1]["failed_hosts"] = ["n2"]
    d = chain.decide(entries, records, 3, 8, 2, ["n3"])
    assert d.code == chain.RUN and d.exclude == ["n2", "n3"]
    entries.append({"job_id": "13", "step": 3})
    d = chain.decide(entries, records, 3, 8, 2, [])
    assert d.code == chain.STOPPED and "\n" not in d.line
    assert d.line.startswith("chain: stopped: 2 allocations in a row gained no step (jobs 12, 13;")
    assert chain.decide(entries, records, 3, 8, 3, []).code == chain.RUN
    assert chain.decide(entries, records, 8, 8, 2, []).code == chain.NOTHING_LEFT
    # a planned stop (75) or completion names no node, even with hosts in its record
    assert chain.failed_hosts([_rec("1", 2, "deadline", 75, failed_hosts=["n1"])], []) == []


def test_slurm_failed_nodes_are_node_fail_jobs_nodes_now_down():
    run = fake_slurm(
        {
            "sacct": "11|FAILED|n[1-2]\n12|NODE_FAIL|n[2-3]\n",
            "sinfo": "n3\nn7\n",
            "scontrol show": "n2\nn3\n",
        }
    )
    assert chain.slurm_failed_nodes([{"job_id": "11"}, {"job_id": "12"}], run) == ["n3"]


def _args(tmp_path: Path, max_steps=8, max_idle=2) -> argparse.Namespace:
    (tmp_path / "job").mkdir(exist_ok=True)
    (tmp_path / "run").mkdir(exist_ok=True)
    return argparse.Namespace(
        job_dir=str(tmp_path / "job"),
        run_dir=str(tmp_path / "run"),
        max_steps=max_steps,
        max_idle=max_idle,
        script="/spool/slurm_script",
    )


def test_begin_queues_the_successor_and_records_the_allocation(tmp_path, capsys):
    args = _args(tmp_path)
    run_dir = Path(args.run_dir)
    _published(run_dir, 3)
    (run_dir / "allocations.jsonl").write_text(
        json.dumps(_rec("11", 3, "error: watchdog", 76, failed_hosts=["n2"])) + "\n"
    )
    calls = []
    run = fake_slurm(
        {
            "sacct": "11|FAILED|n[1-2]\n",
            "scontrol show": "n1\nn3\n",
            "scontrol update": "",
            "sbatch": "13;cluster\n",
        },
        calls,
    )
    env = {"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "n[1,3]"}
    assert chain.begin(args, env, run) == chain.RUN
    sbatch = [c for c in calls if c[0] == "sbatch"]
    assert sbatch == [
        [
            "sbatch",
            "--parsable",
            "--dependency=afternotok:12",
            "--kill-on-invalid-dep=yes",
            "--exclude=n2",
            "/spool/slurm_script",
        ]
    ]
    # not requeueable: a lost node ends it NODE_FAIL, and the queued successor takes over
    assert ["scontrol", "update", "JobId=12", "Requeue=0"] in calls
    entry = chain.read_jsonl(Path(args.job_dir) / chain.CHAIN_FILE)[-1]
    assert entry["job_id"] == "12" and entry["step"] == 3 and entry["next"] == "13"
    assert (
        "starts at step 3; next allocation queued: job 13 (excluding n2)" in capsys.readouterr().out
    )
    # An allocation on an excluded node queues its successor and trains nothing; an exclusion
    # stays after the record that named it is gone.
    (run_dir / "allocations.jsonl").write_text("")
    env = {"SLURM_JOB_ID": "13", "SLURM_JOB_NODELIST": "n2"}
    run = fake_slurm(
        {"sacct": "", "scontrol show": "n2\n", "scontrol update": "", "sbatch": "14\n"}, calls
    )
    assert chain.begin(args, env, run) == chain.STOPPED
    assert [c for c in calls if c[0] == "sbatch"][-1][-2:] == [
        "--exclude=n2",
        "/spool/slurm_script",
    ]
    # Requeued anyway (an administrator), on n1: its successor is already queued, no second one.
    del calls[:]
    run = fake_slurm({"sacct": "", "scontrol show": "n1\n", "scontrol update": ""}, calls)
    assert chain.begin(args, {**env, "SLURM_JOB_NODELIST": "n1"}, run) == chain.RUN
    assert not [c for c in calls if c[0] == "sbatch"]
    assert chain.read_jsonl(Path(args.job_dir) / chain.CHAIN_FILE)[-1]["next"] == "14"


def test_begin_stops_after_idle_allocations_and_when_complete(tmp_path, capsys):
    args = _args(tmp_path, max_idle=2)
    _published(Path(args.run_dir), 4)
    rows = [{"job_id": j, "step": 4, "next": None} for j in ("21", "22")]
    (Path(args.job_dir) / chain.CHAIN_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls = []
    run = fake_slurm({"sacct": "", "scontrol show": "n1\n"}, calls)
    env = {"SLURM_JOB_ID": "23", "SLURM_JOB_NODELIST": "n1"}
    assert chain.begin(args, env, run) == chain.STOPPED
    assert not [c for c in calls if c[0] == "sbatch"]
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("chain: stopped: 2 allocations in a row")
    _published(Path(args.run_dir), 8)
    assert chain.begin(args, env, run) == chain.NOTHING_LEFT
    assert capsys.readouterr().out.strip() == "chain: run complete at step 8"


def test_end_excludes_nodes_named_during_the_allocation_or_cancels_when_done(tmp_path):
    args = _args(tmp_path)
    (Path(args.job_dir) / chain.CHAIN_FILE).write_text(
        json.dumps({"job_id": "31", "step": 0, "next": "32", "started": 0.0}) + "\n"
    )
    calls = []
    run = fake_slurm({"scontrol update": ""}, calls)
    assert chain.end(args, run) == 0 and calls == []
    (Path(args.run_dir) / "allocations.jsonl").write_text(
        json.dumps(_rec("31", 1, "error: watchdog", 76, failed_hosts=["n3"])) + "\n"
    )
    assert chain.end(args, run) == 0
    assert calls == [["scontrol", "update", "JobId=32", "ExcNodeList=n3"]]
    # the watchdog's report of the hang (training/watchdog.py): the hosts of the missing ranks
    (Path(args.run_dir) / "hang").mkdir()
    (Path(args.run_dir) / chain.HANG_REPORT).write_text(json.dumps({"missing_hosts": ["n4"]}))
    assert chain.end(args, run) == 0
    assert calls[-1] == ["scontrol", "update", "JobId=32", "ExcNodeList=n3,n4"]
    # the run complete: the queued successor is cancelled, whatever Slurm's kill_invalid_depend
    _published(Path(args.run_dir), 8)
    run = fake_slurm({"scancel": ""}, calls)
    assert chain.end(args, run) == 0 and calls[-1] == ["scancel", "32"]


def test_status_shows_the_chain_and_its_goodput(tmp_path):
    args = _args(tmp_path)
    run_dir = args.run_dir
    entries = [
        {"job_id": "41", "step": 0, "next": "42", "run_dir": run_dir, "verdict": 0},
        {"job_id": "42", "step": 3, "next": "43", "run_dir": run_dir, "verdict": 0},
        {"job_id": "43", "step": 3, "next": "44", "run_dir": run_dir, "verdict": 0},
    ]
    (Path(args.job_dir) / chain.CHAIN_FILE).write_text(
        "".join(json.dumps(e) + "\n" for e in entries)
    )
    records = [
        _rec("41", 3, "signal:SIGUSR1", 75, step_seconds=60.0, last_step=3),
        _rec("43", 2, "done", 0, step_seconds=40.0, last_step=5),
    ]
    (Path(run_dir) / "allocations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    sacct = "41|FAILED|00:02:00\n42|TIMEOUT|00:01:00\n43|COMPLETED|00:01:20\n44|CANCELLED by 0|00:00:00\n"
    table, ok = chain.summary(Path(args.job_dir), fake_slurm({"sacct": sacct}))
    lines = table.splitlines()
    assert ok and lines[0] == (
        "chain: 3 allocation(s), complete; goodput 38% (0:01:40 in completed steps of 0:04:20 "
        "allocated)"
    ), table
    assert lines[2].split() == ["41", "FAILED", "0:02:00", "0->3", "3", "signal:SIGUSR1"]
    assert lines[3].split()[:5] == ["42", "TIMEOUT", "0:01:00", "3->3", "0"]
    assert lines[3].endswith("no trainer record (job TIMEOUT)")
    assert lines[4].split() == ["43", "COMPLETED", "0:01:20", "3->5", "2", "done"]


def test_until_done_and_signal_lead_reach_the_script(tmp_path, monkeypatch, capsys):
    """--signal-lead (launch.Cluster.signal_lead_s) and --until-done in a dry run's script: the
    warning signal, torchrun handling it for as long, and the chain's lines before the
    pre-flight; without them, the default lead and no chain."""
    import nemo_run

    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(nemo_run.config, "_NEMORUN_HOME", str(tmp_path / "home"))
    argv = [
        "run",
        "tiny",
        "--executor",
        "slurm",
        "--packager",
        "none",
        "--config",
        str(REPO / "configs" / "tiny_test.yaml"),
        "model.tensor_parallel=2",
        "train.max_steps=9",
        "train.run_dir=/shared/run",
        "--dryrun",
    ]
    # NeMo-Run's local commands read stdin, which pytest's capture does not allow
    monkeypatch.setattr("sys.stdin", (tmp_path / "stdin").open("w+"))
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out
    assert (
        cli.main([*argv, "--until-done", "--signal-lead", "45", "--max-idle-allocations", "4"]) == 0
    )
    script = capsys.readouterr().out
    assert "#SBATCH --signal=USR1@60" in plain and "chain.py" not in plain
    assert "#SBATCH --signal=USR1@45" in script and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=45" in script
    assert "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in script
    begin = next(line for line in script.splitlines() if "chain.py begin " in line)
    assert '--run-dir /shared/run --max-steps 9 --max-idle 4 --script "$0"' in begin
    assert begin.startswith(f"python3 {REPO}/megatron_ngrpo/launch/chain.py begin --job-dir")
    assert script.index("chain.py begin ") < script.index("launch.preflight")
    assert "trap '" in script and "chain.py end " in script


def test_the_chain_reads_the_files_the_trainer_writes():
    """launch/chain.py runs on the batch host without torch, so it names the trainer's files
    itself: they must stay the ones training/stop.py and training/watchdog.py write."""
    from megatron_ngrpo.training import stop, watchdog

    assert chain.ALLOCATIONS_FILE == stop.ALLOCATIONS_FILE
    assert chain.HANG_REPORT == f"{watchdog.HANG_DIR}/{watchdog.REPORT_FILE}"
    assert (chain.EXIT_CONTINUE, chain.EXIT_WATCHDOG) == (
        stop.EXIT_CONTINUE,
        watchdog.EXIT_WATCHDOG,
    )


def test_the_chains_step_is_the_trainers_resume_point(tmp_path):
    """A ``latest`` naming a missing checkpoint, with the newest one truncated: the chain counts
    the step the trainer will resume from (the one before), not the pointer's, so the run is not
    taken for complete (the Slurm campaign's (e) found the chain ending there)."""
    run = tmp_path / "run"
    for step in (4, 5):
        _checkpoint(run, step)
    (run / "latest").write_text("iter_0000005\n")
    assert chain.checkpoint_step(run) == 5
    (run / "latest").write_text("iter_0000009\n")
    assert chain.checkpoint_step(run) == 5
    shard = run / "iter_0000005" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:50])
    assert chain.checkpoint_step(run) == 4
    (run / "latest").unlink()
    assert chain.checkpoint_step(run) == 4


def test_the_chain_runs_as_a_file_without_the_package_installed(tmp_path):
    """The batch host runs ``python3 <code>/megatron_ngrpo/launch/chain.py`` with nothing
    installed: isolated mode (no PYTHONPATH, no site-packages' editable install) still imports
    its checkpoint check, and no torch."""
    probe = (
        "import runpy, sys; sys.argv = ['chain.py', '--help']\n"
        "try:\n    runpy.run_path(sys.argv_path, run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    path = Path(chain.__file__).resolve()
    code = probe.replace("sys.argv_path", repr(str(path)))
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("False"), done.stderr[-2000:]


def test_a_heterogeneous_jobs_limit_is_its_shortest_component():
    """``squeue -o %l`` lists a hetjob's components one per line (test_slurm's rollout-server job
    failed its pre-flight on '10:00\\n10:00'): the job's limit is the shortest of them."""
    env = {"SLURM_JOB_ID": "7"}
    for listed, limit in (("10:00\n10:00\n", "10:00"), ("1:00:00\n30:00\n", "30:00")):
        assert time_limit.job_time_limit(env, fake_slurm({"squeue": listed})) == limit
    assert time_limit.job_time_limit(env, fake_slurm({"squeue": "UNLIMITED\n"})) == "UNLIMITED"
    # what is not a Slurm time comes back as read, for check_time's one line (not a traceback)
    assert time_limit.job_time_limit(env, fake_slurm({"squeue": "n/a\n10:00\n"})) == "n/a 10:00"
