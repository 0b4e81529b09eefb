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


def last_boxed(text: str) -> str | None:
    """Content of the last non-empty ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces kept), or
    of a brace-less ``\\boxed 5``; None if there is none or its braces never close.

    Linear in ``len(text)``: braces are matched once, in one pass, before any box is read (a
    response repeating unclosed ``\\boxed{`` made a scan per box quadratic)."""
    starts = sorted((m.end() for m in _BOX_RE.finditer(text)), reverse=True)
    if not starts:
        return None
    match = _matching_braces(text)
    for i in starts:
        content = _box_argument(text, i, match)
        if content:
            return content
    return None


_BOX_RE = re.compile("|".join(re.escape(c) for c in _BOX_COMMANDS))


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


def _box_argument(text: str, i: int, match: dict[int, int]) -> str | None:
    n = len(text)
    if i < n and text[i].isalpha():  # \boxedx is another command, not a box
        return None
    while i < n and text[i] in " \t":
        i += 1
    if i >= n:
        return None
    if text[i] != "{":
        j = i
        while j < n and not text[j].isspace() and text[j] not in "$}":
            j += 1
        return text[i:j].strip() or None
    close = match.get(i)
    if close is None:
        return None
    return text[i + 1:close].strip() or None


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
