"""The GRPO update's arithmetic by value (grpo/mismatch.py, grpo/loss.py, grpo/update.py): the
tests that kill the mutants scripts/mutation_score.sh found surviving in these modules
(bench/results/mutation_score.md), against float64 references written out element by element or
exact expected values. Fast, single-process."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from megatron_ngrpo.architecture import unwrap
from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.grpo import logprobs, update
from megatron_ngrpo.grpo.batches import TokenBatch, split_rows
from megatron_ngrpo.grpo.config import GRPOConfig
from megatron_ngrpo.grpo.logprobs import batch_logprobs, token_logprobs
from megatron_ngrpo.grpo.loss import STAT_KEYS, aggregation_weights, micro_batch_loss, policy_loss
from megatron_ngrpo.grpo.loss_inputs import LossInputs
from megatron_ngrpo.grpo.mismatch import (
    MISMATCH_MODES,
    MismatchConfig,
    correction,
    mismatch_metrics,
    mismatch_sums,
)
from megatron_ngrpo.grpo.packing import pack
from megatron_ngrpo.grpo.update import (
    UpdateSettings,
    _reduce_stats,
    loss_and_grads,
    update_step,
    wrap_for_training,
)
from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.models.config import ModelConfig
from megatron_ngrpo.models.provider import build_model
from megatron_ngrpo.rollout.types import RolloutBatch
from tests.harness.tiny import write_tiny_hf


# ---- mismatch corrections ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields,message",
    [
        ({"cap": 0.0}, "'cap' = 0.0: must be > 0"),
        ({"lower": -0.1}, r"'lower' = -0.1: must be in \[0, upper = 2.0\)"),
        ({"lower": 1.5, "upper": 1.5}, r"'lower' = 1.5: must be in \[0, upper = 1.5\)"),
        ({"log_ratio_clamp": 0.0}, "'log_ratio_clamp' = 0.0: must be > 0"),
    ],
)
def test_mismatch_config_refuses_the_bounds_by_name(fields, message):
    with pytest.raises(ConfigError, match=f"^config field {message}$"):
        MismatchConfig(**fields).validate()


@pytest.mark.parametrize("field", ["log_ratio_clamp", "kl_clamp"])
def test_grpo_clamps_must_be_positive(field):
    """A clamp of 0 (or below) would zero every log-ratio or k3 value: refused by name."""
    with pytest.raises(ConfigError, match=f"^config field '{field}' = 0.0: must be > 0$"):
        GRPOConfig(**{field: 0.0}).validate()
    GRPOConfig(**{field: 1e-3}).validate()


def test_mismatch_config_takes_the_values_next_to_its_bounds():
    for fields in ({"cap": 0.5}, {"lower": 0.0}, {"lower": 0.5}, {"log_ratio_clamp": 0.5}):
        MismatchConfig(**fields).validate()


def _correction64(old, rollout, mask, mc: MismatchConfig):
    """Float64 loop from the modes' definitions (grpo/mismatch.py): weight and keep per token."""
    c = mc.log_ratio_clamp
    weight = [[0.0] * len(r) for r in mask]
    keep = [[False] * len(r) for r in mask]
    for i, row in enumerate(mask):
        cols = [t for t, m in enumerate(row) if m]
        log_rho = {t: min(max(old[i][t] - rollout[i][t], -c), c) for t in cols}
        seq_log = sum(log_rho.values())
        seq = math.exp(min(max(seq_log, -c), c))
        geo = math.exp(seq_log / max(len(cols), 1))
        geo_band = mc.lower <= geo <= mc.upper
        for t in cols:
            rho = math.exp(log_rho[t])
            band = mc.lower <= rho <= mc.upper
            w, k = {
                "token-tis": (min(rho, mc.cap), True),
                "token-mask": (1.0, band),
                "icepop": (rho, band),
                "seq-tis": (min(seq, mc.cap), True),
                "seq-mask": (1.0, geo_band),
                "seq-mask-tis": (min(rho, mc.cap), geo_band),
                "mis": (seq, seq <= mc.cap),
            }[mc.mode]
            weight[i][t], keep[i][t] = (w if k else 0.0), k
    return weight, keep


