"""Each worker's exit status, left for the launcher that started it (launch/torchrun.py).

torchrun ends with status 1 whatever status its workers ended with (and with a traceback when it
handled a signal itself), so a planned stop's 75 ("continue", training/stop.py) and the
watchdog's 76 (training/watchdog.py) never reach whoever ran it. When ``$NGRPO_OUTCOME_DIR`` is
set, each worker writes its status to ``<dir>/rank<RANK>`` as it exits. Standard library only:
the watchdog writes it from its monitor thread just before ``os._exit``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

OUTCOME_ENV = "NGRPO_OUTCOME_DIR"


def write(code: int, env=os.environ) -> None:
    """Leave this worker's status ``code`` where the launcher reads it (nothing when unset)."""
    directory = env.get(OUTCOME_ENV)
    if directory:
        with contextlib.suppress(OSError):  # the status itself is what the process exits with
            (Path(directory) / f"rank{env.get('RANK', '0')}").write_text(f"{code}\n")


def read(directory: str | Path) -> dict[int, int]:
    """The statuses the workers left in ``directory``, by global rank."""
    codes = {}
    for path in Path(directory).glob("rank*"):
        with contextlib.suppress(ValueError, OSError):
            codes[int(path.name[4:])] = int(path.read_text())
    return codes
