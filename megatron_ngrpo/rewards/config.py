"""Configuration of the reward (trainer) and of the grader (evaluation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_ngrpo.config_loader import fail
from megatron_ngrpo.rewards.extract import BoxRule, FreeTextRule
from megatron_ngrpo.rewards.graders import GRADERS


@dataclass
class RewardConfig:
    # Correctness grader: "math" (last \boxed{} vs gold, math-verify) or "mcq" (choice letter).
    name: str = "math"
    # Math grader limits, per answer / per worker process.
    timeout_s: float = 10.0
    memory_mb: int = 2048
    workers: int = 4
    max_response_chars: int = 200_000
    # Without a \boxed{}, use "final answer is ..." / "Answer: ..." (reference: boxed only).
    fallback: bool = True
    # Chat-model answers without a \boxed{} (docs/GRADING.md): "phrases" ("The answer is 18.",
    # "Final Answer: 34", "#### 18", else a bare one-line answer or the last math span),
    # "last_number" (also the last number in the text) or "off". Replaces `fallback` when on.
    free_text: FreeTextRule = "off"
    # Which boxes are graded: "last" (the evaluation rule: the last box, or the last run of
    # adjacent boxes as one list) or "any" (the reference's training reward: any of the last 8
    # boxed answers that matches scores 1; docs/GRADING.md).
    box_rule: BoxRule = "last"
    # mcq: "paper" (only "Answer: X") or "reference" (also \boxed{X} and a last bare letter).
    mcq_mode: Literal["paper", "reference"] = "paper"
    mcq_letters: str = "ABCD"
    # Added format reward: weight × 1[exactly one `format_think_close` and a \boxed{} after it].
    format_weight: float = 0.0
    format_think_close: str = "</think>"
    # Overlong shaping: "none"; "soft" (DAPO): linear penalty from 0 to -overlong_weight over the
    # last overlong_buffer tokens before max_response_tokens; "zero": a truncated response
    # (finish reason "length") gets total reward 0.
    overlong: Literal["none", "soft", "zero"] = "none"
    overlong_buffer: int = 1024
    overlong_weight: float = 1.0
    # Length the soft penalty counts to; 0 = the rollout's max_new_tokens (set by the trainer).
    max_response_tokens: int = 0

    def validate(self) -> None:
        if self.name not in GRADERS:
            fail("name", self.name, f"expected one of {sorted(GRADERS)}")
        if self.timeout_s <= 0:
            fail("timeout_s", self.timeout_s, "must be > 0")
        if self.memory_mb < 256:
            fail("memory_mb", self.memory_mb, "must be >= 256 (sympy needs room)")
        if self.workers < 1:
            fail("workers", self.workers, "must be >= 1")
        if self.overlong == "soft" and self.overlong_buffer < 1:
            fail("overlong_buffer", self.overlong_buffer, "must be >= 1 with overlong = soft")
        if self.max_response_tokens < 0:
            fail("max_response_tokens", self.max_response_tokens, "must be >= 0")
