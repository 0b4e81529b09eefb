"""Is a predicted final answer equal to the gold answer? Runs inside a grading worker.

Layers, cheapest first:
1. an input guard (length, bracket nesting, control characters): hostile text never reaches a
   parser;
2. :func:`~megatron_ngrpo.rewards.normalize.normalize` string equality;
3. base numerals ("4210_{5}") compare as strings only; when both sides are plain numbers
   (:func:`~megatron_ngrpo.rewards.normalize.to_number`) the exact numeric comparison decides;
4. math-verify (the reference implementation's grader, docs/ALGORITHM.md §4.1) for everything
   symbolic: its LaTeX → sympy conversion (latex2sympy2_extended, an ANTLR grammar that builds
   sympy objects and evaluates no Python) and its comparison (simplification, numeric
   evaluation, sets/intervals/tuples/matrices/equations, complex numbers) do far better than a
   hand-written parser could.

Security: nothing here calls ``eval``/``sympify``/``parse_expr`` on model text. math-verify's
plain-expression extractor (``ExprExtractionConfig``, which does call sympy's ``parse_expr``) is
used for neither side; both are parsed as LaTeX only. Time and memory are bounded by the worker
(:mod:`megatron_ngrpo.rewards.pool`); math-verify's own signal timeouts are a softer first limit.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_ngrpo.rewards.extract import extract_answer
from megatron_ngrpo.rewards.normalize import BASE_NUMERAL, normalize, numbers_close, strip_math_delimiters, to_number

MAX_ANSWER_CHARS = 1000
# Deepest {[( nesting parsed; real answers stay under 10, and the ANTLR parse time explodes with
# depth (about 2 s at 200).
MAX_NESTING = 24


def is_parseable(answer: str) -> bool:
    """The guard: short, shallow, no control characters."""
    if not answer or len(answer) > MAX_ANSWER_CHARS:
        return False
    depth = 0
    for ch in answer:
        if ch in "{[(":
            depth += 1
            if depth > MAX_NESTING:
                return False
        elif ch in "}])":
            depth -= 1
        elif ch < " " and ch not in "\t\n":
            return False
    return True


def answers_match(pred: str, gold: str, soft_timeout_s: int = 5) -> bool:
    """True if the predicted answer equals the gold one (both LaTeX/plain answer strings)."""
    if not is_parseable(pred) or not gold:
        return False
    pred_norm, gold_norm = normalize(pred), normalize(gold)
    if pred_norm and pred_norm == gold_norm:
        return True
    if BASE_NUMERAL.match(gold_norm):
        return False
    pred_num, gold_num = to_number(pred_norm), to_number(gold_norm)
    if pred_num is not None and gold_num is not None:
        return numbers_close(pred_num, gold_num)
    return _math_verify_match(strip_math_delimiters(pred), strip_math_delimiters(gold), soft_timeout_s)


def _parse_boxed(answer: str, timeout_s: int) -> list:
    from math_verify import LatexExtractionConfig, parse

    # Wrapped in \boxed{} (as the reference does with the gold), LaTeX extraction only.
    return parse(f"\\boxed{{{answer}}}", extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
                 parsing_timeout=timeout_s)


_GOLD_CACHE: dict[str, list] = {}


def _parse_gold(gold: str, timeout_s: int) -> list:
    # The n samples of a problem share its gold: parse it once per worker (successes only: an
    # empty result may be a timeout).
    if gold not in _GOLD_CACHE:
        parsed = _parse_boxed(gold, timeout_s)
        if not parsed:
            return parsed
        if len(_GOLD_CACHE) >= 1024:
            _GOLD_CACHE.clear()
        _GOLD_CACHE[gold] = parsed
    return _GOLD_CACHE[gold]


def _math_verify_match(pred: str, gold: str, timeout_s: int) -> bool:
    from math_verify import verify

    gold_parsed = _parse_gold(gold, timeout_s)
    if not gold_parsed:
        return False
    pred_parsed = _parse_boxed(pred, timeout_s)
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))


def grade_response(response: str, golds: Sequence[str], fallback: bool = True,
                   soft_timeout_s: int = 5) -> float:
    """1.0 if the response's final answer matches any of the gold alternatives, else 0.0."""
    pred = extract_answer(response, fallback=fallback)
    if pred is None:
        return 0.0
    return float(any(answers_match(pred, g, soft_timeout_s) for g in golds))


def warm_up() -> None:
    """Builds math-verify's parser and regex caches once per worker (not on a task's clock)."""
    answers_match("\\frac{1}{2}", "0.5x")
