"""Measured memory of real GRPO training steps (megatron DDP + distributed optimizer, recompute,
the project's loss_and_grads), DP = 2, for tests/test_memory_model.py to compare with
megatron_ngrpo/launch/memory.py.

Measurement: the process's resident memory. glibc is told to serve every allocation ≥ 64 KiB by
mmap and to give freed memory back at once (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_, set
by the test), so the resident size follows the live tensors; the peak is Linux's VmHWM, reset
before the measured step by writing 5 to /proc/self/clear_refs. The second step is measured (Adam
allocates its moments in the first). Each rank reports its own peak above the resident size
before its model was built; the case returns the larger of the two ranks'.
"""

from __future__ import annotations

import gc
import re
import tempfile
import time

import torch
import torch.distributed as dist

from tests.harness.multiproc import case, run_cases

# (layers, hidden, ffn, heads, kv_heads, vocab, rows, seq_len) per case; the test models the same.
SHAPES = {
    "fixed_overhead": (1, 64, 128, 2, 2, 256, 1, 32),
    "static_dominant": (2, 512, 1536, 8, 2, 8192, 2, 64),
    "logits_dominant": (2, 64, 128, 2, 2, 65536, 8, 256),
    "attention_dominant": (4, 256, 1024, 4, 2, 512, 2, 1024),
    "attention_sdpa": (4, 256, 1024, 4, 2, 512, 2, 1024),
}
# model.attention per case (default sdpa) and the cases with a tied output matrix.
ATTENTION = {"attention_dominant": "unfused"}
TIED = {"logits_dominant"}
STEPS = 2


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(name: str) -> dict:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ngrpo.architecture import unwrap
    from megatron_ngrpo.grpo.batches import TokenBatch
    from megatron_ngrpo.grpo.config import GRPOConfig
    from megatron_ngrpo.grpo.loss_inputs import LossInputs
    from megatron_ngrpo.grpo.update import UpdateSettings, loss_and_grads, wrap_for_training
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.tiny import write_tiny_hf

    layers, hidden, ffn, heads, kv_heads, vocab, rows, seq_len = SHAPES[name]
    initialize_model_parallel(1, 1)
    hf = tempfile.mkdtemp(prefix="memory_worker_")
    write_tiny_hf(
        hf,
        weights=False,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=ffn,
        max_pos=4096,
        tied=name in TIED,
    )
    gc.collect()
    base = _status("VmRSS")
    cfg = ModelConfig(
        hf_path=hf,
        recompute=True,
        make_vocab_size_divisible_by=128,
        attention=ATTENTION.get(name, "sdpa"),
    )
    chunks = wrap_for_training(
        build_model(cfg),
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-5,
            clip_grad=1.0,
            params_dtype=torch.float32,
            use_distributed_optimizer=True,
        ),
        chunks,
    )
    unwrap(chunks[0]).config.grad_scale_func = optimizer.scale_loss

    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, vocab, (rows, seq_len), generator=g)
    mask = torch.zeros(rows, seq_len, dtype=torch.bool)
    mask[:, seq_len // 4 : -1] = True
    batch = TokenBatch(
        tokens,
        torch.roll(tokens, -1, 1),
        mask,
        torch.full((rows,), seq_len // 4 + 1),
        torch.full((rows,), seq_len),
        inputs=LossInputs(
            old_logprobs=torch.full((rows, seq_len), -5.0),
            ref_logprobs=torch.full((rows, seq_len), -5.0),
            advantages=torch.randn(rows, generator=g, dtype=torch.float64),
            active=torch.ones(rows, dtype=torch.bool),
        ),
    )
    settings = UpdateSettings(
        temperature=0.7, micro_batch_size=rows, vocab_limit=vocab, max_response_len=seq_len
    )
    for _ in range(STEPS):
        _reset_peak()
        start = time.perf_counter()
        loss_and_grads(chunks, batch, GRPOConfig(), settings, optimizer)
        optimizer.step()
    peak = torch.tensor([_status("VmHWM") - base], dtype=torch.float64)
    seconds = time.perf_counter() - start
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    del chunks, optimizer, batch
    gc.collect()
    return {"peak": int(peak), "seconds": seconds, "dp": dist.get_world_size()}


@case
def fixed_overhead():
    return measure("fixed_overhead")


@case
def static_dominant():
    return measure("static_dominant")


@case
def logits_dominant():
    return measure("logits_dominant")


@case
def attention_dominant():
    return measure("attention_dominant")


@case
def attention_sdpa():
    return measure("attention_sdpa")


if __name__ == "__main__":
    run_cases()
