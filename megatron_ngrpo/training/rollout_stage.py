"""The rollout stage of a training step: prompts → engine → rewards, as one :class:`ScoredRollout`.

It owns every rollout-side decision: the step's prompts (split over DP ranks by prompt, so a
group stays on one rank), the neighbour source of each weight version
(:class:`~megatron_ngrpo.training.neighbor_source.NeighborSource`), the engine's weight sync,
one-step-off generation (``train.async.max_staleness: 1``, training/async_rollout.py), scoring,
and DAPO's dynamic-sampling refill (grpo/dynamic_sampling.py). Rollouts are seeded by (seed,
step) and keyed by the prompt's global position in the step, so a resumed run regenerates the
same responses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from megatron_ngrpo.data.batches import PromptBatches
from megatron_ngrpo.grpo.advantages import group_ids, zero_variance_groups
from megatron_ngrpo.grpo.dynamic_sampling import (
    DynamicSamplingExhausted,
    choose_groups,
    exhausted_message,
)
from megatron_ngrpo.grpo.metrics import PhaseTimer, dp_max
from megatron_ngrpo.rewards.registry import RewardFunction, Rewards
from megatron_ngrpo.rollout.types import RolloutBatch, RolloutEngine, SamplingParams
from megatron_ngrpo.training.async_rollout import RolloutProducer
from megatron_ngrpo.training.job_config import NGRPOConfig
from megatron_ngrpo.training.neighbor_source import NeighborSource
from megatron_ngrpo.training.snapshot import WeightSnapshot

logger = logging.getLogger(__name__)


@dataclass
class ScoredRollout:
    """One step's rollouts on this DP rank, scored.

    ``examples``: this rank's prompts (``rollout.prompt_index`` indexes them); ``texts``,
    ``rewards``: per response; ``scores`` [N] float64, the rewards the advantages start from;
    ``generating``: the weights that made a one-step-off batch (None: the current ones);
    ``neighbor_rows``: neighbour rows the engine searched on demand for this batch's weight
    version; ``metrics``: the stage's figures of this step (table refresh, refill rounds,
    ``async/*``).
    """

    examples: list
    rollout: RolloutBatch
    texts: list[str]
    rewards: Rewards
    scores: torch.Tensor
    generating: WeightSnapshot | None = None
    neighbor_rows: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def informative(self) -> list[bool]:
        """Per prompt: its group's rewards differ."""
        uniform = zero_variance_groups(self.scores, group_ids(self.rollout.prompt_index))
        flags = [True] * len(self.examples)
        for r, i in enumerate(self.rollout.prompt_index):
            flags[i] = not bool(uniform[r])
        return flags

    def select(self, chosen: list[int]) -> ScoredRollout:
        """The prompts ``chosen`` (indices into ``examples``, in that order) and their rows."""
        rows = [r for i in chosen for r, p in enumerate(self.rollout.prompt_index) if p == i]
        rewards = Rewards(
            total=[self.rewards.total[r] for r in rows],
            correct=[self.rewards.correct[r] for r in rows],
            terms={k: [v[r] for r in rows] for k, v in self.rewards.terms.items()},
        )
        return ScoredRollout(
            [self.examples[i] for i in chosen],
            self.rollout.select_prompts(chosen),
            [self.texts[r] for r in rows],
            rewards,
            self.scores[rows],
            self.generating,
        )

    @staticmethod
    def cat(parts: list[ScoredRollout]) -> ScoredRollout:
        """Consecutive prompt ranges as one batch (same generating weights)."""
        rewards = Rewards(
            total=[x for p in parts for x in p.rewards.total],
            correct=[x for p in parts for x in p.rewards.correct],
            terms={
                k: [x for p in parts for x in p.rewards.terms[k]] for k in parts[0].rewards.terms
            },
        )
        return ScoredRollout(
            [ex for p in parts for ex in p.examples],
            RolloutBatch.cat([p.rollout for p in parts]),
            [t for p in parts for t in p.texts],
            rewards,
            torch.tensor(rewards.total, dtype=torch.float64),
            parts[0].generating,
        )


class RolloutStage:
    """Draws, generates and scores each step's rollouts (every rank, same calls).

    Args:
        cfg: the run's config.
        chunks: the policy's model chunks (the weights synced to the engine).
        engine: the rollout engine (owned by ``producer`` when one-step-off).
        producer: the one-step-off producer, or None (synchronous rollouts).
        prompts: the resumable prompt iterator.
        reward_fn: the reward function.
        neighbors: the owner of the neighbour source.
        tokenizer: decodes responses an engine returned without texts.
        dp_rank, dp_size: this rank's data-parallel position.
        num_real_tokens: ids an engine may return (validated).
        timer: the step's phase timer (``rollout``, ``rollout_wait``, ``neighbor_table``,
            ``reward``).
    """

    def __init__(
        self,
        cfg: NGRPOConfig,
        chunks: list,
        engine: RolloutEngine,
        producer: RolloutProducer | None,
        prompts: PromptBatches,
        reward_fn: RewardFunction,
        neighbors: NeighborSource,
        tokenizer,
        dp_rank: int,
        dp_size: int,
        num_real_tokens: int,
        timer: PhaseTimer,
    ):
        self.cfg, self.chunks, self.engine, self.producer = cfg, chunks, engine, producer
        self.prompts, self.reward_fn, self.neighbors = prompts, reward_fn, neighbors
        self.tokenizer, self.dp_rank, self.dp_size = tokenizer, dp_rank, dp_size
        self.num_real_tokens, self.timer = num_real_tokens, timer

    def next(self, step: int, updates: int, total_steps: int) -> ScoredRollout:
        """Step ``step``'s scored rollouts with the weights after ``updates`` optimizer updates
        (one-step-off: made with the last step's weights, and step ``step + 1``'s launched)."""
        if self.producer is not None:
            return self._one_step_off(step, updates, total_steps)
        examples, keys = self.draw()
        refreshed = self._refresh(updates)
        with self.timer("rollout"):
            rollout = self.generate([ex.prompt_ids for ex in examples], keys, step)
        with self.timer("reward"):
            scored = self._score(examples, rollout)
        metrics = {}
        if self.cfg.train.dynamic_sampling.enabled:
            scored, metrics = self._refill(scored, keys, step)
        scored.metrics = {**metrics, "mixing/table_refreshed": float(refreshed)}
        scored.neighbor_rows = self.engine.neighbor_rows_searched()
        return scored

    def draw(self) -> tuple[list, list[int]]:
        """The next step's prompts of this DP rank and their global indices (the sequence keys)."""
        batch = next(self.prompts)
        per_rank = len(batch) // self.dp_size
        start = self.dp_rank * per_rank
        return batch[start : start + per_rank], list(range(start, start + per_rank))

    def generate(
        self, prompts: list[list[int]], keys: list[int], step: int, sync: bool = True
    ) -> RolloutBatch:
        """One rollout with the current weights; ``sync`` False: the engine has them already."""
        self.engine.wake_up()
        if sync:
            self.engine.sync_weights(self.chunks)
            self.neighbors.apply(self.engine)
        rollout = self.engine.generate(
            prompts, self.sampling(step), mixing=self.neighbors.mixing, keys=keys
        )
        self.engine.sleep()
        rollout.policy_version = step
        rollout.validate(self.num_real_tokens)
        return rollout

    def sampling(self, step: int) -> SamplingParams:
        """Sampling settings of ``step``'s rollouts, seeded by (seed, step)."""
        return SamplingParams.from_config(
            self.cfg.rollout,
            self.tokenizer.eos_token_id,
            seed=(self.cfg.train.seed * 1_000_003 + step) % 2**31,
        )

    def _refresh(self, updates: int) -> bool:
        with self.timer("neighbor_table"):
            return self.neighbors.refresh(updates)

    def _one_step_off(self, step: int, updates: int, total_steps: int) -> ScoredRollout:
        """This step's rollouts, made with the last step's weights while it trained (or now, at
        the first step or after a drop), then the next step's launched with the current weights
        and neighbour source."""
        with self.timer("rollout_wait"):
            job = self.producer.take(step)
        refreshed = self._refresh(updates)
        examples, keys = (job.examples, job.keys) if job is not None else self.draw()
        if job is None or job.rollout is None:
            with self.timer("rollout"):
                rollout = self.generate([ex.prompt_ids for ex in examples], keys, step)
            generating = None
        else:
            rollout, generating = job.rollout, job.snapshot
            rollout.validate(self.num_real_tokens)
        # Read before the launch below syncs the next weight version into the engine.
        neighbor_rows = self.engine.neighbor_rows_searched()
        if step + 1 < total_steps:
            before = self.prompts.state_dict()
            ahead, ahead_keys = self.draw()
            self.producer.launch(
                step,
                self.chunks,
                self.neighbors,
                [ex.prompt_ids for ex in ahead],
                self.sampling(step + 1),
                examples=ahead,
                keys=ahead_keys,
                data_before=before,
            )
        metrics = self.producer.metrics(step, rollout.policy_version)
        with self.timer("reward"):
            scored = self._score(examples, rollout, generating)
        scored.metrics = {**metrics, "mixing/table_refreshed": float(refreshed)}
        scored.neighbor_rows = neighbor_rows
        return scored

    def _score(
        self, examples: list, rollout: RolloutBatch, generating: WeightSnapshot | None = None
    ) -> ScoredRollout:
        texts = rollout.texts or [
            self.tokenizer.decode(r, skip_special_tokens=True) for r in rollout.response_ids
        ]
        rewards = self.reward_fn(
            texts,
            [examples[i].problem.answers for i in rollout.prompt_index],
            rollout.response_lengths,
            rollout.finish_reasons,
        )
        scores = torch.tensor(rewards.total, dtype=torch.float64)
        return ScoredRollout(examples, rollout, texts, rewards, scores, generating)

    def _refill(
        self, first: ScoredRollout, keys: list[int], step: int
    ) -> tuple[ScoredRollout, dict[str, float]]:
        """Dynamic sampling: more rounds of prompts until every DP rank holds its share of groups
        whose rewards differ, then this rank's share in draw order. Rounds after the first reuse
        the synced weights and neighbour source; their sequence keys are offset by
        ``round × prompts_per_step`` (distinct gates and sampling streams)."""
        ds, t = self.cfg.train.dynamic_sampling, self.cfg.train
        need = t.prompts_per_step // self.dp_size
        rounds, informative = [first], [first.informative()]
        while True:
            found = sum(map(sum, informative))
            fewest = -dp_max({"f": -float(found)})["f"]
            if fewest >= need or len(rounds) == ds.max_gen_batches:
                break
            examples, _ = self.draw()
            offset = len(rounds) * t.prompts_per_step
            with self.timer("rollout"):
                rollout = self.generate(
                    [ex.prompt_ids for ex in examples], [k + offset for k in keys], step, sync=False
                )
            with self.timer("reward"):
                rounds.append(self._score(examples, rollout))
            informative.append(rounds[-1].informative())
        metrics = {
            "dynamic_sampling/gen_batches": float(len(rounds)),
            "dynamic_sampling/partial": float(fewest < need),
        }
        if fewest < need:
            if ds.on_exhausted == "error":
                raise DynamicSamplingExhausted(exhausted_message(int(fewest), need, len(rounds)))
            logger.warning(
                "step %d: partial batch, %d of %d groups per rank with differing rewards "
                "after %d rounds",
                step + 1,
                int(fewest),
                need,
                len(rounds),
            )
        picks = choose_groups(informative, need)
        parts = [r.select(chosen) for r, chosen in zip(rounds, picks, strict=True)]
        return ScoredRollout.cat(parts), metrics

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict | None:
        """This rank's in-flight one-step-off batch (None when synchronous or none)."""
        return self.producer.state_dict() if self.producer is not None else None

    def load_state_dict(self, in_flight: dict) -> None:
        """Resume the in-flight batch of a checkpoint: the prompt position before its prompts,
        and (when one-step-off) the batch itself, its prompts drawn again."""
        self.prompts.load_state_dict(in_flight["data_before"])
        if self.producer is not None:  # else (resumed synchronous) its prompts are generated again
            self.producer.load_state_dict(in_flight, self.draw()[0])

    def settle(self) -> None:
        """Wait for an in-flight one-step-off generation (kept), so the engine is free."""
        if self.producer is not None:
            self.producer.settle()

    def close(self) -> None:
        self.reward_fn.close()
        self.engine.close()
