"""Reward functions by name, for the trainer: ``build_reward(RewardConfig)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_ngrpo.rewards.closing import Closing
from megatron_ngrpo.rewards.config import RewardConfig
from megatron_ngrpo.rewards.graders import build_grader
from megatron_ngrpo.rewards.shaping import format_reward, soft_overlong_penalty


@dataclass
class Rewards:
    """Per response: ``total`` (what the advantage uses), ``correct`` (0/1 grade) and each
    shaping term in ``terms`` (for logging)."""

    total: list[float]
    correct: list[float]
    terms: dict[str, list[float]] = field(default_factory=dict)


class RewardFunction(Closing):
    """Correctness from the configured grader plus the configured shaping terms.

    ``__call__(texts, golds, lengths, finish_reasons)``: ``lengths`` are response token counts
    (needed by ``overlong = soft``), ``finish_reasons`` "stop"/"length" (``overlong = zero``).
    """

    def __init__(self, cfg: RewardConfig, max_response_tokens: int | None = None):
        self.cfg = cfg
        self.max_response_tokens = cfg.max_response_tokens or max_response_tokens or 0
        if cfg.overlong == "soft" and self.max_response_tokens <= cfg.overlong_buffer:
            raise ValueError(
                f"overlong = soft needs max_response_tokens "
                f"({self.max_response_tokens}) > overlong_buffer ({cfg.overlong_buffer})"
            )
        self.grader = build_grader(cfg)

    def __call__(
        self,
        texts: Sequence[str],
        golds: Sequence,
        lengths: Sequence[int] | None = None,
        finish_reasons: Sequence[str] | None = None,
    ) -> Rewards:
        if len(texts) != len(golds):
            raise ValueError(f"{len(texts)} responses but {len(golds)} gold answers")
        correct = self.grader.score_batch(list(zip(texts, golds)))
        total = list(correct)
        terms: dict[str, list[float]] = {}
        cfg = self.cfg
        if cfg.format_weight:
            terms["format"] = [
                cfg.format_weight * format_reward(t, cfg.format_think_close) for t in texts
            ]
        if cfg.overlong == "soft":
            if lengths is None:
                raise ValueError("overlong = soft needs the response lengths")
            terms["overlong"] = [
                cfg.overlong_weight
                * soft_overlong_penalty(n, self.max_response_tokens, cfg.overlong_buffer)
                for n in lengths
            ]
        for values in terms.values():
            total = [a + b for a, b in zip(total, values)]
        if cfg.overlong == "zero":
            if finish_reasons is None:
                raise ValueError("overlong = zero needs the finish reasons")
            total = [0.0 if r == "length" else t for t, r in zip(total, finish_reasons)]
        return Rewards(total=total, correct=correct, terms=terms)

    def close(self) -> None:
        self.grader.close()


def build_reward(cfg: RewardConfig, max_response_tokens: int | None = None) -> RewardFunction:
    return RewardFunction(cfg, max_response_tokens)
