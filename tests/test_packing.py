"""Sequence packing (grpo/packing.py): one 2-process launch (tests/dist/packing_worker.py)
comparing packed and unpacked log-probs and gradients at TP 1 / DP 2 and TP 2 + SP, and the
block-diagonal mask and index of a packed micro-batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ngrpo.grpo.packing import pack, unpack
from tests.harness.multiproc import check, launch

WORKER = Path(__file__).parent / "dist" / "packing_worker.py"
CASES = ["packed_tp1_dp2", "packed_tp2_sequence_parallel"]


@pytest.fixture(scope="module")
def results():
    return launch(WORKER, nproc=2, timeout=600)


@pytest.mark.parametrize("name", CASES)
def test_packed_logprobs_and_gradients_equal_unpacked(results, name):
    value = check(results, name)
    assert value["logprob_err"] < 1e-5 and value["grad_rel_err"] < 1e-5


def test_pack_mask_positions_and_unpack():
    tokens = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    kwargs, _, index = pack(tokens, torch.tensor([3, 2]), None, multiple=2, mode="mask")
    assert kwargs["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0]]
    assert kwargs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    allowed = ~kwargs["attention_mask"][0, 0]
    assert (
        allowed[2, :3].all()
        and not allowed[3, :3].any()
        and allowed[4, 3:5].all()
        and not allowed[1, 2]
    )
    out = unpack(kwargs["input_ids"].unsqueeze(-1).float(), index, 2, 4)
    assert out[..., 0].tolist() == [[5, 6, 7, 0], [8, 9, 0, 0]]