# Log-ratios old − rollout per row (None: not a response token, whose log-ratio is OFF[row]: large,
# so that only the mask keeps it out, or 0, as padding is, so that a 0/0 would show). Row 0 crosses
# the token clamp (±1.5) both ways, each way changing ρ_seq; row 1's ρ_seq is past the clamp and
# its ρ_geo in [lo, hi] only over its own length; row 2 is ρ = 1 exactly (a band edge); row 3 has
# no response token; row 4 one (ρ = ρ_geo: a band edge, in [lo, hi] only over its own length);
# row 5's ρ_seq is under the clamp.
GAPS = [
    [0.2, -1.9, 1.7, None, -0.4],
    [None, 0.9, 0.8, 0.7, -0.1],
    [0.0, 0.0, None, None, None],
    [None, None, None, None, None],
    [None, None, -0.5, None, None],
    [-0.9, -0.8, None, None, None],
]
OFF = [5.0, 5.0, 5.0, 0.0, 5.0, 5.0]


def _gap_tensors():
    mask = [[g is not None for g in row] for row in GAPS]
    rollout = [[-0.5 - 0.25 * t for t in range(5)] for _ in GAPS]
    old = [
        [r + (off if g is None else g) for r, g in zip(rr, gg)]
        for rr, gg, off in zip(rollout, GAPS, OFF)
    ]
    return old, rollout, mask


@pytest.mark.parametrize("mode", [m for m in MISMATCH_MODES if m != "off"])
@pytest.mark.parametrize("edges", ["upper-and-cap", "lower"])
def test_correction_of_every_mode_against_float64(mode, edges):
    """Band and cap edges are hit exactly: ρ = 1 (row 2) is on ``upper`` and ``cap``, row 4's ρ
    on ``lower`` (the mask given as 0/1 integers there); then a cap that only ρ_seq's clamp keeps
    row 1 under."""
    old, rollout, mask = _gap_tensors()
    o, r = torch.tensor(old, dtype=torch.float64), torch.tensor(rollout, dtype=torch.float64)
    rho4 = float(torch.exp(o[4, 2] - r[4, 2]))
    lower, upper, cap = (rho4, 1.0, 1.0) if edges == "upper-and-cap" else (0.7, 1.5, 6.0)
    mc = MismatchConfig(mode=mode, cap=cap, lower=lower, upper=upper, log_ratio_clamp=1.5)
    m = torch.tensor(mask, dtype=torch.long if edges == "upper-and-cap" else torch.bool)
    weight, keep = correction(o, r, m, mc)
    want_w, want_k = _correction64(old, rollout, mask, mc)
    assert keep.dtype == torch.bool and keep.tolist() == want_k
    assert weight.dtype == torch.float64
    for got, want in zip(weight.tolist(), want_w):
        assert got == pytest.approx(want, rel=1e-12, abs=0), (mode, got, want)


