"""``ngrpo-launch plan``: each GPU recipe's model built on the meta device under a fake process
group of its real world size (in a subprocess: the fake group must not leak into other tests);
the per-rank parameter counts add up to the HF totals; layouts that cannot be built or cannot fit
an H100 exit 1 with one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ngrpo.launch import plan, recipes

REPO = Path(__file__).resolve().parents[1]
# The published models' parameter counts (R1-Distill-Qwen-1.5B is untied: its card's 1.78 B).
HF_TOTALS = {"r1-1.5b": 1_777_088_000, "r1-7b": 7_615_616_512, "r1-14b": 14_770_033_664}


def run_plan(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "megatron_ngrpo.launch", "plan", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("name,nodes,ranks", [("r1-1.5b", 1, 1), ("r1-7b", 2, 4), ("r1-14b", 8, 8)])
def test_plan_builds_every_recipe(name, nodes, ranks):
    proc = run_plan(name, "--nodes", str(nodes))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"= {recipes.get(name).world_size(nodes)} ranks" in out
    total = re.search(r"padding removed\) = ([\d,]+) = HF total ([\d,]+)", out)
    assert (
        total
        and int(total.group(1).replace(",", ""))
        == int(total.group(2).replace(",", ""))
        == HF_TOTALS[name]
    )
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d,]+)\s+(\d+)-(\d+)$", out, re.M)
    assert len(rows) == ranks and {int(r[1]) for r in rows} == set(range(ranks))
    assert "fits" in out


def test_plan_shows_the_pipeline_split():
    proc = run_plan(
        "r1-14b", "model.tensor_parallel=4", "model.pipeline_parallel=2", "model.virtual_pipeline=2"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    layers = dict(re.findall(r"^\s+\d+\s+0\s+(\d)\s+[\d,]+\s+(.+)$", proc.stdout, re.M))
    assert layers == {"0": "1-12, 25-36", "1": "13-24, 37-48"}
    assert "= 14,770,033,664 = HF total" in proc.stdout


def test_plan_refuses_a_layout_that_cannot_fit():
    proc = run_plan("r1-7b", "model.tensor_parallel=1")
    assert proc.returncode == 1, proc.stdout
    err = proc.stderr.strip()
    assert re.fullmatch(
        r"error: recipe r1-7b on 2 node\(s\): TP 1, PP 1, DP 16 needs [\d.]+ GiB per GPU "
        r"\(training [\d.]+ \+ vLLM [\d.]+\), more than 75.7 GiB of an 80 GB H100",
        err,
    ), err


@pytest.mark.parametrize(
    "nodes,overrides,reason",
    [
        (
            2,
            ("model.tensor_parallel=8",),
            "model.tensor_parallel = 8: does not divide num_attention_heads = 28",
        ),
        (9, (), "recipe r1-7b: nodes = 9: expected 2..4"),
        (2, ("model.pipeline_parallel=3",), "does not divide num_hidden_layers = 28"),
    ],
)
def test_plan_refuses_layouts_that_cannot_be_built(nodes, overrides, reason):
    """Refused before any process group exists (in-process)."""
    with pytest.raises(plan.PlanError, match=re.escape(reason)):
        plan.plan_layout(recipes.get("r1-7b"), nodes, overrides)


@pytest.mark.parametrize("name", sorted(HF_TOTALS))
def test_recipe_memory_uses_its_configs_micro_batch(name):
    """`ngrpo-launch memory` (the recipe table) and `plan` (the config) size the same layout."""
    r = recipes.get(name)
    for nodes in sorted({r.min_nodes, r.max_nodes}):
        cfg = plan.recipe_config(r, nodes)
        assert plan.train_layout(cfg, r.data_parallel(nodes)) == r.train_layout(nodes)
