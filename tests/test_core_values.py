"""The core's arithmetic by value against float64 references written out here element by element
(KL estimators, group advantages, the clipped surrogate and its aggregation): the tests that kill
the mutants scripts/mutation_score.sh found surviving (bench/results/mutation_score.md). Fast,
single-process."""

from __future__ import annotations

import math
import re
import statistics
import zlib

import pytest
import torch

from megatron_ngrpo.grpo.advantages import (
    compute_advantages,
    group_ids,
    group_stats,
    zero_variance_groups,
)
from megatron_ngrpo.grpo.config import DRAConfig, GRPOConfig
from megatron_ngrpo.grpo.dra import TfidfEmbedder, dra_rewards, similarity, text_embedder
from megatron_ngrpo.grpo.kl import kl_estimate
from megatron_ngrpo.grpo.loss import aggregation_weights, micro_batch_loss, policy_loss
from megatron_ngrpo.grpo.loss_inputs import LossInputs
from megatron_ngrpo.mixing.arithmetic import mix_rows
from megatron_ngrpo.mixing.config import MixingConfig
from megatron_ngrpo.mixing.decision import (
    MixDecision,
    anchors,
    counter_uniform,
    decide,
    gate,
    gate_uniform,
    id_mask,
)
from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.training.neighbor_source import NeighborSource


def _k3_64(d: float, clamp: float) -> float:
    d = min(max(d, -20.0), 20.0)
    return min(max(math.exp(d) - d - 1.0, -clamp), clamp)


def test_kl_defaults_are_k3_clamped_at_10():
    lp, ref = torch.tensor([0.0, 0.0, -1.0]), torch.tensor([0.5, 30.0, -3.0])
    want = [_k3_64(r - x, 10.0) for x, r in zip(lp.tolist(), ref.tolist())]
    assert kl_estimate(lp, ref).tolist() == pytest.approx(want, rel=1e-6)
    assert want[1] == 10.0


@pytest.mark.parametrize("d", [-25.0, -20.5, 20.5, 25.0])
def test_k3_log_ratio_is_clamped_at_20_both_ways(d):
    """δ outside ±20 is clamped before exp (k3 = e^δ − δ − 1 at δ = ±20), with a clamp on the
    estimate large enough not to hide it."""
    got = float(
        kl_estimate(
            torch.tensor([0.0], dtype=torch.float64), torch.tensor([d]).double(), "k3", 1e12
        )
    )
    assert got == pytest.approx(_k3_64(d, 1e12), rel=1e-12)


def test_k3_estimate_clamp_is_symmetric_and_k1_k2_are_unclamped():
    lp, ref = torch.zeros(2, dtype=torch.float64), torch.tensor([3.0, -15.0], dtype=torch.float64)
    assert kl_estimate(lp, ref, "k3", 2.5).tolist() == [2.5, 2.5]
    assert kl_estimate(lp, ref, "k3", 100.0).tolist() == pytest.approx(
        [_k3_64(3.0, 100.0), _k3_64(-15.0, 100.0)], rel=1e-12
    )
    assert kl_estimate(lp, ref, "k1", 1.0).tolist() == [-3.0, 15.0]
    assert kl_estimate(lp, ref, "k2", 1.0).tolist() == [4.5, 112.5]
    with pytest.raises(ValueError, match="'k4'"):
        kl_estimate(lp, ref, "k4")


# ---- advantages --------------------------------------------------------------------------------
REWARDS = [1.0, 0.0, 0.5, 2.0, 3.0, 7.0, 1.0, 1.0]
PROMPTS = [5, 5, 5, 9, 9, 2, 4, 4]  # groups of 3, 2, 1, 2 (the last two equal)


def _stats64(rewards, prompts):
    """Per response: its group's mean, unbiased std (a group of one: 0 and 1) and size."""
    out = []
    for p in prompts:
        g = [r for r, q in zip(rewards, prompts) if q == p]
        out.append(
            (statistics.fmean(g), statistics.stdev(g), len(g)) if len(g) > 1 else (0.0, 1.0, 1)
        )
    return out


def test_group_ids_number_groups_by_prompt():
    assert group_ids(PROMPTS).tolist() == [2, 2, 2, 3, 3, 0, 1, 1]
    assert group_ids(torch.tensor(PROMPTS)).dtype == torch.long


