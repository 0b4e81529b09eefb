"""The grader on math-verify's own test suite (issue #28): every parametrised (gold, pred,
expected) case of huggingface/Math-Verify's tests at commit 5d148cf, extracted by
``bench/grader_vs_math_verify.py --write-suite`` into ``tests/data/math_verify_suite.jsonl``
(Apache-2.0; provenance in ``tests/data/math_verify_suite.README.md``).

Graded as the bench grades them: one ``MathGrader`` configuration (``free_text: last_number``)
for every case, the gold read as the bench reads it. The floors are the counts reached at the
time of writing: a regression below them fails and prints every miss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.grader_vs_math_verify import gold_answer
from megatron_ngrpo.rewards import MathGrader
from megatron_ngrpo.rewards.extract import gold_text_answer

SUITE = Path(__file__).parent / "data" / "math_verify_suite.jsonl"
CORE_MIN = 196
# The goal, 45 of its 53 free-text cases, as a share of ours.
FREE_TEXT_MIN_SHARE = 45 / 53


@pytest.mark.parametrize(
    "text, answer",
    [
        ("\\boxed{1} papers and \\boxed{2} bins", "1, 2"),
        ("$\\boxed{35 cm} ++++++ \\boxed{4}$", "35 cm, 4"),
        ("$\\boxed{1}$ and $\\boxed{2}$", "1, 2"),
        ("\\boxed{1} no no no no no \\boxed{2}", "2"),  # prose between: the last box
        ("$1$ and $2$ and $3$", "1, 2, 3"),
        ("Since $a=2$, we get $4$.", "4"),  # spans in prose: the last one
        ("The answer is $5$.", "5"),
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        ("so it is $\\boxed{12\\text{ and }13}$.", "12, 13"),  # numbers joined by a word: a list
    ],
)
def test_gold_text_answer(text, answer):
    assert gold_text_answer(text) == answer


def test_math_verify_suite_counts():
    cases = [json.loads(line) for line in SUITE.read_text().splitlines()]
    with MathGrader(timeout_s=30.0, memory_mb=2048, workers=2, free_text="last_number") as g:
        scores = g.score_batch([(c["pred"], gold_answer(c["gold"])) for c in cases])
    hits = {"core": 0, "free-text": 0}
    sizes = {"core": 0, "free-text": 0}
    misses = []
    for case, score in zip(cases, scores):
        sizes[case["group"]] += 1
        if score == case["expected"]:
            hits[case["group"]] += 1
        else:
            misses.append(
                f"{case['group']} {case['test']}: gold {case['gold'][-60:]!r} "
                f"pred {case['pred'][-80:]!r} expected {case['expected']:.0f}"
            )
    report = f"{hits} of {sizes}; misses:\n" + "\n".join(misses)
    assert sizes == {"core": 201, "free-text": 68}, report
    assert hits["core"] >= CORE_MIN, report
    assert hits["free-text"] >= FREE_TEXT_MIN_SHARE * sizes["free-text"], report
