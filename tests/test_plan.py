"""``ngrpo-launch plan``: each GPU recipe's model built on the meta device under a fake process
group of its real world size (in a subprocess: the fake group must not leak into other tests);
the per-rank parameter counts add up to the HF totals; layouts that cannot be built or cannot fit
an H100 exit 1 with one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_ngrpo.launch import plan, recipes

REPO = Path(__file__).resolve().parents[1]
# The published models' parameter counts (R1-Distill-Qwen-1.5B is untied: its card's 1.78 B).
HF_TOTALS = {"r1-1.5b": 1_777_088_000, "r1-7b": 7_615_616_512, "r1-14b": 14_770_033_664}


# Every `ngrpo-launch plan` the tests read, run in ONE subprocess (one interpreter start and
# megatron import instead of one per plan; each plan tears its fake process group down).
PLANS = {
    "r1-1.5b": ("r1-1.5b", "--nodes", "1"),
    "r1-7b": ("r1-7b", "--nodes", "2"),
    "r1-14b": ("r1-14b", "--nodes", "8"),
    "split": (
        "r1-14b",
        "model.tensor_parallel=4",
        "model.pipeline_parallel=2",
        "model.virtual_pipeline=2",
    ),
    "no_fit": ("r1-7b", "model.tensor_parallel=1"),
    "new_terms": (
        "r1-1.5b",
        "tokenizer=deepseek-r1-distill-qwen",
        "train.reference=copy",
        "rollout.engine=megatron",
    ),
    "sender": (
        "r1-7b",
        "tokenizer=deepseek-r1-distill-qwen",
        "rollout.engine=remote",
        "rollout.remote.urls=[http://a:1,http://b:2]",
        "rollout.remote.weight_transfer=nccl",
        "rollout.remote.bucket_mb=8192",
    ),
    "vllm_reserve": (
        "r1-7b",
        "--nodes",
        "2",
        "tokenizer=deepseek-r1-distill-qwen",
        "rollout.vllm.gpu_memory_utilization=0.3",
    ),
}
RUN_PLANS = """
import contextlib, io, json, sys
from megatron_ngrpo.launch import cli
out = {}
for key, args in json.loads(sys.argv[1]).items():
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        rc = cli.main(["plan", *args])
    out[key] = {"returncode": rc, "stdout": o.getvalue(), "stderr": e.getvalue()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def plans() -> dict[str, SimpleNamespace]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, "-c", RUN_PLANS, json.dumps(PLANS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return {k: SimpleNamespace(**v) for k, v in json.loads(lines[-1]).items()}


@pytest.mark.parametrize("name,nodes,ranks", [("r1-1.5b", 1, 1), ("r1-7b", 2, 4), ("r1-14b", 8, 8)])
def test_plan_builds_every_recipe(plans, name, nodes, ranks):
    proc = plans[name]
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
    rows = re.findall(
        r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d,]+)\s+[\d.]+ GiB\s+(\d+)-(\d+)$", out, re.M
    )
    assert len(rows) == ranks and {int(r[1]) for r in rows} == set(range(ranks))
    assert "fits" in out


