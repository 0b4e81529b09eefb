"""Is a predicted final answer equal to the gold answer? Runs inside a grading worker.

Layers, cheapest first:
1. an input guard (length, bracket nesting, control characters): hostile text never reaches a
   parser;
2. :func:`~megatron_ngrpo.rewards.normalize.normalize` string equality;
3. base numerals ("4210_{5}") compare as strings only; when both sides are plain numbers
   (:func:`~megatron_ngrpo.rewards.normalize.to_number`) the exact numeric comparison decides
   (a tolerance only for a side written as a decimal);
4. after math-verify's parse, two exact rationals (integers, fractions, integer powers and
   factorials of bounded size: ``1/2^{98}``, ``1/100!``) compare exactly: math-verify's numeric
   comparison chops differences below ~1e-15 and calls ``1/2^{98}`` = ``1/2^{99}``;
5. math-verify (the reference implementation's grader, docs/ALGORITHM.md §4.1) for everything
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

import math
from collections.abc import Sequence
from fractions import Fraction

from megatron_ngrpo.rewards.extract import MAX_ANY_BOXES, boxed_answers, candidate_answers
from megatron_ngrpo.rewards.normalize import (
    BASE_NUMERAL,
    as_list,
    normalize,
    numbers_close,
    strip_math_delimiters,
    to_number,
    unicode_to_latex,
    written_as_decimal,
)

MAX_ANSWER_CHARS = 1000
# Deepest {[( nesting parsed; real answers stay under 10, and the ANTLR parse time explodes with
# depth (about 2 s at 200).
MAX_NESTING = 24


def is_parseable(answer: str) -> bool:
    """The guard: short, shallow, no control characters but whitespace ones."""
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
        elif ch < " " and ch not in "\t\n\r\f\v":  # whitespace controls are whitespace
            return False
    return True


def answers_match(pred: str, gold: str, soft_timeout_s: int = 5) -> bool:
    """True if the predicted answer equals the gold one (both LaTeX/plain answer strings)."""
    if not is_parseable(pred) or not gold:
        return False
    pred, gold = unicode_to_latex(pred), unicode_to_latex(gold)
    pred_norm, gold_norm = normalize(pred), normalize(gold)
    if pred_norm and pred_norm == gold_norm:
        return True
    if BASE_NUMERAL.match(gold_norm):
        return False
    pred_num, gold_num = to_number(pred_norm), to_number(gold_norm)
    if pred_num is not None and gold_num is not None:
        return numbers_close(
            pred_num, gold_num, written_as_decimal(pred_norm) or written_as_decimal(gold_norm)
        )
    return _math_verify_match(
        as_list(pred_norm) or strip_math_delimiters(pred),
        as_list(gold_norm) or strip_math_delimiters(gold),
        soft_timeout_s,
    )


def _parse_boxed(answer: str, timeout_s: int) -> list:
    # lazy: heavy import, only in the grader's worker processes
    from math_verify import LatexExtractionConfig, parse

    # Wrapped in \boxed{} (as the reference does with the gold), LaTeX extraction only.
    return parse(
        f"\\boxed{{{answer}}}",
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
        parsing_timeout=timeout_s,
    )


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
    # lazy: heavy import, only in the grader's worker processes
    from math_verify import verify

    gold_parsed = _parse_gold(gold, timeout_s)
    if not gold_parsed:
        return False
    pred_parsed = _parse_boxed(pred, timeout_s)
    if not pred_parsed:
        return False
    gold_value, pred_value = exact_rational(gold_parsed[0]), exact_rational(pred_parsed[0])
    if gold_value is not None and pred_value is not None:
        return gold_value == pred_value
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))


# Largest exact value (bits of numerator or denominator) and factorial argument evaluated by
# exact_rational; beyond them math-verify's comparison decides.
MAX_EXACT_BITS = 4096
MAX_FACTORIAL = 500


def exact_rational(expr) -> Fraction | None:
    """The exact value of a sympy expression built only from integers, rationals, ``+``, ``×``,
    integer powers and factorials (size-bounded: ``MAX_EXACT_BITS``, ``MAX_FACTORIAL``); None for
    anything else (floats, symbols, roots, sets). Walks the tree in Python: no sympy evaluation."""

    # lazy: heavy import, only in the grader's worker processes
    import sympy

    def value(e) -> Fraction:
        if isinstance(e, sympy.Rational):  # Integer included
            return Fraction(int(e.p), int(e.q))
        if isinstance(e, (sympy.Add, sympy.Mul)):
            args = [value(a) for a in e.args]
            out = args[0]
            for a in args[1:]:
                out = out + a if isinstance(e, sympy.Add) else out * a
                _check(out)
            return out
        if isinstance(e, sympy.Pow):
            base, exp = value(e.base), value(e.exp)
            if exp.denominator != 1 or (base == 0 and exp < 0):
                raise ValueError
            bits = max(abs(base.numerator), base.denominator).bit_length() * abs(exp.numerator)
            if bits > MAX_EXACT_BITS:
                raise ValueError
            return base ** int(exp)
        if isinstance(e, sympy.factorial):
            n = value(e.args[0])
            if n.denominator != 1 or not 0 <= n <= MAX_FACTORIAL:
                raise ValueError
            return Fraction(math.factorial(int(n)))
        raise ValueError

    def _check(v: Fraction) -> None:
        if max(abs(v.numerator), v.denominator).bit_length() > MAX_EXACT_BITS:
            raise ValueError

    if not isinstance(expr, sympy.Basic):
        return None
    try:
        v = value(expr)
        _check(v)
        return v
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def grade_response(
    response: str,
    golds: Sequence[str],
    fallback: bool = True,
    soft_timeout_s: int = 5,
    box_rule: str = "last",
    free_text: str = "off",
) -> float:
    """1.0 if the response's final answer (``box_rule`` "last": the last box; "any": any of its
    boxes, see :func:`~megatron_ngrpo.rewards.extract.candidate_answers`; ``free_text``: the
    chat-model rule when there is no box) matches any of the gold alternatives, else 0.0.

    A gold of k > 1 top-level parts ("3, 5", "x=1, y=2") is also matched by the last k boxes
    read as one list ("\\boxed{3} ... \\boxed{5}"), with any box rule."""
    candidates = candidate_answers(response, fallback, box_rule, free_text)
    for gold in golds:
        parts = top_level_parts(gold)
        preds = candidates
        if 1 < parts <= MAX_ANY_BOXES:
            boxes = boxed_answers(response)
            if len(boxes) >= parts:
                preds = [*candidates, ", ".join(boxes[-parts:])]
        if any(answers_match(pred, gold, soft_timeout_s) for pred in preds):
            return 1.0
    return 0.0


def top_level_parts(answer: str) -> int:
    """How many comma-separated parts ``answer`` has outside brackets (thousands separators, as
    :func:`~megatron_ngrpo.rewards.normalize.normalize` reads them, are not commas here)."""
    s = normalize(answer)
    depth, parts = 0, 1
    for ch in s:
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        elif ch == "," and depth == 0:
            parts += 1
    return parts


def warm_up() -> None:
    """Builds math-verify's parser and regex caches once per worker (not on a task's clock)."""
    answers_match("\\frac{1}{2}", "0.5x")
