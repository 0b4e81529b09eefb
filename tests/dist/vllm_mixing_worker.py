"""Colocated bf16 vLLM at TP 2 under a bf16 trainer at TP 2, end to end (tests/test_vllm_engine.py):
the trainer's weights are synced into the in-process vLLM workers, vLLM generates with neighbour
mixing, and the trainer replays the batch (old log-probs through megatron's schedule, the mixes
through its mixing embedding). The rollout-vs-trainer mismatch metrics (grpo/mismatch.py) of
mixed tokens, whose input is a recorded mixture that both sides form with mixing/arithmetic.py,
are compared with those of plain tokens. One case per launch: a process builds one colocated
engine.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from tests.harness.multiproc import case, run_cases, shared_tmpdir

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@case
def bf16_tp2_mismatch_of_mixed_and_plain_tokens():
    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.conversion.hf_import import load_hf_tensors
    from megatron_ngrpo.conversion.hf_io import HFCheckpoint
    from megatron_ngrpo.grpo.batches import TokenBatch
    from megatron_ngrpo.grpo.logprobs import batch_logprobs
    from megatron_ngrpo.grpo.mismatch import mismatch_metrics, mismatch_sums
    from megatron_ngrpo.mixing.config import MixingConfig
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from megatron_ngrpo.rollout.config import VLLMConfig
    from megatron_ngrpo.rollout.types import SamplingParams
    from megatron_ngrpo.rollout.vllm.engine import VLLMEngine
    from tests.harness.tiny import random_prompts, write_tiny_hf

    initialize_model_parallel(2, 1)
    hf = shared_tmpdir("vllm_mixing_")
    if dist.get_rank() == 0:  # head_dim 32 (vLLM's CPU attention takes no smaller heads)
        write_tiny_hf(
            hf, vocab_size=512, hidden_size=128, num_layers=2, seed=7, initializer_range=0.1
        )
    dist.barrier()
    chunks = build_model(ModelConfig(hf_path=hf, tensor_parallel=2, dtype="bfloat16"))
    load_hf_tensors(chunks, ArchSpec.from_hf(hf), HFCheckpoint(hf))
    cfg = VLLMConfig(
        dtype="bfloat16",
        max_model_len=128,
        kv_cache_memory_bytes=2_000_000,
        tensor_parallel=2,
        weight_transfer="gloo",
    )
    engine = VLLMEngine(hf, cfg)
    try:
        engine.sync_weights(chunks)  # the trainer's very bf16 tensors
        batch = engine.generate(
            random_prompts(8, 512, low=3, seed=1),
            SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=4),
            MixingConfig(rate=0.5, k=3),
        )
    finally:
        engine.close()
    tb = TokenBatch.from_rollout(batch)
    old = batch_logprobs(chunks, tb, 1.0, micro_batch_size=4, vocab_limit=512)
    sums = mismatch_sums(old, tb.label_aligned(batch.logprobs), tb.mask, tb.mix.mask, None)
    metrics = mismatch_metrics(sums)
    return {"n_mixed": sums["mixed/n"], "n_plain": sums["plain/n"], **metrics}


if __name__ == "__main__":
    run_cases()
