"""Colocated vLLM weight sync (tests/test_vllm_engine.py), one in-process vLLM worker per rank
(``external_launcher``), weights pushed through vLLM's weight-transfer API (the gloo engine,
small buckets, SHA-256 per tensor): trainer TP=2 with vLLM TP=2 and, at 4 ranks, trainer TP=4
with two vLLM TP=2 replicas (two syncs shard-to-shard, the third with gathered tensors again),
then trainer DP=2 with one vLLM TP=1 replica per rank. After every one of three syncs of changed weights, every vLLM parameter, read
back (and reassembled from its TP shards), equals the trainer's tensors exactly (fp32); every
process group, vLLM's included, has the job's timeout. One case per launch (``--only``): vLLM cannot build a second colocated engine in a
process whose first one has shut down.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.harness.multiproc import case, group_timeouts, run_cases, shared_tmpdir

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _syncs_match(trainer_tp: int, vllm_tp: int, kv_heads: int = 2) -> list[dict]:
    """Three syncs of changed weights from a trainer of TP ``trainer_tp`` (DP the rest) into one
    colocated vLLM worker per rank (vLLM TP ``vllm_tp``); after each, vLLM's parameters,
    reassembled over its TP group, equal the trainer's exactly. Where the engine syncs
    shard-to-shard, the third sync switches the workers back to full tensors."""
    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.conversion.hf_export import export_hf_tensors
    from megatron_ngrpo.conversion.hf_import import load_hf_tensors
    from megatron_ngrpo.conversion.hf_io import HFCheckpoint
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from megatron_ngrpo.rollout.config import VLLMConfig
    from megatron_ngrpo.rollout.vllm.engine import VLLMEngine
    from tests.harness.tiny import write_tiny_hf
    from tests.support.vllm_weights import assert_equal_to_hf, vllm_weights

    initialize_model_parallel(trainer_tp, 1)
    hf = shared_tmpdir("vllm_sync_")
    if dist.get_rank() == 0:  # head_dim 32 (vLLM's CPU attention takes no smaller heads)
        write_tiny_hf(
            hf, vocab_size=512, hidden_size=128, num_heads=4, num_kv_heads=kv_heads, seed=5
        )
    dist.barrier()
    spec = ArchSpec.from_hf(hf)
    chunks = build_model(ModelConfig(hf_path=hf, tensor_parallel=trainer_tp))
    load_hf_tensors(chunks, spec, HFCheckpoint(hf))
    cfg = VLLMConfig(
        max_model_len=64,
        kv_cache_memory_bytes=2_000_000,
        tensor_parallel=vllm_tp,
        weight_transfer="gloo",
        sync_bucket_mb=0.05,
        verify_weights=True,
    )
    engine = VLLMEngine(hf, cfg)
    from vllm.distributed.parallel_state import get_tp_group

    group = (
        get_tp_group().cpu_group if vllm_tp > 1 else None
    )  # the ranks of this worker's vLLM TP group
    try:
        syncs = []
        for step in range(1, 4):
            with torch.no_grad():  # the same change on every rank (replicated tensors stay equal)
                for p in chunks[0].parameters():
                    p.mul_(1.0 + 0.01 * step).add_(0.001 * step)
            if step == 3 and engine.tp_shards:
                engine.llm.collective_rpc("nbr_load_tp_shards", args=(False,))
                engine.tp_shards = None
            engine.sync_weights(chunks)
            want = dict(export_hf_tensors(chunks, spec))
            assert_equal_to_hf(vllm_weights(engine.llm, group), want, where=f"sync {step}: ")
            syncs.append({k: engine.last_sync[k] for k in ("num_params", "buckets", "tp_shards")})
        return {"syncs": syncs, "group_timeouts": group_timeouts()}
    finally:
        engine.close()


@case
def vllm_tp2_under_trainer_tp2():
    return _syncs_match(trainer_tp=2, vllm_tp=2)


@case
def vllm_tp2_under_trainer_tp4():
    """4 ranks: two vLLM TP 2 replicas; each worker's slices are merged from two trainer ranks'."""
    return _syncs_match(trainer_tp=4, vllm_tp=2, kv_heads=4)


@case
def vllm_tp1_replicas_under_trainer_dp2():
    return _syncs_match(trainer_tp=1, vllm_tp=1)


if __name__ == "__main__":
    run_cases()
