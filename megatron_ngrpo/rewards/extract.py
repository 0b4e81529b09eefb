"""Final-answer extraction from model responses (plain string scanning, linear time).

Hand-written rather than math-verify's extraction regexes: those run ``\\boxed{.+}`` with DOTALL
over the whole response and try ~20 alternations per position, which is slow on long outputs
and only finds the *first* candidate per priority; the reference scoring takes the content of
the **last** ``\\boxed{}`` (docs/ALGORITHM.md §9), which needs brace matching, not a regex.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Literal, get_args

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
    return [content for _, content, _ in _boxes(text, _joined)]


def _joined(text: str, prev_end: int, start: int) -> bool:
    """Whether the box at ``start`` continues the list answer of the box ending at ``prev_end``."""
    return start - prev_end <= _MAX_JOINER and _JOINER.fullmatch(text, prev_end, start) is not None


def _boxes(text: str, joined) -> list[tuple[int, str, int]]:
    """``(start, content, end)`` of each answer in boxes, a box that ``joined(text, prev_end,
    start)`` continues the previous one merged into it as a list (see :func:`boxed_answers`)."""
    match = None
    answers: list[tuple[int, str, int]] = []
    for m in _BOX_RE.finditer(text):
        if match is None:
            match = _matching_braces(text)
        box = _box_argument(text, m.end(), match)
        if box is None:
            continue
        content, end = box
        if answers and m.start() < answers[-1][2]:  # a box inside the previous one: the inner wins
            answers[-1] = (answers[-1][0], content, end)
        elif answers and joined(text, answers[-1][2], m.start()):
            answers[-1] = (answers[-1][0], f"{answers[-1][1]}, {content}", end)
        else:
            answers.append((m.start(), content, end))
    return answers


def last_boxed(text: str) -> str | None:
    """The last of :func:`boxed_answers` (the evaluation rule), or None if there is none."""
    answers = boxed_answers(text)
    return answers[-1] if answers else None


_BOX_RE = re.compile("|".join(re.escape(c) for c in _BOX_COMMANDS))
# What may stand between two boxes of one list answer.
_JOINER = re.compile(
    r"(?:[\s$,]|\\[()\[\]]|\\q?quad)*(?:(?:and|or|\\text\{\s*(?:and|or)\s*\})"
    r"(?:[\s$,]|\\[()\[\]]|\\q?quad)*)?"
)
_MAX_JOINER = 40
_SENTENCE_END = re.compile(r'[\\"\u201d\s]*(?:\.|\n|$)')
# Numbers in one box joined by a word ("12\text{ and }13"), read as a list in a gold.
_NUMBERS_JOINED = re.compile(r"\\text\{\s*(?:and|or)\s*\}|\s+(?:and|or)\s+")
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
    content = text[i + 1 : close].strip()
    return (content, close + 1) if content else None


def fallback_answer(text: str) -> str | None:
    """The text after the last "final answer is" / "Answer:" up to the end of its line or
    sentence, with math delimiters and markdown stripped; None if neither phrase occurs."""
    lower = text.lower()
    for phrase in _FALLBACK_PHRASES:
        pos = lower.rfind(phrase)
        if pos < 0:
            continue
        tail = text[pos + len(phrase) : pos + len(phrase) + 2000].lstrip(" :*")
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


def extract_answer(text: str, fallback: bool = True, free_text: str = "off") -> str | None:
    """The final answer of a math response: the last ``\\boxed{}``, else (``free_text`` "phrases"
    or "last_number") the free-text rule of :func:`free_text_answer`, else (``fallback``) the
    "final answer is ..." / "Answer: ..." phrase; None when nothing is found. With ``free_text``,
    an answer phrase written after the last box ("... \\boxed{255} ... The final answer is
    $10,455$.") is the answer."""
    if free_text not in FREE_TEXT_RULES:
        raise ValueError(f"free_text {free_text!r}: expected one of {FREE_TEXT_RULES}")
    boxed = last_boxed(text)
    if boxed is not None:
        if free_text != "off":
            last_box = max(text.rfind(c) for c in _BOX_COMMANDS)
            return _phrase_answer(text[last_box:][-FREE_TEXT_TAIL:]) or boxed
        return boxed
    if free_text != "off":
        return free_text_answer(text, last_number=free_text == "last_number")
    return fallback_answer(text) if fallback else None


# Free-text rule (chat models): "off", "phrases" (answer phrases, a bare one-line response, the
# last math span) or "last_number" (also the last number in the text). Only the tail is read: the final answer comes last, and it bounds
# the work on a hostile response.
FreeTextRule = Literal["off", "phrases", "last_number"]
FREE_TEXT_RULES = get_args(FreeTextRule)
FREE_TEXT_TAIL = 4000
# The last of these phrases (case-insensitive) introduces the answer; GSM8K's "#### 18" included.
_ANSWER_PHRASE = re.compile(
    r"final answer is|final answer\s*:|the answer is|answer is|answer\s*:|####", re.IGNORECASE
)
# Math spans, inline ones on one line (math-verify's reading); bounded length keeps the scan linear.
_MATH_SPAN = re.compile(
    r"\$\$(?P<a>[^$]{1,500}?)\$\$|(?<!\\)\$(?P<b>(?:[^$\n\\]|\\.){1,500}?)\$"
    r"|\\\((?P<c>[^\n]{1,500}?)\\\)|\\\[(?P<d>.{1,500}?)\\\]",
    re.S,
)
# A number in prose: thousands groups, decimals, a/b fractions, a unicode minus; not the end of a word.
_NUMBER = re.compile(
    r"(?<![A-Za-z\d.])[-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+|(?=\.\d))(?:\.\d+)?(?:/\d+)?"
    r"(?![\d.]?\d|,\d)"
)
# A word of prose (not a LaTeX command): the phrase's text is a sentence, its number is the answer.
_PROSE_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")
# A whole response this short, on one line and without prose, is the answer itself ("\frac{10}{9}").
_MAX_BARE_RESPONSE = 100


def free_text_answer(text: str, last_number: bool = True) -> str | None:
    """The final answer of a response without a box (the ``free_text`` option, for chat models),
    from the last ``FREE_TEXT_TAIL`` characters, first rule that applies:

    1. after the last answer phrase ("The answer is 18.", "Final Answer: 34", "#### 18",
       "the final answer is $x$"): a math span that opens it, else its text up to the end of the
       line or sentence; when that text is prose ("18 apples in all") its first number;
    2. a whole response of one short line without prose ("-\\frac{10}{9}") is the answer;
    3. whichever comes last of the last math span (``$...$``, ``$$...$$``, ``\\(...\\)``,
       ``\\[...\\]``, its content) and (``last_number``) the last number after it ("...
       increases by 100%."). Without ``last_number`` a response that only mentions numbers has no
       answer: on a task whose answer is one of the numbers in the question (max/min) the last
       number rewards restating the question.
    None when there is none. Linear: bounded regular expressions over a bounded tail."""
    tail = text[-FREE_TEXT_TAIL:]
    answer = _phrase_answer(tail)
    if answer:
        return answer
    bare = tail.strip().strip("$").strip().rstrip(".")
    if 0 < len(bare) <= _MAX_BARE_RESPONSE and "\n" not in bare and not _PROSE_WORD.search(bare):
        return bare
    span = _last_match(_MATH_SPAN.finditer(tail))
    number = (
        _last_match(_NUMBER.finditer(tail, span.end() if span is not None else 0))
        if last_number
        else None
    )
    if number is not None:
        return number.group()
    if span is not None:
        return next(g for g in span.groups() if g is not None).strip() or None
    return None


def _phrase_answer(text: str) -> str | None:
    """The answer after the last answer phrase of ``text`` (rule 1 of :func:`free_text_answer`)."""
    phrase = _last_match(_ANSWER_PHRASE.finditer(text))
    if phrase is None:
        return None
    after = text[phrase.end() :].lstrip(" :*\t")
    listed = _joined_spans(after.lstrip('\\"\u201c'), sentence=True)
    if listed is not None:  # 'The final answer is "$12$ and $13$".'
        return listed
    span = _MATH_SPAN.match(after)
    if span is not None:
        return next(g for g in span.groups() if g is not None).strip() or None
    stop = _FALLBACK_STOP.search(after)
    answer = (
        (after[: stop.start()] if stop else after).strip().strip("*").strip().rstrip(".").strip()
    )
    if _PROSE_WORD.search(answer):  # a sentence without a number is no answer: the next rule
        number = _NUMBER.search(answer)
        return number.group() if number is not None else None
    return answer.strip("$ ") or None


def gold_text_answer(text: str) -> str:
    """The answer of a gold written as a text (a reference solution, math-verify's gold strings),
    read as math-verify reads a gold: its last box, boxes with at most two words between them
    read as one list ("\\boxed{1} papers and \\boxed{2} bins" -> "1, 2"; "\\boxed{1} no no no
    \\boxed{2}" -> "2", as math-verify's own tests ask), else its math spans when only commas, "and"/"or" and spaces
    stand between them ("$1$ and $2$ and $3$" -> "1, 2, 3"), else :func:`extract_answer` with the
    "phrases" rule; the text itself when none applies. Linear: one brace pass, bounded regular
    expressions over the last ``FREE_TEXT_TAIL`` characters."""
    boxes = _boxes(text, _gold_joined)
    if boxes:
        parts = _NUMBERS_JOINED.split(boxes[-1][1])
        if len(parts) > 1 and all(_NUMBER.fullmatch(p.strip()) for p in parts):
            return ", ".join(p.strip() for p in parts)  # "12\text{ and }13" -> "12, 13"
        return boxes[-1][1]
    tail = text[-FREE_TEXT_TAIL:]
    return _joined_spans(tail.lstrip()) or extract_answer(text, free_text="phrases") or text


def _joined_spans(text: str, sentence: bool = False) -> str | None:
    """``text`` that is two or more math spans joined only by commas, "and"/"or" and spaces as
    one list answer ("$1$ and $2$" -> "1, 2"); nothing may follow but a period, or with
    ``sentence`` the end of its sentence (closing quotes, then a period or a line break)."""
    spans = list(_MATH_SPAN.finditer(text))
    rest = text[spans[-1].end() :] if spans else ""
    if (
        len(spans) > 1
        and spans[0].start() == 0
        and (_SENTENCE_END.match(rest) is not None if sentence else not rest.strip(" \t\n."))
        and all(_JOINER.fullmatch(text, a.end(), b.start()) for a, b in zip(spans, spans[1:]))
    ):
        return ", ".join(next(g for g in m.groups() if g is not None).strip() for m in spans)
    return None


def _gold_joined(text: str, prev_end: int, start: int) -> bool:
    """A gold's boxes are one list when joined as a response's are or by at most two words."""
    return _joined(text, prev_end, start) or (
        start - prev_end <= _MAX_JOINER and len(text[prev_end:start].split()) <= 2
    )


BoxRule = Literal["last", "any"]
BOX_RULES = get_args(BoxRule)
# Boxes tried by the "any" rule, the last ones first: bounds the grading work per response.
MAX_ANY_BOXES = 8


def candidate_answers(
    text: str, fallback: bool = True, box_rule: str = "last", free_text: str = "off"
) -> list[str]:
    """The answers a response is graded on: ``box_rule`` "last" (evaluation) gives the final
    answer of :func:`extract_answer`; "any" (the reference's training reward, math-verify style:
    any boxed answer that matches counts) gives up to ``MAX_ANY_BOXES`` boxed answers, last first,
    and the fallback phrase when there is no box."""
    if box_rule == "last":
        answer = extract_answer(text, fallback, free_text)
        return [] if answer is None else [answer]
    if box_rule != "any":
        raise ValueError(f"box_rule {box_rule!r}: expected one of {BOX_RULES}")
    answers = boxed_answers(text)[::-1][:MAX_ANY_BOXES]
    if answers or not (fallback or free_text != "off"):
        return answers
    answer = (
        free_text_answer(text, free_text == "last_number")
        if free_text != "off"
        else fallback_answer(text)
    )
    return [] if answer is None else [answer]


def _last_match(matches):
    """The last of ``matches`` (None when there is none), in one pass and O(1) memory."""
    last = deque(matches, maxlen=1)
    return last[0] if last else None
