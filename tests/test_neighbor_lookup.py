"""On-demand neighbour rows (mixing/neighbors.py ``NeighborLookup``) on the real SmolLM2-135M-
Instruct embedding (V = 49,152, d = 576): equal, bit for bit, to the full table's rows and to the
float64 reference, at TP 1 here and TP 2 / 3 in one 6-process launch
(tests/dist/neighbor_lookup_worker.py); only the queried anchors are ever searched.
"""

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_ngrpo.config_loader import ConfigError, validate
from megatron_ngrpo.mixing.config import MixingConfig
from megatron_ngrpo.mixing.neighbors import NeighborLookup, build_neighbor_table, exclusion_mask
from tests.harness.multiproc import check, launch
from tests.harness.reference import neighbor_table64

MODEL = (
    Path(os.environ.get("NGRPO_MODELS", "/root/.cache/megatron_ngrpo/models"))
    / "SmolLM2-135M-Instruct"
)
WORKER = Path(__file__).parent / "dist" / "neighbor_lookup_worker.py"
METRICS = ("cosine", "l2", "l1", "dot")


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The real embedding, its exclusions (special tokens), 40 anchors (frequent-looking low ids,
    random ids, an excluded one, repeats), the full cosine table and float64 reference rows."""
    if not (MODEL / "model.safetensors").exists():
        pytest.skip(f"real model not built at {MODEL}")
    from transformers import AutoTokenizer

    from megatron_ngrpo.data.tokenizer import special_token_ids

    with safe_open(str(MODEL / "model.safetensors"), "pt") as f:
        weight = f.get_tensor("model.embed_tokens.weight").float()
    special = special_token_ids(AutoTokenizer.from_pretrained(str(MODEL)))
    exclude = exclusion_mask(weight.shape[0], MixingConfig(), weight.shape[0], special)
    g = torch.Generator().manual_seed(0)
    anchors = torch.cat(
        [
            torch.tensor([special[0], 198, 30, 30, 284, 198]),
            torch.randint(0, weight.shape[0], (34,), generator=g),
        ]
    )
    table = build_neighbor_table(weight, 0, 3, "cosine", exclude)
    ref = {"weight": weight, "exclude": exclude, "anchors": anchors, "table": table[anchors]}
    for metric in METRICS:
        ref[f"ref64_{metric}"] = neighbor_table64(weight, 3, metric, exclude, rows=anchors.tolist())
    path = tmp_path_factory.mktemp("lookup") / "ref.pt"
    torch.save(ref, path)
    return ref, path


@pytest.mark.parametrize("metric", METRICS)
def test_lookup_tp1_equals_table_and_float64(real, metric):
    ref, _ = real
    lookup = NeighborLookup(ref["weight"], 0, 3, metric, ref["exclude"])
    anchors = ref["anchors"]
    for batch in (anchors[:1], anchors[:1], anchors[1:8], anchors):
        lookup.ensure(batch)
    got = lookup.rows(anchors)
    assert torch.equal(got, ref[f"ref64_{metric}"])
    if metric == "cosine":
        assert torch.equal(got, ref["table"])
    distinct = len(torch.unique(anchors))
    assert (
        lookup.rows_computed == distinct == int(lookup.known.sum())
    )  # searched once each, nothing else
    assert bool((lookup.cache[~lookup.known] == -1).all())


def test_lookup_tp2_tp3_equal_table_and_float64(real):
    _, path = real
    results = launch(WORKER, nproc=6, env={"NGRPO_LOOKUP_REF": str(path)})
    for name in ("lookup_tp2", "lookup_tp3"):
        assert check(results, name) == {m: len(torch.unique(real[0]["anchors"])) for m in METRICS}


def test_lookup_mode_rule_and_validation():
    cfg = MixingConfig(rate=0.1)
    assert cfg.lookup_mode(16 * 48, 49152) == "on_demand"  # SmolLM2 bench step on CPU
    assert (
        cfg.lookup_mode(16 * 48, 49152, "cuda") == "table"
    )  # the whole table takes 0.15 s on an H100
    assert cfg.lookup_mode(512 * 4096, 152064) == "table"  # 7B-scale step
    assert MixingConfig(rate=0.1, refresh_every=2).lookup_mode(16, 49152) == "table"
    assert MixingConfig(neighbor_lookup="table").lookup_mode(1, 49152) == "table"
    with pytest.raises(ConfigError, match="neighbor_lookup"):
        validate(MixingConfig(neighbor_lookup="lazy"))
    with pytest.raises(ConfigError, match="refresh_every"):
        validate(MixingConfig(neighbor_lookup="on_demand", refresh_every=0))
