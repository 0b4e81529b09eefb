"""``ngrpo-launch run ... --executor slurm --until-done``: one training run continued across Slurm
allocations by a self-chaining job, until ``train.max_steps``.

At the start of every allocation the batch script runs this file's ``begin`` (``python3
<code>/megatron_ngrpo/launch/chain.py``, on the batch host, outside any container: it needs the
standard library only):

* the run's checkpoint step (``<run_dir>/latest``) at or past ``train.max_steps``: nothing is left,
  the script ends (exit 0) without starting the trainer;
* the last ``max_idle`` allocations gained no checkpointed step: the chain stops with one line;
* otherwise the successor is queued first, ``sbatch --dependency=afternotok:<this job>
  --kill-on-invalid-dep=yes [--exclude=<failed nodes>]`` of this same script, and the trainer
  starts. Queued at the start, not the end: a job killed at its time limit runs no more script.

The successor starts only when this job ends in any state but COMPLETED: the trainer's exit 75
(a planned stop with a checkpoint, :mod:`megatron_ngrpo.training.stop`), 76 (the watchdog), any
failure, a time limit, ``scancel`` or a node failure. A trainer that reached ``train.max_steps``
exits 0, the job COMPLETES and Slurm drops the successor (its dependency can never be met).
Nodes are excluded where something names them as failed: the watchdog's hang report
(``<run_dir>/hang/report.json``: the hosts of the ranks that did not arrive), a trainer record's
``failed_hosts``, or the nodes of a NODE_FAIL job that Slurm now lists as down, drained or
failing; excluded once, excluded for the rest of the chain. ``begin`` makes its job not
requeueable (``scontrol update Requeue=0``): a lost node ends it NODE_FAIL, its nodes are excluded
and the successor resumes on the others. The batch script's EXIT trap
(``end``) puts nodes learnt during the allocation on the queued successor.

The chain's own record is ``<job_dir>/chain.jsonl`` (one line per allocation: job id, nodes,
checkpoint step at its start, successor); with the trainer's ``<run_dir>/allocations.jsonl``
(steps gained, seconds in completed steps, why each process ended) and ``sacct`` (elapsed time,
state), :func:`summary` is what ``ngrpo-launch status`` shows, goodput included: seconds in
completed steps / seconds allocated.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__:
    from megatron_ngrpo import checkpoint_files
else:  # run as a file on the batch host, where nothing is installed: the module from its path
    _spec = importlib.util.spec_from_file_location(
        "checkpoint_files", Path(__file__).resolve().parents[1] / "checkpoint_files.py"
    )
    checkpoint_files = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(checkpoint_files)

CHAIN_FILE = "chain.jsonl"
ALLOCATIONS_FILE = "allocations.jsonl"  # written by megatron_ngrpo.training.stop
HANG_REPORT = "hang/report.json"  # written by megatron_ngrpo.training.watchdog (exit 76)
# ``begin``'s exit codes: start the trainer; nothing left to do; the chain stops.
RUN, NOTHING_LEFT, STOPPED = 0, 3, 4
EXIT_CONTINUE, EXIT_WATCHDOG = 75, 76
FAILED_NODE_STATES = "down,drain,fail,no_respond"
ACTIVE_STATES = ("PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED", "CONFIGURING")
MISSING_GRACE_S = 120
_ITER = re.compile(r"iter_(\d+)")

Runner = Callable[[list[str]], str]


def _slurm(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout


def read_jsonl(path: Path) -> list[dict]:
    """The complete JSON lines of ``path`` (a line cut by a crash is skipped)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def checkpoint_step(run_dir: Path) -> int:
    """The step the trainer resumes from (0: none yet): the checkpoint ``<run_dir>/latest`` names
    when it verifies, else the newest verified ``iter_*`` (training/checkpoint.py's
    ``resume_point``, by the same ``checkpoint_files.verify_checkpoint``): a ``latest`` naming a missing or
    truncated checkpoint must not end the chain as if the run were complete."""
    try:
        m = _ITER.search((run_dir / checkpoint_files.LATEST_FILE).read_text())
    except OSError:
        m = None
    if m and checkpoint_files.verify_checkpoint(run_dir / m.group(0)) is None:
        return int(m.group(1))
    verified = [
        p
        for p in checkpoint_files.iter_dirs(run_dir)
        if checkpoint_files.verify_checkpoint(p) is None
    ]
    return int(verified[-1].name[5:]) if verified else 0


def idle_allocations(entries: list[dict], step: int) -> int:
    """How many of the last allocations in a row ended without a new checkpointed step (an
    allocation that skipped itself for an excluded node does not count)."""
    idle = 0
    for entry in reversed([e for e in entries if not e.get("skipped")]):
        if entry["step"] < step:
            break
        idle += 1
    return idle


