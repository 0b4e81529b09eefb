"""scripts/gpu_bench.sh's dry mode (the benchmark itself runs only where a GPU is lent): every stage
runs at a tiny size on CPU through the same commands, and the results table names the device and
the commit: bench_mfu with unfused and SDPA attention (host syncs counted), the neighbour-table
bench, bench_vs_trl in the mode the GPU runs (random weights of a model with SmolLM2's
tokenizer, the built-in engine, fixed-length responses on both sides)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_dry_run_passes_every_stage_and_writes_the_table(real_model, tmp_path):
    pytest.importorskip("trl", reason="TRL not installed (pip install -e '.[peer]')")
    results = tmp_path / "results"
    p = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_bench.sh"), "--dry", "--work", str(tmp_path)]
        + ["--results", str(results)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    summary = json.loads((results / "gpu_bench.json").read_text())
    assert {r["stage"]: r["status"] for r in summary["stages"]} == dict.fromkeys(
        ("mfu_unfused", "mfu_sdpa", "neighbors", "vs_trl"), "PASS"
    ), summary["stages"]
    assert summary["device"] == "cpu (dry run)" and len(summary["commit"].split()[0]) == 40
    table = (results / "gpu_bench.md").read_text()
    assert "Dry run on CPU" in table and summary["commit"] in table
    stages = {r["stage"]: r.get("results", {}) for r in summary["stages"]}
    assert stages["mfu_unfused"]["args"]["attention"] == "unfused"
    assert stages["mfu_sdpa"]["args"]["attention"] == "sdpa"
    for kind in ("plain", "mixed"):
        assert stages["mfu_sdpa"][kind]["syncs"]["scalar_reads"] > 0  # the profiler counted
    trl = stages["vs_trl"]
    assert trl["sizes"]["random_weights"] and trl["sizes"]["fixed_length"]
    assert set(trl["rows"]) == {"megatron"}
    new_tokens = trl["sizes"]["new_tokens"]
    assert all(x == new_tokens for side in ("ours", "trl") for x in trl["response_lengths"][side])
