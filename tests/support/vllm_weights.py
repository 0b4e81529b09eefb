"""Read a live vLLM engine's weights back and compare them with HF tensors, and push fixed tensors
into one (tests only).

vLLM holds q/k/v and gate/up fused (``qkv_proj``, ``gate_up_proj``), each rank one TP shard per
fused part, and CPU vLLM repacks linear weights for its GEMM kernels and empties ``weight``: those
are read back by applying the layer to the identity (fp32: x·1 and + 0 are exact).
"""

from __future__ import annotations

import torch
from vllm.distributed.weight_transfer import base

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _local_weights(worker) -> dict[str, tuple[torch.Tensor, str, list[int]]]:
    """This worker's parameters: name → (shard, how it is split over vLLM's TP, fused part sizes
    per rank)."""
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    tp = get_tensor_model_parallel_world_size()
    out = {}
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
                split, parts = (
                    "rows",
                    [s // tp for s in getattr(m, "output_sizes", [t.shape[0] * tp])],
                )
            elif isinstance(m, VocabParallelEmbedding):
                split, parts = "rows", [t.shape[0]]
            else:
                split, parts = "replicated", []
            out[f"{mname}.{pname}"] = (t, split, parts)
    return out


def vllm_weights(llm, group=None) -> dict[str, torch.Tensor]:
    """The parameters of the in-process worker of ``llm`` (``vllm.LLM``), vLLM's fused names,
    reassembled from the TP shards of every rank of ``group`` (the ranks of one colocated vLLM TP
    group, in TP order; None: a single worker)."""
    import torch.distributed as dist

    local = llm.collective_rpc(_local_weights)[0]
    shards = [local]
    if group is not None and dist.get_world_size(group) > 1:
        shards = [None] * dist.get_world_size(group)
        dist.all_gather_object(shards, local, group=group)
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
            full[name] = torch.cat(
                [pieces[r][i] for i in range(len(parts)) for r in range(len(ts))]
            )
    return full


def assert_equal_to_hf(
    got: dict[str, torch.Tensor], hf: dict[str, torch.Tensor], where: str = ""
) -> None:
    """Every vLLM parameter in ``got`` equals the HF tensors it is made of, exactly (vocabulary
    padding rows beyond the HF rows are not compared)."""
    assert got
    for name, t in got.items():
        parts = [name]
        for fused, names in FUSED.items():
            if f"{fused}." in name:
                parts = [name.replace(fused, n) for n in names]
        want = torch.cat([hf[p] for p in parts])
        assert t.shape[1:] == want.shape[1:] and torch.equal(t[: want.shape[0]], want), (
            f"{where}{name}"
        )


class NamedSource(base.WeightSource):
    """A fixed list of ``(name, tensor)`` pairs as a vLLM ``WeightSource`` (what
    ``VLLMEngine.push_weights`` takes)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        self.named = named

    def metadata(self) -> list:
        return [base.ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.named]

    def __iter__(self):
        return iter(self.named)
