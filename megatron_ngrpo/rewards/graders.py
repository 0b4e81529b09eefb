"""Graders by name: ``GRADERS[name](reward_config)`` → an object with ``score_batch([(text, gold)])
-> [0/1]`` and ``close()``. Below :mod:`megatron_ngrpo.rewards.config`, which validates names here."""

from __future__ import annotations

from collections.abc import Callable

from megatron_ngrpo.rewards.choice import ChoiceGrader
from megatron_ngrpo.rewards.math_grader import MathGrader


def _math(cfg) -> MathGrader:
    return MathGrader(
        timeout_s=cfg.timeout_s,
        memory_mb=cfg.memory_mb,
        workers=cfg.workers,
        max_response_chars=cfg.max_response_chars,
        fallback=cfg.fallback,
        box_rule=cfg.box_rule,
        free_text=cfg.free_text,
    )


def _mcq(cfg) -> ChoiceGrader:
    return ChoiceGrader(mode=cfg.mcq_mode, letters=cfg.mcq_letters)


# name → factory(RewardConfig) → grader.
GRADERS: dict[str, Callable[[object], object]] = {"math": _math, "mcq": _mcq}


def register_grader(name: str, factory: Callable[[object], object]) -> None:
    GRADERS[name] = factory


def build_grader(cfg):
    """The grader ``cfg`` (a RewardConfig) names."""
    return GRADERS[cfg.name](cfg)
