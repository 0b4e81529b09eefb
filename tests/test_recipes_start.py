"""Every shipped GPU recipe validates at its real world size (no GPUs, no process groups): the
recipe's config file plus the launcher's overrides, an HF config.json of the recipe's shape (with
the R1 tokenizer's parts, which the configs use as the model folder's own tokenizer), and
WORLD_SIZE set as torchrun would set it on the recipe's nodes; where vLLM runs TP > 1 its weight
syncs are shard-to-shard."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.conversion.hf_export import check_tp_shards
from megatron_ngrpo.data.paths import REPO_DATA
from megatron_ngrpo.launch.recipes import RECIPES
from megatron_ngrpo.training.job_config import load_config

REPO = Path(__file__).resolve().parents[1]
GPU_RECIPES = {"r1-1.5b": "ngrpo_r1_1.5b", "r1-7b": "ngrpo_r1_7b", "r1-14b": "ngrpo_r1_14b"}


def _hf_folder(tmp_path: Path, recipe) -> Path:
    hf = tmp_path / "hf"
    shutil.copytree(REPO_DATA / "tokenizers" / "deepseek-r1-distill-qwen", hf)
    (hf / "config.json").write_text(json.dumps(recipe.shape.hf_config()))
    (hf / "model.safetensors").write_bytes(b"")  # validation only checks the weights exist
    return hf


@pytest.mark.parametrize("name", sorted(GPU_RECIPES))
def test_recipe_config_validates_at_world_size(name, tmp_path, monkeypatch):
    recipe = RECIPES[name]
    hf = _hf_folder(tmp_path, recipe)
    for nodes in sorted({recipe.min_nodes, recipe.nodes, recipe.max_nodes}):
        monkeypatch.setenv("WORLD_SIZE", str(recipe.world_size(nodes)))
        cfg = load_config(
            [REPO / "configs" / f"{GPU_RECIPES[name]}.yaml"],
            [*recipe.model_overrides(str(hf)), *recipe.rollout_overrides()],
        )
        assert cfg.rollout.engine == "vllm"
        assert recipe.world_size(nodes) % cfg.rollout.vllm.tensor_parallel == 0
    # Weight syncs are shard-to-shard wherever vLLM runs TP > 1 (7B: trainer TP 4 → vLLM TP 2;
    # 14B: 8 → 4): no rank gathers a whole linear-layer tensor.
    vllm_tp = cfg.rollout.vllm.tensor_parallel
    if vllm_tp > 1:
        spec = ArchSpec.from_hf(hf)
        assert (
            check_tp_shards(spec, cfg.model.tensor_parallel, cfg.model.pipeline_parallel, vllm_tp)
            is None
        )


def test_vllm_layout_errors_are_one_line(tmp_path, monkeypatch):
    from megatron_ngrpo.config_loader import ConfigError

    recipe = RECIPES["r1-7b"]
    hf = _hf_folder(tmp_path, recipe)
    monkeypatch.setenv("WORLD_SIZE", "20")
    with pytest.raises(
        ConfigError,
        match=r"^config field 'rollout.vllm.tensor_parallel' = 8: must divide the world size 20",
    ):
        load_config(
            [REPO / "configs" / "ngrpo_r1_7b.yaml"],
            [
                *recipe.model_overrides(str(hf)),
                *recipe.rollout_overrides(),
                "rollout.vllm.tensor_parallel=8",
            ],
        )
