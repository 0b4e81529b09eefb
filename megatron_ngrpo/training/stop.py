"""Planned stops: save the step reached before the allocation ends, then exit with "continue".

Two triggers, both acted on at a step boundary only (the update of the step in flight is
finished; no rollout is in flight between steps, except the one-step-off producer's, which the
checkpoint holds as on every save: kept, not dropped, so the resumed run trains on it as the
uninterrupted one does; docs/LAUNCHING.md "Planned stops" says why):

* SIGUSR1 or SIGTERM (Slurm's warning signal ``--signal=USR1@N``, sent to every process of the
  job step, ``scancel``, preemption, torchrun passing on its own SIGTERM): the handler only sets
  a flag.
* The allocation's deadline (:func:`allocation_deadline`) closer than the margin: the longest
  recent step plus the last save, times :data:`SAFETY`, plus ``train.stop.margin_s`` (checked
  from the first step this process completes on: before, nothing is measured and nothing new
  would be saved).

At every boundary all ranks all-reduce their reason code (MAX over the default group: one
collective per step), so every rank stops at the same step and no rank saves alone. The trainer
then saves synchronously, publishes ``latest``, tells the trackers and exits with
:data:`EXIT_CONTINUE`.

Every exit the process can still act on appends one line to ``run_dir/allocations.jsonl``
(:meth:`StopControl.record`, rank 0): the chain of allocations (launch/) reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections import deque
from datetime import datetime
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from megatron_ngrpo.compat.cpu import device
from megatron_ngrpo.training.config import StopConfig
from megatron_ngrpo.training.watchdog import node_name

# The process saved at a planned stop before train.max_steps: run again in a new allocation
# (BSD's EX_TEMPFAIL). 0: the run is complete; anything else: a failure.
EXIT_CONTINUE = 75
ALLOCATIONS_FILE = "allocations.jsonl"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Reason per all-reduced code; the highest wins (a signal names the stop over the deadline).
REASONS = (None, "deadline", "signal:SIGTERM", "signal:SIGUSR1")
SAFETY = 1.5  # on the measured step + save time
RECENT_STEPS = 8
SQUEUE_TIMEOUT_S = 10


def allocation_deadline(
    cfg: StopConfig, started: float, env=os.environ, run=subprocess.run
) -> float | None:
    """Epoch seconds by which the run must have stopped, or None: ``train.stop.time_limit_s``
    after the allocation's start; else ``SLURM_JOB_END_TIME``; else what ``squeue`` reports as
    the job's end time (``%e``); else None."""
    if cfg.time_limit_s:
        return float(env.get("SLURM_JOB_START_TIME") or started) + cfg.time_limit_s
    if env.get("SLURM_JOB_END_TIME", "").isdigit():
        return float(env["SLURM_JOB_END_TIME"])
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = run(
            ["squeue", "-h", "-j", job, "-o", "%e"],
            capture_output=True,
            text=True,
            timeout=SQUEUE_TIMEOUT_S,
        ).stdout.strip()
        return datetime.fromisoformat(out).timestamp()  # squeue prints local time
    except (OSError, ValueError, subprocess.SubprocessError):
        return None  # no squeue, or "N/A" / "Unknown": no deadline known


class StopControl:
    """The stop flag, the deadline and this process's record of steps (one per process)."""

    def __init__(self, cfg: StopConfig, env=os.environ):
        self.cfg = cfg
        self.started = psutil.Process().create_time()
        self.deadline = allocation_deadline(cfg, self.started, env) if cfg.enabled else None
        self.signal_name: str | None = None
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self.save_s = 0.0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.step_seconds = 0.0
        self._previous = {}
        # Python installs handlers from the main thread only (a trainer built elsewhere, e.g. in
        # a benchmark's thread, keeps the deadline but not the signals).
        if cfg.enabled and threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        # A flag only: acted on at the next step boundary, by every rank at once.
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def restore(self) -> None:
        """Put back the signal handlers found at construction."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    @contextlib.contextmanager
    def signals_held(self):
        """Hold the stop signals pending (blocked, not ignored) while the body runs.

        Slurm's warning signal and ``scancel`` reach every process of the job step, the helper
        processes megatron's checkpoint writer starts during a save too, and those die of it (the
        save then fails). A blocked mask is inherited by fork and kept across exec, so helpers
        started in the body never see the signals; the trainer gets them when the body ends."""
        held = set(self._previous) if self._previous else set()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def step_done(self, step: int, seconds: float) -> None:
        """Step ``step`` (1-based) completed in ``seconds`` (its save included)."""
        self.first_step = self.first_step or step
        self.last_step = step
        self.step_seconds += seconds
        self.recent.append(seconds)

    def margin(self) -> float:
        """Seconds a step and a save take, with safety, plus the configured floor."""
        return SAFETY * (max(self.recent, default=0.0) + self.save_s) + self.cfg.margin_s

    def agreed(self) -> str | None:
        """The stop reason every rank agrees on, or None to go on (collective when enabled)."""
        if not self.cfg.enabled:
            return None
        code = 0
        # Not before a step of this process is measured: the margin is unknown until then.
        if self.deadline and self.recent and time.time() + self.margin() > self.deadline:
            code = REASONS.index("deadline")
        if self.signal_name:
            code = REASONS.index(f"signal:{self.signal_name}")
        flag = torch.tensor([code], dtype=torch.int32, device=device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return REASONS[int(flag.item())]

    def record(self, run_dir: str | Path, reason: str, exit_code: int) -> None:
        """Append this process's line to ``run_dir/allocations.jsonl`` (global rank 0; one
        ``O_APPEND`` write, fsynced)."""
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        if rank != 0:
            return
        gained = self.last_step - self.first_step + 1 if self.first_step else 0
        line = {
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            "host": node_name(),
            "started": self.started,
            "ended": time.time(),
            "first_step": self.first_step,
            "last_step": self.last_step,
            "steps_gained": gained,
            "step_seconds": round(self.step_seconds, 3),
            "reason": reason,
            "exit_code": exit_code,
        }
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        fd = os.open(
            Path(run_dir) / ALLOCATIONS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
        )
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)


def error_reason(e: BaseException) -> str:
    """``error: <type>: <first line of the message>`` for the allocations line."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"error: {type(e).__name__}: {first}"[:300]
