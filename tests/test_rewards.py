"""Rewards: extraction, normalisation, the grader table (golds from the real eval files), hostile
inputs under time/memory limits, the worker pool, multiple choice, shaping, the registry."""

from __future__ import annotations

import json
import operator
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from megatron_ngrpo.config_loader import ConfigError, load
from megatron_ngrpo.data.datasets import clean_answers
from megatron_ngrpo.rewards import ChoiceGrader, MathGrader, RewardConfig, build_reward
from megatron_ngrpo.rewards.equivalence import answers_match, is_parseable
from megatron_ngrpo.rewards.extract import extract_answer, fallback_answer, last_boxed
from megatron_ngrpo.rewards.graders import build_grader
from megatron_ngrpo.rewards.normalize import normalize, numbers_close, to_number, unicode_to_latex
from megatron_ngrpo.rewards.pool import _REIMPORT_ERROR, GuardedPool
from megatron_ngrpo.rewards.shaping import format_reward, soft_overlong_penalty

CASES = Path(__file__).parent / "data" / "grader_cases.jsonl"
# In the spirit of math-verify's own test suite (not shipped in its wheel): boxed answers,
# numbers, commas, fractions, sets/intervals, percentages, units, LaTeX variants, multiple boxes.
MV_CASES = Path(__file__).parent / "data" / "mathverify_cases.jsonl"
HOSTILE_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def grader():
    # Generous limit: the table checks answers, not speed (the CPU is shared).
    with MathGrader(timeout_s=30.0, memory_mb=2048, workers=2) as g:
        yield g


@pytest.fixture(scope="module")
def any_grader():
    with MathGrader(timeout_s=30.0, memory_mb=2048, workers=1, box_rule="any") as g:
        yield g


@pytest.fixture(scope="module")
def free_grader():
    with MathGrader(timeout_s=30.0, memory_mb=2048, workers=1, free_text="phrases") as g:
        yield g


@pytest.fixture(scope="module")
def strict_grader():
    with MathGrader(timeout_s=HOSTILE_TIMEOUT_S, memory_mb=1024, workers=2) as g:
        yield g


# ---- extraction / normalisation -------------------------------------------------------------


def test_last_boxed_forms():
    assert last_boxed(r"a \boxed{1} b \boxed{\frac{1}{\sqrt{2}}} c") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"so \boxed 5 done") == "5"
    assert last_boxed(r"\boxed{5}$ and \boxed{}") == "5"  # empty box skipped
    assert last_boxed(r"\boxed{5") is None
    assert last_boxed(r"\boxedx{5}") is None
    assert last_boxed("no box") is None


def test_fallback_phrases():
    assert (
        fallback_answer("The final answer is $\\frac{1}{2}$. I hope it is correct.")
        == r"\frac{1}{2}"
    )
    assert fallback_answer("**Answer:** 3.5\nmore text") == "3.5"
    assert fallback_answer("Answer: \\(x+1\\)") == "x+1"
    assert fallback_answer("nothing here") is None
    assert extract_answer("Answer: 4", fallback=False) is None
    assert extract_answer("Answer: 4 \\boxed{5}") == "5"


@pytest.mark.parametrize(
    "text, answer",
    [
        # 1. the last answer phrase; prose after it gives its first number; a math span opening it
        ("So 3 + 15 = 18. The answer is 18.", "18"),
        ("Final Answer: 34", "34"),
        ("She pays 3 * 6 = 18 dollars.\n#### 18", "18"),
        ("The answer is 18 apples in all, not 20.", "18"),
        ("Final Answer: The final answer is $(0, 1)$. I hope it is correct.", "(0, 1)"),
        ("the answer is: **-2.5**", "-2.5"),
        ('Final Answer: The final answer is "$12$ and $13$". I hope it is correct.', "12, 13"),
        ("The answer is 7. Wait, the answer is 9.", "9"),
        # 2. a whole one-line response without prose
        (r"-\frac{10}{9}", r"-\frac{10}{9}"),
        # 3. the later of the last math span and ("last_number") the last number after it
        (r"Therefore $x \geq 5$ is the solution.", r"x \geq 5"),
        (r"We get $x=3$ and so the total is 1,250 marbles.", "1,250"),
        (r"First 12, then \(\frac{3}{4}\) remains", r"\frac{3}{4}"),
        ("so 5 people, 3 cars; the ratio is .4 per car", ".4"),
        ("AZYUK2A", None),
        ("no number here", None),
    ],
)
def test_free_text_rule(text, answer):
    assert extract_answer(text, free_text="last_number") == answer
    # "phrases": the same, except that a number in prose is no answer.
    number_only = answer in ("1,250", ".4")
    assert extract_answer(text, free_text="phrases") == (
        "x=3" if answer == "1,250" else None if number_only else answer
    )
    with pytest.raises(ValueError, match="free_text"):
        extract_answer(text, free_text="on")
    # Off (the default): only boxes and the two fallback phrases.
    assert extract_answer("The answer is 18.") is None
    assert extract_answer("#### 18") is None


