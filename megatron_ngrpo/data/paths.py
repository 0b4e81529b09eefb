"""Where data files are found: the repository's own ``data/`` folder, then ``$NGRPO_SHARED/data``
when that variable is set (an optional extra location, never needed by the shipped configs)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_DATA = Path(__file__).resolve().parents[2] / "data"


def data_dirs() -> list[Path]:
    """The data folders searched, in order."""
    extra = os.environ.get("NGRPO_SHARED")
    return [REPO_DATA] + ([Path(extra) / "data"] if extra else [])


def find_data(relative: str | Path) -> Path | None:
    """The first ``<data folder>/relative`` that exists, else None."""
    for folder in data_dirs():
        if (folder / relative).exists():
            return folder / relative
    return None


def searched(relative: str | Path) -> str:
    """Where ``relative`` was looked for, for error messages."""
    return ", ".join(str(folder / relative) for folder in data_dirs())
