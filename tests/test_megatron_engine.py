"""Built-in Megatron rollout engine: KV-cached generation at TP=1/2/4, PP=2, TP2×PP2 (one
4-process launch, cases in tests/dist/megatron_engine_worker.py)."""

from pathlib import Path

import pytest

from tests.harness.multiproc import check, launch

WORKER = Path(__file__).parent / "dist" / "megatron_engine_worker.py"
LAYOUTS = ["tp1_pp1", "tp2_pp1", "tp4_pp1", "tp1_pp2", "tp2_pp2"]


@pytest.fixture(scope="module")
def results():
    return launch(WORKER, nproc=4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_matches_full_forward_and_tp1(results, layout):
    """Greedy KV-cached output equals repeated full forwards of each prompt alone, and TP=1."""
    check(results, f"greedy_{layout}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replay_logprobs(results, layout):
    """Log-probs of sampled, mixed (ρ=0.1 anchor / ρ=1 sample, n=3, ragged prompts) responses
    equal a full-forward replay of the records and the trainer's sequence_logprobs (1e-5).
    ``emit``: the anchor (the record's ids[0]) at every mixed step, or the sample (T = 1.3),
    which on the tiny model is another token at most mixed steps."""
    value = check(results, f"replay_{layout}")
    for v in value.values():
        assert v["d_full"] < 1e-5 and v["d_train"] < 1e-5
    assert value["rho0.1"]["emitted_not_anchor"] == 0
    sample = value["rho1"]
    assert sample["emitted_not_anchor"] > sample["mixed"] // 4, sample


def test_determinism_gates_anchor(results):
    check(results, "determinism_gates_anchor")


def test_stop_after_thinking_gate(results):
    check(results, "stop_after_thinking_gate")


def test_stop_strings_and_ids(results):
    check(results, "stop_strings_and_ids")


def test_separate_copy(results):
    check(results, "separate_copy")


def test_bad_requests(results):
    check(results, "bad_requests")


def test_unfused_attention_engine_equals_sdpa(results):
    """The KV-cached engine on megatron's unfused attention (TP 2) reproduces the SDPA engine's
    greedy tokens and mixed rollout (models/attention.py)."""
    assert check(results, "unfused_attention_tp2")["logprob_err"] < 1e-5


def test_virtual_pipeline(results):
    check(results, "virtual_pipeline_tp1_pp2_vpp2")


def test_baseline_strategies_replay(results):
    """Soft Thinking / STHT (with recorded noise) / Gumbel mixtures replay within 1e-5."""
    check(results, "strategies_replay_tp2_pp2")


def test_on_demand_neighbors_equal_table(results):
    """On-demand neighbour rows: the table's batch bit for bit, only the mixed anchors searched."""
    value = check(results, "on_demand_neighbors_tp2_pp2")
    assert 0 < value["rows_computed"] <= value["mixed"]
