"""One-step-off rollouts (training/async_rollout.py): the staleness rule and the policy-version
field, plus one 2-process TP=2 launch (tests/dist/async_worker.py): generation on the producer's
thread during an update, replay under the generating weights = the engine's log-probs, loss on
the stale batch = float64 reference. The trainer runs (every version = step − 1, kill + resume)
are in tests/test_train.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.rollout.types import RolloutBatch
from megatron_ngrpo.training.async_rollout import (
    InFlight,
    RolloutProducer,
    StaleRolloutError,
    check_staleness,
)
from tests.harness.multiproc import check, launch

WORKER = Path(__file__).parent / "dist" / "async_worker.py"


def test_staleness_is_refused_in_one_line_or_dropped():
    assert check_staleness(5, 4, 1, "error") and check_staleness(5, 5, 0, "error")
    assert check_staleness(5, 3, 1, "drop") is False
    with pytest.raises(StaleRolloutError) as err:
        check_staleness(5, 3, 1, "error")
    assert str(err.value) == (
        "rollout of policy version 3 at step 5: staleness 2 > train.async.max_staleness = 1"
    )


@pytest.mark.parametrize("on_stale", ["drop", "error"])
def test_producer_drops_and_counts_or_refuses_a_stale_batch(on_stale):
    producer = RolloutProducer(engine=None, max_staleness=1, on_stale=on_stale, keep_weights=False)
    producer._job = InFlight(
        version=3, examples=["p"], keys=[7], data_before={}, snapshot=None, rollout=_batch(3)
    )
    if on_stale == "error":
        with pytest.raises(StaleRolloutError, match="staleness 2"):
            producer.take(5)
        return
    job = producer.take(5)
    assert job.rollout is None and (job.examples, job.keys) == (
        ["p"],
        [7],
    )  # the trainer regenerates these
    assert producer.metrics(5, 5)["async/dropped"] == 1 and producer.take(6) is None


def _batch(version) -> RolloutBatch:
    return RolloutBatch(
        [[1, 2]], [[3]], [[-0.5]], ["stop"], MixRecord.empty(1, 2), [0], policy_version=version
    )


def test_policy_version_is_validated_and_kept():
    _batch(0).validate(10)
    _batch(None).validate(10)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="policy_version"):
            _batch(bad).validate(10)
    assert RolloutBatch.cat([_batch(3), _batch(3)]).policy_version == 3
    assert _batch(3).select_prompts([0]).policy_version == 3
    with pytest.raises(ValueError, match="different policy versions"):
        RolloutBatch.cat([_batch(3), _batch(4)])


@pytest.fixture(scope="module")
def dist_results():
    return launch(WORKER, nproc=2, timeout=600, only=["stale_batch_tp2"])


def test_stale_batch_replay_and_loss_match_float64_reference(dist_results):
    value = check(dist_results, "stale_batch_tp2")
    assert value["gap"] < 1e-5 and value["old_vs_float64"] < 1e-5 and value["mixed"] > 0
    assert value["loss_rel_err"] < 1e-5
