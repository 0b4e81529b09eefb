"""Shared pytest fixtures: paths to the shared data and per-session tiny models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("NGRPO_SHARED", REPO.parent / "shared"))
DATA = SHARED / "data"

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not DATA.is_dir():
        pytest.fail(f"shared data not found at {DATA} (set NGRPO_SHARED)")
    return DATA