def test_whitespace_controls_pass_the_guard():
    """A form feed is whitespace (math-verify's suite has ``"\\frac"`` written without r: a
    ``\f``); other control characters still fail the guard."""
    assert is_parseable("1\f2\r\v") and not is_parseable("5\x00") and not is_parseable("5\x1b")
    text = "\\begin{pmatrix}-\\\frac{7}{4}\\end{pmatrix}"
    assert answers_match(text, text)


def test_free_text_phrase_after_the_last_box_wins():
    text = (
        r"interest \boxed{255}; total $10,200 + $255. Final Answer: The final answer is $10,455$."
    )
    assert extract_answer(text, free_text="phrases") == "10,455"
    assert extract_answer(text) == "255"
    assert extract_answer(r"The final answer is $\boxed{5}$.", free_text="phrases") == "5"


def test_unicode_math():
    assert unicode_to_latex("2√3") == r"2\sqrt{3}"
    assert unicode_to_latex("√(x+1)") == r"\sqrt{x+1}"
    assert unicode_to_latex("x²−y³") == "x^{2}-y^{3}"
    assert unicode_to_latex("10⁻³") == "10^{-3}"
    assert unicode_to_latex("3×4÷2") == r"3\times 4\div 2"
    assert unicode_to_latex("x≤5, y≥1, z≠0") == r"x\le 5, y\ge 1, z\ne 0"
    assert unicode_to_latex("2πr") == r"2\pi r"
    assert unicode_to_latex("1½") == r"1\frac{1}{2}"
    assert unicode_to_latex("plain") == "plain"


def test_unicode_free_text_and_multi_part_grading(grader, free_grader):
    items = [
        (r"\boxed{√2}", r"\sqrt{2}", 1.0),
        (r"\boxed{2√3}", r"2\sqrt{3}", 1.0),
        (r"\boxed{x²+1}", "x^2+1", 1.0),
        (r"\boxed{−7}", "-7", 1.0),
        (r"\boxed{3π}", r"3\pi", 1.0),
        (r"\boxed{x ≤ 5}", r"x \leq 5", 1.0),
        (r"\boxed{√3}", r"\sqrt{2}", 0.0),
        # several boxes against a multi-part gold: the last k boxes as one list
        (r"x = \boxed{3}, and then y is \boxed{5}", "3, 5", 1.0),
        (r"x = \boxed{3}, and then y is \boxed{5}", "5, 3", 1.0),
        (r"\boxed{1} so \boxed{3} then \boxed{5}", "3, 5", 1.0),
        (r"\boxed{1} then \boxed{3}", "3, 5", 0.0),
        (r"x = \boxed{3}, and then y is \boxed{5}", "5", 1.0),
        (r"x = \boxed{3}, and then y is \boxed{5}", "3", 0.0),
    ]
    assert grader.score_batch([(t, g) for t, g, _ in items]) == [e for _, _, e in items]
    chat = [
        ("So 3 + 15 = 18. The answer is 18.", "18", 1.0),
        ("Final Answer: 34", "34", 1.0),
        ("#### 1,250", "1250", 1.0),
        ("The side is 2√3 cm, so the answer is $2\\sqrt{3}$.", "2\\sqrt{3}", 1.0),
        ("The answer is 17.", "18", 0.0),
        ("The max is 37 or 52.", "52", 0.0),
    ]  # no number guessing
    assert free_grader.score_batch([(t, g) for t, g, _ in chat]) == [e for _, _, e in chat]
    assert grader.score_batch([(t, g) for t, g, _ in chat[:3]]) == [0.0, 1.0, 0.0]  # option off