def test_group_stats_and_advantages_against_float64():
    r, g = torch.tensor(REWARDS), group_ids(PROMPTS)
    mean, std, count = group_stats(r, g)
    ref = _stats64(REWARDS, PROMPTS)
    assert mean.tolist() == pytest.approx([m for m, _, _ in ref], rel=1e-12, abs=1e-12)
    assert std.tolist() == pytest.approx([s for _, s, _ in ref], rel=1e-12, abs=1e-12)
    assert count.tolist() == [c for _, _, c in ref]
    for eps in (1e-6, 0.5):
        want = [(x - m) / (s + eps) for x, (m, s, _) in zip(REWARDS, ref)]
        got = compute_advantages(r, g, "grpo", eps)
        assert got.dtype == torch.float32
        assert got.tolist() == pytest.approx(want, rel=1e-6, abs=1e-7)
    default = [(x - m) / (s + 1e-6) for x, (m, s, _) in zip(REWARDS, ref)]
    assert compute_advantages(r, g).tolist() == pytest.approx(default, rel=1e-6, abs=1e-7)
    dr = [x - m for x, (m, _, _) in zip(REWARDS, ref)]
    assert compute_advantages(r, g, "dr_grpo").tolist() == pytest.approx(dr, abs=1e-7)
    with pytest.raises(ValueError, match="'gspo'"):
        compute_advantages(r, g, "gspo")


def test_zero_variance_groups_need_two_equal_rewards():
    assert zero_variance_groups(torch.tensor(REWARDS), group_ids(PROMPTS)).tolist() == [
        False, False, False, False, False, False, True, True,
    ]  # fmt: skip


def test_an_empty_batch_has_empty_advantages():
    e, g = torch.zeros(0), torch.zeros(0, dtype=torch.long)
    assert zero_variance_groups(e, g).tolist() == []
    assert [t.tolist() for t in group_stats(e, g)] == [[], [], []]
    assert compute_advantages(e, g).tolist() == []


# ---- policy loss and aggregation ---------------------------------------------------------------
def _surrogate64(lp, old, adv, cfg):
    """One token's clipped surrogate, clipped flag and ratio (token mode)."""
    lr = min(max(lp - old, -cfg.log_ratio_clamp), cfg.log_ratio_clamp)
    r = math.exp(lr)
    l1, l2 = -adv * r, -adv * min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
    loss, clipped = max(l1, l2), l2 > l1
    if cfg.dual_clip is not None and adv < 0:
        clipped = clipped or loss > -adv * cfg.dual_clip
        loss = min(loss, -adv * cfg.dual_clip)
    return loss, clipped, r


LP = [[-0.2, -1.5, 0.9, -3.0], [-0.4, 0.6, -0.1, 1.7]]
OLD = [[-0.5, -1.0, -0.3, -0.5], [-0.3, -0.6, -0.1, -0.4]]
MASK = [[True, True, True, False], [True, True, True, True]]


@pytest.mark.parametrize("adv", [[1.5, -0.7], [-2.0, 0.4]])
@pytest.mark.parametrize(
    "cfg",
    [
        GRPOConfig(),
        GRPOConfig(clip_low=0.1, clip_high=0.35, dual_clip=1.5, log_ratio_clamp=1.0),
        GRPOConfig(dual_clip=None, log_ratio_clamp=0.5),
    ],
    ids=["defaults", "tight", "no-dual"],
)
def test_policy_loss_per_token_against_float64(cfg, adv):
    lp, old = torch.tensor(LP, dtype=torch.float64), torch.tensor(OLD, dtype=torch.float64)
    loss, clipped, ratio = policy_loss(
        lp, old, torch.tensor(adv, dtype=torch.float64), torch.tensor(MASK), cfg
    )
    for i in range(2):
        for t in range(4):
            want = _surrogate64(LP[i][t], OLD[i][t], adv[i], cfg)
            assert float(loss[i, t]) == pytest.approx(want[0], rel=1e-12, abs=1e-15)
            assert bool(clipped[i, t]) == want[1], (i, t)
            assert float(ratio[i, t]) == pytest.approx(want[2], rel=1e-12)


