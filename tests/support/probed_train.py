"""``python -m tests.support.probed_train [arguments of megatron_ngrpo.train]``: the training
entry point under two test-side probes.

- The save gate (``$NGRPO_SAVE_GATE`` set): every checkpoint writer is held until the test opens
  its gate, so a test can tell whether training went on while a save was being written
  (train.async_save) or waited for it. The writer of megatron's dist-checkpointing
  (``FileSystemWriterAsync.write_preloaded_data_multiproc``, run in the forked writer process of
  an asynchronous save and in the trainer itself for a synchronous one) waits until
  ``$NGRPO_SAVE_GATE/<iter_NNNNNNN>`` exists for the checkpoint it writes; :class:`SaveGatekeeper`
  opens the gates from the test process.
- Process-group timeouts: when ``Trainer.run`` returns, each rank writes the timeout of every
  process group it holds to ``<run_dir>/group_timeouts.<rank>.json``.
- A signal at a known point (``$NGRPO_SIGNAL_AT`` = ``<rank>:<step>``): rank ``<rank>`` sends
  itself SIGUSR1 as step ``<step>``'s update starts, i.e. after the step's rollout stage launched
  the one-step-off producer's next batch, while it is generated.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

GATE_VAR = "NGRPO_SAVE_GATE"
SIGNAL_VAR = "NGRPO_SIGNAL_AT"


class SaveGatekeeper:
    """Opens the gate of the save at step ``s`` once the metrics row of step ``s + 1`` is written
    (training went on while the save was held: ``overlapped[s]`` True) or after ``patience``
    seconds without it (it did not: False); the gate of the last step's save opens with its row.
    Runs on a thread until :meth:`close`."""

    def __init__(self, run_dir: Path, gate: Path, saves: list[int], last: int, patience=60.0):
        self.metrics, self.gate, self.last = run_dir / "metrics.jsonl", gate, last
        self.overlapped: dict[int, bool] = {}
        self._pending = sorted(saves)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(patience,), daemon=True)
        self._thread.start()

    def _steps(self) -> set[int]:
        try:
            lines = self.metrics.read_text().splitlines()
        except FileNotFoundError:
            return set()
        return {json.loads(line)["step"] for line in lines if line.endswith("}")}

    def _run(self, patience: float) -> None:
        while self._pending and not self._stop.is_set():
            s = self._pending[0]
            wanted = s if s == self.last else s + 1
            deadline = time.monotonic() + patience
            while wanted not in self._steps() and time.monotonic() < deadline:
                if self._stop.wait(0.05):
                    return
            if s != self.last:
                self.overlapped[s] = wanted in self._steps()
            (self.gate / f"iter_{s:07d}").touch()
            self._pending.pop(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _hold_writers(gate: Path) -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    write = FileSystemWriterAsync.write_preloaded_data_multiproc

    def held(transform_list, use_msc, rank, write_buckets, results_queue):
        names = {
            m.group(0) for b in write_buckets for m in [re.search(r"iter_\d+", str(b[0]))] if m
        }
        deadline = time.monotonic() + 600  # a test that died leaves no writer behind for long
        while not all((gate / n).exists() for n in names) and time.monotonic() < deadline:
            time.sleep(0.02)
        return write(transform_list, use_msc, rank, write_buckets, results_queue)

    FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(held)


def _record_group_timeouts() -> None:
    import torch.distributed as dist

    from megatron_ngrpo.training.trainer import Trainer
    from tests.harness.multiproc import group_timeouts

    run = Trainer.run

    def recorded(self):
        run(self)
        out = Path(self.cfg.train.run_dir) / f"group_timeouts.{dist.get_rank()}.json"
        out.write_text(json.dumps(group_timeouts()))

    Trainer.run = recorded


def _signal_at(rank: int, step: int) -> None:
    import torch.distributed as dist

    from megatron_ngrpo.training.trainer import Trainer

    update = Trainer._update

    def signalled(self, batch):
        if dist.get_rank() == rank and self.step + 1 == step:
            os.kill(os.getpid(), signal.SIGUSR1)
        return update(self, batch)

    Trainer._update = signalled


if __name__ == "__main__":
    from megatron_ngrpo.train import main

    if GATE_VAR in os.environ:
        _hold_writers(Path(os.environ[GATE_VAR]))
    if SIGNAL_VAR in os.environ:
        _signal_at(*map(int, os.environ[SIGNAL_VAR].split(":")))
    _record_group_timeouts()
    sys.exit(main(sys.argv[1:]))
