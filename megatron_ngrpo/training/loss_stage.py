"""The loss-input stage of a training step: a :class:`ScoredRollout` and its replay batch →
:class:`~megatron_ngrpo.grpo.loss_inputs.LossInputs`, the one object the loss reads.

Old log-probs are the trainer's replay of the records (under the weights that generated a
one-step-off batch) or the engine's (``grpo.old_logprobs``); reference log-probs come from the
frozen initial policy; the rollout-vs-trainer mismatch (grpo/mismatch.py) gives its metrics and,
when configured, the correction's weights and kept tokens; rewards (DRA-adjusted when on) become
group advantages, and the zero-variance filter marks inactive rows.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from megatron_ngrpo.grpo.advantages import compute_advantages, group_ids, zero_variance_groups
from megatron_ngrpo.grpo.batches import TokenBatch
from megatron_ngrpo.grpo.config import GRPOConfig
from megatron_ngrpo.grpo.dra import ResponseHiddenMeans, dra_rewards, similarity, text_embedder
from megatron_ngrpo.grpo.logprobs import batch_logprobs
from megatron_ngrpo.grpo.loss_inputs import LossInputs
from megatron_ngrpo.grpo.metrics import PhaseTimer, dp_max, dp_sums
from megatron_ngrpo.grpo.mismatch import correction, mismatch_metrics, mismatch_sums
from megatron_ngrpo.grpo.update import UpdateSettings
from megatron_ngrpo.training.reference import ReferencePolicy
from megatron_ngrpo.training.rollout_stage import ScoredRollout


@dataclass
class BuiltLossInputs:
    """The stage's output: ``inputs`` for the loss; ``scores`` [N] float64, the rewards the
    advantages were computed from (DRA-adjusted when on); ``metrics`` (``mismatch/*``,
    ``logprob_gap/max_abs``)."""

    inputs: LossInputs
    scores: torch.Tensor
    metrics: dict[str, float]


class LossInputStage:
    """Builds each step's :class:`LossInputs` (every rank, same calls: the replays are
    collectives of the model-parallel group).

    Args:
        cfg: the ``grpo`` section.
        chunks: the policy's model chunks (replayed for old log-probs).
        settings: the replay's temperature, micro-batching and packing.
        reference: the reference policy, or None (no KL term).
        filter_zero_variance: rows of groups with uniform rewards are inactive
            (``grpo.filter_zero_variance`` or dynamic sampling).
        timer: the step's phase timer (``old_logprobs``, ``ref_logprobs``, ``reward``).
    """

    def __init__(
        self,
        cfg: GRPOConfig,
        chunks: list,
        settings: UpdateSettings,
        reference: ReferencePolicy | None,
        filter_zero_variance: bool,
        timer: PhaseTimer,
    ):
        self.cfg, self.chunks, self.settings = cfg, chunks, settings
        self.reference, self.filter_zero_variance, self.timer = (
            reference,
            filter_zero_variance,
            timer,
        )

    def build(self, scored: ScoredRollout, tb: TokenBatch) -> BuiltLossInputs:
        """The loss inputs of ``tb``, the replay batch of ``scored.rollout`` (same rows)."""
        hidden = self._dra_hidden(tb)
        engine_lp = tb.label_aligned(scored.rollout.logprobs)
        metrics: dict[str, float] = {}
        tis_weight = keep = None
        corr = self.cfg.correction
        with self.timer("old_logprobs"):
            if self.cfg.old_logprobs == "recompute":
                weights = (
                    scored.generating.active(self.chunks)
                    if scored.generating is not None
                    else contextlib.nullcontext(self.chunks)
                )
                with hidden or contextlib.nullcontext(), weights as chunks:
                    old = self._replay(chunks, tb)
                if corr.mode != "off":
                    tis_weight, keep = correction(old, engine_lp, tb.mask, corr)
                metrics = self._mismatch_metrics(old, engine_lp, tb, keep)
            else:
                old = engine_lp
        ref = None
        if self.reference is not None:
            with self.timer("ref_logprobs"), self.reference.active(self.chunks) as ref_chunks:
                ref = self._replay(ref_chunks, tb)
        with self.timer("reward"):
            scores, advantages, active = self._advantages(scored, hidden)
        inputs = LossInputs(
            old_logprobs=old,
            advantages=advantages.to(tb.tokens.device),
            active=active.to(tb.tokens.device),
            ref_logprobs=ref,
            tis_weight=tis_weight,
            keep=keep,
        )
        return BuiltLossInputs(inputs, scores, metrics)

    def _replay(self, chunks: list, tb: TokenBatch) -> torch.Tensor:
        s = self.settings
        return batch_logprobs(
            chunks,
            tb,
            s.temperature,
            s.micro_batch_size,
            s.vocab_limit,
            s.max_tokens,
            packing=s.packing,
        )

    @staticmethod
    def _mismatch_metrics(old, engine_lp, tb: TokenBatch, keep) -> dict[str, float]:
        """The rollout-vs-trainer log-prob gap, split mixed / plain (label-aligned)."""
        mixed = tb.mix.mask if tb.mix is not None else None
        out = mismatch_metrics(dp_sums(mismatch_sums(old, engine_lp, tb.mask, mixed, keep)))
        gap = (old - engine_lp).abs() * tb.mask
        out["logprob_gap/max_abs"] = dp_max({"m": float(gap.max()) if gap.numel() else 0.0})["m"]
        return out

    def _advantages(
        self, scored: ScoredRollout, hidden: ResponseHiddenMeans | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (DRA-adjusted) rewards [N], their group advantages [N] and the active rows [N]."""
        groups = group_ids(scored.rollout.prompt_index)
        scores = scored.scores
        d = self.cfg.dra
        if d.enabled:
            emb = hidden.means() if hidden is not None else self._dra_text_embedder(scored.texts)
            scores = dra_rewards(
                scores, similarity(emb), groups if d.scope == "group" else None
            ).double()
        advantages = compute_advantages(scores, groups, self.cfg.advantage, self.cfg.adv_eps)
        active = (
            ~zero_variance_groups(scores, groups)
            if self.filter_zero_variance
            else torch.ones(len(scores), dtype=torch.bool)
        )
        return scores, advantages, active

    def _dra_hidden(self, tb: TokenBatch) -> ResponseHiddenMeans | None:
        """DRA's capture of the policy's pooled hidden states in the replay
        (``grpo.dra.embedder = policy_hidden``)."""
        d = self.cfg.dra
        if not (d.enabled and d.embedder == "policy_hidden"):
            return None
        return ResponseHiddenMeans(
            self.chunks, tb, self.settings.micro_batch_size, self.settings.max_tokens
        )

    @functools.cached_property
    def _dra_text_embedder(self):
        return text_embedder(self.cfg.dra)  # a local model loads once
