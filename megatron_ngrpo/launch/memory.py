"""Expected GPU memory per rank, computed from the model shapes.

Training (megatron-core, bf16 with fp32 main grads, distributed optimizer, 1F1B pipeline):

* weights: 2 B/param (bf16) of the rank's TP/PP shard;
* grads: 4 B/param (fp32 main-grad buffer: megatron accumulates and reduces bf16 grads in fp32);
* optimizer: 12 B/param (fp32 master copy + Adam m + v), sharded over the data-parallel group by
  the distributed optimizer (ZeRO-1): 12/DP B/param. Together the known "6 + 12/d" bytes/param;
* activations of one micro-batch of ``tokens`` tokens per transformer layer, bf16, flash/fused
  attention (no s² scores kept; the TE spec on H100):
  norms' inputs and outputs feeding QKV and FC1: 4h (÷TP with sequence parallelism),
  q/k/v after RoPE: (a + 2g)·d / TP, attention output (o_proj input): a·d / TP,
  FC1 output (gate, up): 2f / TP, SwiGLU output (FC2 input): f / TP;
  with full recomputation only each layer's input (h, ÷TP with SP) is kept, plus one layer's
  working set during its backward. The first pipeline stage holds PP micro-batches in flight
  (1F1B), i.e. all L layers' worth; the last stage holds one;
* logits (last stage): bf16 logits + their fp32 copy + the fp32 softmax kept by
  ``vocab_parallel_cross_entropy``: 10 B per token and local vocabulary row.
  Computing log-probs in token chunks shrinks this term; the estimate assumes one pass.
* a fixed 3 GiB for the CUDA context, NCCL buffers and allocator slack.

vLLM (rollout): weights 2 B/param / vLLM TP, KV cache 2·L·g_local·d·2 B per token
(g_local = max(1, g / TP): KV heads are replicated when TP > g), from the fraction
``gpu_memory_utilization`` of the GPU minus weights and a 2 GiB activation/graph reserve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ngrpo.architecture import ArchSpec, padded_vocab_size

GIB = 2**30
# nvidia-smi's total for an H100 80GB SXM (81559 MiB); vLLM's utilisation fraction applies to it.
H100_BYTES = 81559 * 2**20
OVERHEAD_BYTES = 3 * GIB
VLLM_RESERVE_BYTES = 2 * GIB

BF16, FP32 = 2, 4
GRAD_BYTES = FP32
ADAM_BYTES = 3 * FP32
LOGIT_BYTES = BF16 + FP32 + FP32


@dataclass(frozen=True)
class TrainLayout:
    """Parallel layout and micro-batch of one training rank."""

    tp: int
    pp: int
    dp: int
    tokens: int  # tokens per micro-batch (sequences × length)
    sequence_parallel: bool = True
    recompute: bool = True
    make_vocab_size_divisible_by: int = 128


@dataclass(frozen=True)
class TrainMemory:
    """Bytes per rank on the busiest pipeline stage."""

    params: int  # parameters held by the rank
    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    overhead: int

    @property
    def total(self) -> int:
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits
                + self.overhead)


@dataclass(frozen=True)
class VLLMMemory:
    """Bytes per GPU of one vLLM engine rank and the KV-cache capacity that leaves."""

    reserved: int  # gpu_memory_utilization × GPU
    weights: int
    kv_bytes_per_token: int
    kv_cache: int

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_cache) // self.kv_bytes_per_token


def layer_params(spec: ArchSpec, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank (norms are replicated)."""
    qkv_out = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    sharded = (spec.hidden_size * qkv_out + (qkv_out if spec.qkv_bias else 0)
               + spec.num_heads * spec.head_dim * spec.hidden_size
               + 3 * spec.hidden_size * spec.ffn_hidden_size)
    replicated = 2 * spec.hidden_size + (2 * spec.head_dim if spec.qk_norm else 0)
    return sharded // tp + replicated


