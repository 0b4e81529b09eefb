"""Multiple-choice (GPQA-style) letter grading.

Two modes (docs/ALGORITHM.md §9): ``paper`` accepts only the instructed "Answer: <letter>" line (the
last one in the response); ``reference`` also accepts ``\\boxed{<letter>}`` and, failing both, the
last stand-alone capital choice letter, as the reference implementation's regex does.
Runs in-process: bounded regular expressions over the response tail, no parsing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from megatron_ngrpo.rewards.closing import Closing

MODES = ("paper", "reference")
# Only the tail is searched: the answer line comes last, and it bounds the regex work.
TAIL_CHARS = 4000


class ChoiceGrader(Closing):
    """Scores ``(response_text, gold_letter)`` pairs 1.0/0.0; ``letters`` are the valid choices."""

    def __init__(self, mode: str = "paper", letters: str = "ABCD"):
        if mode not in MODES:
            raise ValueError(f"ChoiceGrader mode {mode!r}: expected one of {MODES}")
        if not letters.isalpha() or not letters.isupper():
            raise ValueError(f"ChoiceGrader letters {letters!r}: expected capital letters")
        self.mode = mode
        set_ = f"[{re.escape(letters)}]"
        self._answer = re.compile(rf"(?i:answer)\s*[:：]\s*\**\s*\(?\s*({set_})(?![A-Za-z])")
        self._boxed = re.compile(rf"\\boxed\s*\{{\s*(?:\\text\s*\{{)?\s*\(?({set_})\)?\s*\}}")
        self._bare = re.compile(rf"(?<![A-Za-z])({set_})(?![A-Za-z])")

    def extract(self, text: str) -> str | None:
        tail = text[-TAIL_CHARS:]
        patterns = (
            [self._answer] if self.mode == "paper" else [self._answer, self._boxed, self._bare]
        )
        for pattern in patterns:
            matches = pattern.findall(tail)
            if matches:
                return matches[-1].upper()
        return None

    def score_batch(self, items: Sequence[tuple[str, str]]) -> list[float]:
        scores = []
        for text, gold in items:
            ok = isinstance(text, str) and isinstance(gold, str)
            scores.append(float(ok and self.extract(text) == gold.strip().strip("()").upper()))
        return scores

    @property
    def failures(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass
