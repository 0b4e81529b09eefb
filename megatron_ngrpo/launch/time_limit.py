"""A Slurm job's time limit against its partition's ``MaxTime``, and the checkpoint interval
against the time limit, checked before anything queues (``ngrpo-launch plan`` and ``run``) and
by pre-flight inside the allocation (launch/preflight.py, the job's own limit).

* A requested ``--time`` above the partition's MaxTime (``sinfo -h -p P -o %l``) is refused by
  ``sbatch`` only after the configs are staged; here it is one line naming both values and
  ``--until-done``, which continues the run in allocations the partition allows.
* ``train.save_every`` steps of the planned (or this run's measured) step time that do not fit
  in one allocation mean no checkpoint is ever written in time: said in one line.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from megatron_ngrpo.config_loader import ConfigError

# Slurm's forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
UNLIMITED = ("infinite", "unlimited")


def parse_time(text: str) -> int | None:
    """Seconds of a Slurm time string; None for infinite/UNLIMITED. Raises ValueError."""
    text = text.strip()
    if text.lower() in UNLIMITED:
        return None
    m = _TIME.match(text)
    if not m:
        raise ValueError(f"time {text!r}: expected [D-]HH:MM:SS, MM, MM:SS, D-HH or D-HH:MM")
    days, a, b, c = m.groups()
    if days is not None:  # D-H | D-H:M | D-H:M:S
        h, mi, sec = int(a), int(b or 0), int(c or 0)
    elif c is not None:  # H:M:S
        h, mi, sec = int(a), int(b), int(c)
    else:  # M | M:S
        h, mi, sec = 0, int(a), int(b or 0)
    return ((int(days or 0) * 24 + h) * 60 + mi) * 60 + sec


def format_seconds(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    text = f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{d}-{text}" if d else text


Runner = Callable[[list[str]], str]


def _sinfo(argv: list[str]) -> str:
    """A Slurm query's output (``sinfo``, ``squeue``)."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout


def partition_max_time(partition: str, run: Runner = _sinfo) -> int | None:
    """The partition's MaxTime in seconds (None: unlimited). Raises ConfigError for a partition
    sinfo does not know."""
    out = run(["sinfo", "-h", "-p", partition, "-o", "%l"]).split()
    if not out:
        raise ConfigError(f"--partition {partition!r}: sinfo lists no such partition")
    limits = [parse_time(t) for t in out]  # one line per node state: all equal
    return None if None in limits else max(limits)


def check_time(time: str, partition: str | None, run: Runner | None = None) -> None:
    """One ConfigError line when ``time`` exceeds the partition's MaxTime. Without a partition,
    or without a Slurm this machine can ask (a dry run on a laptop), there is nothing to compare
    (sbatch, where there is one, refuses it)."""
    if run is None:
        if not shutil.which("sinfo"):
            return
        run = _sinfo
    try:
        requested = parse_time(time)
    except ValueError as e:
        raise ConfigError(f"--time: {e}") from None
    if not partition:
        return
    try:
        limit = partition_max_time(partition, run)
    except (OSError, subprocess.SubprocessError):
        return
    if limit is not None and (requested is None or requested > limit):
        raise ConfigError(
            f"--time {time}: above partition {partition}'s MaxTime {format_seconds(limit)}; ask "
            f"for --time {format_seconds(limit)} or less (--until-done continues the run in the "
            f"next allocation)"
        )


def job_time_limit(env=os.environ, run: Runner | None = None) -> str | None:
    """Inside an allocation, the job's time limit as a Slurm time string: its end less its start
    (``SLURM_JOB_END_TIME``, ``SLURM_JOB_START_TIME``), else ``squeue -h -j JOB -o %l``; None
    outside a job or where neither answers (a container without Slurm's commands)."""
    start, end = env.get("SLURM_JOB_START_TIME", ""), env.get("SLURM_JOB_END_TIME", "")
    if start.isdigit() and end.isdigit():
        return format_seconds(int(end) - int(start))
    job = env.get("SLURM_JOB_ID")
    if not job or (run is None and not shutil.which("squeue")):
        return None
    try:
        out = (run or _sinfo)(["squeue", "-h", "-j", job, "-o", "%l"]).split()
    except (OSError, subprocess.SubprocessError):
        return None
    # a heterogeneous job lists each component (the rollout servers, the trainer): the shortest
    try:
        return min(
            out, key=lambda t: math.inf if parse_time(t) is None else parse_time(t), default=None
        )
    except ValueError:  # not a Slurm time: returned as read, check_time names it in one line
        return " ".join(out)


def measured_step_seconds(run_dir: str) -> float | None:
    """Mean seconds per completed step over this run's allocations (``allocations.jsonl``)."""
    path = Path(run_dir) / "allocations.jsonl"
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    steps = sum(r.get("steps_gained") or 0 for r in rows)
    seconds = sum(r.get("step_seconds") or 0.0 for r in rows)
    return seconds / steps if steps else None


def save_interval_note(time: str, save_every: int, step_seconds: float | None) -> str | None:
    """One line when ``save_every`` steps of ``step_seconds`` do not fit in ``time``."""
    limit = parse_time(time)
    if not step_seconds or limit is None or save_every * step_seconds <= limit:
        return None
    fit = max(int(limit // step_seconds) - 1, 1)
    return (
        f"note: train.save_every={save_every} × {step_seconds:.0f} s per step = "
        f"{format_seconds(save_every * step_seconds)} does not fit one allocation of {time}: "
        f"only a signal or deadline save checkpoints; train.save_every={fit} would"
    )
