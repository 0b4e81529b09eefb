"""The pre-flight check every rendered job script runs before torchrun
(megatron_ngrpo/launch/preflight.py), and the Transformer Engine rule of ``model.layer_spec``: on a
GPU without TE, ``auto`` / ``te`` stop with one line instead of falling back to the local spec."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from megatron_ngrpo.compat import cpu as cpu_compat
from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.launch import preflight
from megatron_ngrpo.models.config import ModelConfig, use_te
from tests.harness.tiny import write_tiny_hf

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_test.yaml"


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    from slurm_harness import write_arithmetic_task

    return write_arithmetic_task(tmp_path_factory.mktemp("arith"))


def run_preflight(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_ngrpo.launch.preflight", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_one_line_ok_and_one_line_config_error(task):
    ok = run_preflight(
        "--gpus", "0", "--world-size", "2", "--config", str(TINY), "--config", str(task)
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("preflight ok: Python ") and "megatron-core 0.16" in ok.stdout
    assert "0 GPU(s), world size 2" in ok.stdout and len(ok.stdout.splitlines()) == 1
    bad = run_preflight(
        "--gpus",
        "0",
        "--world-size",
        "3",
        "--config",
        str(TINY),
        "--config",
        str(task),
        "model.tensor_parallel=2",
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines()[-1] == (
        "preflight failed: config field 'model.tensor_parallel' = 2: "
        "TP 2 × PP 1 does not divide the world size 3"
    ), bad.stderr


def test_gpu_count_and_dependencies(task):
    # The CPU shim (installed by any earlier in-process test) makes device_count() say 1: the count
    # must not be fooled by it.
    cpu_compat.install()
    with pytest.raises(
        preflight.PreflightError, match=r"^0 GPU\(s\) visible, the node's ranks need 8$"
    ):
        preflight.preflight([str(TINY), str(task)], [], gpus=8, world_size=1)
    with pytest.raises(
        preflight.PreflightError, match="no_such_module_xyz does not import: ModuleNotFoundError"
    ):
        preflight.check_imports({"no_such_module_xyz": "no-such"}, {})
    with pytest.raises(
        preflight.PreflightError, match=r"pyyaml .* is outside the required range <1"
    ):
        preflight.check_imports({"yaml": "pyyaml"}, {"pyyaml": Requirement("pyyaml<1")})


def test_modules_follow_the_config(task):
    from megatron_ngrpo.training.job_config import load_config

    cfg = load_config([TINY, task], [])
    assert set(preflight.needed_modules(cfg, gpus=0)) == set(preflight.ALWAYS)
    cfg.rollout.engine, cfg.model.layer_spec = "vllm", "auto"
    assert {"vllm", "transformer_engine.pytorch"} <= set(preflight.needed_modules(cfg, gpus=8))
    assert "transformer_engine.pytorch" not in preflight.needed_modules(cfg, gpus=0)


def test_layer_spec_auto_on_a_gpu_without_te_stops(tmp_path, monkeypatch):
    """No GPU here: CUDA is reported available (the TE import itself is real: TE is absent)."""
    hf = write_tiny_hf(tmp_path, weights=False)
    ModelConfig(hf_path=str(hf), layer_spec="auto").validate()  # CPU: the local spec, as before
    with pytest.raises(ConfigError, match="'te': Transformer Engine's spec needs a GPU"):
        use_te(ModelConfig(hf_path=str(hf), layer_spec="te"))  # at build time on a CPU host
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for spec in ("auto", "te"):
        with pytest.raises(ConfigError) as e:
            ModelConfig(hf_path=str(hf), layer_spec=spec).validate()
        assert str(e.value).startswith(
            f"model.layer_spec = '{spec}': Transformer Engine does not import on this "
            "GPU machine (ModuleNotFoundError"
        ), e.value
        assert str(e.value).endswith("or set model.layer_spec=local for megatron's local spec")
    ModelConfig(hf_path=str(hf), layer_spec="local").validate()
