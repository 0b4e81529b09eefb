"""Binary correctness reward for math: final answer of a response vs gold answer(s)."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_ngrpo.rewards.closing import Closing
from megatron_ngrpo.rewards.equivalence import grade_response, warm_up
from megatron_ngrpo.rewards.extract import BOX_RULES, FREE_TEXT_RULES
from megatron_ngrpo.rewards.pool import GuardedPool

Gold = str | Sequence[str]


class MathGrader(Closing):
    """Scores ``(response_text, gold)`` pairs 1.0/0.0 in worker processes.

    ``gold`` is an answer string or a sequence of acceptable alternatives (Minerva). Every answer
    gets at most ``timeout_s`` seconds and its worker ``memory_mb`` MiB; a response longer than
    ``max_response_chars`` (no real 8k-token response is) scores 0 without leaving this
    process. ``fallback``: use "final answer is" / "Answer:" when there is no ``\\boxed{}``.
    ``box_rule``: "last" (evaluation) or "any" (the reference's training reward), see
    :func:`~megatron_ngrpo.rewards.extract.candidate_answers`. ``free_text``: without a box, the
    chat-model rule ("phrases": answer phrases, last math span; "last_number": also the last
    number; "off") of
    :func:`~megatron_ngrpo.rewards.extract.free_text_answer` instead of ``fallback``.
    Use as a context manager (or call :meth:`close`) to stop the workers.
    """

    def __init__(
        self,
        timeout_s: float = 10.0,
        memory_mb: int = 2048,
        workers: int = 4,
        max_response_chars: int = 200_000,
        fallback: bool = True,
        box_rule: str = "last",
        free_text: str = "off",
    ):
        if box_rule not in BOX_RULES:
            raise ValueError(f"MathGrader box_rule {box_rule!r}: expected one of {BOX_RULES}")
        if free_text not in FREE_TEXT_RULES:
            raise ValueError(
                f"MathGrader free_text {free_text!r}: expected one of {FREE_TEXT_RULES}"
            )
        self.max_response_chars = max_response_chars
        self.fallback = fallback
        self.box_rule = box_rule
        self.free_text = free_text
        # math-verify's signal timeouts (whole seconds) stop the common slow cases gently,
        # before the pool has to kill and replace the worker.
        self._soft_timeout_s = max(1, int(timeout_s / 3))
        self._pool = GuardedPool(
            workers,
            timeout_s,
            memory_mb,
            preload=["megatron_ngrpo.rewards.equivalence"],
            warmup=warm_up,
        )

    @property
    def failures(self) -> dict[str, int]:
        """Tasks that timed out, crashed their worker or raised (each scored 0)."""
        return dict(self._pool.failures)

    def score_batch(self, items: Sequence[tuple[str, Gold]]) -> list[float]:
        scores = [0.0] * len(items)
        todo, args = [], []
        for i, (text, gold) in enumerate(items):
            golds = (
                [gold]
                if isinstance(gold, str)
                else list(gold)
                if isinstance(gold, (list, tuple))
                else []
            )
            if (
                not isinstance(text, str)
                or len(text) > self.max_response_chars
                or not golds
                or not all(isinstance(g, str) for g in golds)
            ):
                continue
            todo.append(i)
            args.append(
                (text, golds, self.fallback, self._soft_timeout_s, self.box_rule, self.free_text)
            )
        for i, score in zip(todo, self._pool.map(grade_response, args, default=0.0)):
            scores[i] = score
        return scores

    def close(self) -> None:
        self._pool.close()