def test_gspo_ratio_is_the_masked_mean_log_ratio_clamped():
    cfg = GRPOConfig(loss_mode="gspo", log_ratio_clamp=0.3)
    lp, old = torch.tensor(LP, dtype=torch.float64), torch.tensor(OLD, dtype=torch.float64)
    _, _, ratio = policy_loss(lp, old, torch.tensor([1.0, 1.0]), torch.tensor(MASK), cfg)
    for i in range(2):
        d = [LP[i][t] - OLD[i][t] for t in range(4) if MASK[i][t]]
        want = math.exp(min(max(sum(d) / len(d), -0.3), 0.3))
        assert ratio[i].tolist() == pytest.approx([want] * 4, rel=1e-12)
    empty = torch.zeros(1, 2, dtype=torch.bool)  # no response token: log-ratio 0, not 0/0
    _, _, ratio = policy_loss(lp[:1, :2], old[:1, :2], torch.tensor([1.0]), empty, cfg)
    assert ratio.tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_weights_against_float64(mode):
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]).bool()
    active = torch.tensor([True, True, False, True])
    lengths = [3, 1, 0, 0]  # active response tokens per row
    n_tok, n_seq = sum(lengths), sum(n > 0 for n in lengths)
    w, norm = aggregation_weights(mask, active, mode, max_len=7)
    want_norm = {"token-mean": n_tok, "seq-mean-token-mean": n_seq}.get(mode, n_seq * 7)
    assert norm == want_norm
    for i, n in enumerate(lengths):
        per = 1 / (n_seq * n) if mode == "seq-mean-token-mean" and n else 1 / want_norm
        assert w[i].tolist() == pytest.approx([per if t < n else 0.0 for t in range(5)], rel=1e-6)
    w, norm = aggregation_weights(mask, torch.zeros(4, dtype=torch.bool), mode, max_len=7)
    assert norm == 0.0 and not w.any()
    with pytest.raises(ValueError, match="'mean'"):
        aggregation_weights(mask, active, "mean", 7)


@pytest.mark.parametrize("kl_mode", ["loss", "metric"])
def test_micro_batch_loss_and_stats_against_float64(kl_mode):
    cfg = GRPOConfig(kl_mode=kl_mode, kl_coef=0.25, kl_estimator="k2", clip_high=0.3)
    lp, old = torch.tensor(LP, dtype=torch.float64), torch.tensor(OLD, dtype=torch.float64)
    ref = old - 0.5
    adv, tis = [0.8, -1.2], torch.tensor([[0.5, 1.0, 2.0, 1.0], [1.0, 0.25, 1.0, 3.0]]).double()
    weight = torch.tensor([[0.1, 0.2, 0.3, 0.0], [0.05, 0.1, 0.15, 0.2]]).double()
    ent = torch.arange(8, dtype=torch.float64).view(2, 4)
    inputs = LossInputs(
        old,
        torch.tensor(adv, dtype=torch.float64),
        torch.ones(2, dtype=torch.bool),
        ref,
        tis,
        None,
        weight,
    )
    loss, stats = micro_batch_loss(lp, ent, inputs, torch.tensor(MASK), cfg)
    pg = kl = total = 0.0
    want = dict.fromkeys(("tokens", "clipped", "kl", "entropy", "ratio", "abs_log_ratio"), 0.0)
    want["ratio_max"] = -math.inf
    for i in range(2):
        for t in range(4):
            s, c, r = _surrogate64(LP[i][t], OLD[i][t], adv[i], cfg)
            k = 0.5 * (float(ref[i, t]) - LP[i][t]) ** 2
            w = float(weight[i, t])
            pg += s * float(tis[i, t]) * w
            kl += k * w
            if MASK[i][t]:
                for key, v in zip(want, (1, c, k, float(ent[i, t]), r, abs(LP[i][t] - OLD[i][t]))):
                    want[key] += v
                want["ratio_max"] = max(want["ratio_max"], r)
    total = pg + (0.25 * kl if kl_mode == "loss" else 0.0)
    assert float(loss) == pytest.approx(total, rel=1e-12)
    assert float(stats["loss"]) == pytest.approx(total, rel=1e-12)
    assert float(stats["pg_loss"]) == pytest.approx(pg, rel=1e-12)
    assert float(stats["kl_loss"]) == pytest.approx(
        0.25 * kl if kl_mode == "loss" else 0.0, rel=1e-12
    )
    for key, v in want.items():
        assert float(stats[key]) == pytest.approx(v, rel=1e-12), key
    assert all(v.dtype == torch.float64 for v in stats.values())


