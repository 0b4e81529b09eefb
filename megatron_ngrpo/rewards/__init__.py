"""Rewards: final-answer extraction, answer equivalence (math-verify behind guards, in worker
processes with time and memory limits), multiple-choice grading, shaping terms, registry."""

from megatron_ngrpo.rewards.choice import ChoiceGrader
from megatron_ngrpo.rewards.config import RewardConfig
from megatron_ngrpo.rewards.graders import build_grader, register_grader
from megatron_ngrpo.rewards.math_grader import MathGrader
from megatron_ngrpo.rewards.registry import RewardFunction, Rewards, build_reward

__all__ = [
    "ChoiceGrader",
    "MathGrader",
    "RewardConfig",
    "RewardFunction",
    "Rewards",
    "build_grader",
    "build_reward",
    "register_grader",
]
