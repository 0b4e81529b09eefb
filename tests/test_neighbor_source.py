"""The one owner of the rollouts' neighbour source (training/neighbor_source.py): how
``mixing.neighbor_lookup`` resolves, that every weight sync is followed by the owner's source
(None too, so no earlier table survives), and a 2-rank run in which validation with mixing
(``mixing.at_eval``) is followed by training steps that still search rows on demand."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from test_train import _finish, _launch, task  # noqa: F401 (task: the module fixture)

from megatron_ngrpo.grpo.metrics import PhaseTimer
from megatron_ngrpo.mixing.config import MixingConfig
from megatron_ngrpo.mixing.neighbor_mode import resolve_mode
from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.rollout.types import RolloutBatch, RolloutEngine
from megatron_ngrpo.training.job_config import NGRPOConfig
from megatron_ngrpo.training.neighbor_source import NeighborSource
from megatron_ngrpo.training.rollout_stage import RolloutStage

V = 49152  # SmolLM2-135M's vocabulary


@pytest.mark.parametrize(
    "mixing,searches,positions,device,mode",
    [
        (MixingConfig(), True, 16 * 48, "cpu", "on_demand"),  # auto, cheap on CPU
        (MixingConfig(), True, 16 * 48, "cuda", "table"),  # auto: the table is cheap on a GPU
        (MixingConfig(), False, 16 * 48, "cpu", "table"),  # auto with rollout servers
        (MixingConfig(), True, 512 * 4096, "cpu", "table"),  # a 7B-scale step
        (MixingConfig(refresh_every=2), True, 16, "cpu", "table"),  # a table kept over updates
        (MixingConfig(neighbor_lookup="table"), True, 1, "cpu", "table"),
        (MixingConfig(neighbor_lookup="on_demand"), True, 10**9, "cuda", "on_demand"),
        (MixingConfig(strategy="stht"), True, 16, "cpu", "none"),
        (MixingConfig(rate=0.0), True, 16, "cpu", "none"),
    ],
)
def test_lookup_resolves_once_per_run(mixing, searches, positions, device, mode):
    assert resolve_mode(mixing, searches, positions, V, device) == mode


def test_on_demand_needs_an_engine_that_searches():
    with pytest.raises(ValueError, match="mixes with the trainer's table only"):
        resolve_mode(MixingConfig(neighbor_lookup="on_demand"), False, 16, V, "cpu")


class RecordingEngine(RolloutEngine):
    """Records syncs, the tables it is handed and the lookup each generate mixes with."""

    neighbors_on_demand = True

    def __init__(self):
        self.calls: list[tuple] = []

    def sync_weights(self, model_chunks) -> None:
        self.calls.append(("sync",))

    def set_neighbor_table(self, table) -> None:
        self.calls.append(("table", None if table is None else int(table.sum())))

    def generate(self, prompts, params, mixing=None, keys=None) -> RolloutBatch:
        self.calls.append(("generate", mixing.neighbor_lookup if mixing else None))
        return RolloutBatch(
            [list(p) for p in prompts],
            [[3]] * len(prompts),
            [[0.0]] * len(prompts),
            ["length"] * len(prompts),
            MixRecord.empty(len(prompts), 3),
            list(range(len(prompts))),
        )


def _stage(engine: RolloutEngine, neighbors: NeighborSource) -> RolloutStage:
    return RolloutStage(
        NGRPOConfig(),
        [],
        engine,
        None,
        None,
        None,
        neighbors,
        SimpleNamespace(eos_token_id=1),
        0,
        1,
        16,
        PhaseTimer(),
    )


def test_every_sync_is_followed_by_the_owners_source():
    engine = RecordingEngine()
    built = []

    def build():
        built.append(1)
        return torch.full((16, 3), len(built))

    # On demand: an earlier table handed to the engine (e.g. a validation pass) is cleared at the
    # next sync, and the engine is asked for "on_demand", never the unresolved "auto".
    rows = NeighborSource(MixingConfig(), "on_demand", build)
    engine.set_neighbor_table(torch.ones(16, 3))
    assert rows.refresh(0) is False and rows.table is None
    _stage(engine, rows).generate([[2, 3]], [0], step=0)
    assert engine.calls[1:] == [("sync",), ("table", None), ("generate", "on_demand")]
    assert not built

    # Table: computed when due (refresh_every 2), handed over after every sync.
    engine.calls.clear()
    table = NeighborSource(MixingConfig(refresh_every=2), "table", build)
    stage = _stage(engine, table)
    for updates in (0, 1, 2):
        table.refresh(updates)
        stage.generate([[2, 3]], [0], step=updates)
    assert len(built) == 2  # at updates 0 and 2
    assert engine.calls == [
        ("sync",),
        ("table", 48),
        ("generate", "table"),
        ("sync",),
        ("table", 48),
        ("generate", "table"),
        ("sync",),
        ("table", 96),
        ("generate", "table"),
    ]

    # No neighbour mixing: the engine holds no table either.
    engine.calls.clear()
    none = NeighborSource(MixingConfig(strategy="none"), "none", build)
    _stage(engine, none).generate([[2, 3]], [0], step=0)
    assert engine.calls == [("sync",), ("table", None), ("generate", None)]


def test_validation_then_training_searches_fresh_rows(task, tmp_path):  # noqa: F811
    """Validation with mixing at every step, then the next step's rollouts: each step's rollouts
    search rows on demand for their own weight version; no table is ever built."""
    run = tmp_path / "val"
    run.mkdir()
    _finish(
        _launch(
            task,
            run,
            "train.max_steps=3",
            "train.save_every=0",
            "mixing.neighbor_lookup=on_demand",
            "mixing.refresh_every=1",
            "mixing.at_eval=true",
            "validation.every=1",
            f"validation.benchmarks=[{task / 'heldout.jsonl'}]",
            "validation.limit=4",
            "validation.keep_best=false",
            "validation.sampling.n=1",
            "validation.sampling.max_new_tokens=6",
        ),
        run,
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["mixing/neighbor_rows_searched"] > 0 and r["mixing/table_refreshed"] == 0, r
        assert r["mixing/mixed_token_frac"] > 0 and "val/mean@1" in r, r
