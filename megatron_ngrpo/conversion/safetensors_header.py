"""Whether a safetensors file can be read, from its header alone (no tensor is loaded).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (name ->
``{"dtype", "shape", "data_offsets": [begin, end]}``, plus ``__metadata__``), then the data. A
file cut short (an interrupted copy, a full disk) keeps a valid header and loses the data at its
end: the file must be at least 8 + N + the largest ``end``. Pre-flight runs this on every node
before any process group starts; :class:`~megatron_ngrpo.conversion.hf_io.HFCheckpoint` before it
opens a file, so a bad file is one line naming it instead of a traceback per rank.
"""

from __future__ import annotations

import json
from pathlib import Path


def problem(path: Path) -> str | None:
    """One line naming ``path`` and what makes it unreadable, or None."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path}: {size} bytes, shorter than a safetensors header"
            length = int.from_bytes(head, "little")
            if 8 + length > size:
                return f"{path}: header of {length} bytes in a file of {size}: truncated or not safetensors"
            header = json.loads(f.read(length))
    except OSError as e:
        return f"{path}: cannot be read ({e.strerror or e})"
    except ValueError as e:  # UnicodeDecodeError, json.JSONDecodeError
        return f"{path}: the safetensors header is not JSON ({' '.join(str(e).split())[:80]})"
    try:
        end = max(
            (int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"),
            default=0,
        )
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        return f"{path}: the safetensors header has no valid data_offsets"
    if 8 + length + end > size:
        return f"{path}: {size} bytes, its tensors end at byte {8 + length + end}: truncated"
    return None


def directory_problems(path: str | Path) -> list[str]:
    """:func:`problem` of every ``*.safetensors`` file in directory ``path`` (none if it is not
    a directory: the config's own validation names that)."""
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    return [p for p in map(problem, files) if p]