def failed_hosts(records: list[dict], failed_jobs_nodes: list[str]) -> list[str]:
    """Nodes to keep the chain off: those a trainer record names (``failed_hosts``, e.g. the
    watchdog's hosts of ranks that did not arrive) for a process that neither completed nor
    stopped as planned, and ``failed_jobs_nodes`` (nodes Slurm lists as failed)."""
    hosts = {
        h
        for r in records
        if r.get("exit_code") not in (0, EXIT_CONTINUE)
        for h in r.get("failed_hosts") or ()
    }
    return sorted(hosts | set(failed_jobs_nodes))


def hang_hosts(run_dir: Path, since: float) -> list[str]:
    """The hosts of the ranks that did not arrive at the watchdog's last hang (its report's
    ``missing_hosts``), if that report was written after ``since`` (epoch seconds)."""
    path = run_dir / HANG_REPORT
    try:
        if path.stat().st_mtime < since:
            return []
        return list(json.loads(path.read_text()).get("missing_hosts") or [])
    except (OSError, ValueError):
        return []


def slurm_failed_nodes(entries: list[dict], run: Runner = _slurm) -> list[str]:
    """Nodes of this chain's NODE_FAIL jobs that Slurm lists as down, drained or failing."""
    ids = [str(e["job_id"]) for e in entries]
    if not ids:
        return []
    out = run(["sacct", "-X", "-n", "-P", "-o", "JobID,State,NodeList", "-j", ",".join(ids)])
    nodes = [line.split("|")[2] for line in out.splitlines() if "|NODE_FAIL|" in line]
    if not nodes:
        return []
    bad = run(["sinfo", "-h", "-N", "-t", FAILED_NODE_STATES, "-o", "%N"]).split()
    mine = set(run(["scontrol", "show", "hostnames", ",".join(nodes)]).split())
    return sorted(mine & set(bad))


@dataclass
class Decision:
    code: int  # RUN | NOTHING_LEFT | STOPPED
    line: str
    exclude: list[str]


def decide(
    entries: list[dict], records: list[dict], step: int, max_steps: int, max_idle: int, failed
) -> Decision:
    """What this allocation does, from the chain so far (``entries``), the trainer's records,
    the checkpoint step and the nodes Slurm lists as failed."""
    exclude = failed_hosts(records, failed)
    if max_steps and step >= max_steps:
        return Decision(NOTHING_LEFT, f"chain: run complete at step {step}", exclude)
    idle = idle_allocations(entries, step)
    if idle >= max_idle:
        jobs = ", ".join(str(e["job_id"]) for e in entries[-idle:])
        why = [r.get("reason") for r in records[-idle:]]
        return Decision(
            STOPPED,
            f"chain: stopped: {idle} allocations in a row gained no step (jobs {jobs}; at step "
            f"{step}; last reasons {why}): see their logs (ngrpo-launch logs)",
            exclude,
        )
    return Decision(RUN, "", exclude)


def begin(args: argparse.Namespace, env=os.environ, run: Runner = _slurm) -> int:
    """The start of an allocation: decide, queue the successor, record this allocation."""
    job_dir, run_dir = Path(args.job_dir), Path(args.run_dir)
    entries = read_jsonl(job_dir / CHAIN_FILE)
    step = checkpoint_step(run_dir)
    known = (
        entries[-1].get("exclude", []) + hang_hosts(run_dir, entries[-1].get("started", 0.0))
        if entries
        else []
    )
    d = decide(
        entries,
        read_jsonl(run_dir / ALLOCATIONS_FILE),
        step,
        args.max_steps,
        args.max_idle,
        slurm_failed_nodes(entries, run) + known,
    )
    job = env["SLURM_JOB_ID"]
    nodes = run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]]).split()
    entry = {"job_id": job, "nodes": nodes, "step": step, "started": time.time(), "next": None}
    entry.update(run_dir=str(run_dir), exclude=d.exclude)
    on_excluded = sorted(set(nodes) & set(d.exclude))
    if d.code == RUN:
        requeued = bool(entries) and str(entries[-1]["job_id"]) == job
        # A job Slurm requeued anyway (an administrator) already has its successor queued.
        entry["next"] = (
            entries[-1]["next"] if requeued else submit_successor(args.script, job, d.exclude, run)
        )
        # The chain, not Slurm, continues the run: NeMo-Run submits with --requeue, and a
        # requeued job would wait 2 min (Slurm's delay) to start a second chain beside the queued
        # successor; not requeued, a node failure ends it NODE_FAIL and the successor starts.
        run(["scontrol", "update", f"JobId={job}", "Requeue=0"])
        entry["skipped"] = bool(on_excluded)
    with open(job_dir / CHAIN_FILE, "a") as f:
        f.write(json.dumps({**entry, "verdict": d.code}) + "\n")
    if d.code != RUN:
        print(d.line, flush=True)
        return d.code
    if on_excluded:  # the successor keeps off them; this allocation trains nothing
        print(f"chain: skipping this allocation: on failed node(s) {', '.join(on_excluded)}")
        return STOPPED
    print(
        f"chain: allocation {len(entries) + 1} (job {job}) starts at step {step}; next "
        f"allocation queued: job {entry['next']}"
        + (f" (excluding {','.join(d.exclude)})" if d.exclude else ""),
        flush=True,
    )
    return RUN


