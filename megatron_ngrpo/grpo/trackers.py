"""Experiment trackers beside ``metrics.jsonl`` and TensorBoard: Weights & Biases and MLflow.

Every tracker gets the scalars ``metrics.jsonl`` gets, keyed by the training step. A resumed run
continues the same tracker run: the run ids are kept in ``run_dir/trackers.json``. Steps a killed
run had logged after its last checkpoint are logged again by the resumed one (the trackers keep
both points; ``metrics.jsonl`` is truncated instead). W&B plots against the ``train/step``
metric, not its own monotonic ``_step`` counter, which would drop the repeated steps. MLflow
metric names allow letters, digits and ``_-. /`` only: other characters become ``_``
(``val/mean@4`` -> ``val/mean_4``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_ngrpo.config_loader import fail

IDS_FILE = "trackers.json"
STEP_KEY = "train/step"


@dataclass
class TrackersConfig:
    wandb: bool = False
    mlflow: bool = False
    project: str = "megatron_ngrpo"
    # Tracker run name; "" = the run directory's name.
    run_name: str = ""
    # W&B: "offline" (files under run_dir/wandb, `wandb sync` uploads them) or "online".
    wandb_mode: Literal["offline", "online"] = "offline"
    # MLflow tracking URI; "" = a local file store under run_dir/mlruns.
    mlflow_uri: str = ""

    def validate(self) -> None:
        if not self.project:
            fail("project", self.project, "required")
        for name in ("wandb", "mlflow"):
            if getattr(self, name):
                _require(name)


def _require(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        fail(
            name,
            True,
            f"the {name} package is not installed (pip install 'megatron_ngrpo[trackers]')",
        )


def mlflow_key(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", key)


class Trackers:
    """The configured trackers of one run (global rank 0 only). ``config``: the resolved job
    config as a dict (W&B run config)."""

    def __init__(self, cfg: TrackersConfig, run_dir: str | Path, config: dict | None = None):
        self.run_dir = Path(run_dir)
        ids_path = self.run_dir / IDS_FILE
        ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
        name = cfg.run_name or self.run_dir.resolve().name
        self._wandb = self._mlflow = None
        if cfg.wandb:
            # lazy: wandb is optional (the trackers extra)
            import wandb  # optional dependency (the trackers extra)

            self._wandb = wandb.init(
                project=cfg.project,
                name=name,
                dir=str(self.run_dir),
                mode=cfg.wandb_mode,
                id=ids.get("wandb"),
                resume="allow",
                config=config,
            )
            self._wandb.define_metric(STEP_KEY)
            self._wandb.define_metric("*", step_metric=STEP_KEY)
            ids["wandb"] = self._wandb.id
        if cfg.mlflow:
            uri = cfg.mlflow_uri or (self.run_dir.resolve() / "mlruns").as_uri()
            if uri.startswith("file:"):
                # MLflow 3 keeps the file store but refuses it unless asked (maintenance mode).
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            # Optional dependency (the trackers extra).
            # lazy: mlflow is optional (the trackers extra)
            from mlflow.tracking import MlflowClient

            self._mlflow = MlflowClient(uri)
            if "mlflow" not in ids:
                exp = self._mlflow.get_experiment_by_name(cfg.project)
                exp_id = exp.experiment_id if exp else self._mlflow.create_experiment(cfg.project)
                ids["mlflow"] = self._mlflow.create_run(exp_id, run_name=name).info.run_id
            self._mlflow_run = ids["mlflow"]
            self._mlflow.update_run(self._mlflow_run, status="RUNNING")
        if ids:
            ids_path.write_text(json.dumps(ids) + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._wandb is not None:
            self._wandb.log({STEP_KEY: step, **metrics})
        if self._mlflow is not None:
            # lazy: mlflow is optional (the trackers extra)
            from mlflow.entities import Metric  # optional (the trackers extra)

            now = int(time.time() * 1000)
            self._mlflow.log_batch(
                self._mlflow_run,
                metrics=[Metric(mlflow_key(k), float(v), now, step) for k, v in metrics.items()],
            )

    def close(self, stopped: str | None = None) -> None:
        """End the tracker runs; ``stopped``: a planned stop's reason (training/stop.py), recorded
        as ``stop`` (W&B summary, MLflow tag) with a ``preempted`` W&B tag, the run ending
        cleanly (W&B exit code 0; MLflow KILLED, RUNNING again when the run resumes)."""
        if self._wandb is not None:
            if stopped:
                self._wandb.summary["stop"] = stopped
                self._wandb.tags = (*(self._wandb.tags or ()), "preempted")
            self._wandb.finish(exit_code=0)
            self._wandb = None
        if self._mlflow is not None:
            if stopped:
                self._mlflow.set_tag(self._mlflow_run, "stop", stopped)
            self._mlflow.set_terminated(self._mlflow_run, "KILLED" if stopped else "FINISHED")
            self._mlflow = None