def test_plan_shows_the_pipeline_split(plans):
    proc = plans["split"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    layers = dict(
        re.findall(r"^\s+\d+\s+0\s+(\d)\s+[\d,]+\s+[\d.]+ GiB\s+(.+)$", proc.stdout, re.M)
    )
    assert layers == {"0": "1-12, 25-36", "1": "13-24, 37-48"}
    assert "= 14,770,033,664 = HF total" in proc.stdout


def test_plan_refuses_a_layout_that_cannot_fit(plans):
    proc = plans["no_fit"]
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


# ---- memory terms beyond the policy's training (issue #29 item 13) ---------------------------
# r1-7b on 2 nodes: TP 4, PP 1, DP 4; Qwen2-7B: L 28, h 3584, g 4 KV heads, d 128, vocab 152,064
# (padded: 152,064), FFN 18,944, untied. Per rank: 28 × (233,050,624 / 4 + 2·3584) + 2 × 38,016
# × 3584 + 3584 = 1,904,057,344 parameters.
R7B_RANK_PARAMS = 1_904_057_344
# The recipes' configs name no tokenizer, and the plan's config.json folder holds none.
TOKENIZER = "tokenizer=deepseek-r1-distill-qwen"


def r7b_memory(*overrides: str):
    r = recipes.get("r1-7b")
    cfg = plan.recipe_config(r, 2, (TOKENIZER, *overrides))
    return plan.memory.train_memory(r.spec, plan.train_layout(cfg, r.data_parallel(2)))


def training_phase(m) -> int:
    return m.activations + max(m.working, m.logits)


def test_recipe_figures_unchanged_without_the_new_terms():
    """The recipes use none of the terms: their figures are the ones before the terms existed
    (since issue #38: the log-prob pass in chunks instead of the logits and fp32 copies, and the
    SwiGLU backward's gradients in a layer's backward)."""
    before = {("r1-1.5b", 1): 22_224_278_784, ("r1-7b", 2): 23_497_178_112}
    before |= {("r1-7b", 4): 20_641_092_096, ("r1-14b", 8): 19_382_125_056}
    for (name, nodes), total in before.items():
        r = recipes.get(name)
        cfg = plan.recipe_config(r, nodes, (TOKENIZER,))
        m = plan.memory.train_memory(r.spec, plan.train_layout(cfg, r.data_parallel(nodes)))
        assert (m.reference, m.engine_copy, m.kv_cache, m.sender) == (0, 0, 0, 0)
        assert m.total == total, name


def test_attention_terms_follow_the_attention_in_use():
    """The local spec's SDPA attention plans like TE's fused one (no s² scores); megatron's unfused
    attention (model.attention: unfused) adds its scores to a layer's backward."""
    te, sdpa = r7b_memory(), r7b_memory("model.layer_spec=local")
    unfused = r7b_memory("model.layer_spec=local", "model.attention=unfused")
    assert sdpa == te
    assert unfused.working > 5 * te.working and unfused.total > te.total


def test_reference_copy_is_a_second_model():
    base, m = r7b_memory(), r7b_memory("train.reference=copy")
    assert m.params == R7B_RANK_PARAMS
    assert m.reference == 2 * R7B_RANK_PARAMS == 3_808_114_688
    assert m.total == base.total + 3_808_114_688
    # No KL term: no reference model is built.
    assert r7b_memory("train.reference=copy", "grpo.kl_mode='off'").reference == 0


def test_megatron_engine_kv_cache_is_a_phase_of_its_own():
    """64 prompts / DP 4 × n 4 = 64 rows × (4096 + 8192) tokens × 28 layers × 2 × 4/TP 4 KV
    heads × 128 × 2 B = 11,274,289,152 B, more than the training step's activations: the peak is
    the static memory plus the cache."""
    base, m = r7b_memory(), r7b_memory("rollout.engine=megatron")
    assert m.kv_cache == 64 * 12288 * 28 * 2 * 1 * 128 * 2 == 11_274_289_152
    assert training_phase(base) < m.kv_cache
    assert m.total == base.total - training_phase(base) + 11_274_289_152
    assert r7b_memory("rollout.engine=megatron", "rollout.max_batch_size=16").kv_cache == (
        11_274_289_152 // 4
    )


def test_separate_engine_copy_and_kv_cache_beside_training():
    """One-step-off Megatron rollouts: a second weight copy, and the cache held during the
    training step."""
    base = r7b_memory()
    m = r7b_memory("rollout.engine=megatron", "train.async.max_staleness=1")
    assert m.engine_copy == 2 * R7B_RANK_PARAMS
    assert m.kv_beside_training and m.kv_cache == 11_274_289_152
    assert m.total == base.total + 3_808_114_688 + 11_274_289_152
    sync_copy = r7b_memory("rollout.engine=megatron", "rollout.separate_copy=true")
    assert sync_copy.engine_copy == 3_808_114_688 and not sync_copy.kv_beside_training


def test_weight_sync_sender_buckets():
    """Bucket + the largest gathered HF tensor (the 152,064 × 3584 bf16 embedding); a sync runs
    between steps: it sets the peak only when larger than the training step."""
    embedding = 2 * 152_064 * 3584
    base = r7b_memory()
    assert base.sender == r7b_memory("rollout.vllm.weight_transfer=reload").sender == 0
    gloo = r7b_memory("rollout.vllm.weight_transfer=gloo")
    assert gloo.sender == 512 * 2**20 + embedding == 1_626_865_664
    assert gloo.total == base.total  # smaller than the training step's activations
    big = r7b_memory("rollout.vllm.weight_transfer=gloo", "rollout.vllm.sync_bucket_mb=20480")
    assert big.total == base.total - training_phase(base) + 20480 * 2**20 + embedding
    remote = r7b_memory(
        "rollout.engine=remote",
        "rollout.remote.urls=[http://a:1,http://b:2]",
        "rollout.remote.weight_transfer=nccl",
    )
    assert remote.sender == 2 * 512 * 2**20 + embedding  # one packed buffer per server
    http = r7b_memory("rollout.engine=remote", "rollout.remote.urls=[http://a:1,http://b:2]")
    assert http.sender == 512 * 2**20 + embedding


def test_plan_shows_the_new_terms(plans):
    proc = plans["new_terms"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^  reference copy [\d.]+ GiB, KV cache [\d.]+ GiB$", proc.stdout, re.M), (
        proc.stdout
    )


def test_plan_table_shows_the_sender_on_rank_0_only(plans):
    """rollout.remote: global rank 0 alone gathers and sends (2 servers × 8 GiB nccl buffers +
    the 2.0 GiB embedding, above the training step); the other TP ranks show the training peak."""
    proc = plans["sender"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^\s+(\d+)\s+\d+\s+\d+\s+[\d,]+\s+([\d.]+) GiB\s+1-28$", proc.stdout, re.M)
    m = r7b_memory()
    static = m.total - training_phase(m)
    assert [r for r, _ in rows] == ["0", "1", "2", "3"]
    assert float(rows[0][1]) == round((static + 16 * 2**30 + 2 * 152_064 * 3584) / 2**30, 1)
    assert {gib for _, gib in rows[1:]} == {f"{m.total / 2**30:.1f}"}
    assert "weight-sync sender 17.0 GiB" in proc.stdout


def test_vllm_reserve_follows_gpu_memory_utilization(plans):
    """rollout.vllm.gpu_memory_utilization: the colocated engine's share of each GPU in the plan
    (r1-7b's config gives 0.4)."""
    assert (
        plan.recipe_config(
            recipes.get("r1-7b"), 2, (TOKENIZER,)
        ).rollout.vllm.gpu_memory_utilization
        == 0.4
    )
    proc = plans["vllm_reserve"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    reserved = 0.3 * plan.memory.H100_BYTES / plan.memory.GIB
    assert f"+ vLLM reserved {reserved:.1f} GiB =" in proc.stdout, proc.stdout
