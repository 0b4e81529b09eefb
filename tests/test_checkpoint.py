"""Distributed-optimizer checkpoints are written in parallel and reshard: saved at 2 ranks (DP 2,
TP 2), resumed at DP 4, TP 2 × DP 2 and TP 1 × DP 2 (tests/dist/checkpoint_worker.py: real
torchrun + gloo, megatron DDP + distributed Adam, tiny Qwen2). Every rank writes its own part of
the optimizer state and about half the (DP-replicated) model weights (read from the checkpoint's
storage metadata). The resumed
optimizer state equals the saved one bit for bit in every layout (fp32 main weights and moments,
assembled through megatron's own model-space view), also with bf16 parameters and fp32 main
weights, and from a checkpoint in the old gathered format. A resumed run's next update equals
the saving layout's own continuation: bit for bit in the same layout, else the loss of the
updated model and every parameter within rounding.

Tolerances: the layouts add the same numbers in another order (DP gradient reduction over 2 or 4
ranks, TP partial sums of the row-parallel matmuls), so losses differ by fp32 rounding: ≈1e-7
relative (eps 6e-8 per operation, errors averaging over the 128 tokens); LOSS_RTOL = 1e-6. Adam's
update is lr · m / (√v + eps) per element, at most ≈ lr in size; rounding moves it by a tiny
fraction of that, except for elements whose gradient is itself at rounding level, where the
ratio's sign is noise. PARAM_ATOL = lr / 100. The control (the same resume with a fresh optimizer,
what was lost before) moves the next loss by ≈ 7e-5 relative and parameters by ≈ lr.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import pytest
import torch

from megatron_ngrpo import atomic
from megatron_ngrpo.atomic import commit_directory
from megatron_ngrpo.conversion.checkpoint import MANIFEST_FILE, META_FILE, write_latest
from megatron_ngrpo.training.checkpoint import (
    RunDirError,
    _blocks,
    latest_checkpoint,
    prune,
    resume_point,
)
from tests.harness.checkpoint import written_bytes
from tests.harness.multiproc import check, launch

WORKER = Path(__file__).parent / "dist" / "checkpoint_worker.py"
LR = 1e-2  # the worker's
LOSS_RTOL = 1e-6
PARAM_ATOL = LR / 100


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("distopt")


@pytest.fixture(scope="module")
def results(root) -> dict:
    saved = launch(
        WORKER, 2, timeout=600, env={"NGRPO_CKPT_DIR": str(root), "NGRPO_CKPT_PHASE": "save"}
    )
    resumed = launch(
        WORKER, 4, timeout=600, env={"NGRPO_CKPT_DIR": str(root), "NGRPO_CKPT_PHASE": "resume"}
    )
    return {**saved, **resumed}


def _max_param_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys() and len(want) == 10  # 2 layers, stacked
    diff = max(float((torch.tensor(got[k]) - torch.tensor(want[k])).abs().max()) for k in want)
    assert diff == diff, "a parameter was not assembled (NaN)"
    return diff


def test_every_rank_writes_its_own_part(results, root):
    """DP 2: each rank wrote about half the optimizer state (its own DP shard) and about half the
    model weights (replicated over DP; megatron's fully parallel save spreads their writes). The
    control: the old format (optimizer gathered onto DP rank 0, model saved without spreading)
    has rank 1 write none of either, so this fails if either funnel comes back."""
    check(results, "dp2_save"), check(results, "old_dp2_save")
    new = written_bytes(latest_checkpoint(root / "dp2"))
    old = written_bytes(latest_checkpoint(root / "old"))
    for kind in ("optimizer", "model"):
        part = new[kind]
        assert sorted(part) == [0, 1], (kind, part)
        assert all(0.4 < part[r] / sum(part.values()) < 0.6 for r in part), (kind, part)
        assert sum(old[kind].values()) == sum(part.values()), kind  # the same tensors, ...
        assert old[kind].get(1, 0) == 0, (kind, old[kind])  # ... all written by rank 0


def test_blocks_tile_the_range():
    """Any row-major range of any tensor is cut into ≤ 2·ndim − 1 rectangles, in order."""
    rng = random.Random(0)
    for _ in range(2000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        t = torch.arange(n).view(shape)
        blocks = _blocks(shape, lo, hi)
        assert len(blocks) <= 2 * len(shape) - 1
        got = [t[tuple(slice(o, o + s) for o, s in zip(off, size))] for off, size in blocks]
        assert torch.cat([g.flatten() for g in got] + [t.new_empty(0)]).tolist() == [*range(lo, hi)]


def test_same_layout_resume_is_bit_identical(results):
    assert check(results, "dp2_resume_dp2") == check(results, "dp2_save")


def test_bf16_resume_with_fp32_main_weights_is_bit_identical(results):
    """bf16 parameters, fp32 main weights in the distributed optimizer (the GPU path), on CPU:
    the resumed run equals the uninterrupted one bit for bit, and at DP 4 the optimizer state
    (main weights included) is the saved one bit for bit."""
    want = check(results, "bf16_dp2_save")
    assert check(results, "bf16_dp2_resume_dp2") == want
    assert check(results, "bf16_dp2_resume_dp4")["state"] == want["state"]
    assert want["state"] != check(results, "dp2_save")["state"]  # bf16 is another run


def test_old_format_checkpoint_loads(results):
    """A checkpoint written before the parallel format (megatron's gathered
    ``fully_reshardable``) resumes at DP 4 exactly as the new format's does."""
    assert check(results, "old_dp2_resume_dp4") == check(results, "dp2_resume_dp4")


@pytest.mark.parametrize(
    "saved,resumed",
    [
        ("dp2_save", "dp2_resume_dp4"),
        ("dp2_save", "dp2_resume_tp2_dp2"),
        ("tp2_save", "tp2_resume_tp1_dp2"),
    ],
)
def test_resharded_resume_continues_the_run(results, saved, resumed):
    want, got = check(results, saved), check(results, resumed)
    assert got["state"] == want["state"]  # the optimizer state, bit for bit
    assert got["steps"] == want["steps"] == [3.0]  # Adam's step counts came back
    assert got["before"] == pytest.approx(want["before"], rel=LOSS_RTOL, abs=0)  # the model did
    assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL, abs=0)
    assert _max_param_diff(got["params"], want["params"]) < PARAM_ATOL