def test_normalize_and_numbers():
    assert normalize("025") == "25"
    assert normalize("142.0") == "142"
    assert normalize(r"10,\!080") == "10080"
    assert normalize(r"\$32,\!348") == "32348"
    assert normalize(r"90^\circ") == normalize("90")
    assert normalize(r"\text{(C)}") == "c"
    assert normalize(r"864 \mbox{ inches}^2") == "864"
    assert normalize(r"x \in [-2,7]") == "[-2,7]"
    assert normalize(r"6m") == "6m"  # a product, not 6 metres
    assert to_number("8.7\\times10^{8}") == 870_000_000
    assert to_number("4.5e33") == 45 * 10**32
    assert to_number(r"1\frac{4}{5}") == to_number("9/5")
    assert to_number("1e100000") is None  # exponent bound
    assert to_number(r"\frac{1}{0}") is None
    assert not numbers_close(to_number("3986729"), to_number("3986728"), approximate=True)
    assert numbers_close(to_number("-0.3333333"), to_number("-1/3"), approximate=True)
    assert not numbers_close(to_number("4.6667"), to_number("14/3"), approximate=True)
    # Two exact values never get the tolerance.
    assert not numbers_close(
        to_number(r"\frac{1}{1000001}"), to_number(r"\frac{1}{1000000}"), approximate=False
    )


# ---- the grader table -----------------------------------------------------------------------


def test_grader_table(grader):
    cases = [json.loads(line) for line in CASES.read_text().splitlines() if line.strip()]
    sources = Counter(c["source"] for c in cases)
    assert len(cases) >= 150
    assert {
        "aime24",
        "aime25",
        "amc22_23",
        "amc23",
        "math500",
        "minerva",
        "olympiad_bench",
        "extraction",
    } <= set(sources)
    assert Counter(c["expected"] for c in cases)[0] >= 80  # wrong answers are tested too
    # Golds as the data loader cleans them (floats → "142", lists → alternatives); raw
    # "336^\circ" (Skywork row 19) stays raw here on purpose.
    scores = grader.score_batch([(c["response"], clean_answers(c["gold"])) for c in cases])
    wrong = [
        (c["source"], c["gold"], c["response"][-60:], c["expected"], s)
        for c, s in zip(cases, scores)
        if s != c["expected"]
    ]
    assert not wrong, f"{len(wrong)} of {len(cases)} graded wrongly: {wrong}"
    assert grader.failures == {"timeout": 0, "crash": 0, "error": 0}


def test_mathverify_suite(grader):
    """Our grade is the table's; math-verify (LaTeX extraction, gold boxed, as the reference
    reward) agrees except on the listed deliberate differences (docs/GRADING.md), where it must
    still differ."""
    from math_verify import LatexExtractionConfig, parse, verify

    cases = [json.loads(line) for line in MV_CASES.read_text().splitlines() if line.strip()]
    assert len(cases) >= 100 and Counter(c["expected"] for c in cases)[0] >= 30
    scores = grader.score_batch([(c["response"], c["gold"]) for c in cases])
    wrong = [
        (c["group"], c["response"][-40:], c["gold"], c["expected"])
        for c, s in zip(cases, scores)
        if s != c["expected"]
    ]
    assert not wrong, f"{len(wrong)} of {len(cases)} graded wrongly: {wrong}"
    gold_cfg = [LatexExtractionConfig(boxed_match_priority=0)]
    mismatch = []
    for c in cases:
        if c["group"] == "hostile":  # math-verify runs in this process: no hostile text
            continue
        mv = float(
            verify(
                parse(f"\\boxed{{{c['gold']}}}", extraction_config=gold_cfg),
                parse(c["response"], extraction_config=[LatexExtractionConfig()]),
            )
        )
        if (mv != c["expected"]) != ("math_verify_differs" in c):
            mismatch.append((c["response"][-40:], c["gold"], c["expected"], mv))
    assert not mismatch, mismatch


