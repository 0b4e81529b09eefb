"""Expected memory per rank, computed from the model shapes: the GPU plan of a recipe, and with
the CPU parameters the peak of a tiny CPU run (tests/test_memory_model.py compares both with a
measured peak; docs/LAUNCHING.md).

Training (megatron-core, fp32 main grads, Adam, 1F1B pipeline), on the busiest rank:

* weights: ``param_bytes``/param (bf16 on GPU, fp32 on CPU) of the rank's TP/PP shard;
* grads: 4 B/param (fp32 main-grad buffer: megatron accumulates and reduces grads in fp32);
* optimizer: Adam m + v (8 B/param) plus an fp32 master copy (4 B/param) when the weights are
  16-bit, sharded over the data-parallel group by the distributed optimizer (ZeRO-1). On GPU
  together the known "6 + 12/d" bytes/param;
* saved activations: what each layer keeps for its backward, for every layer in flight (the first
  pipeline stage holds PP micro-batches under 1F1B, i.e. all L layers' worth; the last stage
  one). A layer's full set per token (elements, activation dtype): norms' inputs and outputs
  feeding QKV and FC1 ``4h`` (÷TP with sequence parallelism), q/k/v after RoPE ``(a + 2g)·d / TP``,
  the attention output ``a·d / TP``, FC1's gate/up output ``2f / TP``, SwiGLU's output ``f / TP``.
  With full recomputation a layer keeps only its input (``h``, ÷TP with SP);
* working set: with recomputation, one layer's full set again while its backward runs (the MLP's
  backward comes first; at the attention's backward the MLP side is already freed); the SwiGLU
  MLP's backward holds :data:`MLP_BACKWARD_FFN` FFN-sized gradients beside it (with or without
  recomputation);
* log-prob pass (last stage): the logits are never formed whole (grpo/token_logprobs.py computes
  them from the hidden states chunk by chunk): its peak is one chunk's buffers, forward (the
  chunk's logits in the activation dtype, z/τ and its exponentials in fp32) or backward (the
  chunk's gradient in the activation dtype beside the recomputed fp32 chunk, then beside the
  output matrix's gradient of that chunk, [V/TP, h], before it is added to the fp32 main grad;
  :func:`logprob_pass_bytes`). It and a layer's
  recomputed backward never overlap (the pass ends before the first layer's backward), so the
  peak holds the larger of the two;
* attention: fused attention keeps no s² scores: TE's on GPU, and torch SDPA in the local spec
  (``model.attention: sdpa``, the default; models/attention.py). megatron's unfused attention
  (``model.attention: unfused``) keeps the softmax input and output (2 × a·s² per sequence) and,
  during that layer's backward, their two gradients (:data:`UNFUSED_S2_COPIES` in all);
* a fixed 3 GiB on GPU for the CUDA context, NCCL buffers and allocator slack;
* ``train.reference: copy``: a second model's weights (frozen, no grads), the rank's shard;
* a separate rollout copy of the weights (the Megatron engine with ``rollout.separate_copy``, or
  beside the trainer for one-step-off rollouts), the rank's shard;
* the built-in Megatron engine's KV cache (megatron's ``StaticInferenceContext``): rows ×
  (prompt + max_new_tokens) × L/PP layers × 2 (k, v) × max(1, g/TP) × d × activation bytes.
  Synchronous rollouts generate while no training activations exist (a phase of its own); one-step-
  off rollouts generate beside the training step (added to it);
* the weight-sync sender (routes with buckets: vLLM's gloo / ipc, rollout.remote's http / gloo /
  nccl): the bucket of gathered tensors it holds plus one full HF tensor being gathered (the
  largest: the embedding or an MLP matrix). Colocated vLLM: every rank sends to its own worker;
  remote: global rank 0 (first stage) only, with one packed buffer per server on the nccl route.
  Weights are synced between steps, so this is a phase of its own too.

Context parallelism (``cp``) divides every per-token term by cp (each rank holds 1/cp of each
sequence) and shards the distributed optimizer over DP × CP.

vLLM (rollout): weights 2 B/param / vLLM TP (FP8 rollouts: 1 B per linear-layer weight), KV cache 2·L·g_local·d·2 B per token
(g_local = max(1, g / TP): KV heads are replicated when TP > g), from the fraction
``gpu_memory_utilization`` of the GPU minus weights and a 2 GiB activation/graph reserve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ngrpo.architecture import ArchSpec, padded_vocab_size
from megatron_ngrpo.grpo.token_logprobs import chunk_rows

GIB = 2**30
# nvidia-smi's total for an H100 80GB SXM (81559 MiB); vLLM's utilisation fraction applies to it.
H100_BYTES = 81559 * 2**20
# What a plan may use: 95 % of the GPU (fragmentation, NCCL's own growth).
H100_USABLE_BYTES = int(0.95 * H100_BYTES)
OVERHEAD_BYTES = 3 * GIB
VLLM_RESERVE_BYTES = 2 * GIB

FP8, BF16, FP32 = 1, 2, 4
GRAD_BYTES = FP32
ADAM_BYTES = 2 * FP32  # m, v
# s²-sized tensors per head and sequence of megatron's unfused (local-spec) attention at a layer's
# backward: softmax input and output kept, and their gradients (measured on CPU).
UNFUSED_S2_COPIES = 4
# FFN-sized (f/TP per token) gradients the SwiGLU MLP's backward holds beside the layer's saved
# set: the gated product's, the gate's and the up projection's, and their concatenation into FC1's
# output gradient (measured on CPU: tests/test_memory_model.py, the SDPA shape).
MLP_BACKWARD_FFN = 4


@dataclass(frozen=True)
class TrainLayout:
    """Parallel layout, micro-batch and number formats of one training rank (GPU defaults)."""

    tp: int
    pp: int
    dp: int
    tokens: int  # tokens per micro-batch (sequences × length)
    # Context parallelism: each sequence split over cp ranks (activations, logits ÷ cp; the
    # distributed optimizer shards over DP × CP).
    cp: int = 1
    sequence_parallel: bool = True
    recompute: bool = True
    make_vocab_size_divisible_by: int = 128
    distributed_optimizer: bool = True
    param_bytes: int = BF16  # weights and activations: bf16 on GPU, fp32 on CPU
    # 0: fused attention (TE, or torch SDPA in the local spec). > 0: megatron's unfused local-spec
    # attention (model.attention: unfused) on sequences of this length (the s² scores it keeps).
    unfused_seq_len: int = 0
    overhead: int = OVERHEAD_BYTES
    reference_copy: bool = False  # train.reference: copy (and a KL term that needs it)
    engine_copy: bool = False  # the Megatron engine generates with a separate weight copy
    # Megatron engine's KV cache: rows decoded at once on this rank and their longest sequence
    # (0: no engine on the trainer's devices); generated beside the training step (one-step-off).
    kv_rows: int = 0
    kv_seq_len: int = 0
    kv_beside_training: bool = False
    # Weight-sync sender: bytes of the buckets it holds (0: no bucketed sender), and whether only
    # global rank 0 (first stage) sends (rollout.remote) or every rank (colocated vLLM).
    sync_bucket_bytes: int = 0
    sync_rank0_only: bool = False


@dataclass(frozen=True)
class TrainMemory:
    """Bytes per rank on the busiest pipeline stage."""

    params: int  # parameters held by the rank
    weights: int
    grads: int
    optimizer: int
    activations: int  # kept for the backward by every layer in flight
    working: int  # one layer's backward: recomputed set (with recompute) and gradients
    logits: int  # the log-prob pass's chunk buffers
    overhead: int
    reference: int = 0  # train.reference: copy
    engine_copy: int = 0  # the rollout engine's separate weights
    kv_cache: int = 0  # the Megatron engine's KV cache
    kv_beside_training: bool = False
    sender: int = 0  # weight-sync buckets and one gathered tensor

    @property
    def total(self) -> int:
        training = self.activations + max(self.working, self.logits)
        if self.kv_beside_training:
            training += self.kv_cache
        phases = (training, 0 if self.kv_beside_training else self.kv_cache, self.sender)
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.reference
            + self.engine_copy
            + max(phases)
            + self.overhead
        )


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
    sharded = (
        spec.hidden_size * qkv_out
        + (qkv_out if spec.qkv_bias else 0)
        + spec.num_heads * spec.head_dim * spec.hidden_size
        + 3 * spec.hidden_size * spec.ffn_hidden_size
    )
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


def _layer_elements(spec: ArchSpec, layout: TrainLayout) -> tuple[float, float, float]:
    """Per token, the elements one layer keeps for its backward: (attention side, MLP side, one
    s²-sized tensor of unfused attention)."""
    sp = layout.tp if layout.sequence_parallel else 1
    d, a, g = spec.head_dim, spec.num_heads, spec.num_kv_heads
    attention = 2 * spec.hidden_size / sp + ((a + 2 * g) * d + a * d) / layout.tp
    mlp = 2 * spec.hidden_size / sp + 3 * spec.ffn_hidden_size / layout.tp
    # a/TP heads × s columns per token (rows × s = tokens).
    scores = a / layout.tp * layout.unfused_seq_len
    return attention, mlp, scores


def _rank_tokens(layout: TrainLayout) -> float:
    """Tokens of one micro-batch on one rank: each CP rank holds 1/cp of every sequence."""
    return layout.tokens / layout.cp


def layer_activation_bytes(spec: ArchSpec, layout: TrainLayout) -> int:
    """Activations one layer keeps for its backward without recomputation (see the module
    docstring; unfused attention: the softmax input and output), in the activation dtype."""
    attention, mlp, scores = _layer_elements(spec, layout)
    return int(layout.param_bytes * _rank_tokens(layout) * (attention + mlp + 2 * scores))


def activation_bytes(spec: ArchSpec, layout: TrainLayout, stage: int = 0) -> int:
    """Saved activations on pipeline stage ``stage``: under 1F1B it holds PP − stage
    micro-batches in flight, so the first stage keeps all L layers' worth."""
    layers_in_flight = spec.num_layers // layout.pp * (layout.pp - stage)
    if not layout.recompute:
        return layers_in_flight * layer_activation_bytes(spec, layout)
    sp = layout.tp if layout.sequence_parallel else 1
    return int(
        layers_in_flight * (layout.param_bytes * _rank_tokens(layout) * spec.hidden_size // sp)
    )


def working_bytes(spec: ArchSpec, layout: TrainLayout) -> int:
    """What one layer's backward holds beyond the saved activations: with recomputation its
    recomputed full set, without only its own gradients (the set is counted as saved). The
    backward runs the MLP first (its gradients beside the full set), then attention: at the
    attention's backward the MLP side is freed and unfused attention holds its scores'
    gradients too."""
    attention, mlp, scores = _layer_elements(spec, layout)
    mlp_backward = MLP_BACKWARD_FFN * spec.ffn_hidden_size / layout.tp
    if layout.recompute:
        elements = max(
            attention + mlp + 2 * scores + mlp_backward,
            attention + UNFUSED_S2_COPIES * scores,
        )
    else:
        elements = max(mlp_backward, (UNFUSED_S2_COPIES - 2) * scores)
    return int(layout.param_bytes * _rank_tokens(layout) * elements)


def logprob_pass_bytes(rows: int, vocab_local: int, hidden: int, act_bytes: int) -> int:
    """Peak of the log-prob pass of ``rows`` tokens over ``vocab_local`` output rows (this rank's)
    beyond what exists before it: one chunk's buffers (see the module docstring). Forward: the
    chunk's logits (activation dtype) beside z/τ and its exponentials (fp32; a float32 chunk is
    its own z/τ). Backward: the hidden states' gradient [rows, h], and the recomputed chunk in
    fp32 beside its gradient in the activation dtype, then that gradient beside the weight
    gradient of the chunk, [V/TP, h] (all in the activation dtype)."""
    chunk = chunk_rows(rows, vocab_local) * vocab_local
    narrow = act_bytes if act_bytes < FP32 else 0
    forward = (narrow + 2 * FP32) * chunk
    backward = act_bytes * rows * hidden + max(
        (FP32 + narrow) * chunk, act_bytes * (chunk + vocab_local * hidden)
    )
    return max(forward, backward)


def logits_bytes(spec: ArchSpec, layout: TrainLayout) -> int:
    """The log-prob pass of one micro-batch (last stage): :func:`logprob_pass_bytes`."""
    vocab = padded_vocab_size(spec.vocab_size, layout.tp, layout.make_vocab_size_divisible_by)
    return logprob_pass_bytes(
        int(_rank_tokens(layout)), vocab // layout.tp, spec.hidden_size, layout.param_bytes
    )


def kv_cache_bytes(spec: ArchSpec, layout: TrainLayout) -> int:
    """The Megatron engine's KV cache on one TP/PP rank: [seq, rows, g_local, d] keys and values
    per layer of the stage, in the activation dtype."""
    kv_heads = max(1, spec.num_kv_heads // layout.tp)
    layers = spec.num_layers // layout.pp
    per_token = 2 * layers * kv_heads * spec.head_dim * layout.param_bytes
    return layout.kv_rows * layout.kv_seq_len * per_token


def sender_bytes(spec: ArchSpec, layout: TrainLayout) -> int:
    """The weight-sync sender's peak: its buckets plus the largest full HF tensor being gathered
    (the embedding / output matrix or one MLP matrix); 0 without a bucketed route."""
    if not layout.sync_bucket_bytes:
        return 0
    largest = spec.hidden_size * max(spec.vocab_size, spec.ffn_hidden_size)
    return layout.sync_bucket_bytes + layout.param_bytes * largest


def optimizer_bytes_per_param(layout: TrainLayout) -> float:
    """Adam's moments plus an fp32 master copy of 16-bit weights, ÷DP×CP when distributed."""
    master = FP32 if layout.param_bytes < FP32 else 0
    return (ADAM_BYTES + master) / (layout.dp * layout.cp if layout.distributed_optimizer else 1)


def stage_memory(spec: ArchSpec, layout: TrainLayout, stage: int, rank0: bool) -> TrainMemory:
    """Expected memory of a rank on pipeline stage ``stage``; ``rank0``: global rank 0 (the
    weight-sync sender of rollout.remote)."""
    params = stage_params(spec, layout.tp, layout.pp, stage, layout.make_vocab_size_divisible_by)
    return TrainMemory(
        params=params,
        weights=layout.param_bytes * params,
        grads=GRAD_BYTES * params,
        optimizer=math.ceil(optimizer_bytes_per_param(layout) * params),
        activations=activation_bytes(spec, layout, stage),
        working=working_bytes(spec, layout),
        logits=logits_bytes(spec, layout) if stage == layout.pp - 1 else 0,
        overhead=layout.overhead,
        reference=layout.param_bytes * params if layout.reference_copy else 0,
        engine_copy=layout.param_bytes * params if layout.engine_copy else 0,
        kv_cache=kv_cache_bytes(spec, layout),
        kv_beside_training=layout.kv_beside_training,
        sender=sender_bytes(spec, layout) if rank0 or not layout.sync_rank0_only else 0,
    )


def train_memory(spec: ArchSpec, layout: TrainLayout) -> TrainMemory:
    """Expected training memory of the busiest rank: the larger of the first stage (embedding,
    most activations, global rank 0) and the last stage (output layer, logits)."""
    stages = sorted({0, layout.pp - 1})
    return max((stage_memory(spec, layout, s, rank0=s == 0) for s in stages), key=lambda m: m.total)


def vllm_memory(
    spec: ArchSpec,
    tp: int,
    gpu_memory_utilization: float,
    gpu_bytes: int = H100_BYTES,
    quantization: str | None = None,
) -> VLLMMemory:
    """Weights and KV-cache capacity of one vLLM engine rank. ``quantization="fp8"``: vLLM's
    online FP8 stores the transformer layers' linear weights in 1 byte (norms, embedding and
    output matrix stay bf16); the KV cache stays bf16."""
    kv_heads = max(1, spec.num_kv_heads // tp)
    kv_per_token = 2 * spec.num_layers * kv_heads * spec.head_dim * BF16
    reserved = int(gpu_memory_utilization * gpu_bytes)
    weights = BF16 * model_params(spec) // tp
    if quantization == "fp8":
        qkv_out = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        linear = (
            spec.num_layers
            * spec.hidden_size
            * (qkv_out + spec.num_heads * spec.head_dim + 3 * spec.ffn_hidden_size)
        )
        weights -= (BF16 - FP8) * linear // tp
    return VLLMMemory(
        reserved=reserved,
        weights=weights,
        kv_bytes_per_token=kv_per_token,
        kv_cache=reserved - weights - VLLM_RESERVE_BYTES,
    )