def test_resume_without_optimizer_state_differs(results):
    """The control: the comparisons above can fail."""
    want, got = check(results, "dp2_save"), check(results, "dp2_resume_dp4_without_optimizer_state")
    assert got["state"] != want["state"]
    assert abs(got["loss"] - want["loss"]) > 10 * LOSS_RTOL * abs(want["loss"])
    assert _max_param_diff(got["params"], want["params"]) > 10 * PARAM_ATOL


# ---- a run's history: broken pointers, verification, fresh starts, pruning, durability ---------
def _fake_checkpoint(run_dir: Path, step: int) -> Path:
    """A checkpoint folder as the trainer commits it (metadata, a shard, the manifest)."""
    tmp = run_dir / f".iter_{step:07d}.partial"
    tmp.mkdir(parents=True)
    (tmp / META_FILE).write_text(f'{{"step": {step}}}')
    (tmp / "__0_0.distcp").write_bytes(bytes(range(200)) * step)
    commit_directory(tmp, run_dir / f"iter_{step:07d}", collective=False, manifest=MANIFEST_FILE)
    return run_dir / f"iter_{step:07d}"


def _history(run_dir: Path) -> Path:
    """iter_2, iter_4 and iter_6 (``latest``) with metrics rows 1-6."""
    for step in (2, 4, 6):
        _fake_checkpoint(run_dir, step)
    write_latest(run_dir, "iter_0000006")
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 7)))
    return run_dir


def _snapshot(run_dir: Path) -> dict:
    return {
        p.relative_to(run_dir).as_posix(): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != "latest"
    }


