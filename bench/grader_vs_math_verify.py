"""Our math grader against math-verify on math-verify's own test suite (its ``tests/``, not shipped
in its wheel and not committed here: pass the path of a checkout of huggingface/Math-Verify).

    PYTHONPATH=/path/to/Math-Verify:. python -m bench.grader_vs_math_verify /path/to/Math-Verify [--free-text RULE] [--show]
    PYTHONPATH=/path/to/Math-Verify:. python -m bench.grader_vs_math_verify /path/to/Math-Verify \
        --write-suite tests/data/math_verify_suite.jsonl

(the second form writes the cases, one JSON object a line, for ``tests/test_grader_suite.py``)

(its test modules are imported as ``tests.<name>`` from the checkout, hence its place on PYTHONPATH.)

Every parametrised ``(gold, pred, expected)`` case of its tests is read from the test modules (the
multiple-choice ``StringExtractionConfig`` cases are left out: that is our ``mcq`` grader's job).
Both graders run as a user runs them, one configuration for all cases: math-verify with its
defaults (``verify(parse(gold), parse(pred))``: LaTeX and plain-expression extraction, not each
test's own options: match types, precision, strictness), ours with ``MathGrader`` (``free_text``
"last_number" unless ``--free-text`` says otherwise). A case counts when the grade is ``expected``. math-verify parses the gold as a text too,
so our gold is read the way a response is (boxes, ``$...$``) when it has a box or a ``$``.

Two groups: **free-text** cases, whose ``pred`` has no box and is not one math span
(``$...$``, ``\\(...\\)``, ``\\[...\\]``), so the answer has to be found in prose; and **core**, all
others. Prints ``core ours/N  math-verify M/N`` and the same for free-text.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

from math_verify import parse, verify

from megatron_ngrpo.rewards import MathGrader
from megatron_ngrpo.rewards.extract import FREE_TEXT_RULES, gold_text_answer

MODULES = (
    "test_all",
    "test_boxed",
    "test_numina_cases",
    "test_open_thoughts",
    "test_yujianll",
    "test_strict",
)
_ONE_MATH_SPAN = re.compile(r"\s*(?:\$\$?[^$]*\$\$?|\\\(.*\\\)|\\\[.*\\\])\s*\.?", re.S)


def load_cases(checkout: Path) -> list[dict]:
    """``{"test", "gold", "pred", "expected"}`` per parametrised case of the test modules."""
    if not any(Path(p).resolve() == checkout.resolve() for p in sys.path if p):
        raise SystemExit(f"put {checkout} first on PYTHONPATH (its tests/ are imported from there)")
    cases = []
    for name in MODULES:
        module = importlib.import_module(f"tests.{name}")
        for attr in sorted(dir(module)):
            fn = getattr(module, attr)
            if not attr.startswith("test_") or not callable(fn):
                continue
            for mark in getattr(fn, "pytestmark", []):
                if mark.name != "parametrize":
                    continue
                names = [s.strip() for s in mark.args[0].split(",")]
                for values in mark.args[1]:
                    params = dict(zip(names, values))
                    params["expected"] = params.get("expected", params.get("result"))
                    if {"gold", "pred"} <= params.keys():
                        cases.append(
                            {
                                "test": f"{name}::{attr}",
                                "gold": params["gold"],
                                "pred": params["pred"],
                                "expected": float(params["expected"]),
                            }
                        )
    return cases


def group_of(pred: str) -> str:
    """The case's group: free-text when its pred has no box and is not one math span."""
    boxed = "\\boxed" in pred or "\\fbox" in pred
    return "core" if boxed or _ONE_MATH_SPAN.fullmatch(pred) else "free-text"


def gold_answer(gold: str) -> str:
    """Our gold for a case: a gold with a box or a ``$`` is a text, read as math-verify reads it."""
    if "\\boxed" in gold or "$" in gold:
        return gold_text_answer(gold)
    return gold


def math_verify_grade(case: dict) -> float:
    """math-verify as a grader is used: one configuration for every case (its defaults, LaTeX and
    plain-expression extraction for both sides), not each test's own options."""
    return float(verify(parse(case["gold"]), parse(case["pred"])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "checkout", type=Path, help="a checkout of huggingface/Math-Verify (with tests/)"
    )
    ap.add_argument(
        "--free-text",
        default="last_number",
        choices=FREE_TEXT_RULES,
        help="the grader's free_text rule (default last_number)",
    )
    ap.add_argument("--show", action="store_true", help="print the cases we grade wrongly")
    ap.add_argument(
        "--write-suite",
        type=Path,
        metavar="JSONL",
        help="write the cases (with their group) to JSONL and stop",
    )
    args = ap.parse_args()
    if not (args.checkout / "tests" / "test_all.py").is_file():
        sys.exit(
            f"{args.checkout}: no tests/test_all.py (expected a checkout of huggingface/Math-Verify)"
        )
    cases = load_cases(args.checkout)
    if args.write_suite:
        with args.write_suite.open("w") as f:
            for case in cases:
                f.write(
                    json.dumps({**case, "group": group_of(case["pred"])}, ensure_ascii=False) + "\n"
                )
        print(f"wrote {len(cases)} cases to {args.write_suite}")
        return
    with MathGrader(timeout_s=30.0, workers=2, free_text=args.free_text) as grader:
        ours = grader.score_batch([(c["pred"], gold_answer(c["gold"])) for c in cases])
    totals: dict[str, list[int]] = {"core": [0, 0, 0], "free-text": [0, 0, 0]}
    for case, score in zip(cases, ours):
        group = group_of(case["pred"])
        row = totals[group]
        ok = score == case["expected"]
        row[0] += ok
        row[1] += math_verify_grade(case) == case["expected"]
        row[2] += 1
        if args.show and not ok:
            print(
                f"WRONG {group} {case['test']}: gold {case['gold'][-60:]!r} pred {case['pred'][-80:]!r} "
                f"expected {case['expected']:.0f}"
            )
    for group, (mine, mv, n) in totals.items():
        print(f"{group:9s} ours {mine}/{n}  math-verify {mv}/{n}")


if __name__ == "__main__":
    main()
