"""scripts/gpu_smoke.sh's CPU mode (the GPU check itself runs only where a GPU is lent): its stages
run in their own processes and the table reports them; 2 GRPO steps mix tokens; a failing stage
is a FAIL row, the next stages still run, and the exit status says so."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def smoke(tmp_path: Path, *args: str) -> tuple[int, list[dict], str]:
    p = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_smoke.sh"), "--cpu", "--work", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    rows = json.loads((tmp_path / "summary.json").read_text())
    return p.returncode, rows, p.stdout


def test_cpu_mode_runs_two_mixing_grpo_steps(tmp_path):
    code, rows, out = smoke(tmp_path, "--skip", "preflight", "vllm", "refused")
    status = {r["stage"]: r["status"] for r in rows}
    assert status == {
        "env": "PASS",
        "task": "PASS",
        "preflight": "SKIP",
        "grpo": "PASS",
        "memory": "INFO",
        "vllm": "SKIP",
        "refused": "SKIP",
    }, out
    grpo = next(r for r in rows if r["stage"] == "grpo")
    assert "2 steps" in grpo["detail"] and "local layer spec" in grpo["detail"], grpo
    assert code == 0 and "all stages passed" in out
    assert (tmp_path / "summary.txt").read_text().splitlines()[0].startswith("stage")


def test_a_failing_stage_is_a_row_and_the_exit_status(tmp_path):
    """Without the task (stage skipped) the GRPO stage cannot load its config: a FAIL row naming
    the reason, the refused stage still runs, exit status 1."""
    code, rows, out = smoke(tmp_path, "--skip", "env", "task", "preflight", "vllm")
    grpo = next(r for r in rows if r["stage"] == "grpo")
    assert grpo["status"] == "FAIL" and "paths.yaml" in grpo["detail"], grpo
    assert any(r["stage"] == "refused" and r["status"] != "SKIP" for r in rows), out
    assert code == 1 and "FAILED: grpo" in out
