"""Helpers for the launcher tests: the CLI in a subprocess, the tiny model and config of the smoke
workload, and the single-host Slurm test cluster of scripts/slurm/."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from examples.arithmetic.task import write_task

REPO = Path(__file__).resolve().parents[1]
SLURM_SCRIPTS = REPO / "scripts" / "slurm"
# The launcher tests' workload (tests/smoke_workload.py), importable in jobs through smoke_env().
SMOKE_MODULE = "smoke_workload"


def smoke_env() -> dict[str, str]:
    """This environment with ``tests/`` on PYTHONPATH: jobs inherit it, so ``--module
    smoke_workload`` runs there."""
    path = os.pathsep.join(p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


@dataclass
class Launch:
    """A CLI run started in the background; ``finish()`` waits and returns (rc, output)."""

    proc: subprocess.Popen
    log: Path

    def finish(self, timeout_s: float = 420) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return rc, self.log.read_text(errors="replace")

    def kill(self) -> None:
        """Kill the CLI and what it started (its own process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_cli(args: list[str], env: dict[str, str], log: Path) -> Launch:
    """``python -m megatron_ngrpo.launch ARGS`` in the background, stdout and stderr to ``log``."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_ngrpo.launch", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Launch(proc, log)


def slurm_options(time: str) -> list[str]:
    """``ngrpo-launch run``'s options for the test cluster: its partition and account, shared
    nodes, the code where it is (no packaging), a time limit ``time``."""
    return [
        "--executor",
        "slurm",
        "--packager",
        "none",
        "--partition",
        "batch",
        "--account",
        "test",
        "--time",
        time,
        "--no-exclusive",
    ]


def experiment_id(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("experiment "):
            return line.split()[1]
    raise AssertionError(f"no experiment id in the CLI output:\n{output[-3000:]}")


def write_smoke_inputs(directory: Path) -> tuple[Path, Path]:
    """The tiny Qwen2 (config only: megatron initialises the weights) and a smoke_workload config
    naming it."""
    from tests.harness.tiny import write_tiny_hf

    hf = write_tiny_hf(directory / "tiny-qwen2", weights=False)
    config = directory / "smoke.yaml"
    config.write_text(f"model:\n  hf_path: {hf}\nsmoke:\n  seq_len: 32\n")
    return hf, config


def write_arithmetic_task(directory: Path, **task_kwargs) -> Path:
    """examples/arithmetic's task (tokenizer, tiny Qwen2 config, problems; ``task_kwargs`` go to
    its ``write_task``) and a YAML overlay that points configs/tiny_test.yaml at it; returns the
    overlay."""
    write_task(directory, **task_kwargs)
    overlay = directory / "paths.yaml"
    overlay.write_text(
        f"tokenizer: {directory / 'tokenizer'}\n"
        f"model:\n  hf_path: {directory / 'model'}\n"
        f"data:\n  train:\n    - path: {directory / 'train.jsonl'}\n  template:\n    kind: plain\n"
        f"    instruction: ''\n"
    )
    return overlay


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ports_free(base: int, n: int) -> bool:
    for port in range(base, base + n):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                return False
    return True


class SlurmCluster:
    """scripts/slurm/start.sh on enter, stop.sh on exit, on ports nobody else uses.

    ``env`` is the environment for clients: SLURM_CONF of this cluster."""

    def __init__(self, state: Path):
        self.state = state
        base = next(
            b for b in (random.randrange(20000, 40000, 5) for _ in range(100)) if _ports_free(b, 5)
        )
        self.script_env = {**os.environ, "NGRPO_SLURM_PORT_BASE": str(base)}
        self.env = {**os.environ, "SLURM_CONF": str(state / "etc" / "slurm.conf")}

    def start(self) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(SLURM_SCRIPTS / "start.sh"), str(self.state)],
            env=self.script_env,
            capture_output=True,
            text=True,
            timeout=240,
        )

    def stop(self) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(SLURM_SCRIPTS / "stop.sh"), str(self.state)],
            env=self.script_env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def lose_node(self, node: str) -> list[int]:
        """``node`` dies: SIGKILL to its slurmd and to every process of this cluster's job steps
        on it (the nodes share this host: a step's processes carry their node's name and this
        cluster's SLURM_CONF; their slurmstepd parents too). Slurm marks it DOWN and its jobs
        NODE_FAIL after SlurmdTimeout. Returns the pids killed."""
        marks = (
            f"SLURMD_NODENAME={node}".encode(),
            f"SLURM_CONF={self.env['SLURM_CONF']}".encode(),
        )
        victims = {int((self.state / "run" / f"slurmd-{node}.pid").read_text())}
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            if all(m in _proc(pid, "environ").split(b"\0") for m in marks):
                victims.add(pid)
                victims.update(
                    a for a in _ancestors(pid) if _proc(a, "cmdline").startswith(b"slurmstepd")
                )
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return sorted(victims)

    def revive_node(self, node: str, timeout_s: float = 120) -> None:
        """Start ``node``'s slurmd again and wait until Slurm lists it idle (ReturnToService=2)."""
        subprocess.run(["slurmd", "-N", node], env=self.env, check=True, timeout=60)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            out = subprocess.run(
                ["sinfo", "-h", "-n", node, "-o", "%t"],
                env=self.env,
                capture_output=True,
                text=True,
            ).stdout
            if out.strip() == "idle":
                return
            time.sleep(1)
        raise AssertionError(f"node {node} not idle {timeout_s:.0f} s after its slurmd restarted")


def _proc(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def _ancestors(pid: int) -> list[int]:
    out = []
    while True:
        stat = _proc(pid, "stat")
        pid = int(stat.rsplit(b")", 1)[1].split()[1]) if stat else 0
        if pid <= 1:
            return out
        out.append(pid)
