"""The output layer of a last-stage GPTModel, able to hand back its input instead of the logits.

Replay and training need only ``log p(label)`` (and the entropy) per token, not the [tokens, V/TP]
logits: megatron's output layer would write them in the model dtype, ``GPTModel`` copy them to
[b, s, V/TP] and ``Float16Module`` again in fp32 (at the 1.5B shape, 4096 tokens and a 151,936-row
vocabulary: 1.2 + 1.2 + 2.3 GiB, and the same again for their gradients). Within
:func:`hidden_output` the output layer returns the hidden states it would multiply, in the TP
region the logits would be computed in (all-gathered over the sequence under sequence
parallelism; its backward reduce-scatters, or all-reduces without SP, exactly megatron's
column-parallel input path), so the model returns [b, s, h]; :class:`OutputHead` carries them
with this rank's vocabulary rows of the output weight to ``grpo/token_logprobs.py``, which
computes the log-probs chunk by chunk.

``GPTModel`` builds its output layer internally (no spec hook), so :func:`install_output_head`
swaps the class of that module in place (parameters, tied weights and checkpoint keys are
unchanged), as ``mixing.embedding.install_mixing_embedding`` does for the word embedding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron_ngrpo.architecture import unwrap


@dataclass
class OutputHead:
    """What the last stage hands the log-prob pass instead of logits.

    ``hidden`` [..., h]: the output layer's input (fp32 from ``Float16Module``, model dtype
    otherwise); ``weight`` [V/TP, h]: this rank's rows of the output (or tied embedding) matrix,
    the first being global id ``vocab_start``; ``group``: the TP group. The logits would be
    ``hidden @ weight.T``. ``batch_invariant``: the model runs the batch-invariant forward
    (models/batch_invariant.py), so the log-probs take its log-softmax."""

    hidden: torch.Tensor
    weight: torch.nn.Parameter
    vocab_start: int
    group: torch.distributed.ProcessGroup
    batch_invariant: bool = False


class HiddenOutputLayer(ColumnParallelLinear):
    """megatron's ``ColumnParallelLinear`` output layer; within :func:`hidden_output` its forward
    returns ``(input in the logits' TP region, None)`` instead of ``(logits, None)``."""

    _defer: bool = False

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if not self._defer:
            return super().forward(input_, weight, runtime_gather_output)
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                input_, tensor_parallel_output_grad=True, group=self.tp_group
            )
        else:
            hidden = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
            if hidden.requires_grad:
                # GPTModel transposes the output, so the gradient arrives non-contiguous, and
                # megatron's backward all-reduce (mappings._reduce) reduces a contiguous copy of
                # such a tensor and returns the original unreduced.
                hidden.register_hook(torch.Tensor.contiguous)
        return hidden, None


def install_output_head(model) -> HiddenOutputLayer:
    """Turn the output layer of a last-stage GPTModel into a :class:`HiddenOutputLayer`, in place."""
    layer = model.output_layer
    if not isinstance(layer, ColumnParallelLinear):
        raise TypeError(f"expected a ColumnParallelLinear, found {type(layer).__name__}")
    layer.__class__ = HiddenOutputLayer
    return layer


@contextlib.contextmanager
def hidden_output(model):
    """Within the block, ``model`` (a possibly wrapped chunk) returns hidden states [b, s, h]
    instead of logits when it is a last stage; :func:`output_head` wraps them."""
    layer = getattr(unwrap(model), "output_layer", None)
    if not isinstance(layer, HiddenOutputLayer):
        yield
        return
    layer._defer = True
    try:
        yield
    finally:
        layer._defer = False


def output_head(model, hidden: torch.Tensor) -> OutputHead:
    """``hidden`` (what ``model`` returned within :func:`hidden_output`) with the matrix that
    would turn it into logits: the tied word embedding or the output layer's own weight."""
    inner = unwrap(model)
    layer = inner.output_layer
    weight = (
        inner.shared_embedding_or_output_weight()
        if inner.share_embeddings_and_output_weights
        else layer.weight
    )
    return OutputHead(
        hidden=hidden,
        weight=weight,
        vocab_start=layer.tp_group.rank() * weight.shape[0],
        group=layer.tp_group,
        batch_invariant=getattr(inner, "batch_invariant", False),
    )
