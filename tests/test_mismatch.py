"""Rollout-trainer mismatch corrections (grpo/mismatch.py): the loss of every mode, through the
trainer's path (correction -> aggregation over kept tokens -> micro_batch_loss, float32), against
a float64 per-token loop written from the modes' definitions; the metrics' mixed/plain split."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ngrpo.config_loader import ConfigError, load
from megatron_ngrpo.grpo.config import GRPOConfig
from megatron_ngrpo.grpo.loss import aggregation_weights, micro_batch_loss
from megatron_ngrpo.grpo.loss_inputs import LossInputs
from megatron_ngrpo.grpo.mismatch import (
    MISMATCH_MODES,
    MismatchConfig,
    correction,
    mismatch_metrics,
    mismatch_sums,
)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, length = 6, 9
    mask = torch.zeros(b, length, dtype=torch.bool)
    for i, (start, n) in enumerate([(1, 7), (2, 5), (0, 9), (3, 2), (1, 6), (2, 4)]):
        mask[i, start : start + n] = True
    rollout = -torch.rand(b, length, generator=g, dtype=torch.float64) * 3
    # Gaps of up to ±1.2 nats: every band and cap is crossed by some tokens and some sequences.
    old = rollout + (torch.rand(b, length, generator=g, dtype=torch.float64) - 0.5) * 2.4 * (
        torch.rand(b, length, generator=g) < 0.4
    )
    old[3, 3:5] = rollout[3, 3:5] + 1.0  # one sequence far off as a whole (geometric mean e)
    new = old + (torch.rand(b, length, generator=g, dtype=torch.float64) - 0.5) * 0.6
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return new, old, rollout, adv, mask


def _reference(new, old, rollout, adv, mask, cfg: GRPOConfig, mc: MismatchConfig) -> float:
    """Float64 loop: the clipped surrogate × the mode's weight, over kept tokens, aggregated."""
    rows = []
    for i in range(mask.shape[0]):
        cols = [t for t in range(mask.shape[1]) if mask[i, t]]
        log_rho = [float(old[i, t] - rollout[i, t]) for t in cols]
        rho = [math.exp(x) for x in log_rho]
        seq = math.exp(sum(log_rho))
        geo = math.exp(sum(log_rho) / len(cols))
        terms = []
        for j, t in enumerate(cols):
            r = math.exp(float(new[i, t] - old[i, t]))
            a = float(adv[i])
            pg = max(-a * r, -a * min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high))
            if a < 0:
                pg = min(pg, -a * cfg.dual_clip)
            band = mc.lower <= rho[j] <= mc.upper
            geo_band = mc.lower <= geo <= mc.upper
            w, keep = {
                "token-tis": (min(rho[j], mc.cap), True),
                "token-mask": (1.0, band),
                "icepop": (rho[j], band),
                "seq-tis": (min(seq, mc.cap), True),
                "seq-mask": (1.0, geo_band),
                "seq-mask-tis": (min(rho[j], mc.cap), geo_band),
                "mis": (seq, seq <= mc.cap),
            }[mc.mode]
            if keep:
                terms.append(w * pg)
        rows.append(terms)
    if cfg.loss_agg == "token-mean":
        n = sum(len(t) for t in rows)
        return sum(sum(t) for t in rows) / n
    kept = [t for t in rows if t]  # seq-mean-token-mean over sequences with a kept token
    return sum(sum(t) / len(t) for t in kept) / len(kept)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mode", [m for m in MISMATCH_MODES if m != "off"])
def test_loss_of_every_mode_matches_float64_reference(mode, agg):
    new, old, rollout, adv, mask = _batch()
    mc = MismatchConfig(mode=mode, cap=1.5, lower=0.6, upper=1.4)
    cfg = GRPOConfig(loss_agg=agg, kl_mode="off", mismatch=mc)
    f = torch.float32
    weight, keep = correction(old.to(f), rollout.to(f), mask, cfg.correction)
    # The mode must act on this batch: some weight differs from 1 or some token is rejected.
    assert (weight[keep] != 1).any() or (mask & ~keep).any(), mode
    token_weight, norm = aggregation_weights(
        mask & keep, torch.ones(len(adv), dtype=torch.bool), agg, 9
    )
    inputs = LossInputs(
        old_logprobs=old.to(f),
        advantages=adv.to(f),
        active=torch.ones(len(adv), dtype=torch.bool),
        tis_weight=weight,
        token_weight=token_weight,
    )
    loss, _ = micro_batch_loss(new.to(f), None, inputs, mask, cfg)
    ref = _reference(new, old, rollout, adv, mask, cfg, mc)
    assert norm > 0 and abs(float(loss) - ref) <= 1e-5 * max(1.0, abs(ref)), (
        mode,
        agg,
        float(loss),
        ref,
    )


def test_tis_cap_is_token_tis():
    _, old, rollout, _, mask = _batch(1)
    a = correction(old, rollout, mask, GRPOConfig(tis_cap=1.3).correction)
    b = correction(old, rollout, mask, MismatchConfig(mode="token-tis", cap=1.3))
    assert torch.equal(a[0], b[0]) and torch.equal(
        a[0], torch.exp(old - rollout).clamp(max=1.3) * mask
    )


