"""The memory model (megatron_ngrpo/launch/memory.py) against measured peaks of real GRPO training
steps on CPU (tests/dist/memory_worker.py: megatron DDP + distributed optimizer at DP 2, full
recomputation, fp32, megatron's unfused local-spec attention): the same formulas that give the GPU
plans, with the CPU's number formats. The fixed cost of a process (gloo buffers, autograd, small
allocations; the CPU's "CUDA context") is measured on a near-empty model in the same launch.
Within 20 % at every shape, each dominated by a different term."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.launch import memory
from tests.dist.memory_worker import SHAPES
from tests.harness.multiproc import check, launch
from tests.harness.tiny import tiny_hf_config

WORKER = Path(__file__).parent / "dist" / "memory_worker.py"

# glibc: mmap every allocation >= 64 KiB and give freed memory back at once (see the worker).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


@pytest.fixture(scope="module")
def measured():
    return launch(WORKER, nproc=2, timeout=600, env=MALLOC_ENV)


def cpu_model(shape, dp: int, overhead: int) -> memory.TrainMemory:
    layers, hidden, ffn, heads, kv_heads, vocab, rows, seq_len = shape
    spec = ArchSpec.from_dict(
        tiny_hf_config(
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            intermediate_size=ffn,
        )
    )
    layout = memory.TrainLayout(
        tp=1,
        pp=1,
        dp=dp,
        tokens=rows * seq_len,
        sequence_parallel=False,
        recompute=True,
        param_bytes=memory.FP32,
        unfused_seq_len=seq_len,
        overhead=overhead,
    )
    return memory.train_memory(spec, layout)


@pytest.mark.parametrize(
    "name,dominant",
    [
        ("static_dominant", "static"),
        ("logits_dominant", "logits"),
        ("attention_dominant", "working"),
    ],
)
def test_memory_model_matches_measured_peak(measured, name, dominant):
    fixed = check(measured, "fixed_overhead")
    got = check(measured, name)
    model = cpu_model(SHAPES[name], got["dp"], fixed["peak"])
    terms = {
        "static": model.weights + model.grads + model.optimizer,
        "logits": model.logits,
        "working": model.working,
    }
    assert max(terms, key=terms.get) == dominant, terms  # each shape tests a different term
    assert model.total == pytest.approx(got["peak"], rel=0.2), (
        f"{name}: model {model.total / 2**20:.0f} MiB, measured {got['peak'] / 2**20:.0f} MiB"
    )


def test_logits_pass_peak_within_one_and_a_half_fp32_logits(measured):
    """The fused log-prob + entropy pass, forward and backward, holds at most 1.5 extra fp32
    logits tensors at its peak (before the fused pass: 6.25), at three shapes and TP 1 / 2."""
    peaks = check(measured, "logits_pass")
    assert len(peaks) == 6
    assert all(p <= 1.5 for p in peaks.values()), peaks