def test_micro_batch_loss_without_reference_or_entropy():
    cfg = GRPOConfig(kl_coef=0.5)
    lp, old = torch.tensor(LP, dtype=torch.float64), torch.tensor(OLD, dtype=torch.float64)
    weight = torch.full((2, 4), 0.125, dtype=torch.float64)
    inputs = LossInputs(
        old, torch.tensor([1.0, -1.0]), torch.ones(2, dtype=torch.bool), token_weight=weight
    )
    loss, stats = micro_batch_loss(lp, None, inputs, torch.tensor(MASK), cfg)
    pg = sum(
        _surrogate64(LP[i][t], OLD[i][t], [1.0, -1.0][i], cfg)[0] * 0.125
        for i in range(2)
        for t in range(4)
    )
    assert float(loss) == pytest.approx(pg, rel=1e-12)
    assert float(stats["kl"]) == float(stats["kl_loss"]) == float(stats["entropy"]) == 0.0


# ---- mix records ------------------------------------------------------------------------------
def _record(seq, pos, ids, weights, num_seqs, noise=None):
    return MixRecord(
        torch.tensor(seq),
        torch.tensor(pos),
        torch.tensor(ids),
        torch.tensor(weights),
        num_seqs,
        None if noise is None else torch.tensor(noise),
    )


def test_record_empty_cat_pads_k_and_offsets_sequences():
    e = MixRecord.empty(3, 2)
    assert (len(e), e.k, e.num_seqs, e.noise) == (0, 2, 3, None)
    assert (e.seq.dtype, e.pos.dtype, e.ids.dtype, e.weights.dtype) == (
        torch.long, torch.long, torch.long, torch.float32,
    )  # fmt: skip
    a = _record([1, 0], [4, 2], [[5, 6], [7, 8]], [[0.75, 0.25], [0.5, 0.5]], 2)
    b = _record([0], [1], [[9, 3, 2]], [[0.5, 0.25, 0.25]], 2)
    c = MixRecord.cat([a, e, b])
    assert c.num_seqs == 7 and c.k == 3 and c.noise is None
    assert c.seq.tolist() == [1, 0, 5] and c.pos.tolist() == [4, 2, 1]
    assert c.ids.tolist() == [[5, 6, 0], [7, 8, 0], [9, 3, 2]]
    assert c.weights.tolist() == [[0.75, 0.25, 0.0], [0.5, 0.5, 0.0], [0.5, 0.25, 0.25]]
    with pytest.raises(ValueError, match="at least one"):
        MixRecord.cat([])


def test_record_cat_keeps_noise_and_refuses_mixing_with_and_without():
    a = _record([0], [1], [[1, 2]], [[0.5, 0.5]], 1, [[0.5, -1.0]])
    b = _record([0], [0], [[3, 4]], [[1.0, 0.0]], 1, [[2.0, 3.0]])
    c = MixRecord.cat([a, MixRecord.empty(2, 2), b])  # an empty record without noise is fine
    assert c.noise.tolist() == [[0.5, -1.0], [2.0, 3.0]] and c.seq.tolist() == [0, 3]
    with pytest.raises(ValueError, match="with and without noise"):
        MixRecord.cat([a, _record([0], [0], [[3, 4]], [[1.0, 0.0]], 1)])


