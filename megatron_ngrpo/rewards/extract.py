"""Final-answer extraction from model responses (plain string scanning, linear time).

Hand-written rather than math-verify's extraction regexes: those run ``\\boxed{.+}`` with DOTALL
over the whole response and try ~20 alternations per position, which is slow on long outputs
and only finds the *first* candidate per priority; the reference scoring takes the content of
the **last** ``\\boxed{}`` (docs/ALGORITHM.md §9), which needs brace matching, not a regex.
"""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
# Fallback phrases, most specific first; the last occurrence of the first phrase found wins.
_FALLBACK_PHRASES = ("final answer is", "answer:")
# The answer ends at a line break or a sentence-ending period (not a decimal point).
_FALLBACK_STOP = re.compile(r"\n|\.(?=\s|$)")


def boxed_answers(text: str) -> list[str]:
    """The answers given in boxes, in order: the content of each non-empty ``\\boxed{...}`` /
    ``\\fbox{...}`` (nested braces kept) or brace-less ``\\boxed 5``; boxes whose braces never
    close are skipped. Adjacent boxes joined only by commas, "and"/"or", spaces or ``$``
    ("$\\boxed{1}$ and $\\boxed{2}$") are one list answer "1, 2", as math-verify reads them.

    Linear in ``len(text)``: braces are matched once, in one pass, before any box is read (a
    response repeating unclosed ``\\boxed{`` made a scan per box quadratic)."""
    match = None
    answers: list[str] = []
    prev_end = 0
    for m in _BOX_RE.finditer(text):
        if match is None:
            match = _matching_braces(text)
        box = _box_argument(text, m.end(), match)
        if box is None:
            continue
        content, end = box
        if answers and m.start() < prev_end:  # a box inside the previous one: the inner wins
            answers[-1] = content
        elif answers and m.start() - prev_end <= _MAX_JOINER and _JOINER.fullmatch(text, prev_end, m.start()):
            answers[-1] = f"{answers[-1]}, {content}"
        else:
            answers.append(content)
        prev_end = end
    return answers


def last_boxed(text: str) -> str | None:
    """The last of :func:`boxed_answers` (the evaluation rule), or None if there is none."""
    answers = boxed_answers(text)
    return answers[-1] if answers else None


_BOX_RE = re.compile("|".join(re.escape(c) for c in _BOX_COMMANDS))
# What may stand between two boxes of one list answer.
_JOINER = re.compile(r"[\s$,]*(?:(?:and|or|\\text\{\s*(?:and|or)\s*\})[\s$,]*)?")
_MAX_JOINER = 40
# A brace-less box argument is one short token ("\boxed 5").
_MAX_BARE_ARGUMENT = 64


def _matching_braces(text: str) -> dict[int, int]:
    """``{open index: close index}`` of every matched brace pair (``\\x`` escapes skipped)."""
    stack, match, i, n = [], {}, 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            match[stack.pop()] = i
        i += 1
    return match


def _box_argument(text: str, i: int, match: dict[int, int]) -> tuple[str, int] | None:
    """(content, end index) of the box whose command ends at ``i``; None if empty or unclosed."""
    n = len(text)
    if i < n and text[i].isalpha():  # \boxedx is another command, not a box
        return None
    while i < n and text[i] in " \t":
        i += 1
    if i >= n:
        return None
    if text[i] != "{":
        j, stop = i, min(n, i + _MAX_BARE_ARGUMENT)
        while j < stop and not text[j].isspace() and text[j] not in "$}\\":
            j += 1
        content = text[i:j].strip()
        return (content, j) if content else None
    close = match.get(i)
    if close is None:
        return None
    content = text[i + 1:close].strip()
    return (content, close + 1) if content else None


def fallback_answer(text: str) -> str | None:
    """The text after the last "final answer is" / "Answer:" up to the end of its line or
    sentence, with math delimiters and markdown stripped; None if neither phrase occurs."""
    lower = text.lower()
    for phrase in _FALLBACK_PHRASES:
        pos = lower.rfind(phrase)
        if pos < 0:
            continue
        tail = text[pos + len(phrase):pos + len(phrase) + 2000].lstrip(" :*")
        stop = _FALLBACK_STOP.search(tail)
        answer = tail[: stop.start()] if stop else tail
        answer = answer.strip().strip("*").strip()
        if answer.startswith(("\\(", "\\[")):
            answer = answer[2:]
        if answer.endswith(("\\)", "\\]")):
            answer = answer[:-2]
        answer = answer.strip("$ ").rstrip(".").strip()
        if answer:
            return answer
    return None


def extract_answer(text: str, fallback: bool = True) -> str | None:
    """The final answer of a math response: the last ``\\boxed{}``, else (``fallback``) the
    "final answer is ..." / "Answer: ..." phrase; None when nothing is found."""
    boxed = last_boxed(text)
    if boxed is not None or not fallback:
        return boxed
    return fallback_answer(text)


BOX_RULES = ("last", "any")
# Boxes tried by the "any" rule, the last ones first: bounds the grading work per response.
MAX_ANY_BOXES = 8


def candidate_answers(text: str, fallback: bool = True, box_rule: str = "last") -> list[str]:
    """The answers a response is graded on: ``box_rule`` "last" (evaluation) gives the final
    answer of :func:`extract_answer`; "any" (the reference's training reward, math-verify style:
    any boxed answer that matches counts) gives up to ``MAX_ANY_BOXES`` boxed answers, last first,
    and the fallback phrase when there is no box."""
    if box_rule == "last":
        answer = extract_answer(text, fallback)
        return [] if answer is None else [answer]
    if box_rule != "any":
        raise ValueError(f"box_rule {box_rule!r}: expected one of {BOX_RULES}")
    answers = boxed_answers(text)[::-1][:MAX_ANY_BOXES]
    if answers or not fallback:
        return answers
    answer = fallback_answer(text)
    return [] if answer is None else [answer]
