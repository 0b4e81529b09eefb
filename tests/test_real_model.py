"""The real pretrained SmolLM2-135M-Instruct (tied embeddings, 9 heads / 3 KV heads, vocab 49,152)
through conversion and the neighbour table (issue 27 item 3). One 3-rank launch (TP 1, TP 3) and
one 2-rank launch (PP 2) of tests/dist/real_model_worker.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.multiproc import check, launch

WORKER = Path(__file__).resolve().parent / "dist" / "real_model_worker.py"


@pytest.fixture(scope="module")
def results(real_model, tmp_path_factory):
    env = {
        "NGRPO_REAL_MODEL": str(real_model),
        "NGRPO_REAL_OUT": str(tmp_path_factory.mktemp("real")),
    }
    three = launch(
        WORKER,
        3,
        timeout=900,
        env=env,
        only=["logits_tp1pp1", "logits_tp3pp1", "roundtrip_tp3", "neighbors_tp3"],
    )
    return {
        **three,
        **launch(
            WORKER,
            2,
            timeout=600,
            env=env,
            only=[
                "logits_tp1pp2",
                "tied_grad_tp2pp1",
                "tied_grad_tp1pp2",
                "special_anchors_tp1pp2",
            ],
        ),
    }


@pytest.mark.parametrize("layout", ["tp1pp1", "tp3pp1", "tp1pp2"])
def test_logits_match_transformers(results, layout):
    """Megatron fp32 logits on two real sentences vs transformers in float64: max |diff| at most
    4× transformers' own fp32 error (+1e-5), argmax agreement 100%. PP 2: the last stage's copy of
    the tied matrix equals the first stage's."""
    value = check(results, f"logits_{layout}")
    print(layout, value)


def test_roundtrip_bit_exact(results):
    assert check(results, "roundtrip_tp3") == 272


# TP 1 on this embedding: tests/test_neighbor_lookup.py (the full table = float64 at its anchors).
@pytest.mark.parametrize("tp", [3])
def test_neighbor_table_equals_brute_force(results, tp):
    value = check(results, f"neighbors_tp{tp}")
    print(tp, value)
    assert value["rows"] == 384


@pytest.mark.parametrize("layout", ["tp2pp1", "tp1pp2"])
def test_tied_matrix_gradient_from_both_uses(results, layout):
    """Tiny tied Llama, mixing replayed: the one matrix's gradient (input, mixture rows and output
    layer; at PP 2 the two stages' copies summed) = float64 transformers within 1e-5 relative."""
    value = check(results, f"tied_grad_{layout}")
    assert value["mixture_rows_nonzero"]


def test_special_anchors_stay_unmixed_in_a_real_rollout(results):
    """mixing.skip_special_anchors on the real model (tests/dist/real_model_worker.py)."""
    print(check(results, "special_anchors_tp1pp2"))
