"""DRA embedders and the bounded reward adjustment: the policy's pooled hidden states under TP /
SP / PP (one 2-process launch, tests/dist/dra_worker.py) and a local sentence-embedding model
(a tiny BERT written here), both against float64 references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ngrpo.config_loader import ConfigError, load
from megatron_ngrpo.grpo.config import DRAConfig
from megatron_ngrpo.grpo.dra import LocalModelEmbedder, dra_rewards, similarity, text_embedder
from tests.harness.multiproc import check, launch
from tests.harness.tiny import write_tiny_bert

WORKER = Path(__file__).parent / "dist" / "dra_worker.py"
CASES = [
    "hidden_means_tp2",
    "hidden_means_tp2_sequence_parallel",
    "hidden_means_pp2",
    "hidden_means_own_pass_without_replay",
]


@pytest.fixture(scope="module")
def dist_results():
    return launch(WORKER, nproc=2, timeout=600)


@pytest.mark.parametrize("name", CASES)
def test_policy_hidden_means_match_float64_reference(dist_results, name):
    assert check(dist_results, name) < 1e-4


def test_dra_multiplier_is_bounded_with_negative_similarities():
    e = torch.tensor([[1.0, 0.0], [-1.0, 0.01], [-0.9, -0.5], [1.0, 0.1]], dtype=torch.float64)
    sim = similarity(e)
    assert float(sim.min()) < -0.9  # dense embeddings: cosines can be negative
    r = torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    out = dra_rewards(r, sim, None).double()
    # float64 reference: r / (1 + Σ_{j≠i} clip(s_ij, 0, 1))
    clipped = sim.clamp(0, 1) - torch.eye(4, dtype=torch.float64)
    assert torch.allclose(out, r / (1 + clipped.sum(1)), atol=1e-6)
    mult = out / r
    assert bool((mult <= 1 + 1e-6).all()) and bool((mult >= 1 / 4 - 1e-6).all())
    # Two nearly opposite responses: the old floor (1e-6 on 1 + Σ s) multiplied both rewards by
    # about 10⁶; now they keep them.
    opposite = similarity(torch.tensor([[1.0, 0.0], [-1.0, 1e-4]], dtype=torch.float64))
    assert float(1 / (1 + opposite[0, 1]).clamp(min=1e-6)) > 1e5
    assert dra_rewards(torch.ones(2), opposite, None).tolist() == [1.0, 1.0]


def test_local_model_embedder_mean_pools_against_float64(tmp_path):
    path = write_tiny_bert(tmp_path / "bert")
    local = ["embedder=local_model", f"model_path={path}"]
    cfg = load(DRAConfig, overrides=local)
    emb = text_embedder(cfg)
    assert isinstance(emb, LocalModelEmbedder)
    texts = ["the answer is four", "so we get x", "a b c the answer is five so we get y z"]
    got = emb(texts)  # one padded batch
    assert got.shape == (3, 32) and got.dtype == torch.float32
    model64 = emb.model.double()
    for i, t in enumerate(texts):  # float64, one unpadded text at a time
        enc = emb.tokenizer(t, return_tensors="pt")
        ref = model64(**enc).last_hidden_state[0].mean(0)
        assert torch.allclose(got[i].double(), ref, atol=1e-5), i
    # grpo.dra.max_length: each text's first tokens only
    short = text_embedder(load(DRAConfig, overrides=[*local, "max_length=3"]))(texts)
    enc = emb.tokenizer(texts[2], truncation=True, max_length=3, return_tensors="pt")
    ref = model64(**enc).last_hidden_state[0].mean(0)
    assert torch.allclose(short[2].double(), ref, atol=1e-5)
    assert not torch.allclose(short[2], got[2], atol=1e-3)
    with pytest.raises(ConfigError, match="'model_path'"):
        load(DRAConfig, overrides=["embedder=local_model", f"model_path={tmp_path}/missing"])
    with pytest.raises(ConfigError, match="'embedder'"):
        load(DRAConfig, overrides=["embedder=jina"])