def test_exact_rationals_and_comma_rule(grader):
    items = [
        (r"\boxed{\frac{1}{2^{98}}}", r"\frac{1}{2^{99}}"),
        (r"\boxed{\frac{1}{100!}}", r"\frac{1}{99!}"),
        (r"\boxed{\frac{1}{1000001}}", r"\frac{1}{1000000}"),
        (r"\boxed{2^{-98}}", r"\frac{1}{2^{98}}"),
        (r"\boxed{0.3333333}", r"\frac{1}{3}"),
        (r"\boxed{32,349}", "32349"),
        (r"\boxed{32, 349}", "32349"),
        (r"\boxed{32, 349}", r"\{32, 349\}"),
        (r"\boxed{0,111}", "111"),
        (r"\boxed{0,111}", "0.111"),
        (r"\boxed{0,111}", r"\{0,111\}"),
        (r"\boxed{11,\! 111,\! 100}", "11111100"),
        (r"\boxed{10{,}080}", "10080"),
    ]
    assert grader.score_batch(items) == [
        0.0,
        0.0,
        0.0,
        1.0,
        1.0,
        1.0,
        0.0,
        1.0,
        0.0,
        0.0,
        1.0,
        1.0,
        1.0,
    ]


def test_box_rule_any_for_training(grader, any_grader):
    items = [
        (r"first \boxed{4}, then corrected: \boxed{3}", "4"),  # an earlier box matches
        (r"\boxed{3} then \boxed{4}", "4"),
        (r"$\boxed{1}$ and $\boxed{2}$", "2"),  # one list answer {1, 2}
        ("".join(rf"\boxed{{{i}}} x " for i in range(20)), "0"),  # only the last 8 boxes
        ("Answer: 5", "5"),
        ("no answer", "5"),
    ]
    assert grader.score_batch(items) == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert any_grader.score_batch(items) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    cfg = load(RewardConfig, overrides=["box_rule=any"])
    assert cfg.box_rule == "any"
    with pytest.raises(ValueError, match="box_rule"):
        MathGrader(box_rule="first")


