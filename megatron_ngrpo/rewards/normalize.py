"""Canonical string form and exact numeric value of a final answer (pure string work).

Runs before math-verify: these cheap rules settle the common cases (AIME "025" vs 25, AMC
"142.0", thousands separators "10,\\!080", degrees, percent, units, \\text{}, scientific notation
"4.5e33" / "8.7 \\times 10^{8}", mixed numbers "1\\frac{4}{5}") exactly and in microseconds, and
cover formats math-verify 0.9 gets wrong (e-notation, percent vs plain number).

The comma rule (docs/GRADING.md): a comma is a thousands separator only inside well-formed groups
written without spaces: 1 to 3 leading digits not starting with 0, then groups of exactly 3
("32,349", "1,000,000.5", LaTeX "10,\\!080" and "10{,}080"). Any other comma separates the items
of a list: "32, 349" and "0,111" are the two-item lists {32, 349} and {0, 111}, never 32349,
111 or a decimal comma 0.111 (the benchmarks write decimals with a point).
No expression is evaluated here: numbers are read by regular expressions into ``Fraction``s with
bounded exponents.
"""

from __future__ import annotations

import re
from fractions import Fraction

# Largest |exponent| of 10 read as a number; beyond it the answer is not a number for us (a huge
# integer would cost time and memory; math-verify runs under the worker's limits instead).
MAX_EXPONENT = 400
REL_TOL = 1e-6