def submit_successor(script: str, job: str, exclude: list[str], run: Runner = _slurm) -> str:
    """``sbatch`` of ``script`` to start when job ``job`` ends in any state but COMPLETED."""
    argv = [
        "sbatch",
        "--parsable",
        f"--dependency=afternotok:{job}",
        "--kill-on-invalid-dep=yes",
        *([f"--exclude={','.join(exclude)}"] if exclude else []),
        script,
    ]
    return run(argv).strip().split(";")[0]


def end(args: argparse.Namespace, run: Runner = _slurm) -> int:
    """The batch script's EXIT trap: a complete run cancels the queued successor; nodes learnt
    as failed during this allocation go onto its exclude list."""
    job_dir, run_dir = Path(args.job_dir), Path(args.run_dir)
    entries = read_jsonl(job_dir / CHAIN_FILE)
    if not entries or not entries[-1].get("next"):
        return 0
    this = entries[-1]
    if args.max_steps and checkpoint_step(run_dir) >= args.max_steps:
        # Slurm drops a successor whose afternotok can never be met only with kill_invalid_depend
        run(["scancel", str(this["next"])])
        print(f"chain: run complete; queued job {this['next']} cancelled", flush=True)
        return 0
    learnt = hang_hosts(run_dir, this["started"]) + this.get("exclude", [])
    exclude = failed_hosts(read_jsonl(run_dir / ALLOCATIONS_FILE), learnt)
    if set(exclude) - set(this.get("exclude", [])):
        nxt = entries[-1]["next"]
        run(["scontrol", "update", f"JobId={nxt}", f"ExcNodeList={','.join(exclude)}"])
        print(f"chain: next allocation (job {nxt}) excludes {','.join(exclude)}", flush=True)
    return 0


@dataclass(frozen=True)
class ChainSpec:
    """The run the chain continues: its directory, its last step (0: the trainer's own end) and
    how many allocations in a row may gain no step before the chain stops."""

    run_dir: str
    max_steps: int
    max_idle: int = 2


def chain_lines(code_root: str, job_dir: str, spec: ChainSpec) -> list[str]:
    """The batch script's lines that make it a link of the chain (before the pre-flight)."""
    # Run as a file: no PYTHONPATH of its own, which the successor it submits would inherit.
    cmd = (
        f"python3 {code_root}/megatron_ngrpo/launch/chain.py {{}} --job-dir {job_dir} "
        f"--run-dir {spec.run_dir} --max-steps {spec.max_steps} --max-idle {spec.max_idle} "
        '--script "$0"'
    )
    return [
        "# --until-done: continue the run in a new allocation (megatron_ngrpo/launch/chain.py)",
        cmd.format("begin"),
        "chain_rc=$?",
        f"[ $chain_rc -eq {NOTHING_LEFT} ] && exit 0",
        "[ $chain_rc -ne 0 ] && exit $chain_rc",
        f"trap '{cmd.format('end')} || true' EXIT",
    ]


# ---- the chain as `ngrpo-launch status` shows it ----------------------------------------------


