"""The memory model (megatron_ngrpo/launch/memory.py) against measured peaks of real GRPO training
steps on CPU (tests/dist/memory_worker.py: megatron DDP + distributed optimizer at DP 2, full
recomputation, fp32): the same formulas that give the GPU plans, with the CPU's number formats.
The fixed cost of a process (gloo buffers, autograd, small allocations; the CPU's "CUDA context")
is measured on a near-empty model in the same launch. Within 20 % at every shape, each dominated
by a different term: weights/grads/optimizer, the log-prob pass (chunks of logits of a tied
output matrix), megatron's unfused attention (its s² scores); the same attention shape on torch
SDPA (models/attention.py) keeps no scores, as planned. The log-prob pass alone (tensors counted
by torch's MemTracker, on CPU at small shapes and on fake tensors at full ones) holds its planned
chunk buffers, a fraction of one fp32 logits tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.bench_logprob_memory import SHAPES as SIM_SHAPES
from bench.bench_logprob_memory import pass_peak
from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.launch import memory
from tests.dist.memory_worker import ATTENTION, SHAPES, TIED
from tests.harness.multiproc import check, launch
from tests.harness.tiny import tiny_hf_config

WORKER = Path(__file__).parent / "dist" / "memory_worker.py"

# glibc: mmap every allocation >= 64 KiB and give freed memory back at once (see the worker).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


@pytest.fixture(scope="module")
def measured():
    return launch(WORKER, nproc=2, timeout=600, env=MALLOC_ENV)


def cpu_model(name: str, dp: int, overhead: int) -> memory.TrainMemory:
    layers, hidden, ffn, heads, kv_heads, vocab, rows, seq_len = SHAPES[name]
    spec = ArchSpec.from_dict(
        tiny_hf_config(
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            intermediate_size=ffn,
            tied=name in TIED,
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
        unfused_seq_len=seq_len if ATTENTION.get(name) == "unfused" else 0,
        overhead=overhead,
    )
    return memory.train_memory(spec, layout)


@pytest.mark.parametrize(
    "name,dominant",
    [
        ("static_dominant", "static"),
        ("logits_dominant", "logits"),
        ("attention_dominant", "working"),
        ("attention_sdpa", None),
    ],
)
def test_memory_model_matches_measured_peak(measured, name, dominant):
    fixed = check(measured, "fixed_overhead")
    got = check(measured, name)
    model = cpu_model(name, got["dp"], fixed["peak"])
    terms = {
        "static": model.weights + model.grads + model.optimizer,
        "logits": model.logits,
        "working": model.working,
    }
    if dominant:  # each shape tests a different term
        assert max(terms, key=terms.get) == dominant, terms
    assert model.total == pytest.approx(got["peak"], rel=0.2), (
        f"{name}: model {model.total / 2**20:.0f} MiB, measured {got['peak'] / 2**20:.0f} MiB"
    )


def test_sdpa_attention_keeps_no_scores(measured):
    """The attention-dominated shape on torch SDPA and on megatron's unfused attention: the
    measured difference is the planned one, the unfused path's s² scores and their gradients."""
    sdpa, unfused = check(measured, "attention_sdpa"), check(measured, "attention_dominant")
    planned = [cpu_model(n, 2, 0).total for n in ("attention_sdpa", "attention_dominant")]
    assert planned[1] - planned[0] > 0.3 * planned[1]  # the shape is attention-dominated
    measured_gap = unfused["peak"] - sdpa["peak"]
    assert measured_gap == pytest.approx(planned[1] - planned[0], rel=0.2), (sdpa, unfused, planned)


# (tokens, vocab, hidden) of the log-prob pass measured alone on CPU; TP 2 holds half the vocabulary.
LOGPROB_PASS_SHAPES = [(1024, 16384, 64), (4096, 8192, 64), (256, 65536, 64)]


@pytest.mark.parametrize("tp", [1, 2])
def test_logprob_pass_holds_its_chunks_not_the_logits(tp):
    """The log-prob + entropy pass, forward and backward, from hidden states (grpo/
    token_logprobs.py) on CPU tensors: the tensors live at its peak (torch's MemTracker) are the
    planned chunk buffers (memory.logprob_pass_bytes), at most 0.4 of one fp32 [tokens, V/TP]
    logits tensor, at three shapes."""
    for tokens, vocab, hidden in LOGPROB_PASS_SHAPES:
        peak = pass_peak(tokens, hidden, vocab // tp, torch.float32, fake=False)
        plan = memory.logprob_pass_bytes(tokens, vocab // tp, hidden, memory.FP32)
        assert peak == pytest.approx(plan, rel=0.01), (tokens, vocab, peak, plan)
        assert peak <= 0.4 * tokens * vocab // tp * memory.FP32, (tokens, vocab, peak)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logprob_pass_plan_equals_a_simulation_at_full_shapes(dtype):
    """At the 1.5B benchmark shape and the 7B recipe's TP-4 shard, the pass on fake tensors
    (bench/bench_logprob_memory.py) peaks at the planned bytes."""
    for _, tokens, hidden, vocab, tp in SIM_SHAPES:
        simulated = pass_peak(tokens, hidden, vocab // tp, dtype)
        plan = memory.logprob_pass_bytes(tokens, vocab // tp, hidden, dtype.itemsize)
        assert simulated == pytest.approx(plan, rel=0.01), (tokens, vocab, simulated, plan)
