"""The stage watchdog (issue 43 item 3): a hang is explained in one line, with every rank's Python
stacks, and the job ends with a code the Slurm chain retries on other nodes.

The trainer's main thread wraps its stages (``rollout``, ``weight_sync``, ``update``, ``save``,
``validation``) in :meth:`Watchdog.stage`. A monitor thread per rank (not the main thread: that
is the one blocked in a collective) checks the open stages' deadlines. Only files cross ranks, so
the explanation works while every collective is hung (``<run_dir>/hang/``, on the run
directory's shared file system):

* ``rank<R>.json``: this rank's heartbeat, rewritten (atomically) at each stage boundary only:
  ``{session, rank, host, pid, seq, stage, step, state, at}``. Every rank enters the same stages
  in the same order, so ``seq`` (stage boundaries crossed) orders ranks: the highest is the
  front, where ranks wait; a rank behind it did not arrive.
* ``request_<session>.json``: created (exclusively) by the first rank whose deadline expired; it
  is the reporter. Every rank's monitor polls for it, so ranks whose own deadline has not expired
  yet dump their stacks too.
* ``stack_rank<R>.txt``: this rank's stacks of all threads (:func:`faulthandler.dump_traceback`;
  ``py-spy dump --native`` appended where the ``py-spy`` binary is installed).
* ``report.json``: the reporter's verdict (stage, step, the ranks that did not arrive and their
  hosts, for the chain's ``--exclude``) once every rank's stacks are in, or after
  :data:`GRACE_S`. The reporter prints its one line on stderr::

    watchdog: stage 'update' at step 7: ranks [1] did not arrive (rank 1 last seen in 'rollout'
    at step 7, 130 s ago); rank 0's 'update' deadline of 120 s expired; stacks in <run_dir>/hang

Then every rank leaves with :data:`EXIT_WATCHDOG` through :func:`os._exit`: a hung collective
cannot be unwound. The session (a token broadcast from rank 0 at start) tells this job's files
from those a previous allocation left.

Deadlines (:class:`WatchdogConfig`): a stage's ``*_s`` when set; otherwise ``first_s`` at its
first occurrence in this process (start-up costs: compilation, caches), then max(``floor_s``,
``factor`` × the longest seen), never above the first. Every deadline stays at most
:data:`BEFORE_PG_TIMEOUT` × ``train.dist_timeout_s``: the watchdog fires, and leaves time for the
stacks, before a hung collective's process-group timeout ends the rank with a bare traceback.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from megatron_ngrpo.config_loader import fail
from megatron_ngrpo.training import outcome

EXIT_WATCHDOG = 76
Stage = Literal["rollout", "weight_sync", "update", "save", "validation"]
STAGES: tuple[str, ...] = get_args(Stage)
HANG_DIR = "hang"
REPORT_FILE = "report.json"
# Deadlines at most this fraction of train.dist_timeout_s (the rest: stacks and the report).
BEFORE_PG_TIMEOUT = 0.9
POLL_S = 1.0  # the monitor's period: a deadline fires at most this late
GRACE_S = 10.0  # the reporter waits this long at most for the other ranks' stacks
PY_SPY_TIMEOUT_S = 20


def node_name() -> str:
    """This node as Slurm names it (what ``--exclude`` takes; the host name may differ, e.g. a
    domain, or several test nodes on one host), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


@dataclass
class WatchdogConfig:
    """``train.watchdog``: per-stage deadlines in seconds (0: learned, see the module docstring)."""

    enabled: bool = True
    rollout_s: int = 0
    weight_sync_s: int = 0
    update_s: int = 0
    save_s: int = 0
    validation_s: int = 0
    # A learned stage's deadline at its first occurrence; 0: 0.9 × train.dist_timeout_s.
    first_s: int = 0
    floor_s: int = 300
    factor: float = 5.0

    def validate(self) -> None:
        for name in (*(f"{s}_s" for s in STAGES), "first_s", "floor_s"):
            if getattr(self, name) < 0:
                fail(name, getattr(self, name), "must be >= 0 (0: learned from this run)")
        if self.factor < 1:
            fail("factor", self.factor, "must be >= 1 (a multiple of the longest time seen)")

    def check_below(self, dist_timeout_s: int) -> None:
        """Refuse a deadline the process-group timeout would beat (fields named from ``train.``)."""
        if not self.enabled:
            return
        limit = BEFORE_PG_TIMEOUT * dist_timeout_s
        for name in (*(f"{s}_s" for s in STAGES), "first_s"):
            if getattr(self, name) > limit:
                fail(
                    f"watchdog.{name}",
                    getattr(self, name),
                    f"must be at most {BEFORE_PG_TIMEOUT} × train.dist_timeout_s = {limit:g} s, "
                    "so that the watchdog explains a hang before the process groups time out "
                    "(raise train.dist_timeout_s with it)",
                )