def stage_params(spec: ArchSpec, tp: int, pp: int, stage: int, divisible_by: int = 128) -> int:
    """Parameters on pipeline stage ``stage`` of one TP rank. With tied embeddings and PP > 1
    the last stage keeps its own copy of the output (= embedding) matrix, as megatron does."""
    vocab_rows = padded_vocab_size(spec.vocab_size, tp, divisible_by) // tp
    n = spec.num_layers // pp * layer_params(spec, tp)
    first, last = stage == 0, stage == pp - 1
    if first:
        n += vocab_rows * spec.hidden_size
    if last:
        n += spec.hidden_size  # final norm
        if not spec.tied_embeddings or not first:
            n += vocab_rows * spec.hidden_size
    return n


def model_params(spec: ArchSpec) -> int:
    """Total parameters (HF count: the tied matrix once)."""
    return stage_params(spec, 1, 1, 0, divisible_by=1)


def layer_activation_bytes(spec: ArchSpec, tokens: int, tp: int, sequence_parallel: bool) -> int:
    """bf16 activations one layer keeps for its backward (see the module docstring)."""
    sp = tp if sequence_parallel else 1
    d, a, g = spec.head_dim, spec.num_heads, spec.num_kv_heads
    per_token = (4 * spec.hidden_size / sp
                 + ((a + 2 * g) * d + a * d + 3 * spec.ffn_hidden_size) / tp)
    return int(BF16 * tokens * per_token)


def activation_bytes(spec: ArchSpec, layout: TrainLayout, stage: int = 0) -> int:
    """Activations on pipeline stage ``stage``: under 1F1B it holds PP − stage micro-batches in
    flight, so the first stage keeps all L layers' worth."""
    layers_in_flight = spec.num_layers // layout.pp * (layout.pp - stage)
    full = layer_activation_bytes(spec, layout.tokens, layout.tp, layout.sequence_parallel)
    if not layout.recompute:
        return layers_in_flight * full
    sp = layout.tp if layout.sequence_parallel else 1
    layer_input = BF16 * layout.tokens * spec.hidden_size // sp
    return layers_in_flight * layer_input + full


def logits_bytes(spec: ArchSpec, layout: TrainLayout) -> int:
    vocab = padded_vocab_size(spec.vocab_size, layout.tp, layout.make_vocab_size_divisible_by)
    return LOGIT_BYTES * layout.tokens * vocab // layout.tp


def train_memory(spec: ArchSpec, layout: TrainLayout) -> TrainMemory:
    """Expected training memory of the busiest rank: the larger of the first stage (embedding,
    most activations) and the last stage (output layer, logits)."""
    best = None
    for stage in sorted({0, layout.pp - 1}):
        params = stage_params(spec, layout.tp, layout.pp, stage, layout.make_vocab_size_divisible_by)
        mem = TrainMemory(
            params=params,
            weights=BF16 * params,
            grads=GRAD_BYTES * params,
            optimizer=math.ceil(ADAM_BYTES * params / layout.dp),
            activations=activation_bytes(spec, layout, stage),
            logits=logits_bytes(spec, layout) if stage == layout.pp - 1 else 0,
            overhead=OVERHEAD_BYTES,
        )
        if best is None or mem.total > best.total:
            best = mem
    return best


def vllm_memory(spec: ArchSpec, tp: int, gpu_memory_utilization: float,
                gpu_bytes: int = H100_BYTES) -> VLLMMemory:
    """Weights and KV-cache capacity of one vLLM engine rank."""
    kv_heads = max(1, spec.num_kv_heads // tp)
    kv_per_token = 2 * spec.num_layers * kv_heads * spec.head_dim * BF16
    reserved = int(gpu_memory_utilization * gpu_bytes)
    weights = BF16 * model_params(spec) // tp
    return VLLMMemory(reserved=reserved, weights=weights, kv_bytes_per_token=kv_per_token,
                      kv_cache=reserved - weights - VLLM_RESERVE_BYTES)