def test_record_sorted_select_and_flat_positions():
    noise = [[float(i)] for i in range(5)]
    r = _record(
        [2, 0, 2, 1, 0], [0, 3, 1, 9, 0], [[i, 0] for i in range(5)], [[1.0, 0.0]] * 5, 3, noise
    )
    s = r.sorted()
    assert s.seq.tolist() == [0, 0, 1, 2, 2] and s.pos.tolist() == [0, 3, 9, 0, 1]
    assert s.ids[:, 0].tolist() == [4, 1, 3, 0, 2] and s.noise[:, 0].tolist() == [
        4.0,
        1.0,
        3.0,
        0.0,
        2.0,
    ]
    assert MixRecord.empty(2, 2).sorted().num_seqs == 2
    sel = r.select([2, 0])  # renumbered in the given order, then sorted
    assert (
        sel.num_seqs == 2 and sel.seq.tolist() == [0, 0, 1, 1] and sel.pos.tolist() == [0, 1, 0, 3]
    )
    assert sel.ids[:, 0].tolist() == [0, 2, 4, 1] and sel.noise[:, 0].tolist() == [
        0.0,
        2.0,
        4.0,
        1.0,
    ]
    assert len(MixRecord.empty(3, 2).select([1])) == 0
    flat = s.flat_positions(torch.tensor([2, 0, 1]), 12)
    assert flat.tolist() == [2, 5, 12 + 9, 24 + 1, 24 + 2]
    s.flat_positions(torch.tensor([2, 2, 1]), 12)  # column 11: the last one
    with pytest.raises(ValueError, match="mix position 12 outside a batch of length 12"):
        s.flat_positions(torch.tensor([2, 3, 1]), 12)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_seqs=3), "records for 3 sequences, 2 responses given"),
        (dict(seq=[0, 2]), "sequence index out of range"),
        (dict(seq=[-1, 1]), "sequence index out of range"),
        (dict(pos=[4, 0]), "mix at seq 0 pos 4 outside a response of 4 tokens"),
        (dict(pos=[0, -1]), "mix at seq 1 pos -1 outside a response of 2 tokens"),
        (dict(ids=[[0, 10], [1, 2]]), r"mix ids outside the vocabulary \[0, 10\)"),
        (dict(ids=[[0, -1], [1, 2]]), "mix ids outside"),
        (dict(weights=[[0.5, 0.5], [0.5, 0.4998]]), "do not sum to 1"),
        (dict(weights=[[0.5, 0.5], [0.5, 0.5002]]), "do not sum to 1"),
    ],
)
def test_record_validate_names_what_is_wrong(change, message):
    args = dict(
        seq=[0, 1],
        pos=[3, 1],
        ids=[[0, 9], [1, 2]],
        weights=[[0.5, 0.5], [0.5, 0.49995]],
        num_seqs=2,
    )
    _record(**args).validate([4, 2], 10)  # in range, at every edge
    MixRecord.empty(2, 2).validate([4, 2], 10)
    with pytest.raises(ValueError, match=message):
        _record(**{**args, **change}).validate([4, 2], 10)


def test_record_to_json():
    r = _record([0], [1], [[2, 3]], [[0.75, 0.25]], 4)
    assert r.to_json() == {
        "seq": [0],
        "pos": [1],
        "ids": [[2, 3]],
        "weights": [[0.75, 0.25]],
        "num_seqs": 4,
    }
    r.noise = torch.tensor([[1.5]])
    assert r.to_json()["noise"] == [[1.5]]


# ---- neighbour source -------------------------------------------------------------------------
class _TableEngine:
    def set_neighbor_table(self, table):
        self.table = table


@pytest.mark.parametrize(
    "every, due", [(0, [1, 0, 0, 0, 0]), (1, [1, 1, 1, 1, 1]), (3, [1, 0, 0, 1, 0])]
)
def test_neighbor_source_refreshes_when_due_and_checkpoints_its_table(every, due):
    built = []

    def build():
        built.append(1)
        return torch.full((4, 2), len(built))

    src = NeighborSource(MixingConfig(refresh_every=every), "table", build)
    assert src.mixing.neighbor_lookup == "table" and src.table_updates == -1
    got = [src.refresh(u) for u in range(5)]
    assert got == [bool(d) for d in due] and len(built) == sum(due)
    assert src.table_updates == max(u for u, d in enumerate(due) if d)
    engine = _TableEngine()
    src.apply(engine)
    assert engine.table is src.table and int(src.table[0, 0]) == len(built)
    state = src.state_dict()
    assert state == {"neighbor_table": src.table, "table_updates": src.table_updates}
    other = NeighborSource(MixingConfig(refresh_every=every), "table", build)
    other.load_state_dict({"neighbor_table": torch.ones(4, 2), "table_updates": torch.tensor(3)})
    assert other.table_updates == 3 and isinstance(other.table_updates, int)
    assert other.table.tolist() == [[1.0, 1.0]] * 4


@pytest.mark.parametrize("mode", ["on_demand", "none"])
def test_neighbor_source_without_a_table_clears_the_engines(mode):
    src = NeighborSource(MixingConfig(), mode, lambda: pytest.fail("no table in this mode"))
    src.table = torch.ones(2, 2)  # e.g. restored from a checkpoint of a table run
    assert src.refresh(0) is False and src.table is None
    engine = _TableEngine()
    engine.table = torch.ones(2, 2)
    src.table = torch.ones(2, 2)
    src.apply(engine)
    assert engine.table is None
    # "none" passes the config through unresolved (only a disabled one reaches no engine)
    assert src.mixing.neighbor_lookup == ("auto" if mode == "none" else mode)
    assert NeighborSource(MixingConfig(rate=0.0), "none", list).mixing is None


