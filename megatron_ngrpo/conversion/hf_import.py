"""HF → Megatron through THE mapping (:mod:`.mapping`).

* :func:`hf_to_megatron` — an HF state dict (or lazy :class:`~megatron_ngrpo.conversion.hf_io.HFCheckpoint`)
  → this rank's Megatron tensors for its model chunks (TP slice, PP/VPP layer offset, vocab padding).
* :func:`load_hf_tensors` — the same, copied into the chunks' parameters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from tqdm import tqdm

from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.conversion.mapping import Entry, Kind, check_hf_names, entries, fuse, tp_shard


def _hf_shapes(hf: Mapping) -> dict[str, tuple[int, ...]]:
    shapes = getattr(hf, "shapes", None)
    return dict(shapes) if shapes is not None else {k: tuple(v.shape) for k, v in hf.items()}


def hf_to_megatron(
    spec: ArchSpec, hf: Mapping[str, torch.Tensor], chunks: list, source: str = "HF state dict"
) -> Iterator[tuple[Entry, torch.Tensor]]:
    """This rank's Megatron tensors for ``chunks``: yields ``(entry, local tensor)`` with the
    local tensor in the parameter's shape (HF dtype; the caller casts). ``hf`` is a state dict or a
    lazy :class:`HFCheckpoint` (only the tensors this rank needs are read, one at a time). All
    names and shapes are validated first: one :class:`ConversionError` lists every problem."""
    # lazy: keeps conversion.hf_import free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps

    check_hf_names(spec, _hf_shapes(hf), source)
    plan = entries(chunks, spec)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for e in plan:
        padded = e.param.shape[0] * tp if e.rule.kind is Kind.VOCAB else 0
        full = fuse(spec, e.rule.kind, [hf[n] for n in e.rule.hf_names], padded)
        yield e, tp_shard(e.rule.kind, full, tp, rank)


@torch.no_grad()
def load_hf_tensors(
    chunks: list,
    spec: ArchSpec,
    hf: Mapping[str, torch.Tensor],
    source: str = "HF state dict",
    progress: bool = False,
) -> int:
    """Copy ``hf`` into the parameters of ``chunks`` (cast to their dtype); returns the number
    of parameters set. Nothing is copied when validation fails."""

    n = 0
    with tqdm(desc=f"load {source}", unit="param", disable=not progress) as bar:
        for e, local in hf_to_megatron(spec, hf, chunks, source):
            e.param.copy_(local)
            n += 1
            bar.update()
    return n
