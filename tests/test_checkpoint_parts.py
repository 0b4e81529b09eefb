"""Corrupt checkpoint parts and metadata, as conversion and ``ngrpo-eval`` read them
(conversion/checkpoint.py): one :class:`ConversionError` line naming the file, before anything is
loaded, instead of an ``EOFError`` / ``FileNotFoundError`` / ``JSONDecodeError`` traceback."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_ngrpo.conversion.checkpoint import META_FILE, check_parts, read_meta
from megatron_ngrpo.conversion.mapping import ConversionError


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A torch DCP checkpoint (the layout megatron-core's torch_dist format writes) + metadata."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: single-process save
        dcp.save({"w": torch.arange(4096.0), "b": torch.ones(64)}, checkpoint_id=str(tmp_path))
    (tmp_path / META_FILE).write_text(json.dumps({"iteration": 1}))
    return tmp_path


def _part(checkpoint: Path) -> Path:
    return next(checkpoint.glob("*.distcp"))


def test_an_intact_checkpoint_passes(checkpoint):
    check_parts(checkpoint)
    assert read_meta(checkpoint) == {"iteration": 1}


def test_a_truncated_or_missing_part_is_named(checkpoint):
    part = _part(checkpoint)
    size = part.stat().st_size
    part.write_bytes(part.read_bytes()[: size // 2])
    with pytest.raises(ConversionError, match=rf"^{part}: {size // 2} bytes, its tensors end at"):
        check_parts(checkpoint)
    part.unlink()
    with pytest.raises(ConversionError, match=rf"^{part}: missing \(the checkpoint's index"):
        check_parts(checkpoint)


def test_a_corrupt_index_or_metadata_is_named(checkpoint):
    index = checkpoint / ".metadata"
    index.write_bytes(index.read_bytes()[:20])
    with pytest.raises(ConversionError, match=rf"^{index}: unreadable checkpoint index"):
        check_parts(checkpoint)
    meta = checkpoint / META_FILE
    for text, why in (
        ("{not json", "unreadable checkpoint metadata"),
        ("[1]", "checkpoint metadata is not a JSON object"),
    ):
        meta.write_text(text)
        with pytest.raises(ConversionError) as e:
            read_meta(checkpoint)
        assert str(e.value).startswith(f"{meta}: {why}") and "\n" not in str(e.value)
