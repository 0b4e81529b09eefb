"""Dynamic sampling (DAPO, grpo/dynamic_sampling.py): the choice of groups, and 2-process runs of
configs/tiny_test.yaml where some groups' rewards are uniform (the soft overlong penalty on a
random model: a group whose four responses all run to the length limit scores -1 four times),
refilled to full batches (with a mismatch correction and both trackers on); a reward uniform
everywhere exhausts the rounds (one-line error, or a logged partial batch)."""

from __future__ import annotations

import json
import re

import test_train
from test_train import _finish, _launch

from megatron_ngrpo.grpo.dynamic_sampling import choose_groups

task = test_train.task  # the arithmetic task fixture (module scope)
DS = ("train.dynamic_sampling.enabled=true", "train.max_steps=3", "train.save_every=0")


def test_choose_groups_keeps_the_first_informative_groups_in_draw_order():
    informative = [[False, True, False, True], [True, False, True, True]]
    assert choose_groups(informative, 3) == [[1, 3], [0]]
    # Short: the informative ones, then the first uniform ones.
    assert choose_groups([[False, True], [False, False]], 3) == [[0, 1], [0]]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_refills_batches_with_informative_groups(task, tmp_path):
    run = tmp_path / "ds"
    run.mkdir()
    # Also on: a mismatch correction (its keep mask through real micro-batches) and both trackers.
    _finish(
        _launch(
            task,
            run,
            *DS,
            "train.dynamic_sampling.max_gen_batches=8",
            "grpo.mismatch.mode=icepop",
            "train.trackers.wandb=true",
            "train.trackers.mlflow=true",
        ),
        run,
    )
    rows = _rows(run)
    assert len(rows) == 3
    assert set(json.loads((run / "trackers.json").read_text())) == {"wandb", "mlflow"}
    for r in rows:  # mixing at rate 0.3: both kinds of positions; the built-in engine = the trainer
        assert r["mismatch/mixed/logprob_gap"] < 1e-4 and r["mismatch/plain/logprob_gap"] < 1e-4, r
        assert r["mismatch/all/masked_frac"] == 0 and r["mixing/mixed_token_frac"] > 0, r
    assert all(r["filtered_frac"] == 0 and r["dynamic_sampling/partial"] == 0 for r in rows), rows
    # Some first round had a uniform group, so a second round was generated.
    assert max(r["dynamic_sampling/gen_batches"] for r in rows) > 1, rows


def test_exhausted_rounds_error_or_partial(task, tmp_path):
    flat = ("reward.overlong=none",)  # a random model is never right: every reward is 0
    err = tmp_path / "err"
    err.mkdir()
    proc = _launch(task, err, *DS, *flat, "train.dynamic_sampling.max_gen_batches=2")
    assert proc.wait(timeout=300) != 0
    log = (tmp_path / "err.log").read_text()
    assert (
        "error: dynamic sampling: 0 groups with differing rewards after 2 generation rounds" in log
    ), log[-3000:]
    # The ranks exit with status 3 (train.py); torchrun itself exits 1 and names the rank's status.
    root_cause = log.split("Root Cause (first observed failure):")[-1]
    assert re.search(r"exitcode\s*:\s*3 ", root_cause), log[-3000:]

    part = tmp_path / "part"
    part.mkdir()
    _finish(
        _launch(
            task,
            part,
            *DS,
            *flat,
            "train.dynamic_sampling.max_gen_batches=2",
            "train.dynamic_sampling.on_exhausted=partial",
        ),
        part,
    )
    rows = _rows(part)
    assert [r["dynamic_sampling/partial"] for r in rows] == [1, 1, 1]
    assert all(r["dynamic_sampling/gen_batches"] == 2 and r["filtered_frac"] == 1 for r in rows), (
        rows
    )
    assert "partial batch, 0 of 2 groups per rank" in (tmp_path / "part.log").read_text()
