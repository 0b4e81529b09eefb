"""A run directory's checkpoint files, and whether a checkpoint is complete: the standard library
only, so that the trainer (training/checkpoint.py) and the Slurm chain (launch/chain.py, run on a
batch host without torch) judge a checkpoint by one function.

A checkpoint is ``<run_dir>/iter_<step>/``: its metadata (``META_FILE``), the data, and a manifest
(``MANIFEST_FILE``: every file's size, written at the atomic commit, atomic.py); ``<run_dir>/latest``
names the newest published one."""

from __future__ import annotations

import json
from pathlib import Path

META_FILE = "megatron_ngrpo.json"
LATEST_FILE = "latest"
# every file's size, written at the commit (atomic.py): a reader finds a truncated checkpoint
MANIFEST_FILE = "manifest.json"


def read_manifest(directory: str | Path, manifest: str) -> str | None:
    """None when every file ``directory/manifest`` lists is there with its size; else what is
    wrong, naming the file (the manifest itself when missing or unreadable)."""
    directory = Path(directory)
    try:
        sizes = json.loads((directory / manifest).read_text())["files"]
    except FileNotFoundError:
        return f"{directory / manifest}: missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{directory / manifest}: unreadable ({type(e).__name__})"
    for name, size in sizes.items():
        f = directory / name
        if not f.is_file():
            return f"{f}: missing"
        if f.stat().st_size != size:
            return f"{f}: {f.stat().st_size} bytes, {size} written"
    return None


def iter_dirs(run_dir: Path) -> list[Path]:
    """The run's ``iter_<step>`` folders, oldest first."""
    return sorted(p for p in run_dir.glob("iter_*") if p.is_dir() and p.name[5:].isdigit())


def has_manifests(run_dir: Path) -> bool:
    """Whether this run writes manifests (any of its checkpoints has one): then a checkpoint
    without one lost it."""
    return any((p / MANIFEST_FILE).is_file() for p in iter_dirs(run_dir))


def verify_checkpoint(path: str | Path) -> str | None:
    """None when ``path`` is a complete checkpoint: its metadata parses and every file its
    manifest lists is there with the size written (checkpoints from before manifests: the
    metadata only); else one line naming the file at fault."""
    path = Path(path)
    meta = path / META_FILE
    try:
        json.loads(meta.read_text())
    except FileNotFoundError:
        return f"{meta}: missing"
    except (OSError, ValueError) as e:
        return f"{meta}: unreadable ({type(e).__name__}: {str(e).splitlines()[0]})"
    if not (path / MANIFEST_FILE).is_file() and not has_manifests(path.parent):
        return None  # written before manifests existed
    return read_manifest(path, MANIFEST_FILE)