def test_mismatch_sums_without_mixes_or_rejections_and_a_one_token_split():
    """No mixed positions and no keep mask: everything is ``plain``, nothing rejected; a split of
    one token is divided by 1."""
    old = torch.tensor([[-1.0, -0.5, 0.0], [-2.0, -1.0, 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.5, -0.25, 0.0], [-1.0, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    d = [0.5, -0.25, -1.0]
    k3 = sum(math.expm1(x) - x for x in d)
    sums = mismatch_sums(old, rollout, mask, None, None)
    assert sums == pytest.approx(
        {"mixed/n": 0.0, "mixed/gap": 0.0, "mixed/kl": 0.0, "mixed/masked": 0.0,
         "plain/n": 3.0, "plain/gap": 1.75, "plain/kl": k3, "plain/masked": 0.0},
        rel=1e-15,
    )  # fmt: skip
    one = mismatch_sums(old, rollout, mask, torch.tensor([[False] * 3, [True] * 3]), None)
    metrics = mismatch_metrics(one)
    assert metrics["mismatch/mixed/logprob_gap"] == 1.0
    assert metrics["mismatch/mixed/kl"] == pytest.approx(math.expm1(-1.0) + 1.0, rel=1e-15)
    assert metrics["mismatch/all/logprob_gap"] == pytest.approx(1.75 / 3, rel=1e-15)


# ---- the update's statistics ------------------------------------------------------------------
def _stats(values: dict) -> dict:
    return {k: torch.tensor(values.get(k, 0.0), dtype=torch.float64) for k in STAT_KEYS}


MICRO_BATCHES = [
    {"loss": 0.1, "pg_loss": 0.3, "kl_loss": 0.7, "tokens": 3.0, "clipped": 1.0, "kl": 0.3,
     "entropy": 2.1, "ratio": 3.3, "abs_log_ratio": 0.6, "ratio_max": 1.25},
    {"loss": -0.7, "pg_loss": -1.1, "kl_loss": 0.2, "tokens": 2.0, "clipped": 0.0, "kl": 0.1,
     "entropy": 1.3, "ratio": 1.9, "abs_log_ratio": 0.2, "ratio_max": 2.5},
    {"loss": 0.3, "pg_loss": 0.1, "kl_loss": 0.1, "tokens": 1.0, "clipped": 1.0, "kl": 0.7,
     "entropy": 0.9, "ratio": 0.75, "abs_log_ratio": 0.3, "ratio_max": 0.75},
]  # fmt: skip
# The other data-parallel rank's sums (its ratio_max slot is never read) and its ratio_max.
OTHER_RANK = {"loss": 0.9, "pg_loss": 0.2, "kl_loss": 0.3, "tokens": 4.0, "clipped": 2.0,
              "kl": 0.5, "entropy": 3.7, "ratio": 4.1, "abs_log_ratio": 0.9, "ratio_max": 99.0}  # fmt: skip
OTHER_MAX = 2.0


def _expected(sums: dict, ratio_max: float, norm: float) -> dict:
    tokens = sums["tokens"]
    return {
        "loss": sums["loss"],
        "pg_loss": sums["pg_loss"],
        "kl_loss": sums["kl_loss"],
        "clip_frac": sums["clipped"] / tokens,
        "kl": sums["kl"] / tokens,
        "entropy": sums["entropy"] / tokens,
        "ratio": sums["ratio"] / tokens,
        "abs_log_ratio": sums["abs_log_ratio"] / tokens,
        "ratio_max": ratio_max,
        "tokens": tokens,
        "normaliser": norm,
    }


def test_reduce_stats_sums_micro_batches_and_dp_ranks_and_takes_the_max(single_rank, monkeypatch):
    """The last pipeline stage of a VPP layout (the schedule leaves the virtual rank anywhere:
    the stage, not the chunk, must decide) with one other DP rank, emulated by the all-reduce:
    sums over micro-batches and ranks, the per-token means over all tokens, the max of
    ``ratio_max``."""
    dp = ps.get_data_parallel_group()

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None):
        assert group is dp
        if op == dist.ReduceOp.MAX:
            t.copy_(torch.maximum(t, torch.tensor(OTHER_MAX, dtype=t.dtype)))
        elif op == dist.ReduceOp.SUM:
            t += torch.tensor([OTHER_RANK[k] for k in STAT_KEYS], dtype=t.dtype)
        else:
            raise ValueError(op)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(ps, "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", 2)
    out = _reduce_stats([_stats(mb) for mb in MICRO_BATCHES], 7.0)
    sums = {k: sum(mb[k] for mb in MICRO_BATCHES) + OTHER_RANK[k] for k in STAT_KEYS}
    want = _expected(sums, 2.5, 7.0)
    assert set(out) == set(want)
    for k, v in want.items():
        assert out[k] == pytest.approx(v, rel=1e-15, abs=0), k


def test_reduce_stats_of_a_first_pipeline_stage_are_the_last_stages(single_rank, monkeypatch):
    """A first stage of PP 2 (emulated: its statistics arrive by the broadcast from the last
    stage's rank over the pipeline group), with one token in all."""
    pp_group = object()
    last = {"loss": 0.1, "pg_loss": -0.3, "kl_loss": 0.2, "tokens": 1.0, "clipped": 1.0,
            "kl": 0.4, "entropy": 1.7, "ratio": 1.1, "abs_log_ratio": 0.1, "ratio_max": 0.0}  # fmt: skip

    def broadcast(t, src, group):
        assert src == 5 and group is pp_group and t.shape == (len(STAT_KEYS) + 1,)
        t.copy_(torch.tensor([last[k] for k in STAT_KEYS] + [1.1], dtype=t.dtype))

    monkeypatch.setattr(dist, "broadcast", broadcast)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(ps, "is_pipeline_last_stage", lambda ignore_virtual=False: False)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_last_rank", lambda: 5)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_group", lambda: pp_group)
    out = _reduce_stats([], 3.0)
    want = _expected(last, 1.1, 3.0)
    assert set(out) == set(want)
    for k, v in want.items():
        assert out[k] == pytest.approx(v, rel=1e-15, abs=0), k


# ---- the update through a tiny model ----------------------------------------------------------
class _Scheduler:
    """Records the increments it is stepped by."""

    def __init__(self):
        self.steps = []

    def step(self, increment):
        self.steps.append(increment)


def _loss64(lp, ent, inputs: LossInputs, mask, cfg: GRPOConfig, max_len: int):
    """Float64 loop: the Dr.GRPO-normalised clipped surrogate × the correction's weight + k2 KL over
    kept tokens of active rows, and the statistics over every response token."""
    kept = [[bool(mask[i, t] and inputs.keep[i, t] and inputs.active[i]) for t in range(mask.shape[1])] for i in range(mask.shape[0])]  # fmt: skip
    norm = sum(any(row) for row in kept) * max_len
    pg = kl_loss = 0.0
    means = dict.fromkeys(("clip_frac", "kl", "entropy", "ratio", "abs_log_ratio"), 0.0)
    ratio_max, tokens = 0.0, int(mask.sum())
    for i, t in zip(*torch.nonzero(mask, as_tuple=True)):
        x, old, a = float(lp[i, t]), float(inputs.old_logprobs[i, t]), float(inputs.advantages[i])
        r = math.exp(x - old)
        clipped = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
        k2 = 0.5 * (float(inputs.ref_logprobs[i, t]) - x) ** 2
        if kept[i][t]:
            pg += max(-a * r, -a * clipped) * float(inputs.tis_weight[i, t]) / norm
            kl_loss += cfg.kl_coef * k2 / norm
        for k, v in zip(means, (-a * clipped > -a * r, k2, float(ent[i, t]), r, abs(x - old))):
            means[k] += v / tokens
        ratio_max = max(ratio_max, r)
    return {"loss": pg + kl_loss, "pg_loss": pg, "kl_loss": kl_loss, **means,
            "ratio_max": ratio_max, "tokens": tokens, "normaliser": norm}  # fmt: skip


def _tiny_update(tmp_path):
    """A tiny model wrapped for training, its Adam (with weight decay: a step always moves the
    weights) and a batch of 4 responses (vocabulary 60, padded to 64)."""
    hf = write_tiny_hf(tmp_path / "hf", weights=False, vocab_size=60, hidden_size=32,
                       num_layers=1, intermediate_size=64)  # fmt: skip
    chunks = wrap_for_training(
        build_model(ModelConfig(hf_path=str(hf), make_vocab_size_divisible_by=8))
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=1e9), chunks
    )
    g = torch.Generator().manual_seed(5)
    lengths = [3, 2, 4, 1]
    rb = RolloutBatch([[1, 2, 3]] * 4, [torch.randint(4, 60, (n,), generator=g).tolist()
                      for n in lengths], [[0.0] * n for n in lengths], ["stop"] * 4,
                      MixRecord.empty(4, 2), [0, 0, 1, 1])  # fmt: skip
    return chunks, optimizer, TokenBatch.from_rollout(rb)


