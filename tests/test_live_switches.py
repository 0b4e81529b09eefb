"""Live switches (issue #37 item 3): every config field is registered in tests/live_switches.py as
flipped by a named test that sees what the trainer, an engine, the evaluation or the launcher then
does differently, or as validated only (with the reason); a field without an entry fails here.

The trainer runs behind many entries are here: two 2-process launches of
tests/dist/trainer_switches_worker.py, side by side, run short trainer jobs
(``Trainer(cfg).setup(); .run()`` on configs/tiny_test.yaml) with switches flipped and report
their metrics, outputs and what test-side instruments saw (model forwards, optimizer steps,
engine calls)."""

from __future__ import annotations

import ast
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import test_train
import torch

from megatron_ngrpo.grpo.advantages import compute_advantages, group_ids
from megatron_ngrpo.grpo.dra import TfidfEmbedder, dra_rewards, similarity
from tests.harness.config_fields import config_fields as walk_fields
from tests.harness.multiproc import check, launch
from tests.live_switches import SWITCHES, TEST, VALIDATED

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "dist" / "trainer_switches_worker.py"
task = test_train.task  # the arithmetic task fixture (module scope)


# ---- the registry ------------------------------------------------------------------------------
def config_fields() -> dict[str, str]:
    """The registry's names of the config fields (tests/harness/config_fields.py) → "Class.field"."""
    return {name: f"{cls.__name__}.{f.name}" for name, (cls, f) in walk_fields().items()}


def test_every_config_field_is_registered():
    fields = config_fields()
    missing = sorted(set(fields) - set(SWITCHES))
    assert not missing, (
        f"config fields without a live-switch entry in tests/live_switches.py: {missing} — name "
        "the test that flips each and sees the change, or say why it is validated only"
    )
    gone = sorted(set(SWITCHES) - set(fields))
    assert not gone, f"tests/live_switches.py names fields that no longer exist: {gone}"


def test_registry_entries_name_real_tests_or_reasons():
    functions: dict[str, set[str]] = {}
    bad = []
    for name, (kind, what) in SWITCHES.items():
        if kind == VALIDATED:
            if len(what.split()) < 3:
                bad.append(f"{name}: validated only, but no reason given ({what!r})")
            continue
        if kind != TEST:
            bad.append(f"{name}: kind {kind!r}")
            continue
        path, _, func = what.partition("::")
        if path not in functions:
            file = REPO / path
            tree = ast.parse(file.read_text()) if file.is_file() else ast.Module(body=[])
            functions[path] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if func not in functions[path]:
            bad.append(f"{name}: no test function {what}")
    assert not bad, "\n".join(bad)


def test_the_walker_sees_nested_listed_and_optional_dataclasses():
    fields = config_fields()
    assert fields["grpo.mismatch.cap"] == "MismatchConfig.cap"  # a section's fields
    assert fields["train.async.on_stale"] == "AsyncConfig.on_stale"  # a keyword field's name
    assert fields["data.train"] == "DataConfig.train"  # a list of sources is a field
    assert fields["data.train.limit"] == "SourceConfig.limit"  # ... and so are its rows' fields
    assert fields["eval.model"] == "EvalConfig.model"  # optional section: a field
    assert "eval.model.hf_path" not in fields and "eval.extra_benchmarks.limit" not in fields
    assert "grpo.mismatch" not in fields and "eval.sampling.n" not in fields
    assert fields["launch.cluster.rdzv_port"] == "Cluster.rdzv_port"


# ---- trainer runs --------------------------------------------------------------------------------
# The worker cases each trainer test reads (``@reads``): the fixture launches those of the tests
# selected in this session only, so one test (a mutant run, ``-k``) costs its own cases, not all.
CASES: dict[str, tuple[str, ...]] = {}


def reads(*cases: str):
    def register(test):
        CASES[test.__name__] = cases
        return test

    return register


# validation_and_evaluation evaluates the checkpoint that outputs_and_starts (run before it) saves.
NEEDS = {"validation_and_evaluation": ("outputs_and_starts",)}