class Deadlines:
    """Each stage's deadline from the config and the durations measured so far in this process."""

    def __init__(self, cfg: WatchdogConfig, dist_timeout_s: int):
        self.cfg = cfg
        self.first = float(cfg.first_s or BEFORE_PG_TIMEOUT * dist_timeout_s)
        self.longest: dict[str, float] = {}

    def of(self, stage: Stage) -> float:
        fixed = getattr(self.cfg, f"{stage}_s")
        if fixed:
            return float(fixed)
        if stage not in self.longest:
            return self.first
        return min(self.first, max(float(self.cfg.floor_s), self.cfg.factor * self.longest[stage]))

    def observe(self, stage: Stage, seconds: float) -> None:
        self.longest[stage] = max(seconds, self.longest.get(stage, 0.0))


@dataclass
class _Open:
    stage: Stage
    step: int
    entered: float  # time.monotonic()
    deadline: float  # seconds
    since: float  # time.time() at entry


def _write_json(path: Path, obj: dict) -> None:
    """Whole or not at all for a reader on another node (no fsync: heartbeats are cheap)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Watchdog:
    """This rank's stage deadlines, heartbeat and monitor thread (module docstring).

    Args:
        cfg: ``train.watchdog``.
        dist_timeout_s: ``train.dist_timeout_s`` (the bound on every deadline).
        run_dir: the run directory (``hang/`` beneath it, shared by all ranks).
        rank, world_size: this rank's global position.
        session: the same token on every rank of this job (e.g. broadcast from rank 0).
    """

    def __init__(
        self,
        cfg: WatchdogConfig,
        dist_timeout_s: int,
        run_dir: Path,
        rank: int,
        world_size: int,
        session: str,
    ):
        self.enabled = cfg.enabled
        self.deadlines = Deadlines(cfg, dist_timeout_s)
        self.dir = Path(run_dir) / HANG_DIR
        self.rank, self.world_size, self.session = rank, world_size, session
        self.host = node_name()
        self._open: list[_Open] = []
        self._seq = 0
        self._last: tuple[str, int] = ("", 0)  # the last stage left and its step
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_job(cls, cfg: WatchdogConfig, dist_timeout_s: int, run_dir: Path) -> Watchdog:
        """This rank's started watchdog in a torch.distributed job (collective: the session)."""
        # lazy: training/config.py imports this module and must stay free of torch (start-up)
        import torch.distributed as dist

        # lazy: megatron_ngrpo.parallel imports megatron-core (same reason)
        from megatron_ngrpo.parallel import broadcast_from_rank0

        session = broadcast_from_rank0(uuid.uuid4().hex)
        dog = cls(cfg, dist_timeout_s, run_dir, dist.get_rank(), dist.get_world_size(), session)
        dog.start()
        return dog

    def start(self) -> None:
        """Write this rank's first heartbeat and start the monitor thread (no-op when disabled)."""
        if not self.enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._beat()
        self._thread = threading.Thread(target=self._monitor, name="watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_S)
            self._thread = None

    @contextlib.contextmanager
    def stage(self, name: Stage, step: int | None = None) -> Iterator[None]:
        """Run the body as stage ``name`` of ``step`` (default: the enclosing stage's step)."""
        if not self.enabled:
            yield
            return
        with self._lock:
            if step is None:
                step = self._open[-1].step if self._open else self._last[1]
            entry = _Open(name, step, time.monotonic(), self.deadlines.of(name), time.time())
            self._open.append(entry)
            self._beat()
        try:
            yield
        finally:
            with self._lock:
                self._open.remove(entry)
                self.deadlines.observe(name, time.monotonic() - entry.entered)
                self._last = (name, step)
                self._beat()

    def watched(self, name: Stage, fn):
        """``fn`` run as stage ``name`` (for a call made inside other stages, e.g. weight sync)."""

        def call(*args, **kwargs):
            with self.stage(name):
                return fn(*args, **kwargs)

        return call

    # ---- files -----------------------------------------------------------------------------
    def _beat(self) -> None:
        """This rank's heartbeat: the innermost open stage, or the last one left (lock held)."""
        self._seq += 1
        if self._open:
            stage, step, state = self._open[-1].stage, self._open[-1].step, "in"
        else:
            (stage, step), state = self._last, "after"
        _write_json(
            self.dir / f"rank{self.rank}.json",
            {
                "session": self.session,
                "rank": self.rank,
                "host": self.host,
                "pid": os.getpid(),
                "seq": self._seq,
                "stage": stage,
                "step": step,
                "state": state,
                "at": time.time(),
            },
        )

    def _request_path(self) -> Path:
        return self.dir / f"request_{self.session}.json"

    def _stack_path(self, rank: int) -> Path:
        return self.dir / f"stack_rank{rank}.txt"

    def dump_stacks(self, reason: str) -> Path:
        """This rank's Python stacks of all threads (and py-spy's, where installed)."""
        path = self._stack_path(self.rank)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(
                f"# watchdog session {self.session} rank {self.rank} host {self.host} "
                f"pid {os.getpid()} at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}: {reason}\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            spy = shutil.which("py-spy")
            if spy:
                f.write("\n# py-spy dump --native\n")
                f.flush()
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    subprocess.run(
                        [spy, "dump", "--native", "--pid", str(os.getpid())],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        timeout=PY_SPY_TIMEOUT_S,
                    )
        os.replace(tmp, path)
        return path

    def _has_stack(self, rank: int) -> bool:
        try:
            with open(self._stack_path(rank)) as f:
                return f" session {self.session} " in f.readline()
        except OSError:
            return False

    def _heartbeats(self) -> dict[int, dict]:
        """This job's heartbeats by rank (a file of another session, or none: absent)."""
        out = {}
        for r in range(self.world_size):
            beat = _read_json(self.dir / f"rank{r}.json")
            if beat is not None and beat.get("session") == self.session:
                out[r] = beat
        return out

    # ---- the monitor thread ----------------------------------------------------------------------
    def _expired(self) -> _Open | None:
        now = time.monotonic()
        with self._lock:
            late = [o for o in self._open if now - o.entered > o.deadline]
        return late[-1] if late else None

    def _monitor(self) -> None:
        while not self._stop.wait(POLL_S):
            late = self._expired()
            if late is not None:
                self._fire(late)
            elif self._request_path().exists():
                self._follow()

    def _fire(self, late: _Open) -> None:
        """This rank's deadline expired: dump, and report unless another rank does."""
        reason = f"'{late.stage}' at step {late.step} exceeded its {late.deadline:.0f} s deadline"
        try:
            fd = os.open(self._request_path(), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            self._follow(reason)
            return
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"rank": self.rank, "stage": late.stage, "step": late.step}))
        self.dump_stacks(reason)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and not all(
            self._has_stack(r) for r in range(self.world_size)
        ):
            time.sleep(0.2)
        report = self.report(late)
        _write_json(self.dir / REPORT_FILE, report)
        print(report["line"], file=sys.stderr, flush=True)
        outcome.write(EXIT_WATCHDOG)
        os._exit(EXIT_WATCHDOG)

    def _follow(self, reason: str = "") -> None:
        """Another rank reported a hang: dump this rank's stacks, wait for its report, leave."""
        request = _read_json(self._request_path()) or {}
        self.dump_stacks(reason or f"requested by rank {request.get('rank', '?')}")
        deadline = time.monotonic() + GRACE_S + 5
        while time.monotonic() < deadline:
            if (_read_json(self.dir / REPORT_FILE) or {}).get("session") == self.session:
                break
            time.sleep(0.2)
        outcome.write(EXIT_WATCHDOG)
        os._exit(EXIT_WATCHDOG)

    def report(self, late: _Open) -> dict:
        """The verdict from the heartbeats: the front (highest ``seq``) and the ranks behind it."""
        beats = self._heartbeats()
        front = max(beats.values(), key=lambda b: b["seq"])
        missing = [r for r in range(self.world_size) if beats.get(r, {}).get("seq") != front["seq"]]
        seen = []
        for r in missing:
            b = beats.get(r)
            if b is None:
                seen.append(f"rank {r} never seen in this job")
            else:
                where = "in" if b["state"] == "in" else "after"
                ago = time.time() - b["at"]
                seen.append(
                    f"rank {r} last seen {where} '{b['stage']}' at step {b['step']}, {ago:.0f} s ago"
                )
        point = "after stage" if front["state"] == "after" else "stage"
        head = f"watchdog: {point} '{front['stage']}' at step {front['step']}: "
        if missing:
            head += f"ranks {missing} did not arrive ({'; '.join(seen)}); "
        else:
            head += "every rank arrived (the hang is inside the stage); "
        no_stack = [r for r in range(self.world_size) if not self._has_stack(r)]
        line = (
            f"{head}rank {self.rank}'s '{late.stage}' deadline of {late.deadline:.0f} s expired; "
            f"stacks in {self.dir}" + (f" (none from ranks {no_stack})" if no_stack else "")
        )
        return {
            "session": self.session,
            "line": line,
            "stage": front["stage"],
            "step": front["step"],
            "missing": missing,
            "missing_hosts": sorted({beats[r]["host"] for r in missing if r in beats}),
            "reporter": self.rank,
            "expired": {
                "stage": late.stage,
                "step": late.step,
                "deadline_s": late.deadline,
                "entered_at": late.since,
            },
            "no_stack": no_stack,
            "at": time.time(),
        }
