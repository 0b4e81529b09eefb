"""Distributed-optimizer checkpoints reshard: saved at 2 ranks (DP 2, TP 2), resumed at DP 4,
TP 2 × DP 2 and TP 1 × DP 2 (tests/dist/checkpoint_worker.py: real torchrun + gloo, megatron
DDP + distributed Adam, tiny Qwen2). A resumed run's next update equals the saving layout's own
continuation: the loss of the updated model and every parameter.

Tolerances: the layouts add the same numbers in another order (DP gradient reduction over 2 or 4
ranks, TP partial sums of the row-parallel matmuls), so losses differ by fp32 rounding: ≈1e-7
relative (eps 6e-8 per operation, errors averaging over the 128 tokens); LOSS_RTOL = 1e-6. Adam's
update is lr · m / (√v + eps) per element, at most ≈ lr in size; rounding moves it by a tiny
fraction of that, except for elements whose gradient is itself at rounding level, where the
ratio's sign is noise. PARAM_ATOL = lr / 100. The control (the same resume with a fresh optimizer,
what was lost before) moves the next loss by ≈ 7e-5 relative and parameters by ≈ lr.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ngrpo.testing.multiproc import check, launch

WORKER = Path(__file__).parent / "dist" / "checkpoint_worker.py"
LR = 1e-2  # the worker's
LOSS_RTOL = 1e-6
PARAM_ATOL = LR / 100


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("distopt")
    saved = launch(
        WORKER, 2, timeout=600, env={"NGRPO_CKPT_DIR": str(root), "NGRPO_CKPT_PHASE": "save"}
    )
    resumed = launch(
        WORKER, 4, timeout=600, env={"NGRPO_CKPT_DIR": str(root), "NGRPO_CKPT_PHASE": "resume"}
    )
    return {**saved, **resumed}


def _max_param_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys() and len(want) == 10  # 2 layers, stacked
    diff = max(float((torch.tensor(got[k]) - torch.tensor(want[k])).abs().max()) for k in want)
    assert diff == diff, "a parameter was not assembled (NaN)"
    return diff


def test_same_layout_resume_is_bit_identical(results):
    assert check(results, "dp2_resume_dp2") == check(results, "dp2_save")


@pytest.mark.parametrize(
    "saved,resumed",
    [
        ("dp2_save", "dp2_resume_dp4"),
        ("dp2_save", "dp2_resume_tp2_dp2"),
        ("tp2_save", "tp2_resume_tp1_dp2"),
    ],
)
def test_resharded_resume_continues_the_run(results, saved, resumed):
    want, got = check(results, saved), check(results, resumed)
    assert got["steps"] == want["steps"] == [3.0]  # Adam's step counts came back
    assert got["before"] == pytest.approx(want["before"], rel=LOSS_RTOL, abs=0)  # the model did
    assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL, abs=0)
    assert _max_param_diff(got["params"], want["params"]) < PARAM_ATOL


def test_resume_without_optimizer_state_differs(results):
    """The control: the comparisons above can fail."""
    want, got = check(results, "dp2_save"), check(results, "dp2_resume_dp4_without_optimizer_state")
    assert abs(got["loss"] - want["loss"]) > 10 * LOSS_RTOL * abs(want["loss"])
    assert _max_param_diff(got["params"], want["params"]) > 10 * PARAM_ATOL
