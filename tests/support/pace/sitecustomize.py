"""On PYTHONPATH with ``$NGRPO_STEP_PACE_S`` set, every Python process (the trainer's ranks among
them) runs each GRPO step after that many seconds of sleep: a test's time limit then cuts a run
into allocations of a bounded number of steps, whatever the machine's speed. The trainer is the
real entry point (``python -m megatron_ngrpo.train``, so the launcher renders its pre-flight,
signal and chain); the sleep comes before the step's rollout, after the previous step's
checkpoint, and changes no number the run computes."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time

PACE_VAR = "NGRPO_STEP_PACE_S"
TRAINER = "megatron_ngrpo.training.trainer"


def _pace(module) -> None:
    step = module.Trainer.train_step

    def train_step(self):
        time.sleep(float(os.environ[PACE_VAR]))
        return step(self)

    module.Trainer.train_step = train_step


class _PaceTrainer(importlib.abc.MetaPathFinder):
    """Patches the trainer module right after it is first executed."""

    def find_spec(self, name, path, target=None):
        if name != TRAINER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _pace(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(PACE_VAR):
    sys.meta_path.insert(0, _PaceTrainer())
