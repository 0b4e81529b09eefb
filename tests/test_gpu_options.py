"""GPU-only options (FP8 rollouts, context parallelism): refused at start-up where they cannot
run, and accounted for by the launch plan's memory model (launch/memory.py)."""

from __future__ import annotations

import dataclasses

import pytest
from test_plan import run_plan

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.launch import memory, recipes


def test_fp8_rollout_weights_are_one_byte_per_linear_weight():
    spec = recipes.get("r1-7b").spec
    bf16 = memory.vllm_memory(spec, 2, 0.5)
    fp8 = memory.vllm_memory(spec, 2, 0.5, quantization="fp8")
    h, d = spec.hidden_size, spec.head_dim
    linear = (
        spec.num_layers
        * h
        * (
            (spec.num_heads + 2 * spec.num_kv_heads) * d
            + spec.num_heads * d
            + 3 * spec.ffn_hidden_size
        )
    )
    assert bf16.weights - fp8.weights == linear // 2  # one byte saved per weight, over vLLM TP 2
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token
    assert fp8.kv_tokens > bf16.kv_tokens


def test_context_parallel_divides_per_token_memory():
    spec = recipes.get("r1-7b").spec
    base = memory.TrainLayout(tp=4, pp=1, dp=4, tokens=16384, recompute=True)
    one, two = (
        memory.train_memory(spec, base),
        memory.train_memory(spec, dataclasses.replace(base, cp=2)),
    )
    assert two.activations == one.activations // 2
    assert abs(two.working - one.working / 2) <= 1
    assert two.logits <= one.logits  # chunks of the log-prob pass: at most 256 MiB of fp32
    assert (
        abs(two.optimizer - one.optimizer / 2) <= 1
    )  # the distributed optimizer shards over DP × CP
    assert two.weights == one.weights and two.grads == one.grads


def test_plan_accounts_for_fp8_and_context_parallel():
    proc = run_plan(
        "r1-7b", "--nodes", "2", "model.context_parallel=2", "rollout.vllm.quantization=fp8"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DP 2" in proc.stdout  # 16 ranks / (TP 4 × CP 2)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.context_parallel=2"], "'model.context_parallel' = 2: not run by this trainer"),
        (
            ["rollout.engine=vllm", "rollout.vllm.quantization=fp8"],
            "'rollout.vllm.quantization' = 'fp8': FP8 rollouts need a GPU",
        ),
    ],
)
def test_gpu_only_options_are_refused_at_start_up(tmp_path, monkeypatch, overrides, message):
    from megatron_ngrpo.testing.tiny import write_tiny_hf
    from megatron_ngrpo.training.job_config import NGRPOConfig, check_device

    write_tiny_hf(tmp_path, weights=False)
    cfg = NGRPOConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=str(tmp_path)))
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(overrides))
    )
    with pytest.raises(ConfigError) as e:
        check_device(cfg, gpu=False)
    assert message in str(e.value)


def test_quantization_value_is_checked():
    from megatron_ngrpo.config_loader import load
    from megatron_ngrpo.rollout.config import VLLMConfig

    with pytest.raises(ConfigError, match="'quantization' = 'int4'"):
        load(VLLMConfig, None, ["quantization=int4"])
