"""Run many multi-process cases in one torchrun launch.

Process start plus imports cost seconds per launch, so a worker script registers many cases with
:func:`case` and calls :func:`run_cases`; every rank runs every case in order, the outcome of each
case is gathered over all ranks (a failure on any rank fails the case) and rank 0 writes one JSON
file. :func:`launch` runs the script under torchrun with a random port and returns that JSON, so a
pytest module can launch once (module fixture) and report one test per case.

Cases re-initialise megatron's parallel state themselves (``parallel.initialize_model_parallel``),
so TP/PP layouts are switched within one process group.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from megatron_ngrpo.parallel import broadcast_from_rank0, init_distributed, local_torchrun

_CASES: list[tuple[str, Callable[[], object]]] = []


def case(fn: Callable[[], object]) -> Callable[[], object]:
    """Register ``fn`` as a case; it may return a JSON-able value (from rank 0) for the test."""
    _CASES.append((fn.__name__, fn))
    return fn


def run_cases() -> None:
    """Entry point of a worker script: run the registered cases (optionally ``--only a,b``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    only = {s for s in args.only.split(",") if s}
    init_distributed(timeout_s=int(os.environ.get("NGRPO_TEST_PG_TIMEOUT", "180")))
    results: dict[str, dict] = {}
    for name, fn in _CASES:
        if only and name not in only:
            continue
        try:
            value, error = fn(), None
        except Exception:  # a failed case is reported, the remaining cases still run
            value, error = None, traceback.format_exc()
            # Also now: if the failure left a collective half-done, the gather below can hang.
            print(
                f"rank {dist.get_rank()}: case {name} failed:\n{error}", file=sys.stderr, flush=True
            )
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        failed = {r: e for r, e in enumerate(errors) if e}
        results[name] = {"ok": not failed, "errors": failed, "value": value}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


def shared_tmpdir(prefix: str) -> str:
    """A temporary directory made by global rank 0; its path on every rank (collective)."""
    return broadcast_from_rank0(tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None)


def launch(
    script: str | Path,
    nproc: int,
    timeout: int = 900,
    env: dict | None = None,
    only: list[str] | None = None,
) -> dict[str, dict]:
    """Run ``script`` under torchrun with ``nproc`` processes and return its per-case results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        cmd = [
            *local_torchrun(nproc),
            str(script),
            "--out",
            str(out),
        ]
        if only:
            cmd += ["--only", ",".join(only)]
        full_env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": worker_pythonpath(),
            **(env or {}),
        }
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
        if not out.exists():
            raise RuntimeError(
                f"torchrun {script} (nproc={nproc}) exited {proc.returncode} without results:\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
            )
        return json.loads(out.read_text())


def worker_pythonpath() -> str:
    """This process's import path as PYTHONPATH, so a worker script (whose own folder heads its
    path) imports what its launcher imports: this checkout, ``tests.*`` and ``bench.*`` when
    the launcher runs from the repository root (pytest's ``pythonpath``, ``python -m bench.x``)."""
    return os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path)


def check(results: dict[str, dict], name: str):
    """Assert that case ``name`` ran and passed on every rank; return its value."""
    assert name in results, f"case {name} did not run (cases: {sorted(results)})"
    res = results[name]
    assert res["ok"], f"case {name} failed:\n" + "\n".join(
        f"--- rank {r}:\n{e}" for r, e in res["errors"].items()
    )
    return res["value"]


def group_timeouts() -> dict[str, float]:
    """``{group description: timeout in seconds}`` of every process group of this process (every
    backend of each; a description shared by several groups names the largest timeout)."""
    out: dict[str, float] = {}
    for i, group in enumerate(dist.distributed_c10d._world.pg_map):
        name = group.group_desc or f"group{i}"
        for device in group._device_types:
            seconds = group._get_backend(device).options._timeout.total_seconds()
            out[name] = max(seconds, out.get(name, seconds))
    return out
