"""Experiment trackers (grpo/trackers.py): W&B in offline mode and MLflow with a local file store
get the scalars metrics.jsonl gets, and a resumed run continues the same tracker runs."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from megatron_ngrpo.config_loader import ConfigError, load
from megatron_ngrpo.grpo.metrics import MetricsWriter
from megatron_ngrpo.grpo.trackers import STEP_KEY, TrackersConfig, mlflow_key

pytest.importorskip("wandb")
pytest.importorskip("mlflow")


def _wandb_records(path: Path):
    """The protobuf records of an offline W&B run file: a 7-byte W&B header, then LevelDB log
    blocks of 32 KiB (7-byte record headers; full / first / middle / last fragments)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or kind == 0:
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def _wandb_history(run_dir: Path) -> tuple[set[str], list[dict]]:
    ids, rows = set(), []
    for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for rec in _wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
            elif kind == "history":
                row = {
                    (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                    for i in rec.history.item
                }
                rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return ids, rows


def test_wandb_and_mlflow_get_the_same_scalars_and_resume_the_same_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = TrackersConfig(wandb=True, mlflow=True, project="t")
    metrics = {
        s: {"loss": 0.5 / s, "reward/mean": 0.1 * s, "val/mean@4": 0.25 + s / 100}
        for s in (1, 2, 3, 4)
    }
    first = MetricsWriter(tmp_path, tensorboard=False, trackers=cfg, config={"seed": 1})
    for s in (1, 2, 3):
        first.write(s, metrics[s])
    first.close()
    # Resumed from the step-2 checkpoint: step 3 again, then 4.
    again = MetricsWriter(tmp_path, tensorboard=False, trackers=cfg)
    again.truncate(2)
    for s in (3, 4):
        again.write(s, metrics[s])
    again.close()
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl] == [1, 2, 3, 4]
    logged = [(s, metrics[s]) for s in (1, 2, 3, 3, 4)]

    ids, rows = _wandb_history(tmp_path)
    saved = json.loads((tmp_path / "trackers.json").read_text())
    assert ids == {saved["wandb"]}  # both processes wrote the same W&B run
    assert rows == [{STEP_KEY: s, **m} for s, m in logged]

    client = MlflowClient((tmp_path / "mlruns").as_uri())
    exp = client.get_experiment_by_name("t")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [saved["mlflow"]]
    assert runs[0].info.status == "FINISHED"
    for key in metrics[1]:
        history = client.get_metric_history(saved["mlflow"], mlflow_key(key))
        assert sorted((h.step, h.value) for h in history) == sorted(
            (s, m[key]) for s, m in logged
        ), key
    assert mlflow_key("val/mean@4") == "val/mean_4"


def test_tracker_config_errors():
    with pytest.raises(ConfigError, match="'wandb_mode' = 'cloud'"):
        load(TrackersConfig, None, ["wandb_mode=cloud"])


def test_run_name_mode_and_mlflow_uri_reach_the_trackers(tmp_path, monkeypatch):
    """trackers.run_name names both runs (default: the run dir's name), wandb_mode is W&B's mode
    (online needs its service: W&B's init is recorded instead of run), mlflow_uri the store."""
    import wandb
    from mlflow.tracking import MlflowClient

    calls = []

    class _Run:
        id = "fake"

        def define_metric(self, *args, **kwargs):
            pass

        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs) or _Run())
    store = tmp_path / "elsewhere"
    named = TrackersConfig(
        wandb=True, mlflow=True, run_name="named", wandb_mode="online", mlflow_uri=store.as_uri()
    )
    for cfg, run_dir in ((TrackersConfig(wandb=True), tmp_path / "a"), (named, tmp_path / "b")):
        run_dir.mkdir()
        MetricsWriter(run_dir, tensorboard=False, trackers=cfg).close()
    assert [(c["name"], c["mode"]) for c in calls] == [("a", "offline"), ("named", "online")]
    client = MlflowClient(store.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("megatron_ngrpo").experiment_id])
    assert run.info.run_name == "named" and not (tmp_path / "b" / "mlruns").exists()


def test_a_planned_stop_is_told_to_the_trackers(tmp_path, monkeypatch):
    """A planned stop (training/stop.py) ends the W&B run cleanly with a ``preempted`` tag and
    its reason in the summary, the MLflow run KILLED with a ``stop`` tag; a resumed run is
    RUNNING again."""
    import wandb
    from mlflow.tracking import MlflowClient

    class _Run:
        id, tags, summary, finished = "fake", ("x",), {}, 0

        def define_metric(self, *args, **kwargs):
            pass

        def finish(self):
            self.finished += 1

    run = _Run()
    monkeypatch.setattr(wandb, "init", lambda **kwargs: run)
    cfg = TrackersConfig(wandb=True, mlflow=True, project="t")
    MetricsWriter(tmp_path, tensorboard=False, trackers=cfg).close("signal:SIGUSR1")
    assert run.tags == ("x", "preempted") and run.summary == {"stop": "signal:SIGUSR1"}
    assert run.finished == 1
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    mlflow_run = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    got = client.get_run(mlflow_run)
    assert got.info.status == "KILLED" and got.data.tags["stop"] == "signal:SIGUSR1"
    MetricsWriter(tmp_path, tensorboard=False, trackers=cfg)  # resumed, still running
    assert client.get_run(mlflow_run).info.status == "RUNNING"