# ---- mixing decision --------------------------------------------------------------------------
def test_decide_weights_are_the_float64_softmax_over_real_candidates():
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.5, 9.0, 0.0], [3.0, 3.0, 1.0, 0.25, 9.0, 2.0]])
    table = torch.tensor([[0, 2, 3], [1, 3, 4], [2, 0, 1], [3, 1, 0], [4, 0, 1], [5, 0, 1]])
    for tau in (1.0, 0.6):
        d = decide(logits, table, tau, torch.tensor([True, False]), num_real_tokens=4)
        assert d.anchor.tolist() == [1, 0]  # id 4 is not real; the tie 0/1 goes to the lower id
        assert d.ids.tolist() == [[1, 3, 4], [0, 2, 3]] and d.mixed.tolist() == [True, False]
        for b in range(2):
            z = [float(logits[b, c]) / tau if c < 4 else -math.inf for c in d.ids[b].tolist()]
            e = [math.exp(x - max(z)) for x in z]
            assert d.weights[b].tolist() == pytest.approx([x / sum(e) for x in e], rel=1e-6)
        assert d.weights.dtype == torch.float32 and float(d.weights[0, 2]) == 0.0
    # A partition starting at id 3: its real columns are ids 3 only (num_real_tokens 4).
    assert anchors(logits[:, 3:], 4, vocab_start=3).tolist() == [0, 0]
    assert anchors(logits[:, 4:], 4, vocab_start=4).tolist() == [0, 0]  # none real: empty argmax


def test_decision_select_and_unmix_anchors():
    d = MixDecision(
        mixed=torch.tensor([True, True, False]),
        anchor=torch.tensor([2, 0, 2]),
        ids=torch.tensor([[2, 1], [0, 1], [2, 0]]),
        weights=torch.tensor([[0.5, 0.5], [0.75, 0.25], [1.0, 0.0]]),
        noise=torch.tensor([[1.0], [2.0], [3.0]]),
    )
    s = d.select(torch.tensor([2, 0]))
    assert s.anchor.tolist() == [2, 2] and s.mixed.tolist() == [False, True]
    assert s.ids.tolist() == [[2, 0], [2, 1]] and s.weights.tolist() == [[1.0, 0.0], [0.5, 0.5]]
    assert s.noise.tolist() == [[3.0], [1.0]]
    d.unmix_anchors(torch.tensor([False, False, True]))
    assert d.mixed.tolist() == [False, True, False] and d.noise.tolist() == [[0.0], [2.0], [0.0]]
    plain = MixDecision(d.mixed, d.anchor, d.ids, d.weights).select(torch.tensor([1]))
    assert plain.noise is None
    assert id_mask([0, 3, 5, -1], 4).tolist() == [True, False, False, True]


def test_gate_rate_bounds_and_counter_dimensions():
    keys, pos = torch.arange(64).repeat_interleave(8), torch.arange(8).repeat(64)
    u = gate_uniform(7, keys, pos)
    assert gate(0.0, 7, keys, pos).sum() == 0 and gate(1.0, 7, keys, pos).all()
    assert gate(0.3, 7, keys, pos).tolist() == (u < 0.3).tolist()
    assert counter_uniform(7, keys, pos).tolist() == u.tolist()
    assert not torch.equal(counter_uniform(8, keys, pos), u)
    assert not torch.equal(counter_uniform(7, pos, keys), u)  # the order of counters matters
    three = counter_uniform(7, keys, pos, torch.tensor(1))
    assert not torch.equal(three, u) and bool((three >= 0).all() and (three < 1).all())
    # A seed past 2**63 wraps to the same 64-bit pattern as its negative twin.
    assert counter_uniform(2**64 - 5, 1, 2).item() == counter_uniform(-5, 1, 2).item()