# The worker's cases in two launches side by side (2 processes each, one thread per process): one
# launch kept the 2 cores about half busy (~160 s of user CPU in CI's 176 s), its ranks waiting on
# each other, on start-up and on their reward workers; the other launch's runs use that time.
# Cases that share a run (the baseline step; the checkpoint of ``outputs_and_starts`` that
# ``validation_and_evaluation`` evaluates) stay in one launch, in the worker's order.
LAUNCHES = (
    (
        "mismatch_corrections",
        "batch_arithmetic",
        "dra",
        "warm_start",
        "stale_rollouts",
        "prompt_order_and_epochs",
        "mixing_defaults",
    ),
    (
        "micro_batches",
        "optimizer_settings",
        "model_layouts",
        "objective",
        "embedding_gradient_and_table_refresh",
        "outputs_and_starts",
        "validation_and_evaluation",
    ),
)


@pytest.fixture(scope="module")
def runs(task, request):
    """The cases of the trainer tests selected in this session, in their launches side by side."""
    selected = [i for i in request.session.items if getattr(i, "module", None) is request.module]
    cases = {c for i in selected for c in CASES.get(i.originalname, ())}
    cases |= {n for c in cases for n in NEEDS.get(c, ())}
    groups = [[c for c in names if c in cases] for names in LAUNCHES]
    env = {"NGRPO_TASK": str(task)}
    with ThreadPoolExecutor(len(LAUNCHES)) as pool:
        parts = pool.map(
            lambda only: launch(WORKER, nproc=2, timeout=1500, env=env, only=only),
            [g for g in groups if g],
        )
        return {name: result for part in parts for name, result in part.items()}


def test_every_worker_case_is_launched():
    """A case added to tests/dist/trainer_switches_worker.py without a place in LAUNCHES would
    never run (its test would fail with "did not run"): say so here, by name."""
    tree = ast.parse(WORKER.read_text())
    cases = {
        f.name
        for f in tree.body
        if isinstance(f, ast.FunctionDef)
        and any(getattr(d, "id", "") == "case" for d in f.decorator_list)
    }
    launched = [name for names in LAUNCHES for name in names]
    assert sorted(launched) == sorted(cases), (sorted(cases - set(launched)), launched)


def _row(run: dict, i: int = 0) -> dict:
    return run["rows"][i]


def _training(run: dict) -> list[dict]:
    """The run's training-side forwards (old / reference log-probs, updates)."""
    return [f for f in run["forwards"] if not f["generation"]]


def _of(forwards: list[dict], *keys: str) -> set:
    return {tuple(f[k] for k in keys) if len(keys) > 1 else f[keys[0]] for f in forwards}


@reads("mismatch_corrections")
def test_mismatch_corrections_act_through_the_trainer(runs):
    """The engine's log-probs shifted by ∓1 at a known third of the tokens each (ρ ≈ e, 1/e):
    each correction masks exactly the tokens its thresholds reject and changes the loss; the
    engine's log-probs as π_old move the first update off ratio 1."""
    r = check(runs, "mismatch_corrections")
    n = r["off"]["shifted"]
    up, down, total = n["up"], n["down"], n["up"] + n["down"] + n["same"]
    assert up > 0 and down > 0
    masked = {k: _row(v).get("mismatch/all/masked_frac") for k, v in r.items()}
    assert masked["off"] == 0 and masked["token_tis"] == 0  # TIS weighs, never masks
    assert masked["icepop"] == pytest.approx((up + down) / total, abs=1e-9)
    assert masked["icepop_lower"] == pytest.approx(up / total, abs=1e-9)  # lower 0.3 < 1/e
    assert masked["token_mask_upper"] == pytest.approx(down / total, abs=1e-9)  # upper 3 > e
    assert masked["icepop_clamp"] == 0  # |log ρ| clamped to 0.5: within [0.5, 2]
    for split in ("mixed", "plain"):  # mixed and plain positions alike
        assert _row(r["icepop"])[f"mismatch/{split}/masked_frac"] > 0
    loss = {k: _row(v)["loss"] for k, v in r.items()}
    others = [k for k in loss if k not in ("off", "tis_cap", "token_tis")]
    assert len({loss[k] for k in others} | {loss["off"], loss["token_tis"]}) == len(others) + 2
    assert loss["tis_cap"] == loss["token_tis"]  # grpo.tis_cap is token-tis with that cap
    assert all(
        _row(v)["first_update/abs_log_ratio"] == 0 for k, v in r.items() if k != "engine_old"
    )
    assert 0.5 < _row(r["engine_old"])["first_update/abs_log_ratio"] < 0.85
    assert "mismatch/all/masked_frac" not in _row(r["engine_old"])


