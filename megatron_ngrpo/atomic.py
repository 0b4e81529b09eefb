"""Atomic writes: a file or directory appears whole under its final name or not at all, so a killed
run never leaves a half-written checkpoint, report or weight file behind (written to a temporary
sibling, then renamed: a rename within one directory is atomic on POSIX file systems)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from megatron_ngrpo.parallel import barrier, is_rank0


@contextlib.contextmanager
def atomic_file(path: str | Path):
    """Yield a temporary sibling path of ``path`` for a writer that takes a file name (e.g.
    safetensors' ``save_file``); rename it to ``path`` when the block ends without error."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def atomic_directory(final: str | Path, overwrite: bool = False, collective: bool = True):
    """Yield an empty temporary sibling of ``final``; rename it to ``final`` when the block ends
    without error, remove it otherwise. ``collective``: every rank enters (rank 0 manages the
    directory; barriers around), else only the calling process. Raises FileExistsError when
    ``final`` exists and not ``overwrite``."""
    tmp = begin_directory(final, overwrite, collective)
    manager = is_rank0() or not collective
    try:
        yield tmp
        if collective:
            barrier()
    except BaseException:
        if manager:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_directory(tmp, final, collective)


def begin_directory(final: str | Path, overwrite: bool = False, collective: bool = True) -> Path:
    """The first half of :func:`atomic_directory` for writers that finish later (megatron's
    asynchronous checkpoint save): an empty temporary sibling of ``final``, to be handed to
    :func:`commit_directory` once it is complete."""
    final = Path(final)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final}: output exists (pass overwrite to replace it)")
    tmp = final.parent / f".{final.name}.partial"
    if is_rank0() or not collective:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    if collective:
        barrier()
    return tmp


def commit_directory(tmp: Path, final: str | Path, collective: bool = True) -> None:
    """Rename the complete ``tmp`` (from :func:`begin_directory`) to ``final``, replacing it."""
    final = Path(final)
    if is_rank0() or not collective:
        old = final.parent / f".{final.name}.old"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    if collective:
        barrier()
