"""The README's main job, short: task → NeMo-Run local launcher (torchrun, 2 ranks, TP=2) →
warm-start + N-GRPO → checkpoint → HF export → plot; then the same command with more steps
resumes from the checkpoint instead of starting over."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_ngrpo.launch.experiment import MEGATRON_INFO, TORCHRUN_INFO

REPO = Path(__file__).resolve().parents[1]


def _run_demo(
    out: Path, steps: int, tmp_path: Path, *overrides: str
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "examples.tiny_ngrpo",
        "--out",
        str(out),
        "--steps",
        str(steps),
        "train.warmstart.steps=4",
        "train.save_every=1",
        "train.prompts_per_step=8",
        "train.mini_batch_prompts=8",
        *(overrides or ["validation.every=0"]),
    ]
    env = {
        "NEMORUN_HOME": str(tmp_path / "nemorun"),
        "OMP_NUM_THREADS": "1",
        "PATH": __import__("os").environ["PATH"],
        "HOME": __import__("os").environ.get("HOME", "/root"),
    }
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"main job failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc


def _steps(run_dir: Path) -> list[int]:
    return [
        json.loads(line)["step"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line
    ]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("main_job")
    out = tmp / "demo"
    # Held-out validation once, at the last step, on 8 problems (bounded time).
    first = _run_demo(out, 2, tmp, "validation.every=2", "validation.limit=8")
    return tmp, out, first


def test_writes_metrics_checkpoint_export_and_plot(demo):
    _, out, first = demo
    run_dir = out / "train"
    assert _steps(run_dir) == [1, 2]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for key in ("reward/mean", "accuracy", "mixing/mixed_token_frac", "kl", "clip_frac"):
        assert key in rows[-1], key
    # Held-out accuracy is logged and reported in the summary.
    assert 0.0 <= rows[-1]["val/mean@4"] <= 1.0
    summary = json.loads(first.stdout[first.stdout.rindex("\n{\n") :])
    assert summary["validation"] == {"2": rows[-1]["val/mean@4"]}
    # The job's progress bar is streamed to the terminal while it runs (not just "Waiting ...").
    assert "train:" in first.stdout and "reward=" in first.stdout
    # ... without torchrun's start-up INFO lines (they stay in the job's log file).
    assert not [line for line in first.stdout.splitlines() if TORCHRUN_INFO.match(line.encode())]
    # ... nor megatron-core's INFO records (FSDP notices, DDP / optimizer config dumps, the
    # gradient buckets' parameter list): they go to the job's log only.
    terminal = first.stdout.encode().splitlines()
    assert not [line for line in terminal if MEGATRON_INFO.match(line)]
    assert b"Params for bucket" not in first.stdout.encode()
    tmp = demo[0]
    logs = b"".join(f.read_bytes() for f in (tmp / "nemorun").rglob("nemo_run/*/*/0/std*.log"))
    assert sum(bool(MEGATRON_INFO.match(line)) for line in logs.splitlines()) > 5
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "latest").read_text().strip() == "iter_0000002"
    assert (run_dir / "iter_0000002" / "megatron_ngrpo.json").is_file()
    hf = out / "hf"
    cfg = json.loads((hf / "config.json").read_text())
    tensors = {}
    for shard in hf.glob("*.safetensors"):
        tensors.update(load_file(shard))
    assert tensors["model.embed_tokens.weight"].shape[0] == cfg["vocab_size"]
    assert (hf / "tokenizer.json").is_file()
    png = run_dir / "metrics.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rerun_resumes_from_checkpoint(demo):
    tmp, out, _ = demo
    run_dir = out / "train"
    before = (run_dir / "metrics.jsonl").read_text()
    _run_demo(out, 3, tmp)
    after = (run_dir / "metrics.jsonl").read_text()
    # A fresh start would have rewritten steps 1-2 (and re-run the warm-start); a resume keeps them.
    assert _steps(run_dir) == [1, 2, 3]
    assert after.startswith(before)
    assert (run_dir / "latest").read_text().strip() == "iter_0000003"