def _model_values(chunks, tb):
    """The model's label-aligned log-probs and entropies [B, L] (T = 0.7, ids < 60), float64."""
    lp, ent = batch_logprobs(chunks, tb, 0.7, 4, 60, with_entropy=True).double()
    return lp * tb.mask, ent


def _loss_inputs(lp, mask) -> LossInputs:
    """π_old at least 0.1 nats inside or outside the clip band (no kink within a small difference),
    row 2's first response token rejected, row 3 inactive."""
    offset = 0.1 + 0.25 * (torch.arange(mask.shape[1], dtype=torch.float64) % 3)
    old = (lp + offset * torch.tensor([1.0, -1.0, 1.0, -1.0]).double().unsqueeze(1)) * mask
    keep = mask.clone()
    keep[2, int(mask[2].nonzero()[0])] = False
    return LossInputs(old_logprobs=old.float(), advantages=torch.tensor([1.0, -0.5, 2.0, 1.5]),
                      active=torch.tensor([True, True, True, False]), ref_logprobs=(old - 0.2).float(),
                      tis_weight=(1 + 0.1 * torch.arange(mask.numel()).view(mask.shape)) * keep,
                      keep=keep)  # fmt: skip


def _slope_and_difference(chunks, tb, inputs, cfg, eps=1e-3):
    """The gradient in ``main_grad`` along a random direction, and the central difference of the
    float64 loss along it (the weights restored after)."""
    g = torch.Generator().manual_seed(7)
    params = [p for c in chunks for p in c.parameters()]
    before = [p.detach().clone() for p in params]
    direction = [torch.randn(p.shape, generator=g) for p in params]
    slope = sum(float((p.main_grad * d).sum()) for p, d in zip(params, direction))
    losses = []
    for sign in (1, -1):
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.add_(sign * eps * d)
        losses.append(_loss64(*_model_values(chunks, tb), inputs, tb.mask, cfg, 6)["loss"])
        with torch.no_grad():
            for p, q in zip(params, before):
                p.copy_(q)
    return slope, (losses[0] - losses[1]) / (2 * eps)


