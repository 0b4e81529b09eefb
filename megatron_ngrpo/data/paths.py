"""Where the shared data folder is: ``$NGRPO_SHARED/data``, default ``<repo>/../shared/data``."""

from __future__ import annotations

import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


def shared_data_dir() -> Path:
    return Path(os.environ.get("NGRPO_SHARED", _REPO.parent / "shared")) / "data"