def test_grader_in_unguarded_script_says_what_is_wrong(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(
        "from megatron_ngrpo.rewards import MathGrader\n"
        "with MathGrader(workers=1) as g:\n    g.score_batch([('\\\\boxed{1}', '1')])\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == f"RuntimeError: {_REIMPORT_ERROR}", out.stderr[
        -2000:
    ]
    assert "memory" not in out.stderr


def test_gold_alternatives_and_types(grader):
    assert grader.score_batch(
        [
            (r"\boxed{6630}", ["6630.65", "6630"]),
            (r"\boxed{6630.65}", ("6630.65", "6630")),
            (r"\boxed{1}", None),
            (None, "1"),
            (r"\boxed{1}", [1]),
        ]
    ) == [1.0, 1.0, 0.0, 0.0, 0.0]


# ---- hostile inputs -------------------------------------------------------------------------


def test_hostile_inputs_score_zero_within_limits(strict_grader, tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    hostile = [
        ("x" * (10 * 2**20) + r"\boxed{5}", "5"),  # 10 MB output
        (r"\boxed{" + "{" * 60_000 + "5" + "}" * 60_000 + "}", "5"),  # deep braces
        (r"\boxed{" + "(" * 5_000 + "5" + ")" * 5_000 + "}", "5"),
        (rf"\boxed{{{payload}}}", "0"),  # code, boxed
        (f"Answer: {payload}", "0"),  # code, fallback
        (f"The final answer is {payload}.", "0"),
        (r"\boxed{10^{10^{10}}}", "5"),  # huge exponents
        (r"\boxed{9^{9^{9^{9}}}}", "1"),
        (r"\boxed{2^{2^{2^{2^{2^{2}}}}}}", "2"),
        (r"\boxed{(10^{10^{7}})!}", "3"),
        (r"\boxed{100!!!}", "4"),
        (r"\boxed{" + "1+" * 600 + "1}", "601"),  # longer than the guard
        ("\\boxed{5\x00\x01}", "5"),  # control characters
    ]
    start = time.monotonic()
    scores = strict_grader.score_batch(hostile)
    elapsed = time.monotonic() - start
    assert scores == [0.0] * len(hostile)
    assert not marker.exists()
    # Each answer is bounded by the limit (2 workers); restarts of killed workers add a little.
    assert elapsed < HOSTILE_TIMEOUT_S * (len(hostile) / 2 + 1) + 10, elapsed
    # The pool is still healthy afterwards.
    assert strict_grader.score_batch([(r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{3}", "4")]) == [
        1.0,
        0.0,
    ]


def test_pool_kills_hung_crashed_and_greedy_workers():
    with GuardedPool(workers=2, timeout_s=1.0, memory_mb=512) as pool:
        start = time.monotonic()
        assert pool.map(time.sleep, [(60,), (0.01,)], default="dflt") == ["dflt", None]
        assert time.monotonic() - start < 10
        assert pool.map(os._exit, [(3,)], default="dflt") == ["dflt"]  # worker dies
        assert pool.map(bytearray, [(2**30,)], default="dflt") == ["dflt"]  # over RLIMIT_AS
        assert pool.failures == {"timeout": 1, "crash": 1, "error": 1}
        # Deaths, hangs and normal tasks mixed in one batch: only the bad ones score the default.
        mixed = [(os._exit, 3), (abs, -2), (time.sleep, 60), (os._exit, 4), (abs, -3), (abs, -4)]
        assert pool.map(operator.call, mixed, default="dflt") == ["dflt", 2, "dflt", "dflt", 3, 4]
        assert pool.failures == {"timeout": 2, "crash": 3, "error": 1}
        assert pool.map(abs, [(-i,) for i in range(6)], default=None) == list(range(6))  # replaced


# ---- multiple choice, shaping, registry -----------------------------------------------------


def test_choice_grader_modes():
    paper, ref = ChoiceGrader("paper"), ChoiceGrader("reference")
    items = [
        ("reasoning...\nAnswer: C", "C"),
        ("Answer: (b)", "B"),
        ("Answer: B\nwait.\nAnswer: D", "D"),
        (r"so \boxed{A}", "A"),
        ("I pick B", "B"),
        ("Answer: E", "E"),
        ("Answer: Because", "B"),
    ]
    assert paper.score_batch(items) == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert ref.score_batch(items) == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        ChoiceGrader("lenient")


def test_shaping_terms():
    assert format_reward("think</think> so \\boxed{1}") == 1.0
    assert format_reward("no close \\boxed{1}") == 0.0
    assert format_reward("a</think>b</think>\\boxed{1}") == 0.0
    assert format_reward("\\boxed{1}</think> nothing after") == 0.0
    assert soft_overlong_penalty(100, 1000, 200) == 0.0
    assert soft_overlong_penalty(800, 1000, 200) == 0.0
    assert soft_overlong_penalty(900, 1000, 200) == pytest.approx(-0.5)
    assert soft_overlong_penalty(1500, 1000, 200) == -1.0


def test_reward_function_from_config():
    cfg = load(
        RewardConfig,
        overrides=[
            "name=mcq",
            "format_weight=0.5",
            "overlong=soft",
            "overlong_buffer=10",
            "max_response_tokens=20",
        ],
    )
    with build_reward(cfg) as reward:
        out = reward(
            # The mcq grader reads the "Answer:" line (the math grader would take the box: 0).
            ["x</think>\\boxed{B} Answer: A", "Answer: B", "Answer: A"],
            ["A", "A", "A"],
            lengths=[5, 15, 30],
        )
    assert out.correct == [1.0, 0.0, 1.0]
    assert out.terms["format"] == [0.5, 0.0, 0.0]
    assert out.terms["overlong"] == [0.0, -0.5, -1.0]
    assert out.total == [1.5, -0.5, 0.0]
    cfg = load(RewardConfig, overrides=["name=mcq", "overlong=zero"])
    with build_reward(cfg) as reward:
        out = reward(["Answer: A", "Answer: A"], ["A", "A"], finish_reasons=["stop", "length"])
    assert out.total == [1.0, 0.0] and out.correct == [1.0, 1.0]
    with pytest.raises(ValueError, match="lengths"):
        build_reward(
            load(RewardConfig, overrides=["name=mcq", "overlong=soft", "max_response_tokens=4096"])
        )(["Answer: A"], ["A"])


def test_grading_fields_reach_the_graders():
    """build_grader and the reward hand every grading and shaping field of reward.* on: each one
    flipped changes a score, a shaping term or the worker pool's limits."""
    items = [
        (r"first \boxed{4}, then corrected: \boxed{3}", "4"),  # box_rule any
        ("The final answer is 5", "5"),  # fallback
        (r"\boxed{5}" + " " * 60, "5"),  # max_response_chars 50
        ("so we get 18", "18"),  # free_text last_number
    ]
    flipped = [
        "workers=2",
        "timeout_s=1",
        "memory_mb=512",
        "box_rule=any",
        "fallback=false",
        "max_response_chars=50",
    ]
    with (
        build_grader(load(RewardConfig, overrides=["workers=1"])) as default,
        build_grader(load(RewardConfig, overrides=flipped)) as changed,
        build_grader(load(RewardConfig, overrides=["workers=1", "free_text=last_number"])) as free,
    ):
        assert default.score_batch(items) == [0.0, 1.0, 1.0, 0.0]
        assert changed.score_batch(items) == [1.0, 0.0, 0.0, 0.0]
        assert free.score_batch(items)[3] == 1.0
        pool = changed._pool
        assert (len(default._pool._workers), len(pool._workers)) == (1, 2)
        start = time.monotonic()
        assert pool.map(time.sleep, [(60,)], default="x") == ["x"]  # killed after timeout_s
        assert time.monotonic() - start < 8
        # memory_mb is each worker's address-space limit (its enforcement: the pool test above).
        limits = [
            g._pool.map(resource.getrlimit, [(resource.RLIMIT_AS,)], None)
            for g in (default, changed)
        ]
        assert limits == [[(2048 * 2**20,) * 2], [(512 * 2**20,) * 2]]
    mcq = [(r"so \boxed{A}", "A"), ("Answer: E", "E")]
    reference = ["name=mcq", "mcq_mode=reference", "mcq_letters=ABCDE"]
    assert build_grader(load(RewardConfig, overrides=["name=mcq"])).score_batch(mcq) == [0.0, 0.0]
    assert build_grader(load(RewardConfig, overrides=reference)).score_batch(mcq) == [1.0, 1.0]
    shaping = [
        "name=mcq",
        "format_weight=1",
        "format_think_close=</r>",
        "overlong=soft",
        "overlong_buffer=10",
        "max_response_tokens=20",
        "overlong_weight=2",
    ]
    with build_reward(load(RewardConfig, overrides=shaping)) as reward:
        out = reward(["x</r> \\boxed{A}", "x</think> \\boxed{A}"], ["A", "A"], lengths=[15, 30])
    assert out.terms == {"format": [1.0, 0.0], "overlong": [-1.0, -2.0]}


def test_math_reward_end_to_end():
    cfg = load(RewardConfig, overrides=["workers=1", "timeout_s=20"])
    with build_reward(cfg) as reward:
        out = reward([r"<think>..</think> \boxed{025}", r"\boxed{24}"], ["25", "25"])
    assert out.total == [1.0, 0.0]


@pytest.mark.parametrize(
    "override, field",
    [
        ("name=code", "name"),
        ("workers=0", "workers"),
        ("overlong=hard", "overlong"),
        ("mcq_mode=x", "mcq_mode"),
        ("memory_mb=10", "memory_mb"),
        ("box_rule=first", "box_rule"),
        ("free_text=true", "free_text"),
    ],
)
def test_reward_config_errors(override, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        load(RewardConfig, overrides=[override])


@pytest.mark.parametrize(
    "text",
    [
        "\\boxed{" * 150_000,  # unclosed boxes: one brace scan, not one per box
        "\\boxed{7} " + "\\boxed{{" * 100_000,
        "{" * 500_000 + "\\boxed{7}" + "}" * 500_000,
        "\\boxed\\fbox" * 90_000,
        "$" * 1_000_000,
        "\\(" * 300_000,
        "$$" + "x" * 1_000_000,
        "1," * 500_000,
        "the answer is " * 70_000,
        "\\boxed{1} the answer is " * 40_000,
    ],
    ids=[
        "unclosed",
        "answer-then-unclosed",
        "deep-nesting",
        "commands",
        "dollars",
        "open-parens",
        "open-display",
        "commas",
        "phrases",
        "box-then-phrases",
    ],
)
def test_extraction_is_linear_on_hostile_megabyte_responses(text):
    import time

    from megatron_ngrpo.rewards.extract import extract_answer

    for free_text in ("off", "last_number"):
        t0 = time.process_time()
        extract_answer(text, free_text=free_text)
        assert time.process_time() - t0 < 1.0, (len(text), free_text)