def _elapsed(text: str) -> float:
    days, _, hms = text.rpartition("-")
    parts = [int(p) for p in hms.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return int(days or 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


def sacct_jobs(ids: list[str], run: Runner = _slurm) -> dict[str, tuple[str, float]]:
    """Job id -> (state, elapsed seconds) as sacct reports them."""
    if not ids:
        return {}
    out = run(["sacct", "-X", "-n", "-P", "-o", "JobID,State,Elapsed", "-j", ",".join(ids)])
    jobs = {}
    for line in out.splitlines():
        job, state, elapsed = line.split("|")
        jobs[job] = (state.split()[0], _elapsed(elapsed))
    return jobs


def summary(job_dir: Path, run: Runner = _slurm) -> tuple[str, bool]:
    """The chain's table and whether it is still going or complete (False: it stopped or
    failed). Empty when ``job_dir`` holds no chain."""
    entries = read_jsonl(job_dir / CHAIN_FILE)
    if not entries:
        return "", True
    run_dir = Path(entries[0].get("run_dir") or "")
    ids = [str(e["job_id"]) for e in entries]
    nxt = entries[-1].get("next")
    jobs = sacct_jobs(ids + ([str(nxt)] if nxt else []), run)
    records = read_jsonl(run_dir / ALLOCATIONS_FILE) if run_dir.name else []
    by_job: dict[str, list[dict]] = {}
    for r in records:
        by_job.setdefault(str(r.get("job_id")), []).append(r)
    rows = [f"  {'job':>8} {'state':12} {'elapsed':>9} {'steps':>11} {'gained':>6}  ended by"]
    allocated = in_steps = 0.0
    for e in entries:
        state, elapsed = jobs.get(str(e["job_id"]), ("?", 0.0))
        own = by_job.get(str(e["job_id"]), [])
        gained = sum(r.get("steps_gained") or 0 for r in own)
        allocated += elapsed
        in_steps += sum(r.get("step_seconds") or 0.0 for r in own)
        why = "; ".join(str(r.get("reason")) for r in own) or _no_record(e, state)
        last = max((r.get("last_step") or 0 for r in own), default=e["step"])
        rows.append(
            f"  {e['job_id']:>8} {state:12} {_hms(elapsed):>9} "
            f"{e['step']:>5}->{last:<5} {gained:>6}  {why}"
        )
    going = bool(nxt) and jobs.get(str(nxt), ("PENDING",))[0] in ACTIVE_STATES
    ended = entries[-1].get("verdict")
    status = (
        "stopped"
        if ended == STOPPED
        else "complete"
        if ended == NOTHING_LEFT or any(r.get("reason") == "done" for r in records)
        else "running"
        if going or jobs.get(ids[-1], ("?",))[0] in ACTIVE_STATES
        else "stopped"
    )
    goodput = f"{100 * in_steps / allocated:.0f}%" if allocated else "-"
    head = (
        f"chain: {len(entries)} allocation(s), {status}; goodput {goodput} "
        f"({_hms(in_steps)} in completed steps of {_hms(allocated)} allocated)"
    )
    if nxt and going:
        head += f"; next allocation: job {nxt} ({jobs.get(str(nxt), ('PENDING',))[0]})"
    return "\n".join([head, *rows]), status != "stopped"


def wait(job_dir: Path, first_job: str, poll_s: float = 10.0, run: Runner = _slurm) -> None:
    """Until no job of the chain is queued or running. A job sacct does not list yet (slurmdbd
    records a submission within seconds) counts as queued for ``MISSING_GRACE_S``."""
    missing_since: dict[str, float] = {}
    while True:
        entries = read_jsonl(job_dir / CHAIN_FILE)
        ids = {first_job, *(str(e["job_id"]) for e in entries)}
        ids |= {str(e["next"]) for e in entries[-1:] if e.get("next")}
        jobs = sacct_jobs(sorted(ids), run)
        now = time.monotonic()
        active = [i for i in ids if jobs.get(i, ("",))[0] in ACTIVE_STATES]
        unlisted = [i for i in ids if i not in jobs]
        for i in unlisted:
            missing_since.setdefault(i, now)
        if not active and all(now - missing_since[i] > MISSING_GRACE_S for i in unlisted):
            return
        time.sleep(poll_s)


def _no_record(entry: dict, state: str) -> str:
    """Why an allocation without a trainer record ended."""
    if entry.get("verdict") == STOPPED:
        return "the chain stopped here (allocations without a step)"
    if entry.get("verdict") == NOTHING_LEFT:
        return "nothing left to train"
    if entry.get("skipped"):
        return "nothing (skipped: on a failed node)"
    return f"no trainer record (job {state})"


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 megatron_ngrpo/launch/chain.py")
    p.add_argument("action", choices=("begin", "end"))
    p.add_argument("--job-dir", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--max-idle", type=int, required=True)
    p.add_argument("--script", required=True)
    args = p.parse_args(argv)
    # The successor inherits this environment: without the script's own PYTHONPATH entry again
    # (it exports <code>:$PYTHONPATH), one more copy per allocation.
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(entry for entry in paths if entry))
    try:
        return begin(args) if args.action == "begin" else end(args)
    except (OSError, KeyError, subprocess.SubprocessError) as e:
        print(f"chain: {args.action} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
