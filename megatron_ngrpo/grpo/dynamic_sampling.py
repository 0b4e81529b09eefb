"""Dynamic sampling (DAPO): keep only groups whose rewards differ, and generate more prompts
until the step's batch is full again.

The zero-variance filter alone trains on fewer groups as the policy saturates; here the trainer
draws further prompt batches (up to ``max_gen_batches`` generation rounds per step, the first
included) and every data-parallel rank keeps its first ``prompts_per_step / DP`` informative
groups in draw order. Rounds stop when every rank has enough (one all-reduce per round, so all
ranks run the same number of rounds). When the rounds run out, ``on_exhausted: error`` stops the
run with one line; ``partial`` trains on the informative groups found and fills the batch up to
its size with uniform groups, which carry no gradient and count in no normaliser (the
zero-variance filter), so the update count and the batch shapes stay fixed; the step logs
``dynamic_sampling/partial``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_ngrpo.config_loader import fail


@dataclass
class DynamicSamplingConfig:
    enabled: bool = False
    # Generation rounds per step at most (DAPO's max_num_gen_batches; the first round included).
    max_gen_batches: int = 4
    # Not enough informative groups after max_gen_batches rounds: "error" or "partial".
    on_exhausted: Literal["error", "partial"] = "error"

    def validate(self) -> None:
        if self.max_gen_batches < 1:
            fail("max_gen_batches", self.max_gen_batches, "must be >= 1")


class DynamicSamplingExhausted(RuntimeError):
    """Too few informative groups after ``max_gen_batches`` rounds (``on_exhausted: error``)."""


def exhausted_message(found: int, need: int, rounds: int) -> str:
    """The one-line error of ``on_exhausted: error`` (``found``: the fewest any rank found)."""
    return (
        f"dynamic sampling: {found} groups with differing rewards after {rounds} generation "
        f"rounds on some data-parallel rank, {need} needed per rank (raise "
        f"train.dynamic_sampling.max_gen_batches, or set on_exhausted: partial)"
    )


def choose_groups(informative: list[list[bool]], need: int) -> list[list[int]]:
    """The groups this rank keeps: per round, the prompt indices (in draw order) of the first
    ``need`` informative groups over all rounds, and when fewer were found the first uniform
    ones up to ``need``. ``informative[r][i]``: the rewards of prompt ``i`` of round ``r`` differ."""
    good = [(r, i) for r, row in enumerate(informative) for i, ok in enumerate(row) if ok]
    uniform = [(r, i) for r, row in enumerate(informative) for i, ok in enumerate(row) if not ok]
    chosen = sorted((good + uniform)[:need])
    return [[i for r2, i in chosen if r2 == r] for r in range(len(informative))]
