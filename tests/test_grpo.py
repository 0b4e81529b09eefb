"""GRPO objective: single-process unit tests, plus one 4-process launch (tests/dist/grpo_worker.py)
comparing loss and gradients of one step at TP 1/2, PP 2, TP2×PP2, PP2×VPP2, DP 2/4, TP 2 + SP,
recomputation and token-budget micro-batches (TP 2; PP2×VPP2: different lengths and row counts,
dummy micro-batches) with a float64 reference, with and without mixing records, for GRPO, GSPO,
Dr.GRPO, token-mean + TIS + zero-variance filtering, and an all-masked batch; and one 8-process
launch for DP×TP×PP = 2×2×2 (plain, and VPP 2 + SP)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_ngrpo.grpo.advantages import (
    compute_advantages,
    group_ids,
    group_stats,
    zero_variance_groups,
)
from megatron_ngrpo.grpo.batches import TokenBatch, split_rows
from megatron_ngrpo.grpo.config import GRPOConfig
from megatron_ngrpo.grpo.dra import TfidfEmbedder, dra_rewards, similarity
from megatron_ngrpo.grpo.kl import kl_estimate
from megatron_ngrpo.grpo.loss import aggregation_weights, micro_batch_loss, policy_loss
from megatron_ngrpo.grpo.loss_inputs import LossInputs
from megatron_ngrpo.mixing.embedding import mixing_inputs
from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.rollout.types import RolloutBatch
from tests.harness.multiproc import check, launch
from tests.harness.records import mix_record

WORKER = Path(__file__).parent / "dist" / "grpo_worker.py"
CASES = [
    "layout_tp1_dp4",
    "layout_tp2_dp2",
    "layout_pp2_dp2",
    "layout_tp2_pp2",
    "layout_pp2_vpp2_dp2",
    "layout_tp2_token_budget",
    "layout_tp2_sequence_parallel",
    "layout_tp2_pp2_sequence_parallel_recompute",
    "layout_pp2_recompute",
    "layout_pp2_vpp2_token_budget",
]
# 8 ranks on CI's 2 cores: a minute, with every axis already crossed in pairs by CASES (`slow`).
CASES_8 = ["layout_dp2_tp2_pp2", "layout_dp2_tp2_pp2_vpp2_sequence_parallel"]


@pytest.fixture(scope="module")
def dist_results():
    return launch(WORKER, nproc=4, timeout=600, only=["fused_logprob_pass"] + CASES)


@pytest.fixture(scope="module")
def dist_results_8():
    return launch(WORKER, nproc=8, timeout=600, only=CASES_8)


@pytest.mark.parametrize("name", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in CASES_8])
def test_loss_and_gradients_match_float64_reference(request, name):
    results = request.getfixturevalue("dist_results_8" if name in CASES_8 else "dist_results")
    value = check(results, name)
    for variant in (
        "mix_token",
        "plain_token",
        "gspo",
        "drgrpo",
        "tokmean_tis_filter",
        "all_masked",
    ):
        assert variant in value, f"{name}: variant {variant} not run"
        assert value[variant]["grad_rel_err"] < 1e-5


def test_fused_logprob_pass_matches_float64(dist_results):
    errs = check(dist_results, "fused_logprob_pass")
    assert set(errs) == {
        f"tp{tp}_{dtype}" for tp in (1, 2, 4) for dtype in ("float32", "bfloat16")
    }, errs


# ---- advantages ------------------------------------------------------------------------------
def test_grpo_advantages_are_group_normalised_with_unbiased_std():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    groups = group_ids([7, 7, 7, 7, 3, 3, 3, 3])
    adv = compute_advantages(r, groups, "grpo", 1e-6)
    for g in (slice(0, 4), slice(4, 8)):
        x = r[g].double()
        assert torch.allclose(
            adv[g].double(), (x - x.mean()) / (x.std(unbiased=True) + 1e-6), atol=1e-6
        )
    drg = compute_advantages(r, groups, "dr_grpo")
    assert torch.allclose(drg[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_single_response_group_keeps_its_reward_and_equal_groups_are_flagged():
    r = torch.tensor([2.0, 1.0, 1.0])
    groups = group_ids([0, 1, 1])
    mean, std, count = group_stats(r, groups)
    assert mean[0] == 0 and std[0] == 1 and count[0] == 1
    assert torch.allclose(compute_advantages(r, groups), torch.tensor([2.0 / (1 + 1e-6), 0.0, 0.0]))
    assert zero_variance_groups(r, groups).tolist() == [False, True, True]


# ---- loss pieces -------------------------------------------------------------------------------
def test_clipped_surrogate_clip_higher_and_dual_clip():
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    old = torch.zeros(1, 4)
    lp = torch.log(torch.tensor([[0.5, 1.1, 1.5, 5.0]]))
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, clipped, _ = policy_loss(lp, old, torch.tensor([1.0]), mask, cfg)
    # A > 0: min(r, 1.28)·A, except below 1 − 0.2 where the unclipped r is kept (pessimistic)
    assert torch.allclose(-loss, torch.tensor([[0.5, 1.1, 1.28, 1.28]]))
    assert clipped.tolist() == [[False, False, True, True]]
    loss, clipped, _ = policy_loss(lp, old, torch.tensor([-1.0]), mask, cfg)
    # A < 0: max(r, 0.8)·|A| capped at c·|A| = 3 (dual clip)
    assert torch.allclose(loss, torch.tensor([[0.8, 1.1, 1.5, 3.0]]))
    assert clipped.tolist() == [[True, False, False, True]]
    # clip_low 0.5 keeps r = 0.5 unclipped; no dual clip: r·|A| = 5 unbounded
    cfg = GRPOConfig(clip_low=0.5, clip_high=0.28, dual_clip=None)
    loss, _, _ = policy_loss(lp, old, torch.tensor([-1.0]), mask, cfg)
    assert torch.allclose(loss, torch.tensor([[0.5, 1.1, 1.5, 5.0]]))


def test_log_ratio_and_k3_clamps_are_the_configs():
    """micro_batch_loss bounds log π_θ/π_old by grpo.log_ratio_clamp and k3 by grpo.kl_clamp."""
    lp, mask = torch.tensor([[3.0]]), torch.ones(1, 1, dtype=torch.bool)
    inputs = LossInputs(
        old_logprobs=torch.zeros(1, 1),
        advantages=torch.tensor([1.0]),
        active=torch.ones(1, dtype=torch.bool),
        ref_logprobs=torch.tensor([[9.0]]),  # k3 = e^6 - 7 = 396
        token_weight=torch.ones(1, 1),
    )
    for clamp, kl_clamp in ((20.0, 10.0), (1.0, 2.0)):
        cfg = GRPOConfig(log_ratio_clamp=clamp, kl_clamp=kl_clamp, clip_high=100.0)
        _, stats = micro_batch_loss(lp, None, inputs, mask, cfg)
        assert float(stats["ratio_max"]) == pytest.approx(math.exp(min(3.0, clamp)), rel=1e-6)
        assert float(stats["kl"]) == pytest.approx(kl_clamp)


def test_gspo_uses_one_length_normalised_ratio_per_sequence():
    cfg = GRPOConfig(loss_mode="gspo", dual_clip=None, clip_low=0.5, clip_high=0.5)
    lp = torch.tensor([[0.1, 0.3, 9.0]])
    mask = torch.tensor([[True, True, False]])
    _, _, ratio = policy_loss(lp, torch.zeros(1, 3), torch.tensor([1.0]), mask, cfg)
    assert torch.allclose(ratio, torch.full((1, 3), math.exp(0.2)))


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = ref - lp
    assert torch.allclose(kl_estimate(lp, ref, "k1"), -d)
    assert torch.allclose(kl_estimate(lp, ref, "k2"), 0.5 * d * d)
    assert torch.allclose(kl_estimate(lp, ref, "k3"), torch.exp(d) - d - 1)
    assert float(kl_estimate(torch.tensor([0.0]), torch.tensor([50.0]), "k3")) == 10.0


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", [[1 / 5, 1 / 5, 1 / 5, 0], [1 / 5, 1 / 5, 0, 0]]),
        ("seq-mean-token-mean", [[1 / 6, 1 / 6, 1 / 6, 0], [1 / 4, 1 / 4, 0, 0]]),
        ("seq-mean-token-sum-norm", [[1 / 16, 1 / 16, 1 / 16, 0], [1 / 16, 1 / 16, 0, 0]]),
    ],
)
def test_aggregation_weights(mode, expected):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    active = torch.tensor([True, True, False])  # the third sequence is filtered out
    w, norm = aggregation_weights(mask, active, mode, max_len=8)
    assert torch.allclose(w[:2], torch.tensor(expected)) and float(w[2].abs().sum()) == 0
    w, norm = aggregation_weights(mask, torch.zeros(3, dtype=torch.bool), mode, max_len=8)
    assert norm == 0 and float(w.abs().sum()) == 0


# ---- replay batch ------------------------------------------------------------------------------
def test_token_batch_labels_mask_and_mixes_are_aligned():
    mixes = mix_record([[(0, [5, 6], [0.5, 0.5])], [(2, [7, 8], [0.9, 0.1])]], k=2)
    batch = RolloutBatch(
        [[10, 11], [12]],
        [[20, 21, 22], [23, 24, 25]],
        [[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]],
        ["stop", "length"],
        mixes,
        [0, 1],
    )
    tb = TokenBatch.from_rollout(batch)
    assert tb.tokens.tolist() == [[10, 11, 20, 21, 22], [12, 23, 24, 25, 0]]
    # column j predicts token j+1: response tokens are predicted from columns prompt_len-1 ...
    assert tb.mask.tolist() == [[False, True, True, True, False], [True, True, True, False, False]]
    assert tb.labels[tb.mask].tolist() == [20, 21, 22, 23, 24, 25]
    # a mix at response position t replaces the input at the column of response token t
    assert tb.mix.mask.nonzero().tolist() == [[0, 2], [1, 3]]
    lp = tb.label_aligned(batch.logprobs)
    assert [x.tolist() for x in tb.response_values(lp)] == batch.logprobs
    mb = tb.micro_batch([1], num_rows=2, seq_len=6)
    assert mb.tokens.shape == (2, 6) and not mb.mask[1].any() and mb.mix.mask[0, 3]


def test_token_budget_micro_batches():
    lengths = [10, 3, 7, 2, 9, 4]
    groups = split_rows(lengths, micro_batch_size=3, max_tokens=20)
    assert sorted(r for g in groups for r in g) == list(range(6))
    for g in groups:
        assert len(g) <= 3 and (len(g) == 1 or len(g) * max(lengths[r] for r in g) <= 20)
    assert split_rows(lengths, 4) == [[0, 1, 2, 3], [4, 5]]


# ---- DRA ----------------------------------------------------------------------------------------
def test_dra_divides_by_one_plus_similarity_within_the_group():
    texts = ["the answer is 4", "the answer is 4", "completely different words here", "x y z"]
    emb = TfidfEmbedder(ngram=2, dim=1 << 12)(texts)
    sim = similarity(emb)
    assert torch.allclose(sim.diagonal(), torch.ones(4, dtype=torch.float64))
    assert float(sim[0, 1]) == pytest.approx(1.0) and float(sim[0, 3]) == 0.0
    r = torch.ones(4)
    groups = torch.tensor([0, 0, 1, 1])
    out = dra_rewards(r, sim, groups)
    assert out[:2].tolist() == pytest.approx([0.5, 0.5]) and out[2:].tolist() == pytest.approx(
        [1.0, 1.0]
    )
    batch_scope = dra_rewards(r, sim, None)
    assert float(batch_scope[0]) == pytest.approx(1 / (1 + 1 + float(sim[0, 2]) + float(sim[0, 3])))


# ---- gradients across optimizer steps ---------------------------------------------------------------
def test_gradient_after_an_optimizer_step_is_not_added_twice(tmp_path):
    """megatron's optimizer leaves ``param.grad`` aliasing ``main_grad`` after a step; the next
    backward must still produce the plain gradient (loss_and_grads zeroes the optimizer's grads)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ngrpo.architecture import unwrap
    from megatron_ngrpo.grpo.update import (
        UpdateSettings,
        loss_and_grads,
        wrap_for_training,
    )
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel
    from tests.harness.tiny import write_tiny_hf

    init_distributed()
    initialize_model_parallel(1, 1, None, seed=0)
    hf = write_tiny_hf(
        tmp_path / "hf",
        weights=False,
        vocab_size=64,
        hidden_size=64,
        num_layers=2,
        intermediate_size=128,
    )
    chunks = wrap_for_training(
        build_model(ModelConfig(hf_path=str(hf), make_vocab_size_divisible_by=8))
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), chunks
    )
    g = torch.Generator().manual_seed(0)
    rb = RolloutBatch(
        [[1, 2, 3]] * 4,
        [torch.randint(0, 64, (5,), generator=g).tolist() for _ in range(4)],
        [[0.0] * 5] * 4,
        ["stop"] * 4,
        MixRecord.empty(4, 2),
        [0, 0, 1, 1],
    )
    tb = TokenBatch.from_rollout(rb)
    tb = tb.with_inputs(
        LossInputs(
            old_logprobs=-3.0 * tb.mask,
            advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
            active=torch.ones(4, dtype=torch.bool),
        )
    )
    settings = UpdateSettings(temperature=1.0, micro_batch_size=2)
    cfg = GRPOConfig(kl_mode="off")
    params = list(unwrap(chunks[0]).parameters())

    def grads():
        loss_and_grads(chunks, tb, cfg, settings, optimizer)
        return [p.main_grad.clone() for p in params]

    grads()
    optimizer.step()
    after_step, again = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(after_step, again))


