"""Test pacing of the trainer, for runs cut into Slurm allocations (tests/test_slurm_campaign.py).
On PYTHONPATH, every Python process imports it; it acts in the trainer's ranks only:

* ``$NGRPO_STEP_PACE_S``: each GRPO step starts after that many seconds of sleep;
* ``$NGRPO_STEPS_PER_ALLOCATION`` = K: after K steps in this process the step boundary waits
  for a planned stop (the warning signal, ``scancel``, or the allocation's deadline) instead of
  starting another step, so that an allocation gains at most K steps whatever the machine's
  speed.
* ``$NGRPO_HANG_AT`` (and ``$NGRPO_HANG_ONCE``): one rank hangs in a collective
  (tests/support/hung_train.py).

The trainer is the real entry point (``python -m megatron_ngrpo.train``, so the launcher renders
its pre-flight, signal and chain); neither changes a number the run computes."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time

PACE_VAR, CAP_VAR = "NGRPO_STEP_PACE_S", "NGRPO_STEPS_PER_ALLOCATION"
HANG_VAR = "NGRPO_HANG_AT"  # tests/support/hung_train.py's (this file runs before tests/ imports)
PATCHES = {}


def _pace_trainer(module) -> None:
    if os.environ.get(HANG_VAR):
        # lazy: only in a trainer told to hang; the trainer's modules are imported by now
        from tests.support.hung_train import hang_in_a_collective

        hang_in_a_collective(*map(int, os.environ[HANG_VAR].split(":")))
    step = module.Trainer.train_step

    def train_step(self):
        time.sleep(float(os.environ.get(PACE_VAR) or 0))
        return step(self)

    module.Trainer.train_step = train_step


def _near(stop) -> bool:
    """StopControl.agreed's own deadline test (training/stop.py)."""
    return bool(stop.deadline and stop.recent and time.time() + stop.margin() > stop.deadline)


def _cap_steps(module) -> None:
    agreed, cap = module.StopControl.agreed, int(os.environ.get(CAP_VAR) or 0)
    seen = []

    def capped(self):
        seen.append(None)  # one call per step boundary; the first precedes step 1 of the process
        while cap and len(seen) > cap and not self.signal_name and not _near(self):
            time.sleep(0.2)
        return agreed(self)

    module.StopControl.agreed = capped


PATCHES["megatron_ngrpo.training.trainer"] = _pace_trainer
PATCHES["megatron_ngrpo.training.stop"] = _cap_steps


class _Patcher(importlib.abc.MetaPathFinder):
    """Patches a module of PATCHES right after it is first executed."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(PACE_VAR) or os.environ.get(CAP_VAR) or os.environ.get(HANG_VAR):
    sys.meta_path.insert(0, _Patcher())
