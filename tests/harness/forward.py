"""A model's full forward by hand, for parity tests against transformers: every (virtual)
pipeline stage in turn, hidden states sent point-to-point, logits gathered over TP."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_ngrpo.architecture import unwrap


@torch.no_grad()
def megatron_logits(chunks: list, tokens: torch.Tensor) -> torch.Tensor | None:
    """Forward through all (virtual) pipeline stages by hand: [b, s, padded vocab] on the ranks of
    the last stage, None elsewhere."""
    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    group = ps.get_pipeline_model_parallel_group()
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).view(1, 1, s, s)
    hidden, out = None, None
    for vstage in range(pp * len(chunks)):
        owner = vstage % pp
        if pp > 1 and vstage > 0 and rank == owner:
            hidden = torch.empty(s, b, unwrap(chunks[0]).config.hidden_size)
            dist.recv(hidden, dist.get_global_rank(group, (vstage - 1) % pp), group=group)
        if rank == owner:
            chunk = unwrap(chunks[vstage // pp])
            chunk.set_input_tensor(hidden)
            res = chunk(tokens, pos, mask, runtime_gather_output=True)
            if vstage == pp * len(chunks) - 1:
                out = res
            elif pp > 1:
                dist.send(
                    res.contiguous(), dist.get_global_rank(group, (vstage + 1) % pp), group=group
                )
            else:
                hidden = res
    return out