@reads("micro_batches")
def test_packed_and_budgeted_micro_batches_train_like_unpacked(runs):
    """train.pack_sequences: every training forward is one row, the step's numbers equal the
    unpacked step's within fp32 rounding; a token budget: rows × columns within it."""
    r = check(runs, "micro_batches")
    fw = {k: _training(v) for k, v in r.items()}
    assert _of(fw["unpacked"], "rows") == {2} and _of(fw["packed"], "rows") == {1}
    assert min(_of(fw["packed"], "columns")) > max(_of(fw["unpacked"], "columns"))
    assert all(f["rows"] * f["columns"] <= 40 for f in fw["budget"])
    assert _of(fw["budget"], "rows") == {1, 2}
    for name in ("packed", "budget"):
        a, b = _row(r["unpacked"]), _row(r[name])
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-7)
        for key in ("grad_norm", "kl", "entropy", "pg_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9), key


@reads("batch_arithmetic", "micro_batches")
def test_batch_arithmetic_and_rollout_switches(runs):
    """8 prompts × 2 samples in mini-batches of 4 prompts, 3 epochs, micro-batches of 4 rows;
    the sampling settings the engine gets; its own weight copy, 3 rows at a time; the model's
    19 positions and 30 of 31 token ids; prompts of at most 18 tokens; the generations dumped."""
    r = check(runs, "batch_arithmetic")
    base = check(runs, "micro_batches")["unpacked"]
    assert len(r["steps"]) == 3 * 8 // 4  # epochs × prompts / mini-batch prompts
    assert _of(_training(r), "rows") == {4}
    (call,) = r["calls"]
    assert len(call["prompts"]) == 8 // 2  # this rank's prompts
    params = {k: call["params"][k] for k in ("n", "temperature", "top_p", "top_k", "stop")}
    assert params == {"n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop": ["QQ"]}
    assert call["params"]["max_new_tokens"] == 5
    (base_call,) = base["calls"]
    assert (base_call["params"]["n"], base_call["params"]["top_k"]) == (4, -1)
    # max_seq_len 19: prompt + response never longer, and some response cut by it before 5 tokens
    assert all(p <= 18 and p + n <= 19 for p, n, _ in call["responses"])
    assert any(p + n == 19 and n < 5 and f == "length" for p, n, f in call["responses"])
    generation = [f for f in r["forwards"] if f["generation"]]
    assert max(_of(generation, "rows")) == 3 and max(_of(_training(base), "rows")) == 2
    # separate_copy: generation runs on a model object the updates never use
    assert not _of(generation, "model") & _of(_training(r), "model")
    assert _of([f for f in base["forwards"] if f["generation"]], "model") == {0}
    # the trainer replays at the engine's temperature over the same 30 real tokens
    assert _row(r)["logprob_gap/max_abs"] < 1e-5
    assert call["largest_id"] < 30 <= base_call["largest_id"]
    gens = r["generations"]
    assert sorted(gens) == ["step0000000_dp000.jsonl", "step0000000_dp001.jsonl"]
    assert [len(v) for v in gens.values()] == [4 * 2, 4 * 2]
    assert _row(r)["response_length/max"] == 5
    assert "generations" not in base["files"] and len(base["steps"]) == 2


@reads("optimizer_settings")
def test_optimizer_and_schedule_switches(runs):
    r = check(runs, "optimizer_settings")
    base, opt = r["baseline"]["steps"], r["optimizer"]["steps"]
    assert {(tuple(map(tuple, s["betas"])), tuple(s["eps"])) for s in opt} == {
        (((0.8, 0.99),), (1e-6,))
    }
    assert {tuple(s["weight_decay"]) for s in opt} == {(0.0, 0.05)}  # norms and biases: none
    assert {tuple(s["weight_decay"]) for s in base} == {(0.0, 0.01)}
    # the distributed optimizer: each DP rank steps on its half of the parameters
    assert {s["numel"] for s in opt} == {opt[0]["numel"]}
    assert 0.45 < opt[0]["numel"] / base[0]["numel"] < 0.55  # megatron pads the shards a little
    # clip_grad 0.01: the applied gradient is clipped to 0.01 (the logged norm is before clipping)
    assert all(s["grad_norm"] <= 0.01 * (1 + 1e-4) for s in opt)
    assert _row(r["optimizer"])["grad_norm"] > 0.1
    # lr 2e-3 reached in 2 warm-up updates from 0, then megatron's linear decay over the 6
    # updates to min_lr 1e-4: lr = min_lr + (lr - min_lr)·(1 − (n − 2) / (6 − 2)) at update n
    sched = r["schedule"]
    decay = [1e-4 + 1.9e-3 * (1 - (n - 2) / 4) for n in range(2, 6)]
    assert [s["lr"] for s in sched["steps"]] == [[pytest.approx(x)] for x in (0, 1e-3, *decay)]


@reads("model_layouts")
def test_model_layout_switches(runs):
    """TP 2 halves each rank's embedding rows, with sequence parallelism; PP 2 gives each stage
    one of the two layers, recomputed in the backward pass, in bf16."""
    r = check(runs, "model_layouts")
    keys = ("layers", "embedding_rows", "sequence_parallel", "recompute", "dtype")
    # 31 token rows padded to 32: the tiny config's make_vocab_size_divisible_by 8 (default 128)
    assert _of(r["baseline"]["forwards"], *keys) == {(2, 32, False, None, "torch.float32")}
    # sequence parallelism in the trainer's passes (the engine decodes without it)
    assert _of(_training(r["tp2"]), *keys) == {(2, 16, True, None, "torch.float32")}
    # rank 0: the first stage
    assert _of(r["pp2"]["forwards"], *keys) == {(1, 32, False, "full", "torch.bfloat16")}


def _advantages(rows: list[dict], scores: torch.Tensor, kind: str, eps: float) -> list[float]:
    return compute_advantages(scores, group_ids([x["prompt_index"] for x in rows]), kind, eps)


@reads("objective", "validation_and_evaluation")
def test_objective_switches(runs):
    """Advantages recomputed from the dumped rewards; KL coefficient and mode from the logged
    terms; the zero-variance filter; another seed draws other rollouts."""
    r = check(runs, "objective")
    base, run = _row(r["baseline"]), r["eps_seed"]
    for rows in run["generations"].values():  # adv_eps 1: (r - mean) / (std + 1)
        want = _advantages(rows, torch.tensor([x["reward"] for x in rows]).double(), "grpo", 1.0)
        assert [x["advantage"] for x in rows] == pytest.approx(want.tolist(), abs=1e-6)
        assert any(abs(x["advantage"]) > 0.1 for x in rows)
    # kl_coef 0.5 (the tiny config's 0.001): the same step (the KL gradient is 0 at the first
    # update, where π_θ = π_ref), its KL term 500 times heavier
    coef = _row(check(runs, "validation_and_evaluation")["no_best"])
    assert coef["kl"] == pytest.approx(base["kl"], rel=1e-9) and base["kl"] > 0
    assert coef["kl_loss"] == pytest.approx(500 * base["kl_loss"], rel=1e-6)
    assert _row(run)["reward/mean"] != base["reward/mean"]  # train.seed: other rollouts
    run = r["drgrpo_klmetric"]
    for rows in run["generations"].values():  # dr_grpo: r - mean
        want = _advantages(rows, torch.tensor([x["reward"] for x in rows]).double(), "dr_grpo", 0)
        assert [x["advantage"] for x in rows] == pytest.approx(want.tolist(), abs=1e-6)
    assert _row(run)["kl_loss"] == 0 and _row(run)["kl"] > 0  # kl_mode metric: logged only
    run = _row(r["filter_kloff"])
    assert run["reward/mean"] == 0 and base["reward/mean"] < 0  # reward.overlong none
    assert run["filtered_frac"] == 1 and base["filtered_frac"] == 0
    assert run["skipped_updates"] == 2  # every group filtered: no step
    assert "time/ref_logprobs" not in run and "time/ref_logprobs" in base  # kl_mode off


def _dra_advantages(rows: list[dict], scope: str, ngram: int, dim: int) -> list[float]:
    scores = torch.tensor([x["reward"] for x in rows]).double()
    groups = group_ids([x["prompt_index"] for x in rows])
    sim = similarity(TfidfEmbedder(ngram=ngram, dim=dim)([x["text"] for x in rows]))
    adjusted = dra_rewards(scores, sim, groups if scope == "group" else None).double()
    return compute_advantages(adjusted, groups, "grpo", 1e-6).tolist()


@reads("dra")
def test_dra_switches(runs):
    """DRA's advantages recomputed from the dumped texts and rewards (TF-IDF, group or batch
    similarities, n-grams and hash width); with the policy's hidden states, other ones."""
    r = check(runs, "dra")
    for name, args in (("group", ("group", 2, 2**18)), ("batch", ("batch", 1, 64))):
        for rows in r[name]["generations"].values():
            got = [x["advantage"] for x in rows]
            assert got == pytest.approx(_dra_advantages(rows, *args), abs=1e-5), name
    adv = {
        k: [x["advantage"] for f in sorted(v["generations"]) for x in v["generations"][f]]
        for k, v in r.items()
    }
    rows = r["group"]["generations"]["step0000000_dp000.jsonl"]
    plain = _advantages(rows, torch.tensor([x["reward"] for x in rows]).double(), "grpo", 1e-6)
    assert adv["group"][: len(rows)] != pytest.approx(plain.tolist(), abs=1e-3)  # DRA acted
    assert adv["hidden"] != pytest.approx(adv["group"], abs=1e-3)


@reads("outputs_and_starts")
def test_outputs_reference_and_starts(runs):
    """The reference as a second model (same KL); TensorBoard, progress bar and checkpoint
    outputs; a second start without resuming re-runs step 1; a run from a checkpoint starts from
    its weights."""
    r = check(runs, "outputs_and_starts")
    base, out = r["baseline"], r["outputs"]
    assert _of(_training(base), "model") == {0} and _of(_training(out), "model") == {0, 1}
    assert _row(out)["kl"] == _row(base)["kl"] and _row(out)["loss"] == _row(base)["loss"]
    assert {"tensorboard", "iter_0000001", "latest"} <= set(out["files"])
    assert not {"tensorboard", "latest"} & set(base["files"])
    assert "train: 100%" in out["stderr"] and "train:" not in base["stderr"]
    assert [x["step"] for x in r["fresh"]["rows"]] == [1, 1]  # appended: step 1 trained again
    assert _row(r["loaded"])["reward/mean"] != _row(base)["reward/mean"]


@reads("prompt_order_and_epochs")
def test_prompt_order_and_epoch_switches(runs):
    r = check(runs, "prompt_order_and_epochs")
    assert [x["step"] for x in r["epochs"]["rows"]] == [2]  # 2 epochs of 1 batch, log_every 2
    assert len(r["epochs"]["calls"]) == 2
    first = r["first_batch"]  # rank 0 draws the first half of each step's 4 prompts
    assert r["ordered"]["calls"][0]["prompts"] == first["file"][:2]
    assert r["reseeded"]["calls"][0]["prompts"] == first["seed7"][:2] != first["seed1234"][:2]


@reads("embedding_gradient_and_table_refresh")
def test_embedding_gradient_and_table_refresh_switches(runs):
    r = check(runs, "embedding_gradient_and_table_refresh")
    base, run = _row(r["baseline"]), r["mixing"]
    # the same rollouts, another gradient: mixed inputs no longer reach the embedding rows
    assert _row(run)["reward/mean"] == base["reward/mean"]
    assert not math.isclose(_row(run)["grad_norm"], base["grad_norm"], rel_tol=1e-6)
    # refresh_every 0: the table of the start only (the tiny config's 2 refreshes at step 2)
    assert [x["mixing/table_refreshed"] for x in run["rows"]] == [1, 0]


@reads("mixing_defaults")
def test_mixing_defaults_through_the_trainer(runs):
    """The trainer at the mixing defaults that configs/tiny_test.yaml overrides: ``auto`` with
    ``refresh_every`` 1 over 1024 vocabulary rows resolves to on-demand rows (searched at every
    step, no table built), and special anchors stay unmixed (``skip_special_anchors``) where the
    same run with the option off mixes some."""
    r = check(runs, "mixing_defaults")
    run, special = r["defaults"], r["special"]
    assert len(run["rows"]) == 2
    for row in run["rows"]:
        assert row["mixing/neighbor_rows_searched"] > 0 and row["mixing/table_refreshed"] == 0, row
    assert sum(c["mixed"] for c in run["calls"]) > 0
    assert sum(c["special_anchors_mixed"] for c in run["calls"]) == 0
    assert sum(c["special_anchors_mixed"] for c in special["calls"]) > 0


@reads("validation_and_evaluation")
def test_validation_and_evaluation_switches(runs):
    """Validation every step on 3 problems of a file, 2 samples each with its own sampling
    settings, one problem per engine call; the best checkpoint kept or not. The evaluation CLI:
    extra benchmark files, 3 problems, one per call, its pass@k, its output folder."""
    r = check(runs, "validation_and_evaluation")
    run = r["validation"]
    val = [c for c in run["calls"] if c["params"]["seed"] == 11]  # the rollout's seed differs
    assert val and all(len(c["prompts"]) == 1 for c in val)  # max_tokens_per_call 1
    params = {k: val[0]["params"][k] for k in ("n", "temperature", "top_p", "top_k")}
    assert params == {"n": 2, "temperature": 0.5, "top_p": 0.8, "top_k": 7}
    assert all(n <= 3 for c in val for _, n, _ in c["responses"])
    assert "val/mean@2" in _row(run) and sum(len(c["prompts"]) for c in val) == 2  # rank 0: 2 of 3
    assert {"best", "iter_0000001", "validation"} <= set(run["files"])
    assert not {"best", "iter_0000001"} & set(r["no_best"]["files"])
    assert "validation" in r["no_best"]["files"]
    ev = r["eval"]
    assert ev["status"] == 0 and all(len(c["prompts"]) == 1 for c in ev["calls"])
    assert len(ev["calls"]) == 2  # rank 0's 2 of the 3 problems
    (name,) = ev["results"]["metrics"]
    assert name.startswith("train8") and set(ev["results"]["metrics"][name]) >= {"pass@1", "pass@2"}
    assert "results.json" in ev["files"]


@reads("stale_rollouts")
def test_stale_rollout_rule_reaches_the_producer(runs):
    r = check(runs, "stale_rollouts")
    assert r["drop"] == "dropped"
    assert r["error"].endswith("staleness 2 > train.async.max_staleness = 1")


@reads("warm_start")
def test_warm_start_switches(runs):
    """train.warmstart: 2 steps from its file at its own learning rate, 8 pairs a step (4 per DP
    rank, 2 micro-batches of 2), before the RL step's 2 updates at optim.lr."""
    r = check(runs, "warm_start")
    assert [s["lr"] for s in r["steps"]] == [[1e-2], [1e-2], [1e-3], [1e-3]]
    first_rollout = next(i for i, f in enumerate(r["forwards"]) if f["generation"])
    warm = r["forwards"][:first_rollout]
    assert len(warm) == 2 * 2 and all(f["graph"] and f["rows"] == 2 for f in warm)
    assert len(r["warmstart_nll"]) == 2 and "warmstart" in r["files"]
