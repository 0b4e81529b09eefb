"""Per-step training metrics: phase timers, data-parallel reduction, JSONL + TensorBoard output.

Only global rank 0 writes; every rank takes part in the reductions.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

from megatron_ngrpo.atomic import atomic_write
from megatron_ngrpo.grpo.trackers import Trackers, TrackersConfig


class PhaseTimer:
    """Wall-clock seconds per named phase (``with timer("rollout"): ...``), summed per step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def reset(self) -> None:
        """Start a new step: forget the phases timed so far."""
        self.seconds = {}

    def report(self) -> dict[str, float]:
        return {f"time/{k}": v for k, v in self.seconds.items()}


def dp_sums(values: dict[str, float], group=None) -> dict[str, float]:
    """Sum each value over the data-parallel group (float64, one all-reduce)."""
    if not values:
        return {}
    # lazy: keeps grpo.metrics free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps

    # lazy: keeps grpo.metrics free of megatron-core at import (start-up)
    from megatron_ngrpo.compat.cpu import device

    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device())
    dist.all_reduce(t, group=group or ps.get_data_parallel_group())
    return dict(zip(keys, t.tolist()))


def dp_max(values: dict[str, float], group=None) -> dict[str, float]:
    if not values:
        return {}
    # lazy: keeps grpo.metrics free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps

    # lazy: keeps grpo.metrics free of megatron-core at import (start-up)
    from megatron_ngrpo.compat.cpu import device

    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group or ps.get_data_parallel_group())
    return dict(zip(keys, t.tolist()))


class MetricsWriter:
    """``metrics.jsonl`` (one object per step), TensorBoard scalars under ``run_dir`` and the
    configured experiment trackers (grpo/trackers.py: W&B, MLflow), the same scalars in each."""

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        trackers: TrackersConfig | None = None,
        config: dict | None = None,
    ):
        self.active = not dist.is_initialized() or dist.get_rank() == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = self._trackers = None
        if self.active:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            if trackers is not None and (trackers.wandb or trackers.mlflow):
                self._trackers = Trackers(trackers, run_dir, config)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._trackers is not None:
            self._trackers.log(step, metrics)

    def truncate(self, step: int) -> None:
        """Drop lines of steps after ``step`` (a resumed run rewrites them)."""
        if not self.active or not self.path.is_file():
            return
        keep = []
        for ln in self.path.read_text().splitlines():
            try:
                if json.loads(ln)["step"] <= step:
                    keep.append(ln)
            except (json.JSONDecodeError, KeyError, TypeError):
                pass  # a line cut short by a kill; its step is re-run
        atomic_write(self.path, "".join(ln + "\n" for ln in keep))

    def close(self, stopped: str | None = None) -> None:
        """``stopped``: the reason of a planned stop (training/stop.py), told to the trackers."""
        if self._tb is not None:
            self._tb.close()
        if self._trackers is not None:
            self._trackers.close(stopped)
            self._trackers = None
