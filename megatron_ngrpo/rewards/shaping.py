"""Reward shaping terms added to correctness: a format reward and overlong penalties."""

from __future__ import annotations

from megatron_ngrpo.rewards.extract import last_boxed


def format_reward(text: str, think_close: str = "</think>") -> float:
    """1.0 if the reasoning is closed exactly once and a ``\\boxed{}`` answer follows it."""
    if text.count(think_close) != 1:
        return 0.0
    return float(last_boxed(text.split(think_close, 1)[1]) is not None)


def soft_overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_length - buffer`` tokens, then linearly
    down to -1 at ``max_length`` (and -1 beyond)."""
    start = max_length - buffer
    if length <= start:
        return 0.0
    return max(-1.0, (start - length) / buffer)
