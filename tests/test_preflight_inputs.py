"""Pre-flight of what a job reads before any process group starts: vLLM where the trainer imports
it (colocated engine, and the remote engine's nccl / gloo weight routes), and every safetensors
file of ``model.hf_path`` opened by its header (length, JSON, a file at least as long as its
largest tensor's end: truncation found), one line naming the file; the same check where
``HFCheckpoint`` opens a file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_ngrpo.conversion.hf_io import HFCheckpoint
from megatron_ngrpo.conversion.mapping import ConversionError
from megatron_ngrpo.conversion.safetensors_header import directory_problems, problem
from megatron_ngrpo.launch import preflight

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_test.yaml"


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    from slurm_harness import write_arithmetic_task

    return write_arithmetic_task(tmp_path_factory.mktemp("arith"))


def test_vllm_is_checked_for_the_remote_weight_routes_that_import_it(task):
    from megatron_ngrpo.training.job_config import load_config

    cfg = load_config([TINY, task], [])
    cfg.rollout.engine = "remote"
    for route, imports in (("nccl", True), ("gloo", True), ("reload", False)):
        cfg.rollout.remote.weight_transfer = route
        assert preflight.needs_vllm(cfg) is imports, route
        assert ("vllm" in preflight.needed_modules(cfg, gpus=0)) is imports, route


def _weights(path: Path) -> Path:
    save_file({"a": torch.zeros(64), "b": torch.ones(3, 5)}, str(path))
    return path


def test_safetensors_headers_find_truncation_and_garbage(tmp_path):
    good = _weights(tmp_path / "good.safetensors")
    assert problem(good) is None
    data = good.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-10])
    assert (
        problem(cut)
        == f"{cut}: {len(data) - 10} bytes, its tensors end at byte {len(data)}: truncated"
    )
    cases = {
        "short": (data[:5], "shorter than a safetensors header"),
        "head": (data[:20], "truncated or not safetensors"),
        "json": (data[:8] + b"{" * (len(data) - 8), "the safetensors header is not JSON"),
        "offsets": (
            len(b'{"a": 1}').to_bytes(8, "little") + b'{"a": 1}',
            "has no valid data_offsets",
        ),
    }
    for name, (raw, why) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(raw)
        assert problem(path).startswith(f"{path}: ") and why in problem(path), name
    assert len(directory_problems(tmp_path)) == 5
    with pytest.raises(ConversionError, match=r"cut\.safetensors: \d+ bytes, its tensors end"):
        HFCheckpoint(tmp_path)


def test_preflight_names_a_truncated_weights_file(task, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(task.parent / "model", model)
    weights = _weights(model / "model.safetensors")
    weights.write_bytes(weights.read_bytes()[:-1])
    with pytest.raises(preflight.PreflightError) as e:
        preflight.preflight([str(TINY), str(task)], [f"model.hf_path={model}"], 0, 1)
    assert str(e.value).splitlines() == [
        f"{weights}: {weights.stat().st_size} bytes, its tensors end at byte "
        f"{weights.stat().st_size + 1}: truncated"
    ]


def test_eval_checks_weights_and_vllm_before_process_groups(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from megatron_ngrpo import pins
    from megatron_ngrpo.config_loader import ConfigError
    from megatron_ngrpo.eval import __main__ as eval_main

    weights = _weights(tmp_path / "model.safetensors")
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(engine="vllm"), model=SimpleNamespace(hf_path=tmp_path)
    )
    monkeypatch.setattr(pins, "vllm_mismatch", lambda: None)
    eval_main.check_device(cfg)
    weights.write_bytes(weights.read_bytes()[:-1])
    with pytest.raises(ConversionError, match=rf"^{weights}: \d+ bytes, its tensors end"):
        eval_main.check_device(cfg)
    monkeypatch.setattr(pins, "vllm_mismatch", lambda: "vllm 0.0.1 is not 0.32.0")
    with pytest.raises(ConfigError, match=r"^config field 'rollout.engine' = 'vllm': vllm 0.0.1"):
        eval_main.check_device(cfg)


def test_rollout_server_nodes_get_their_own_preflight(tmp_path):
    """A hetjob's rollout group runs ``preflight --server`` with the server's model (vLLM, GPUs,
    weights), as the training group runs the trainer's."""
    from megatron_ngrpo.launch import executors, recipes

    recipe = recipes.get("r1-14b")
    server = recipes.rollout_server(recipe, "/models/m")
    assert executors.runs_preflight(server)
    line = executors.preflight_line(server, executors.Cluster(packager="none"), "/job", 0)
    assert line.startswith("srun --het-group=0 --nodes=2 --ntasks-per-node=1 ")
    assert "megatron_ngrpo.launch.preflight --gpus 8 --server --model /models/m ||" in line
    weights = _weights(tmp_path / "model.safetensors")
    weights.write_bytes(weights.read_bytes()[:-1])
    with pytest.raises(preflight.PreflightError) as e:
        preflight.server_report(str(tmp_path), gpus=0)
    assert str(e.value).splitlines() == [preflight.safetensors_header.problem(weights)]
    weights.unlink()
    assert preflight.server_report(str(tmp_path), gpus=0).startswith(
        "preflight ok (rollout server): torch "
    )
