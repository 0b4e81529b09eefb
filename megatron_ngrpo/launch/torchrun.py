"""``python -m megatron_ngrpo.launch.torchrun [torchrun's options] -m megatron_ngrpo.train ...``:
torchrun whose exit status says what the trainer's workers on this node said.

torchrun ends with status 1 when any worker ends with a status but 0, and with a traceback
(status 1) when it handled a signal itself, passed it on and waited for its workers: a planned
stop's 75 ("saved, run again to continue", training/stop.py) is lost to whoever runs torchrun by
hand. This runs torchrun in-process with ``$NGRPO_OUTCOME_DIR`` set (training/outcome.py), then
maps: 76 when a worker ended by the watchdog, 75 when every worker of this node stopped as
planned, else torchrun's own outcome, unchanged. Signals are handled as in the rendered Slurm
scripts (launch/executors.py ``stop_signal_env``, unless set): torchrun passes SIGUSR1 to its
workers instead of dying of it, and waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (here 300 s, not 30)
for them to save before SIGKILL. The Slurm chain needs none of this (it reads ``allocations.jsonl``, and
``afternotok`` starts the next allocation for 1 as for 75).
"""

from __future__ import annotations

import os
import sys
import tempfile

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from megatron_ngrpo.training import outcome
from megatron_ngrpo.training.stop import EXIT_CONTINUE
from megatron_ngrpo.training.watchdog import EXIT_WATCHDOG

# torchrun's own options from the environment (launch/executors.py sets them in Slurm scripts)
STOP_ENV = {
    "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300",
}


def node_status(codes: dict[int, int], nproc: int) -> int | None:
    """This node's status from its workers' ``codes`` (by rank), or None: torchrun's stands."""
    if EXIT_WATCHDOG in codes.values():  # the others were hung: killed, or leaving with 76
        return EXIT_WATCHDOG
    if len(codes) == nproc and set(codes.values()) == {EXIT_CONTINUE}:
        return EXIT_CONTINUE
    return None


def main(argv: list[str] | None = None) -> int:
    for name, value in STOP_ENV.items():  # read as torchrun's option defaults
        os.environ.setdefault(name, value)
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    nproc = torchrun.determine_local_world_size(args.nproc_per_node)
    with tempfile.TemporaryDirectory(prefix="ngrpo-outcome-") as directory:
        os.environ[outcome.OUTCOME_ENV] = directory
        try:
            torchrun.run(args)
        except (ChildFailedError, SignalException) as e:
            status = node_status(outcome.read(directory), nproc)
            if status is None:
                raise
            what = "stopped as planned" if status == EXIT_CONTINUE else "ended by the watchdog"
            print(
                f"torchrun: the workers {what} ({type(e).__name__}): exit {status}", file=sys.stderr
            )
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