def test_metrics_split_mixed_and_plain_positions():
    _, old, rollout, _, mask = _batch(2)
    mixed = torch.zeros_like(mask)
    mixed[:, 3] = True
    _, keep = correction(
        old, rollout, mask, MismatchConfig(mode="token-mask", lower=0.8, upper=1.25)
    )
    m = mismatch_metrics(mismatch_sums(old, rollout, mask, mixed, keep))
    for name, sel in (("mixed", mixed & mask), ("plain", mask & ~mixed), ("all", mask)):
        d = (old - rollout)[sel]
        assert m[f"mismatch/{name}/logprob_gap"] == pytest.approx(float(d.abs().mean()), rel=1e-12)
        assert m[f"mismatch/{name}/kl"] == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-12)
        assert m[f"mismatch/{name}/masked_frac"] == pytest.approx(
            float((~keep[sel]).double().mean()), rel=1e-12
        )
    assert 0 < m["mismatch/all/masked_frac"] < 1


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["mismatch.mode=tis"], "'mismatch.mode' = 'tis'"),
        (["mismatch.mode=icepop", "mismatch.lower=3"], "'mismatch.lower' = 3"),
        (["mismatch.mode=icepop", "tis_cap=2"], "'tis_cap' = 2"),
        (["mismatch.mode=mis", "old_logprobs=rollout"], "needs grpo.old_logprobs = recompute"),
        (["tis_cap=2", "old_logprobs=rollout"], "'tis_cap' = 2.0: corrects π_old (recomputed)"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        load(GRPOConfig, None, overrides)
    assert message in str(e.value)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_rejected_tokens_leave_the_trainers_sum_and_normaliser(tmp_path, agg):
    """Through the trainer's update (grpo/update.py ``loss_and_grads`` on a tiny model, one
    process): a token-mask correction's rejected tokens are out of both the loss's sum and its
    normaliser, by value against the float64 reference (counting them in the normaliser passed
    every other test)."""
    from megatron_ngrpo.grpo.batches import TokenBatch
    from megatron_ngrpo.grpo.update import UpdateSettings, loss_and_grads, wrap_for_training
    from megatron_ngrpo.mixing.records import MixRecord
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel
    from megatron_ngrpo.rollout.types import RolloutBatch
    from tests.harness.tiny import write_tiny_hf
    from tests.support.replay import sequence_logprobs

    init_distributed()
    initialize_model_parallel(1, 1, None, seed=0)
    hf = write_tiny_hf(tmp_path / "hf", weights=False, vocab_size=64, hidden_size=32,
                       num_layers=1, intermediate_size=64)  # fmt: skip
    chunks = wrap_for_training(
        build_model(ModelConfig(hf_path=str(hf), make_vocab_size_divisible_by=8))
    )
    g = torch.Generator().manual_seed(3)
    lengths = [7, 5, 9, 2, 6, 4]
    rb = RolloutBatch([[1, 2, 3]] * 6, [torch.randint(4, 64, (n,), generator=g).tolist()
                      for n in lengths], [[0.0] * n for n in lengths], ["stop"] * 6,
                      MixRecord.empty(6, 2), [0, 0, 1, 1, 2, 2])  # fmt: skip
    tb = TokenBatch.from_rollout(rb)
    new = tb.label_aligned(sequence_logprobs(chunks, rb, 1.0, 3), torch.float64)
    mask = tb.mask
    old = new + (torch.rand(new.shape, generator=g, dtype=torch.float64) - 0.5) * 0.6 * mask
    gap = (torch.rand(new.shape, generator=g, dtype=torch.float64) - 0.5) * 2.4
    rollout = old + gap * (torch.rand(new.shape, generator=g) < 0.5) * mask
    rollout[3] = old[3] + 1.0 * mask[3]  # every token of one response rejected
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    mc = MismatchConfig(mode="token-mask", lower=0.6, upper=1.4)
    cfg = GRPOConfig(loss_agg=agg, kl_mode="off", mismatch=mc)
    f = torch.float32
    weight, keep = correction(old.to(f), rollout.to(f), mask, cfg.correction)
    assert 0 < int((mask & ~keep).sum()) < int(mask.sum()) and not (mask[3] & keep[3]).any()
    inputs = LossInputs(old_logprobs=old.to(f), advantages=adv.to(f),
                        active=torch.ones(6, dtype=torch.bool), tis_weight=weight, keep=keep)  # fmt: skip
    stats = loss_and_grads(chunks, tb.with_inputs(inputs), cfg, UpdateSettings(1.0, 2))
    ref = _reference(new, old, rollout, adv, mask, cfg, mc)
    assert stats["loss"] == pytest.approx(ref, rel=1e-5, abs=1e-7)
    kept = mask & keep
    want = int(kept.sum()) if agg == "token-mean" else int(kept.any(1).sum())
    assert stats["normaliser"] == want