def test_loss_and_grads_against_float64_with_its_step_rules(tmp_path, single_rank, monkeypatch):
    """``loss_and_grads`` on a tiny model, temperature 0.7, the padded vocabulary left out, a
    token budget of 12 (3 micro-batches), packed (log-probs equal to rounding): its statistics against the float64 loss of the model's
    log-probs (read forward-only), its gradient along a random direction against the central
    difference of that loss, the normaliser counted over the DP group; no optimizer step unless
    asked, the scheduler stepped by 1, no step (weight decay included) when nothing is active
    (and no keep mask: no correction)."""
    chunks, optimizer, tb = _tiny_update(tmp_path)
    lp, ent = _model_values(chunks, tb)
    inputs = _loss_inputs(lp, tb.mask)
    cfg = GRPOConfig(loss_agg="seq-mean-token-sum-norm", kl_coef=0.3, kl_estimator="k2",
                     dual_clip=None)  # fmt: skip
    settings = UpdateSettings(0.7, 2, 12, vocab_limit=60, max_response_len=6, packing="mask")
    groups, calls, packed = [], [], []
    monkeypatch.setattr(logprobs, "pack", lambda *a: packed.append(a[-1]) or pack(*a))
    monkeypatch.setattr(update, "token_logprobs", lambda *a: calls.append(a) or token_logprobs(*a))
    monkeypatch.setattr(update, "aggregation_weights",
                        lambda *a: groups.append(a[4]) or aggregation_weights(*a))  # fmt: skip
    params = [p for c in chunks for p in c.parameters()]
    before = [p.detach().clone() for p in params]
    stats = loss_and_grads(chunks, tb.with_inputs(inputs), cfg, settings, optimizer)
    assert len(calls) == len(split_rows(tb.lengths, 2, 12)) == 3 and packed == ["mask"] * 3
    assert groups == [ps.get_data_parallel_group()]
    want = _loss64(lp, ent, inputs, tb.mask, cfg, 6)
    assert set(stats) == set(want) | {"grad_norm"} and stats["grad_norm"] == 0.0
    for k, v in want.items():
        assert stats[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    slope, difference = _slope_and_difference(chunks, tb, inputs, cfg)
    assert slope == pytest.approx(difference, rel=1e-2)
    grad_norm = math.sqrt(sum(float((p.main_grad.double() ** 2).sum()) for p in params))
    scheduler = _Scheduler()
    stats = loss_and_grads(chunks, tb.with_inputs(inputs), cfg, settings, optimizer,
                           scheduler=scheduler, step=True)  # fmt: skip
    assert stats["grad_norm"] == pytest.approx(grad_norm, rel=1e-5) and scheduler.steps == [1]
    assert not any(torch.equal(p, q) for p, q in zip(params, before))
    stepped = [p.detach().clone() for p in params]
    idle = replace(inputs, active=torch.zeros(4, dtype=torch.bool), keep=None)
    stats = loss_and_grads(chunks, tb.with_inputs(idle), cfg, settings, optimizer, step=True)
    assert stats["normaliser"] == 0.0 and stats["grad_norm"] == 0.0
    assert all(torch.equal(p, q) for p, q in zip(params, stepped))


def test_update_step_defaults_and_the_training_wrap(tmp_path, single_rank, monkeypatch):
    """``update_step`` with its defaults: micro-batches of ``micro_batch_size`` rows (no token
    budget, no packing) and the optimizer stepped, its gradient norm returned; the wrap sums
    micro-batch losses (per-token mode) and finalises gradients with megatron's function."""
    chunks, optimizer, tb = _tiny_update(tmp_path)
    for c in chunks:
        assert unwrap(c).config.calculate_per_token_loss is True
        assert unwrap(c).config.finalize_model_grads_func is finalize_model_grads
    rows = []

    def loss_fn(mb, head):
        rows.append(mb.mask.shape[0])
        lp, _ = token_logprobs(head, mb.labels, 1.0)
        return (lp * mb.mask).sum(), torch.zeros((), dtype=torch.int), {}

    packed = []
    monkeypatch.setattr(logprobs, "pack", lambda *a: packed.append(a) or pack(*a))
    params = [p for c in chunks for p in c.parameters()]
    before = [p.detach().clone() for p in params]
    _, grad_norm = update_step(chunks, tb, loss_fn, 2, optimizer=optimizer)
    assert rows == [2, 2] and not packed
    want = math.sqrt(sum(float((p.main_grad.double() ** 2).sum()) for p in params))
    assert grad_norm == pytest.approx(want, rel=1e-5) and grad_norm > 0
    assert not any(torch.equal(p, q) for p, q in zip(params, before))


def test_aggregation_weights_count_the_tokens_and_sequences_of_every_dp_rank(monkeypatch):
    """With a DP group of two ranks (the other one's 5 active tokens in 2 sequences arrive by the
    emulated all-reduce) the normalisers are global; without a group they are this rank's."""
    dp = object()

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None):
        assert group is dp and op == dist.ReduceOp.SUM
        t += torch.tensor([5.0, 2.0], dtype=t.dtype)

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]]).bool()
    active = torch.tensor([True, True, False])
    lengths = [3, 1, 0]
    for mode, norm in (
        ("token-mean", 9),
        ("seq-mean-token-mean", 4),
        ("seq-mean-token-sum-norm", 24),
    ):
        w, n = aggregation_weights(mask, active, mode, 6, dp)
        assert n == norm, mode
        for i, length in enumerate(lengths):
            per = 1 / (norm * length) if mode == "seq-mean-token-mean" and length else 1 / norm
            want = [per if t < length else 0.0 for t in range(4)]
            assert w[i].tolist() == pytest.approx(want, rel=1e-6), (mode, i)
    assert aggregation_weights(mask, active, "token-mean", 6)[1] == 4


