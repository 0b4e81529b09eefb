"""scripts/gpu_smoke.sh's CPU mode (the GPU check itself runs only where a GPU is lent): its stages
run in their own processes and the table reports them; 2 GRPO steps mix tokens; a failing stage
is a FAIL row, the next stages still run, and the exit status says so; a missing Transformer
Engine or vLLM fails the check unless --allow-missing names it; the memory rule."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("env", "task", "preflight", "grpo", "vllm", "refused")


def smoke(tmp_path: Path, *args: str, path: str = "") -> tuple[int, list[dict], str]:
    p = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_smoke.sh"), "--cpu", "--work", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, str(REPO)]))},
    )
    rows = json.loads((tmp_path / "summary.json").read_text())
    return p.returncode, rows, p.stdout


def test_cpu_mode_runs_two_mixing_grpo_steps(tmp_path):
    code, rows, out = smoke(
        tmp_path, "--allow-missing", "te,vllm", "--skip", "preflight", "vllm", "refused"
    )
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
    # The memory row's windows are cut at optimizer steps: 2 mini-batches in each of 2 steps.
    assert next(r for r in rows if r["stage"] == "memory")["detail"].endswith(
        "; 4 optimizer steps seen"
    ), rows
    assert code == 0 and "all stages passed" not in out
    assert out.splitlines()[-1].startswith("[gpu_smoke] 3 passed, 3 skipped, 1 information only")
    assert (tmp_path / "summary.txt").read_text().splitlines()[0].startswith("stage")


def test_a_missing_te_or_vllm_fails_unless_allowed(tmp_path):
    """TE never imports on CPU; vLLM is made absent here by a package of that name that fails to
    import, ahead on the path. The strict run also shows a failing stage as a row: without the
    task (stage skipped) the GRPO stage cannot load its config, a FAIL row naming the reason; the
    refused stage still runs; exit status 1."""
    broken = tmp_path / "site" / "vllm"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('vllm absent (test stub)')\n")
    code, rows, out = smoke(
        tmp_path / "strict", "--skip", "task", "preflight", path=str(tmp_path / "site")
    )
    status = {r["stage"]: (r["status"], r["detail"]) for r in rows}
    assert status["env"][0] == "FAIL" and status["vllm"][0] == "FAIL", out
    assert "transformer_engine.pytorch (allow with --allow-missing te)" in status["env"][1]
    assert "vllm (allow with --allow-missing vllm)" in status["env"][1]
    assert status["grpo"][0] == "FAIL" and "paths.yaml" in status["grpo"][1], status["grpo"]
    refused = [r["detail"] for r in rows if r["stage"] == "refused"]
    assert any(d.startswith("context parallelism") for d in refused), refused
    assert code == 1 and "all stages passed" not in out and "FAILED: " in out
    only = ("--skip", "task", "preflight", "grpo", "refused")  # env and vllm: no task needed
    code, rows, out = smoke(
        tmp_path / "allowed", "--allow-missing", "te,vllm", *only, path=str(tmp_path / "site")
    )
    status = {r["stage"]: (r["status"], r["detail"]) for r in rows}
    assert status["env"][0] == "PASS" and status["vllm"] == (
        "SKIP",
        "not run: vllm absent (--allow-missing vllm)",
    ), out
    assert code == 0 and "all stages passed" not in out and "1 passed, 5 skipped" in out


def test_skipping_what_checks_te_or_vllm_needs_allow_missing(tmp_path):
    """--skip env leaves Transformer Engine unchecked, --skip vllm vLLM: each a FAIL row unless
    --allow-missing names the package; the last line counts what was skipped."""
    every = ("--skip", *STAGES)
    code, rows, out = smoke(tmp_path / "strict", *every)
    status = {r["stage"]: (r["status"], r["detail"]) for r in rows}
    assert status["env"] == (
        "FAIL",
        "skipped (--skip) without --allow-missing te: transformer_engine.pytorch unchecked",
    )
    assert status["vllm"][0] == "FAIL" and "--allow-missing vllm" in status["vllm"][1]
    assert code == 1 and out.splitlines()[-1].startswith("[gpu_smoke] FAILED: env, vllm; 0 passed")
    code, rows, out = smoke(tmp_path / "allowed", "--allow-missing", "te,vllm", *every)
    assert {r["status"] for r in rows} == {"SKIP"} and code == 0
    assert out.splitlines()[-1].startswith("[gpu_smoke] 0 passed, 6 skipped (logs: ")


def test_memory_row_checks_the_layout_dependent_terms_within_bounds():
    spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "scripts" / "gpu_smoke.py")
    gpu_smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_smoke)
    # The smoke's GPU shape: 2085 MiB static (weights, grads, Adam), 29 MiB layout-dependent.
    static, terms = 2085 * 2**20, 29 * 2**20

    def row(layout_measured: float) -> dict:
        measured = int(layout_measured * terms)
        run = dict(
            static=static,
            window_peak=static + measured,
            peak=static + measured,
            peak_kind="torch max_memory_allocated",
        )
        return gpu_smoke.memory_row(run, static, terms, cpu=False)

    assert row(1.0)["status"] == "PASS" and "ratio 1.00" in row(1.0)["detail"]
    # A 10x error either way fails, though the total peak is within 14 % of the plan's total.
    assert row(10.0)["status"] == "FAIL" and "ratio 10.00" in row(10.0)["detail"]
    assert row(0.1)["status"] == "FAIL" and "ratio 0.10" in row(0.1)["detail"]
    low, high = gpu_smoke.MEMORY_BOUNDS
    assert row(low)["status"] == row(high)["status"] == "PASS"
