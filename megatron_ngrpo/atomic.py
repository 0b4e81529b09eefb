"""Atomic, durable writes: a file or directory appears whole under its final name or not at all, so
a killed run never leaves a half-written checkpoint, report or weight file behind (written to a
temporary sibling, then renamed: a rename within one directory is atomic on POSIX file systems).

A rename alone is atomic against a killed process, not against a node crash: the file system may
persist the rename before the data. So the data are fsynced before the rename and the parent
directory after it; a crash then leaves the old name or the complete new one (and a later write
that names it, e.g. a checkpoint's ``latest``, is only made after that). A committed directory can
carry a manifest (every file's size, :func:`megatron_ngrpo.checkpoint_files.read_manifest`) that a reader checks to find a
checkpoint truncated or missing a file."""

from __future__ import annotations

import contextlib
import json
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
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def atomic_directory(
    final: str | Path, overwrite: bool = False, collective: bool = True, manifest: str = ""
):
    """Yield an empty temporary sibling of ``final``; rename it to ``final`` when the block ends
    without error, remove it otherwise. ``collective``: every rank enters (rank 0 manages the
    directory; barriers around), else only the calling process. Raises FileExistsError when
    ``final`` exists and not ``overwrite``. ``manifest``: a file name to list the directory's
    files in (:func:`commit_directory`)."""
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
    commit_directory(tmp, final, collective, manifest)


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


def commit_directory(
    tmp: Path, final: str | Path, collective: bool = True, manifest: str = ""
) -> None:
    """Rename the complete ``tmp`` (from :func:`begin_directory`) to ``final``, replacing it:
    its files and folders fsynced first (and, with ``manifest``, listed with their sizes in a
    file of that name), the parent directory after."""
    final = Path(final)
    if is_rank0() or not collective:
        sizes = {}
        for f in sorted(tmp.rglob("*")):
            fsync_path(f)
            if f.is_file():
                sizes[f.relative_to(tmp).as_posix()] = f.stat().st_size
        if manifest:
            with atomic_file(tmp / manifest) as t:
                t.write_text(json.dumps({"files": sizes}, indent=0) + "\n")
        fsync_path(tmp)
        old = final.parent / f".{final.name}.old"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        fsync_path(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    if collective:
        barrier()


def fsync_path(path: str | Path) -> None:
    """Flush a file's or directory's data and metadata to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