BROKEN = {
    "empty latest": (lambda r: (r / "latest").write_text(""), "iter_0000006", "is empty"),
    "latest names a missing iter": (
        lambda r: write_latest(r, "iter_0000009"),
        "iter_0000006",
        "iter_0000009/megatron_ngrpo.json: missing",
    ),
    "truncated newest shard": (
        lambda r: (r / "iter_0000006" / "__0_0.distcp").write_bytes(b"\0" * 10),
        "iter_0000004",
        "iter_0000006/__0_0.distcp: 10 bytes, 1200 written",
    ),
    "missing shard": (
        lambda r: (r / "iter_0000006" / "__0_0.distcp").unlink(),
        "iter_0000004",
        "iter_0000006/__0_0.distcp: missing",
    ),
    "invalid metadata": (
        lambda r: (r / "iter_0000006" / META_FILE).write_text('{"step": 6'),
        "iter_0000004",
        "iter_0000006/megatron_ngrpo.json: unreadable (JSONDecodeError",
    ),
    "no latest": (lambda r: (r / "latest").unlink(), "iter_0000006", "latest is missing"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_latest_falls_back_to_the_newest_verified(tmp_path, caplog, case):
    """The pointer empty, naming a missing checkpoint, or a checkpoint with a truncated or
    missing shard or unreadable metadata: the newest verified one, with one warning naming what
    was wrong; nothing in the run directory changes."""
    run = _history(tmp_path / "run")
    breaks, want, why = BROKEN[case]
    breaks(run)
    before = _snapshot(run)
    with caplog.at_level("WARNING"):
        assert resume_point(run) == run / want
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and why in lines[0] and f"resuming from {want}" in lines[0], lines
    assert _snapshot(run) == before


def test_intact_latest_resumes_silently(tmp_path, caplog):
    run = _history(tmp_path / "run")
    with caplog.at_level("WARNING"):
        assert resume_point(run) == latest_checkpoint(run) == run / "iter_0000006"
    assert not caplog.records


def test_a_run_directory_with_history_is_not_started_over(tmp_path):
    """No verified checkpoint in a directory holding a run: one line naming it; told to start
    over (train.resume false): allowed; an empty or new directory: a new run."""
    assert resume_point(tmp_path / "new") is None
    run = _history(tmp_path / "run")
    for step in (2, 4, 6):
        (run / f"iter_{step:07d}" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(RunDirError) as e:
        resume_point(run)
    message = str(e.value)
    assert "\n" not in message and str(run) in message and "train.resume=false" in message
    assert "iter_0000002/__0_0.distcp: 0 bytes" in message
    assert resume_point(run, resume=False) is None
    only_metrics = tmp_path / "metrics_only"
    only_metrics.mkdir()
    (only_metrics / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirError, match="metrics.jsonl: True"):
        resume_point(only_metrics)


def test_pruning_keeps_the_verified_and_the_newer(tmp_path):
    """keep_last 2 after saving iter_5 in a run resumed from iter_3 whose iter_4 and iter_6
    survive from before: iter_3 (the newest verified older one) stays, iter_1 and the broken
    iter_2 go, iter_6 (newer) stays. A kept checkpoint failing verification prunes nothing."""
    run = tmp_path / "run"
    for step in (1, 2, 3, 5, 6):
        _fake_checkpoint(run, step)
    (run / "iter_0000002" / "__0_0.distcp").write_bytes(b"")
    prune(run, "iter_0000005", keep_last=2)
    assert sorted(p.name for p in run.glob("iter_*")) == [
        "iter_0000003",
        "iter_0000005",
        "iter_0000006",
    ]
    (run / "iter_0000005" / "__0_0.distcp").unlink()
    prune(run, "iter_0000005", keep_last=1)
    assert len(list(run.glob("iter_*"))) == 3


def test_files_and_directories_are_fsynced_before_latest_moves(tmp_path, monkeypatch):
    """Every file of a committed checkpoint, the checkpoint folder and the run directory are
    fsynced before ``latest`` is replaced, and ``latest``'s own data before its rename."""
    events = []
    fsync, replace = atomic.os.fsync, atomic.os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(src, dst):
        events.append(("replace", str(dst)))
        replace(src, dst)

    monkeypatch.setattr(atomic.os, "fsync", recording_fsync)
    monkeypatch.setattr(atomic.os, "replace", recording_replace)
    run = tmp_path / "run"
    ckpt = _fake_checkpoint(run, 1)
    write_latest(run, ckpt.name)
    synced = [p for kind, p in events if kind == "fsync"]
    moved = events.index(("replace", str(run / "latest")))
    for f in (META_FILE, "__0_0.distcp"):  # the data (in the folder's temporary name)
        assert str(run / f".{ckpt.name}.partial" / f) in synced[:moved], synced
    assert str(run) in [p for kind, p in events[:moved] if kind == "fsync"]  # the rename
    assert ("fsync", str(run / ".latest.tmp")) in events[:moved]
    assert events[moved + 1 :] == [("fsync", str(run))]  # the pointer's rename
