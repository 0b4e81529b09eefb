"""Colocated vLLM weight sync at 2 ranks (tests/test_vllm_engine.py): trainer TP=2, one in-process
vLLM worker per rank (``external_launcher``) with vLLM TP=2, weights pushed through vLLM's
weight-transfer API (the gloo engine, small buckets, SHA-256 per tensor). After every one of three
syncs of changed weights, every vLLM parameter, read back from both workers and reassembled from
its TP shards, equals the trainer's tensors exactly (fp32).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from megatron_ngrpo.testing.multiproc import case, run_cases

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _local_weights(worker) -> dict[str, tuple[torch.Tensor, str, list[int]]]:
    """This worker's parameters: name → (shard, how it is split over TP, fused part sizes per
    rank). CPU vLLM repacks linear weights for its GEMM kernels and empties ``weight``: those are
    read back by applying the layer to the identity (fp32: x·1 and + 0 are exact)."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    out = {}
    tp = dist.get_world_size()
    for mname, m in worker.model_runner.model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            if pname == "weight" and p.numel() == 0:
                eye = torch.eye(m.input_size_per_partition, dtype=p.dtype)
                t = m.quant_method.apply(m, eye, None).t().contiguous()
            else:
                t = p.detach().clone()
            if isinstance(m, RowParallelLinear):
                split, parts = ("cols", []) if pname == "weight" else ("replicated", [])
            elif isinstance(m, ColumnParallelLinear):
                split, parts = "rows", [s // tp for s in getattr(m, "output_sizes", [t.shape[0] * tp])]
            elif isinstance(m, VocabParallelEmbedding):
                split, parts = "rows", [t.shape[0]]
            else:
                split, parts = "replicated", []
            out[f"{mname}.{pname}"] = (t, split, parts)
    return out


def _full_vllm_weights(engine) -> dict[str, torch.Tensor]:
    """vLLM's parameters (its fused names) reassembled from both ranks' TP shards."""
    local = engine.llm.collective_rpc(_local_weights)[0]
    shards: list = [None] * dist.get_world_size()
    dist.all_gather_object(shards, local)
    full = {}
    for name, (t0, split, parts) in local.items():
        ts = [s[name][0] for s in shards]
        if split == "replicated":
            assert all(torch.equal(t0, t) for t in ts), f"{name}: replicas differ"
            full[name] = t0
        elif split == "cols":
            full[name] = torch.cat(ts, dim=1)
        else:  # each rank holds [part_0 shard; part_1 shard; ...]
            pieces = [t.split(parts) for t in ts]
            full[name] = torch.cat([pieces[r][i] for i in range(len(parts)) for r in range(len(ts))])
    return full


@case
def vllm_tp2_weights_equal_the_trainers_after_every_sync():
    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.conversion.hf_io import HFCheckpoint
    from megatron_ngrpo.conversion.mapping import export_hf_tensors, load_hf_tensors
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from megatron_ngrpo.rollout.config import VLLMConfig
    from megatron_ngrpo.rollout.vllm_engine import VLLMEngine
    from megatron_ngrpo.testing.tiny import write_tiny_hf

    initialize_model_parallel(2, 1)
    box = [tempfile.mkdtemp(prefix="vllm_sync_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank() == 0:  # head_dim 32 (vLLM's CPU attention takes no smaller heads), 2 KV heads
        write_tiny_hf(box[0], vocab_size=512, hidden_size=128, num_heads=4, num_kv_heads=2, seed=5)
    dist.barrier()
    spec = ArchSpec.from_hf(box[0])
    chunks = build_model(ModelConfig(hf_path=box[0], tensor_parallel=2))
    load_hf_tensors(chunks, spec, HFCheckpoint(box[0]))
    cfg = VLLMConfig(max_model_len=64, kv_cache_memory_bytes=2_000_000, tensor_parallel=2,
                     weight_transfer="gloo", sync_bucket_mb=0.05, verify_weights=True)
    engine = VLLMEngine(box[0], cfg)
    try:
        syncs = []
        for step in range(1, 4):
            with torch.no_grad():  # the same change on every rank (TP-replicated norms stay equal)
                for p in chunks[0].parameters():
                    p.mul_(1.0 + 0.01 * step).add_(0.001 * step)
            engine.sync_weights(chunks)
            want = dict(export_hf_tensors(chunks, spec))
            got = _full_vllm_weights(engine)
            assert got
            for name, t in got.items():
                parts = [name]
                for fused, names in FUSED.items():
                    if f"{fused}." in name:
                        parts = [name.replace(fused, n) for n in names]
                w = torch.cat([want[p] for p in parts])
                assert t.shape[1:] == w.shape[1:] and torch.equal(t[:w.shape[0]], w), f"sync {step}: {name}"
            syncs.append({k: engine.last_sync[k] for k in ("num_params", "buckets")})
        return syncs
    finally:
        engine.close()


if __name__ == "__main__":
    run_cases()