# ---- the micro-batch loss ---------------------------------------------------------------------
def test_micro_batch_loss_gspo_against_float64_in_the_logprobs_dtype():
    """GSPO with a one-token response (its mean log-ratio is that token's), float64 advantages on
    float32 log-probs (the loss stays float32), and a KL coefficient of 0 that adds nothing even
    where the KL is infinite (a reference log-prob of −inf off the response)."""
    cfg = GRPOConfig(loss_mode="gspo", kl_mode="loss", kl_coef=0.0, kl_estimator="k2")
    lp = torch.tensor([[-0.5, -1.25, -0.75], [-2.0, -0.5, -1.0]])
    old = torch.tensor([[-0.75, -1.0, -1.0], [-1.0, -0.625, -3.0]])
    mask = torch.tensor([[True, True, True], [False, True, False]])
    adv = torch.tensor([0.7, -1.3], dtype=torch.float64)
    ref = torch.tensor([[-0.5, -1.0, -1.0], [-math.inf, -0.5, -1.0]])
    weight = torch.tensor([[0.25, 0.25, 0.25], [0.0, 0.25, 0.0]])
    inputs = LossInputs(old, adv, torch.ones(2, dtype=torch.bool), ref, token_weight=weight)
    loss, _ = micro_batch_loss(lp, None, inputs, mask, cfg)
    want = 0.0
    for i in range(2):
        d = [float(lp[i, t] - old[i, t]) for t in range(3) if mask[i, t]]
        r = math.exp(sum(d) / len(d))
        a = float(adv[i].float())  # the advantages in the log-probs' dtype
        want += max(-a * r, -a * min(max(r, 0.8), 1.2)) * sum(weight[i].tolist())
    assert loss.dtype == torch.float32 and float(loss) == pytest.approx(want, rel=1e-6)


def test_micro_batch_loss_of_an_empty_micro_batch_is_zero():
    empty = torch.zeros(0, 4)
    inputs = LossInputs(empty, torch.zeros(0), torch.zeros(0, dtype=torch.bool), token_weight=empty)
    loss, stats = micro_batch_loss(empty, None, inputs, empty.bool(), GRPOConfig())
    assert float(loss) == 0.0 and {k: float(v) for k, v in stats.items()} == dict.fromkeys(
        STAT_KEYS, 0.0
    )


def test_a_token_exactly_at_the_dual_clip_bound_is_not_clipped():
    """A < 0 and −A·r equal to −A·c bit for bit (c set to the ratio torch computes): the dual clip
    does not bind, and the token is not counted as clipped (``loss > loss3``, strict)."""
    lp, old = torch.tensor([[0.9]], dtype=torch.float64), torch.tensor([[0.0]], dtype=torch.float64)
    cfg = GRPOConfig(dual_clip=float(torch.exp(lp - old)))
    loss, clipped, ratio = policy_loss(lp, old, torch.tensor([-1.0]), torch.ones(1, 1).bool(), cfg)
    assert float(ratio) == cfg.dual_clip and float(loss) == cfg.dual_clip
    assert not bool(clipped)
