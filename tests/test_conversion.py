"""HF ↔ Megatron conversion: mapping, round trips, resharding, bad input (issue 6).

The multi-process cases run in one 4-process torchrun launch (tests/dist/conversion_worker.py);
each reports as one test here. Tiny random Qwen2 / Llama (llama3 rope) / Qwen3 (head_dim, QK-norm)
models, tied and untied, with vocab sizes that need padding (300, 500) and one that does not (512).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ngrpo.parallel import SINGLE_PROCESS_PORT_VAR
from tests.harness.multiproc import check, launch
from tests.harness.tiny import write_tiny_hf

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "dist" / "conversion_worker.py"
TOOLS = REPO / "tools"
MODELS = {  # name -> (arch, kwargs); worker's MODELS
    "qwen2": ("qwen2", dict(vocab_size=500, seed=1)),
    "llama": ("llama", dict(vocab_size=512, num_kv_heads=4, seed=2)),  # KV heads split over TP4
    "qwen3": ("qwen3", dict(vocab_size=300, seed=3)),
    "qwen2_tied": ("qwen2", dict(vocab_size=500, tied=True, seed=4)),
    "llama_tied": ("llama", dict(vocab_size=500, tied=True, seed=5)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("conversion")
    for name, (arch, kw) in MODELS.items():
        write_tiny_hf(root / name, arch, **kw)
    return root


@pytest.fixture(scope="module")
def results(models):
    return launch(WORKER, 4, timeout=600, env={"NGRPO_CONV_DIR": str(models)})


@pytest.mark.parametrize(
    "layout",
    [
        "mapping_tp1pp1",
        "mapping_tp2pp1",
        "mapping_tp4pp1",
        "mapping_tp1pp2",
        "mapping_tp2pp2",
        "mapping_tp1pp2vpp2",
    ],
)
def test_mapping_every_model(results, layout):
    """Every model loaded from HF in this layout (TP4 > KV heads: megatron's KV replication):
    logits = HF transformers (fp32) within 1e-5 and zero on padded vocab rows; export_hf_tensors
    (to all ranks and to rank 0 only) = the HF files bit for bit, in layer order."""
    errors = check(results, layout)
    assert set(errors) == set(MODELS) and max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize(
    "case",
    [
        "roundtrip_qwen2_tp2pp2",
        "roundtrip_llama_tp2pp1",
        "roundtrip_qwen3_tp1pp2",
        "roundtrip_qwen2_tied_tp1pp1",
        "roundtrip_llama_tied_tp1pp2vpp2",
    ],
)
def test_roundtrip_files(results, case):
    """HF → Megatron checkpoint → HF through the conversion functions: identical tensors,
    index, carried-over files, same logits from the reloaded HF model and the Megatron model."""
    check(results, case)


def test_reshard_with_vocab_padding_change(results):
    assert check(results, "reshard_padded_vocab") == [512, 384, 384, 512]


def test_reshard_tied_embeddings_across_pipeline(results):
    check(results, "reshard_tied_pp")


def test_run_directory_and_dtypes(results):
    check(results, "run_directory_latest_and_dtypes")


def test_bad_input_names_every_tensor_and_writes_nothing(results):
    msgs = check(results, "errors_truncated_or_mismatched")
    assert len(msgs) == 3


def test_cli_roundtrip_relaunches_under_torchrun(models, tmp_path):
    """The command lines: ``ngrpo-convert hf-to-megatron`` (as ``python -m
    megatron_ngrpo.conversion``) with TP2 output relaunches itself under torchrun; back to bf16 HF
    in one process through the tools/ wrapper; bad input is one line on stderr (exit 2) before any
    process group starts."""
    from megatron_ngrpo.conversion.hf_io import HFCheckpoint

    # The variables a single-process init earlier in this pytest process leaves behind (CI's
    # order): they are ours, not a launcher's, so the CLI must still relaunch under torchrun.
    stale = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": "1"}
    env = {**os.environ, **stale, SINGLE_PROCESS_PORT_VAR: "1", "OMP_NUM_THREADS": "1"}
    src, mdir, hdir = models / "qwen3", tmp_path / "m", tmp_path / "hf"
    run = lambda tool, *args: subprocess.run(  # noqa: E731
        [
            sys.executable,
            *(["-m", "megatron_ngrpo.conversion", tool] if "-" in tool else [str(TOOLS / tool)]),
            *map(str, args),
            "--no-progress",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    r = run("hf-to-megatron", "--input", src, "--output", mdir, "--tp", 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wrote" in r.stdout and (mdir / "megatron_ngrpo.json").is_file()
    r = run("convert_megatron_to_hf.py", "--input", mdir, "--output", hdir, "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = HFCheckpoint(hdir), HFCheckpoint(src)
    assert set(got) == set(want)
    assert all(torch.equal(got[n], want[n].to(torch.bfloat16)) for n in want)
    r = run("convert_megatron_to_hf.py", "--input", mdir, "--output", hdir)
    assert r.returncode == 2 and "exists" in r.stderr.strip().splitlines()[-1], r.stderr
    r = run(
        "convert_hf_to_megatron.py",
        "--input",
        tmp_path / "nope",
        "--output",
        tmp_path / "x",
        "--tp",
        3,
    )
    assert r.returncode == 2 and "not a directory" in r.stderr and not (tmp_path / "x").exists()
    r = subprocess.run(
        [sys.executable, "-m", "megatron_ngrpo.conversion", "hf-to-mcore"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr == (
        "error: ngrpo-convert: expected a command (hf-to-megatron, "
        "megatron-to-hf), got 'hf-to-mcore'\n"
    )


def test_console_scripts_name_importable_entry_points():
    """setup.py's console scripts (ngrpo-train, -eval, -convert, -launch) each name a function."""
    import importlib
    import re

    scripts = dict(re.findall(r'"(ngrpo-[a-z]+)=([\w.]+:\w+)"', (REPO / "setup.py").read_text()))
    assert set(scripts) == {"ngrpo-train", "ngrpo-eval", "ngrpo-convert", "ngrpo-launch"}
    for target in scripts.values():
        module, name = target.split(":")
        assert callable(getattr(importlib.import_module(module), name)), target
