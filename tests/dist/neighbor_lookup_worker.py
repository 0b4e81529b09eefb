"""Cases of the on-demand neighbour lookup on the real SmolLM2-135M-Instruct embedding
(49,152 × 576), run under one 6-process torchrun launch (tests/test_neighbor_lookup.py): each TP
rank holds its vocab partition, the anchors' rows are searched on demand and merged across
ranks, and must equal the full table's rows and the float64 reference (file ``NGRPO_LOOKUP_REF``,
written by the test module).
"""

from __future__ import annotations

import os

import torch

from megatron_ngrpo.mixing.neighbors import NeighborLookup
from megatron_ngrpo.parallel import initialize_model_parallel
from tests.harness.multiproc import case, run_cases

# Anchor batches as decode steps would send them: single anchors, repeats, a larger batch.
BATCHES = [slice(0, 1), slice(0, 1), slice(1, 8), slice(0, 40)]


def _lookup_matches(tp: int) -> dict:
    from megatron.core import parallel_state as ps

    ref = torch.load(os.environ["NGRPO_LOOKUP_REF"], weights_only=True)
    initialize_model_parallel(tp=tp)
    rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    weight = ref["weight"]
    n = weight.shape[0] // tp
    part = weight[rank * n : (rank + 1) * n]
    anchors = ref["anchors"]
    computed = {}
    for metric in ("cosine", "l2", "l1", "dot"):
        lookup = NeighborLookup(part, rank * n, 3, metric, ref["exclude"], tp_group=group)
        for b in BATCHES:
            got = lookup.rows(anchors[b])
            assert torch.equal(got, ref[f"ref64_{metric}"][b]), (
                f"tp={tp} {metric}: {got[(got != ref[f'ref64_{metric}'][b]).any(1)][:3].tolist()}"
            )
            if metric == "cosine":
                assert torch.equal(got, ref["table"][b]), (
                    f"tp={tp}: on-demand rows differ from the full table's"
                )
        # only the distinct anchors were searched, each once (no silent full table)
        assert lookup.rows_computed == len(torch.unique(anchors)), lookup.rows_computed
        assert int(lookup.known.sum()) == lookup.rows_computed
        computed[metric] = lookup.rows_computed
    return computed


@case
def lookup_tp2():
    return _lookup_matches(2)


@case
def lookup_tp3():
    return _lookup_matches(3)


if __name__ == "__main__":
    run_cases()