# ---- DRA and the mixed-row arithmetic ---------------------------------------------------------
def _tfidf64(texts, ngram, dim):
    """Dense reference: smoothed IDF log((1+N)/(1+df)) + 1 over crc32 buckets, L2-normalised."""
    grams = []
    for t in texts:
        w = re.findall(r"\w+|[^\w\s]", t.lower())
        grams.append(
            [
                zlib.crc32(" ".join(w[i : i + n]).encode()) % dim
                for n in range(1, ngram + 1)
                for i in range(len(w) - n + 1)
            ]
        )
    out = torch.zeros(len(texts), dim, dtype=torch.float64)
    for i, g in enumerate(grams):
        for h in set(g):
            df = sum(h in other for other in grams)
            out[i, h] = g.count(h) * (math.log((1 + len(texts)) / (1 + df)) + 1.0)
        out[i] /= out[i].norm() if out[i].norm() > 0 else 1.0
    return out


@pytest.mark.parametrize("ngram, dim", [(2, 2**18), (3, 64), (1, 5)])
def test_tfidf_against_float64_and_cosines_sparse_equal_dense(ngram, dim):
    texts = ["The answer is 42.", "the answer is 41, not 42", "", "x x x y", "42 is THE answer"]
    emb = TfidfEmbedder(ngram, dim)(texts)
    assert emb.is_sparse and emb.shape == (5, dim) and emb.dtype == torch.float64
    want = _tfidf64(texts, ngram, dim)
    assert torch.allclose(emb.to_dense(), want, rtol=1e-12, atol=1e-15)
    dense = want @ want.t()
    for i in range(5):
        if want[i].norm() > 0:
            dense[i] /= want[i].norm()
            dense[:, i] /= want[i].norm()
    assert torch.allclose(similarity(emb), dense, rtol=1e-12, atol=1e-15)
    assert torch.allclose(similarity(want), dense, rtol=1e-12, atol=1e-15)
    assert torch.allclose(TfidfEmbedder()(texts).to_dense(), _tfidf64(texts, 2, 2**18), rtol=1e-12)


def test_text_embedder_by_name():
    emb = text_embedder(DRAConfig(ngram=3, hash_dim=128))
    assert isinstance(emb, TfidfEmbedder) and (emb.ngram, emb.dim) == (3, 128)
    with pytest.raises(ValueError, match="'policy_hidden' does not embed texts"):
        text_embedder(DRAConfig(embedder="policy_hidden"))


def test_dra_rewards_against_float64():
    sim = torch.tensor(
        [[1.0, 0.5, -0.3, 1.4], [0.5, 1.0, 0.2, 0.9], [-0.3, 0.2, 1.0, 0.4], [1.4, 0.9, 0.4, 1.0]]
    )
    r = torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    clip = [
        [min(max(float(sim[i, j]), 0.0), 1.0) if i != j else 0.0 for j in range(4)]
        for i in range(4)
    ]
    groups = [0, 0, 1, 1]
    for g in (None, torch.tensor(groups)):
        want = [
            float(r[i])
            / (1 + sum(c for j, c in enumerate(clip[i]) if g is None or groups[j] == groups[i]))
            for i in range(4)
        ]
        got = dra_rewards(r, sim, g)
        assert got.dtype == torch.float32 and got.tolist() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_mix_rows_is_the_candidate_order_sum_rounded_once(dtype):
    g = torch.Generator().manual_seed(3)
    cand = torch.randn(5, 4, 8, generator=g).to(dtype)
    w = torch.softmax(torch.randn(5, 4, generator=g), -1)
    noise = torch.randn(5, 8, generator=g)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for nz in (None, noise):
        want = w[:, 0, None].to(acc) * cand[:, 0].to(acc)
        for j in range(1, 4):
            want = want + w[:, j, None].to(acc) * cand[:, j].to(acc)
        if nz is not None:
            want = want + nz.to(acc)
        got = mix_rows(cand, w, nz)
        assert got.dtype == dtype and torch.equal(got, want.to(dtype))
    # 16-bit weights too: each product in fp32 from the exactly widened weight, never in 16 bits
    w16 = w.to(torch.bfloat16)
    want = w16[:, 0, None].to(acc) * cand[:, 0].to(acc)
    for j in range(1, 4):
        want = want + w16[:, j, None].to(acc) * cand[:, j].to(acc)
    assert torch.equal(mix_rows(cand, w16), want.to(dtype))
    exact = (w.double()[:, :, None] * cand.double()).sum(1)  # float64: the float64 sum, to 1e-15
    if dtype == torch.float64:
        assert torch.allclose(mix_rows(cand, w.double()), exact, rtol=1e-14, atol=1e-15)
