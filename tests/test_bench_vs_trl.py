"""bench/bench_vs_trl.py at its smallest size: both sides take real GRPO steps on the same prompts.

One subprocess (the bench initialises torch.distributed and megatron's state): a tiny random
Llama with SmolLM2-135M-Instruct's vocabulary and tokenizer (two 135 M trainers in one process
need ~6 GiB; the real model's figures come from the bench itself), 2 prompts × 2 samples × 4 new
tokens, our trainer with colocated vLLM against TRL's GRPOTrainer, one warm-up and one timed step
per side. Skips when TRL is not installed (setup.py extra "peer").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.tiny import write_tiny_hf
from tests.test_real_model_train import REPO, env_for

pytest.importorskip("trl", reason="TRL not installed (pip install -e '.[peer]')")
# tests/test_gpu_bench.py runs this bench too (its GPU mode, through scripts/gpu_bench.sh --dry).
pytestmark = pytest.mark.slow


def test_both_sides_step_on_the_same_prompts(real_model, tmp_path):
    out = tmp_path / "out.json"
    # head_dim 32 for vLLM's CPU attention; positions for the base config's max_model_len.
    model = write_tiny_hf(
        tmp_path / "tiny",
        arch="llama",
        vocab_size=49152,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        max_pos=512,
    )
    cmd = [
        sys.executable,
        "-m",
        "bench.bench_vs_trl",
        "--prompts=2",
        "--n=2",
        "--new-tokens=4",
        "--pairs=1",
        "--engines=vllm",
        f"--model={model}",
        f"--tokenizer={real_model}",  # the tiny folder has weights and config only
        f"--work-dir={tmp_path}",
        f"--out={out}",
    ]
    r = subprocess.run(
        cmd, cwd=REPO, env=env_for(real_model), capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
    result = json.loads(out.read_text())
    row = result["rows"]["vllm"]
    assert row["pairs"] == 1
    for clock in ("cpu", "wall"):
        assert row[clock]["ours_steps_per_hour"] > 0 and row[clock]["trl_steps_per_hour"] > 0
    # Both sides took the warm-up and the timed step, and TRL logged a reward for each of its own.
    ours, trl = result["rewards"]["ours"], result["rewards"]["trl"]
    assert len(ours) == len(trl) == 2, (ours, trl)
    assert all(0.0 <= x <= 1.0 for _, x in ours) and all(0.0 <= x <= 1.0 for x in trl)
    assert Path(tmp_path / "ours").is_dir() and "GRPO steps per hour" in r.stdout
