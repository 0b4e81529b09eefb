"""GPU-only options (FP8 rollouts, context parallelism): accounted for by the launch plan's memory
model (launch/memory.py), and refused wherever a training config is checked until the trainer
runs them (training/job_config.py check_not_run)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.launch import memory, recipes

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_test.yaml"


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
    assert abs(two.logits - one.logits / 2) <= 1 and abs(two.working - one.working / 2) <= 1
    assert (
        abs(two.optimizer - one.optimizer / 2) <= 1
    )  # the distributed optimizer shards over DP × CP
    assert two.weights == one.weights and two.grads == one.grads


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    from slurm_harness import write_arithmetic_task

    return write_arithmetic_task(tmp_path_factory.mktemp("arith"))


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.context_parallel=2", "'model.context_parallel' = 2: not run by this trainer"),
        (
            "rollout.vllm.quantization=fp8",
            "'rollout.vllm.quantization' = 'fp8': FP8 rollouts are refused until a weight-sync "
            "round trip verifies the quantized weights",
        ),
    ],
)
def test_options_not_run_are_refused_before_the_queue(override, message, task, capsys):
    """Context parallelism and FP8 rollouts (memory planning only, above) are refused by
    `ngrpo-launch plan`, by `ngrpo-launch run` before it submits, and by pre-flight on every node,
    not only by the trainer once its job got its nodes."""
    from megatron_ngrpo.launch import cli, plan, preflight

    with pytest.raises(plan.PlanError, match=re.escape(message)):
        plan.plan_layout(recipes.get("r1-7b"), 2, (override,))
    argv = ["run", "r1-7b", "--executor", "slurm", "--config", "configs/ngrpo_r1_7b.yaml"]
    assert cli.main([*argv, "--dryrun", "train.run_dir=/runs/x", override]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight.preflight(
            [str(TINY), str(task)], [override, "rollout.engine=vllm"], gpus=0, world_size=2
        )


def test_quantization_value_is_checked():
    from megatron_ngrpo.config_loader import load
    from megatron_ngrpo.rollout.config import VLLMConfig

    with pytest.raises(ConfigError, match="'quantization' = 'int4'"):
        load(VLLMConfig, None, ["quantization=int4"])