_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_LEFT_RIGHT = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])\s*")
_SPACING = re.compile(r"\\[!,;: ]|\\q?quad(?![a-zA-Z])|~|\\displaystyle(?![a-zA-Z])")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°|\\degree(?![a-zA-Z])")
_TEXT_WRAP = re.compile(
    r"\\(?:text|textbf|textit|textrm|texttt|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}"
)
_UNITS = (
    "degrees?",
    "radians?",
    "cm",
    "mm",
    "km",
    "meters?",
    "centimeters?",
    "kilometers?",
    "inch(?:es)?",
    "feet",
    "foot",
    "ft",
    "yards?",
    "miles?",
    "cents?",
    "dollars?",
    "units?",
    "square units",
    "sq units",
    "hours?",
    "hrs?",
    "minutes?",
    "mins?",
    "seconds?",
    "sec",
    "days?",
    "weeks?",
    "years?",
    "mph",
    "km/h",
    "kg",
    "grams?",
    "pounds?",
    "lbs?",
    "ounces?",
    "liters?",
    "ml",
    "people",
    "students",
    "ways",
    "points",
    "kcal",
)
_TRAILING_UNIT = re.compile(
    r"^(?P<value>.*?[\d}])\s+(?:" + "|".join(_UNITS) + r")(?:\s*\^\s*\{?\d\}?)?\s*$"
)
_ASSIGNMENT = re.compile(r"^[a-zA-Z](?:_\{?\w+\}?)?\s*(?:=|\\in)\s*(?P<rhs>[^=]+)$")
_FRAC_SHORT = (
    (re.compile(r"\\frac\s*(\d)\s*(\d)"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\frac\s*(\d)\s*\{"), r"\\frac{\1}{"),
    (re.compile(r"\\frac\s*(\{[^{}]*\})\s*(\d)"), r"\\frac\1{\2}"),
    (re.compile(r"\\sqrt\s*(\d)"), r"\\sqrt{\1}"),
)
_THOUSANDS = re.compile(r"^[+-]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?$")
# LaTeX thin-space / braced commas inside a number: "10,\\!080", "10{,}080".
_LATEX_THOUSANDS = re.compile(r"(?<=\d)(?:,\\!|\{,\})\s*(?=\d{3})")
# A list of plain numbers written with bare commas ("0,111", "32, 349"): made an explicit set so
# that math-verify does not read "0,111" as the decimal 0.111.
_NUMBER_LIST = re.compile(r"^[+-]?\d+(?:\.\d+)?(?:,[+-]?\d+(?:\.\d+)?)+$")
_LEADING_ZEROS = re.compile(r"^([+-]?)0+(?=\d)")
_TRAILING_ZERO_DECIMAL = re.compile(r"^([+-]?\d+)\.0*$")
_CHOICE = re.compile(r"^\(([A-Za-z])\)$")
_SUBSCRIPT_DIGIT = re.compile(r"_(\d)(?!\d)")
# A numeral in a base, "4210_{5}": compared as written (math-verify drops the subscript).
BASE_NUMERAL = re.compile(r"^[0-9A-Za-z]+_\{\d+\}$")
_WORDS = re.compile(r"^[A-Za-z][A-Za-z ]*$")

_NUM = r"(?:\d+\.?\d*|\.\d+)"
_DECIMAL = re.compile(rf"^[+-]?{_NUM}$")
_SCI_E = re.compile(rf"^(?P<m>[+-]?{_NUM})[eE](?P<e>[+-]?\d+)$")
_SCI_TIMES = re.compile(
    rf"^(?:(?P<m>[+-]?{_NUM})(?:\\times|\\cdot|\*|×))?10\^(?:\{{(?P<e1>[+-]?\d+)\}}|(?P<e2>[+-]?\d))$"
)
_FRAC = re.compile(r"^(?P<s>[+-]?)\\frac\{(?P<a>\d+\.?\d*)\}\{(?P<b>\d+\.?\d*)\}$")
_SLASH = re.compile(rf"^(?P<a>[+-]?{_NUM})/(?P<b>{_NUM})$")
_MIXED = re.compile(r"^(?P<s>[+-]?)(?P<w>\d+)\\frac\{(?P<a>\d+)\}\{(?P<b>\d+)\}$")


# Unicode math as plain-text answers write it, in LaTeX (a space ends a command before a letter).
_UNICODE_SYMBOLS = str.maketrans(
    {
        "\u2212": "-",
        "\u2013": "-",
        "\u00d7": r"\times ",
        "\u22c5": r"\cdot ",
        "\u00b7": r"\cdot ",
        "\u00f7": r"\div ",
        "\u03c0": r"\pi ",
        "\u221e": r"\infty ",
        "\u2264": r"\le ",
        "\u2265": r"\ge ",
        "\u2260": r"\ne ",
        "\u00b1": r"\pm ",
        "\u2213": r"\mp ",
        "\u2248": r"\approx ",
        "\u2208": r"\in ",
        "\u222a": r"\cup ",
        "\u2229": r"\cap ",
        "\u2205": r"\emptyset ",
        "\u03b8": r"\theta ",
        "\u00bd": r"\frac{1}{2}",
        "\u2153": r"\frac{1}{3}",
        "\u2154": r"\frac{2}{3}",
        "\u00bc": r"\frac{1}{4}",
        "\u00be": r"\frac{3}{4}",
    }
)
_SUPERSCRIPTS = str.maketrans(
    "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207b", "0123456789-"
)
_SUBSCRIPTS = str.maketrans(
    "\u2080\u2081\u2082\u2083\u2084\u2085\u2086\u2087\u2088\u2089", "0123456789"
)
_SUPERSCRIPT_RUN = re.compile("[\u2070\u00b9\u00b2\u00b3\u2074-\u2079\u207b]+")
_SUBSCRIPT_RUN = re.compile("[\u2080-\u2089]+")
# √2, √x, √(x+1), √{..}; ∛ likewise. The argument is one number, letter or bracket group (no nesting).
_UNICODE_ROOT = re.compile(
    r"([\u221a\u221b])\s*(\d+(?:\.\d+)?|[A-Za-z]|\([^()]{0,200}\)|\{[^{}]{0,200}\})"
)


def unicode_to_latex(s: str) -> str:
    """Unicode math in LaTeX: ``√2`` → ``\\sqrt{2}``, ``x²`` → ``x^{2}``, ``×``/``÷``/``·``, ``π``,
    ``≤``/``≥``/``≠``, ``∞``, ``−`` (minus), ``½`` ... One pass per rule: linear in ``len(s)``."""
    if s.isascii():
        return s
    s = _UNICODE_ROOT.sub(_root, s)
    s = _SUPERSCRIPT_RUN.sub(lambda m: "^{" + m.group().translate(_SUPERSCRIPTS) + "}", s)
    s = _SUBSCRIPT_RUN.sub(lambda m: "_{" + m.group().translate(_SUBSCRIPTS) + "}", s)
    return s.translate(_UNICODE_SYMBOLS)


def _root(m: re.Match) -> str:
    arg = m.group(2)
    if arg[0] in "({":
        arg = arg[1:-1]
    return (r"\sqrt{" if m.group(1) == "\u221a" else r"\sqrt[3]{") + arg + "}"


def strip_math_delimiters(s: str) -> str:
    """Drops unescaped ``$`` (OlympiadBench golds are wrapped in them)."""
    return _UNESCAPED_DOLLAR.sub("", s)


def normalize(answer: str) -> str:
    """Canonical string form: equal forms mean equal answers (the converse does not hold)."""
    s = strip_math_delimiters(answer).strip()
    s = s.replace("\\$", "").replace("\\%", "").replace("%", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LATEX_THOUSANDS.sub(",", s)
    s = _LEFT_RIGHT.sub("", s)
    s = _SPACING.sub(" ", s)
    s = _DEGREES.sub("", s)
    for _ in range(3):  # nested \text{\textbf{..}} unwrap from the inside
        s = _TEXT_WRAP.sub(r"\1", s)
    s = s.strip().rstrip(".").strip()
    m = _TRAILING_UNIT.match(s)
    if m:
        s = m.group("value")
    m = _ASSIGNMENT.match(s)
    if m:
        s = m.group("rhs")
    for pattern, repl in _FRAC_SHORT:
        s = pattern.sub(repl, s)
    if _THOUSANDS.match(s):  # before spaces go: "32, 349" is a list
        s = s.replace(",", "")
    s = "".join(s.split())
    s = _SUBSCRIPT_DIGIT.sub(r"_{\1}", s)
    s = _LEADING_ZEROS.sub(r"\1", s)
    s = _TRAILING_ZERO_DECIMAL.sub(r"\1", s)
    m = _CHOICE.match(s)
    if m:
        s = m.group(1)
    if _WORDS.match(s):
        s = s.lower()
    return s


def as_list(s: str) -> str | None:
    """``\\{a,b\\}`` for a normalised bare list of numbers ("0,111"); None for anything else."""
    return f"\\{{{s}\\}}" if _NUMBER_LIST.match(s) else None


def written_as_decimal(s: str) -> bool:
    """A normalised number written with a decimal point: an approximation the tolerance of
    :func:`numbers_close` applies to (fractions and integers are exact)."""
    return "." in s


def to_number(s: str) -> Fraction | None:
    """Exact value of a normalised answer that is a plain number (decimal, ``a/b``,
    ``\\frac{a}{b}``, mixed number, ``m e k`` or ``m \\times 10^{k}``); None otherwise."""
    if len(s) > 64:
        return None
    try:
        if _DECIMAL.match(s):
            return Fraction(s)
        m = _SCI_E.match(s)
        if m:
            return _scaled(m.group("m"), m.group("e"))
        m = _SCI_TIMES.match(s)
        if m:
            return _scaled(m.group("m") or "1", m.group("e1") or m.group("e2"))
        m = _FRAC.match(s)
        if m:
            value = Fraction(m.group("a")) / Fraction(m.group("b"))
            return -value if m.group("s") == "-" else value
        m = _SLASH.match(s)
        if m:
            return Fraction(m.group("a")) / Fraction(m.group("b"))
        m = _MIXED.match(s)
        if m:
            value = int(m.group("w")) + Fraction(int(m.group("a")), int(m.group("b")))
            return -value if m.group("s") == "-" else value
    except ZeroDivisionError:
        return None
    return None


def _scaled(mantissa: str, exponent: str) -> Fraction | None:
    e = int(exponent)
    if abs(e) > MAX_EXPONENT:
        return None
    return Fraction(mantissa) * Fraction(10) ** e


def numbers_close(a: Fraction, b: Fraction, approximate: bool, rel_tol: float = REL_TOL) -> bool:
    """Equal; or, when one side was written as a decimal (``approximate``) and either is not an
    integer, within ``rel_tol`` relative difference (a decimal like 0.3333333 matches 1/3 only
    when written to about 7 significant digits). Exact values (integers, fractions) must be
    equal: 1/1000001 is not 1/1000000, and AIME answers and large counts are integers."""
    if a == b:
        return True
    if not approximate or (a.denominator == 1 and b.denominator == 1):
        return False
    return abs(a - b) <= Fraction(str(rel_tol)) * max(abs(a), abs(b))  # 1e-6 exactly, not its float