@pytest.mark.parametrize("tied", [False, True])
def test_output_head_gradients_equal_the_logits_path(tmp_path, tied):
    """The training path never forms the logits (models/output_head.py: the schedule's last stage
    returns hidden states, grpo/token_logprobs.py projects them chunk by chunk, adding the output
    matrix's gradient straight into DDP's main_grad). Its log-probs and gradients, with a tied
    and an untied output matrix (the tied one also gets the mixing embedding's rows), equal an
    unwrapped copy run the plain way: full logits through megatron's output layer and
    torch's log_softmax."""
    from megatron_ngrpo.architecture import unwrap
    from megatron_ngrpo.grpo import token_logprobs as chunked
    from megatron_ngrpo.grpo.logprobs import token_logprobs
    from megatron_ngrpo.grpo.update import update_step, wrap_for_training
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel
    from tests.harness.tiny import write_tiny_hf

    init_distributed()
    hf = write_tiny_hf(
        tmp_path / "hf",
        weights=False,
        vocab_size=96,
        hidden_size=64,
        num_layers=2,
        intermediate_size=128,
        tied=tied,
    )
    cfg = ModelConfig(hf_path=str(hf), make_vocab_size_divisible_by=8)
    models = []
    for _ in range(2):
        initialize_model_parallel(1, 1, None, seed=3)
        models.append(build_model(cfg))
    chunks, (plain,) = wrap_for_training(models[0]), models[1]
    g = torch.Generator().manual_seed(0)
    rb = RolloutBatch(
        [[1, 2, 3], [4, 5]],
        [torch.randint(0, 90, (n,), generator=g).tolist() for n in (6, 4)],
        [[0.0] * 6, [0.0] * 4],
        ["stop"] * 2,
        mix_record([[(1, [7, 8, 9], [0.5, 0.3, 0.2])], []], 3),
        [0, 1],
    )
    tb = TokenBatch.from_rollout(rb)
    coef = torch.randn(tb.tokens.shape, generator=g) * tb.mask
    heads = []

    def loss_fn(mb, head):
        heads.append(type(head).__name__)
        lp, _ = token_logprobs(head, mb.labels, 0.7, 90)
        return (lp * coef).sum(), torch.zeros((), dtype=torch.int), {"lp": lp.detach()}

    chunk_bytes, chunked.CHUNK_BYTES = chunked.CHUNK_BYTES, 3 * 4 * 96  # 3 rows a chunk
    try:
        store, _ = update_step(chunks, tb, loss_fn, micro_batch_size=2)
    finally:
        chunked.CHUNK_BYTES = chunk_bytes
    assert heads == ["OutputHead"]
    assert tb.mix is not None
    with mixing_inputs(plain, tb.mix):
        logits = plain(input_ids=tb.tokens, position_ids=tb.position_ids, attention_mask=None)
    assert logits.shape[-1] == 96
    log_p = torch.log_softmax(logits[..., :90] / 0.7, -1)
    lp = log_p.gather(-1, tb.labels.unsqueeze(-1)).squeeze(-1)
    (lp * coef).sum().backward()
    assert torch.allclose(store[0]["lp"], lp.detach(), atol=1e-6)
    params = dict(unwrap(chunks[0]).named_parameters())
    for name, p in plain.named_parameters():
        err = float((params[name].main_grad - p.grad).abs().max())
        assert err <= 1e-5 * float(p.grad.abs().max()) + 1e-7, (name, err)
