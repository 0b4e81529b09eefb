"""Worker processes for grading hostile model output: per-task time limit, per-worker memory limit.

Each worker owns a pipe and runs one task at a time, so the parent always knows which task a
worker was running when it hung or died: the task scores a default, the worker is killed and a
fresh one started, and the rest of the batch goes on. Hand-written because the pools that exist
lose exactly that: ``concurrent.futures.ProcessPoolExecutor`` (and loky) mark the whole pool
broken when any worker dies and cannot stop a running task; pebble's ``ProcessPool`` kills
timed-out tasks but turns into a permanent error state when a worker dies before acknowledging
its task (seen here under load with a worker that exits at once).

Workers start from a ``forkserver`` that preloads the grading modules: forking the trainer
itself (threads, process groups, GiBs of address space, which would also defeat ``RLIMIT_AS``)
is unsafe, and ``spawn`` would re-import the caller's ``__main__`` for every replaced worker.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import resource
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait

from megatron_ngrpo.rewards.closing import Closing

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
# Exit status of a worker that found itself re-importing the caller's main script.
_REIMPORT_EXIT = 87
_REIMPORT_ERROR = (
    "grading workers re-run the main script on start-up and it builds a grader again: "
    'put the script\'s code under `if __name__ == "__main__":`'
)


def _check_not_bootstrapping() -> None:
    """In a starting worker, Python re-imports the caller's ``__main__`` (multiprocessing's
    ``spawn``/``forkserver`` preparation); a script without the ``__main__`` guard then builds a
    pool from inside that import. Exit with a status the parent turns into a clear error."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        os._exit(_REIMPORT_EXIT)


def _worker_main(conn, memory_mb: int, warmup: Callable | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    limit = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
    if warmup is not None:
        warmup()
    conn.send(("ready", None))
    parent = os.getppid()
    while True:
        # A parent killed by SIGKILL does not always close our pipe end (spawned siblings may
        # hold it), so also leave once we are re-parented.
        if not conn.poll(2.0):
            if os.getppid() != parent:
                return
            continue
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        fn, args = task
        try:
            reply = ("ok", fn(*args))
        except BaseException as e:  # noqa: BLE001 - hostile input may raise anything
            reply = ("error", f"{type(e).__name__}: {str(e)[:200]}")
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable result
            conn.send(("error", f"result not sendable: {type(e).__name__}"))


class _Worker:
    def __init__(self, ctx, memory_mb: int, warmup: Callable | None):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main, args=(child, memory_mb, warmup), daemon=True, name="ngrpo-grader"
        )
        self.process.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class GuardedPool(Closing):
    """``map(fn, args_list, default)`` over worker processes; each call of ``fn`` gets
    ``timeout_s`` seconds (from when its worker receives it) and the worker ``memory_mb`` MiB of
    address space (``RLIMIT_AS``). A call that times out, raises (``MemoryError`` included) or
    kills its worker yields ``default`` and is counted in ``failures``.

    ``fn`` and ``warmup`` must be importable module-level functions; ``preload`` names the
    modules the forkserver imports once for all workers; ``warmup`` runs in each new worker
    before it takes tasks (not on a task's clock).
    """

    def __init__(
        self,
        workers: int,
        timeout_s: float,
        memory_mb: int,
        preload: Sequence[str] = (),
        warmup: Callable | None = None,
    ):
        _check_not_bootstrapping()
        if workers < 1 or timeout_s <= 0 or memory_mb < 64:
            raise ValueError(
                f"GuardedPool(workers={workers}, timeout_s={timeout_s}, "
                f"memory_mb={memory_mb}): need workers >= 1, timeout > 0, >= 64 MiB"
            )
        self.timeout_s = timeout_s
        self._memory_mb = memory_mb
        self._warmup = warmup
        self._ctx = multiprocessing.get_context("forkserver")
        if preload:
            self._ctx.set_forkserver_preload(list(preload))
        self._lock = threading.Lock()
        self._workers = [self._spawn() for _ in range(workers)]
        self.failures = {"timeout": 0, "crash": 0, "error": 0}

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self._memory_mb, self._warmup)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = self._spawn()
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def map(self, fn: Callable, args_list: Sequence[tuple], default) -> list:
        with self._lock:
            return self._map(fn, args_list, default)

    def _map(self, fn: Callable, args_list: Sequence[tuple], default) -> list:
        results = [default] * len(args_list)
        pending = deque(enumerate(args_list))
        busy: dict[_Worker, tuple[int, float]] = {}  # worker → (task index, deadline)
        while pending or busy:
            self._dispatch(fn, pending, busy)
            waiting = [w for w in self._workers if w in busy or not w.ready]
            deadlines = [d for _, d in busy.values()] + [
                w.started + START_TIMEOUT_S for w in waiting if not w.ready
            ]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.0
            ready = set(
                wait([w.conn for w in waiting] + [w.process.sentinel for w in waiting], timeout)
            )
            now = time.monotonic()
            for worker in waiting:
                self._collect(worker, ready, now, busy, results)
        return results

    def _fail(self, busy: dict, worker: _Worker, kind: str, why: str) -> None:
        index, _ = busy.pop(worker)
        self.failures[kind] += 1
        logger.debug("grading task %d: %s (%s)", index, kind, why)

    def _dispatch(self, fn: Callable, pending: deque, busy: dict) -> None:
        """Send the next pending tasks to the idle ready workers."""
        for worker in self._workers:
            if worker.ready and worker not in busy and pending:
                index, args = pending.popleft()
                busy[worker] = (index, time.monotonic() + self.timeout_s)
                try:
                    worker.conn.send((fn, args))
                except Exception as e:  # noqa: BLE001 - a dead pipe or unpicklable args
                    self._fail(busy, worker, "error", f"send: {type(e).__name__}")
                    self._replace(worker)

    def _collect(self, worker: _Worker, ready: set, now: float, busy: dict, results: list) -> None:
        """Take ``worker``'s answer, start-up, crash or overrun (a replacement for the last two)."""
        if worker.conn in ready:
            try:
                status, value = worker.conn.recv()
            except (EOFError, OSError):
                status, value = "crash", "pipe closed"
        else:
            status = "crash" if worker.process.sentinel in ready else None
            value = f"exit code {worker.process.exitcode}"
        if not worker.ready:
            if status == "ready":
                worker.ready = True
            elif status is not None or now > worker.started + START_TIMEOUT_S:
                worker.process.join(timeout=5)
                if worker.process.exitcode == _REIMPORT_EXIT:
                    raise RuntimeError(_REIMPORT_ERROR)
                raise RuntimeError(
                    f"grading worker failed to start ({value}); "
                    f"is memory_mb = {self._memory_mb} enough to import sympy?"
                )
            return
        if status == "ok":
            results[busy.pop(worker)[0]] = value
        elif status in ("error", "crash"):
            self._fail(busy, worker, status, value)
            if status == "crash":
                self._replace(worker)
        elif now > busy[worker][1]:
            self._fail(busy, worker, "timeout", f"over {self.timeout_s} s")
            self._replace(worker)

    def close(self) -> None:
        with self._lock:
            for worker in self._workers:
                try:
                    if worker.process.is_alive():
                        worker.conn.send(None)
                except OSError:
                    pass
            deadline = time.monotonic() + 5
            for worker in self._workers:
                worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
                worker.kill()
            self._workers = []
