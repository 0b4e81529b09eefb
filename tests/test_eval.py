"""Evaluation: Pass@k vs brute force, metrics and reports on known generations, re-grading, the
CLI, and the runner end to end on a real vLLM engine (tiny random Qwen2)."""

from __future__ import annotations

import csv
import itertools
import json
import os
import subprocess
import sys
from math import comb
from pathlib import Path

import numpy as np
import pytest

from megatron_ngrpo.data import MCQ_INSTRUCTION, SourceConfig, TemplateConfig, load_tokenizer
from megatron_ngrpo.data.datasets import Problem
from megatron_ngrpo.data.templates import EVAL_INSTRUCTION, encode_prompt
from megatron_ngrpo.eval import (
    Benchmark,
    benchmark_metrics,
    default_ks,
    evaluate,
    load_benchmarks,
    pass_at_k,
    regrade,
)
from megatron_ngrpo.eval.__main__ import main as eval_main
from megatron_ngrpo.eval.runner import call_plan, prompt_message
from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.rewards import ChoiceGrader, MathGrader
from megatron_ngrpo.rollout.types import RolloutBatch, RolloutEngine, SamplingParams
from tests.support.scripted import ScriptedEngine

REPO = Path(__file__).resolve().parents[1]


# ---- Pass@k ---------------------------------------------------------------------------------


def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(
                    _brute_force_pass_at_k(n, c, k), abs=1e-12
                ), (n, c, k)


def test_pass_at_k_edges_and_stability():
    assert pass_at_k(32, 0, 32) == 0.0
    assert pass_at_k(32, 1, 32) == 1.0  # n - c < k
    assert pass_at_k(32, 32, 1) == 1.0
    assert pass_at_k(32, 8, 1) == pytest.approx(0.25)
    assert pass_at_k(1024, 1, 512) == pytest.approx(0.5)
    assert pass_at_k(4000, 3, 100) == pytest.approx(
        1 - comb(3997, 100) / comb(4000, 100), rel=1e-10
    )
    for bad in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)
    assert (
        default_ks(32) == [1, 2, 4, 8, 16, 32]
        and default_ks(6) == [1, 2, 4, 6]
        and default_ks(1) == [1]
    )


def test_benchmark_metrics():
    correct = np.array([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    m = benchmark_metrics(correct)
    # Standard error over problems (float64 reference: per-problem means 1, 1/4, 0).
    se = np.std([1.0, 0.25, 0.0], ddof=1) / np.sqrt(3)
    assert m == pytest.approx(
        {"mean@4": 5 / 12, "pass@1": 5 / 12, "pass@2": 0.5, "pass@4": 2 / 3, "se(mean@4)": se}
    )
    assert benchmark_metrics(correct, ks=[3]) == pytest.approx(
        {"mean@4": 5 / 12, "pass@3": (1 + 0.75) / 3, "se(mean@4)": se}
    )
    assert benchmark_metrics(np.ones((1, 2)))["se(mean@2)"] == 0.0


# ---- runner on known generations ------------------------------------------------------------


def test_generation_calls_are_bounded_by_the_token_budget():
    paper = SamplingParams(n=32, max_new_tokens=8192)
    # AIME24 × 32 samples: one problem (32 rows, 268k tokens) per call and rank, not 960 rows at once.
    assert call_plan(30, 200, paper, 2**18) == [range(i, i + 1) for i in range(30)]
    assert call_plan(30, 200, paper, 2**20) == [range(i, min(i + 3, 30)) for i in range(0, 30, 3)]
    # DP 4: 3 problems per rank and call, the last call 6 (ranks 2, 3 repeat its first problem).
    assert call_plan(30, 200, paper, 2**20, dp=4) == [range(0, 12), range(12, 24), range(24, 30)]
    assert call_plan(5, 10, SamplingParams(n=2, max_new_tokens=6), 1) == [
        range(i, i + 1) for i in range(5)
    ]


@pytest.fixture(scope="module")
def r1():
    return load_tokenizer("deepseek-r1-distill-qwen")


@pytest.fixture(scope="module")
def grader():
    with MathGrader(timeout_s=30.0, workers=2) as g:
        yield g


ANSWERS = {  # benchmark → per problem, 4 responses; gold of aime24[0..2]: 204, 25, 809
    "aime24": [
        [r"\boxed{204}"] * 4,
        [r"so \boxed{025}", r"\boxed{24}", "no final answer", r"\boxed{26}"],
        [r"\boxed{1}"] * 4,
    ],
    "math500": [
        [
            r"\boxed{(3, \frac{\pi}{2})}",
            r"</think> \boxed{(3,\pi/2)}",
            r"\boxed{(3,\pi)}",
            r"\boxed{3}",
        ],
        [r"\boxed{q-p}"] * 4,
    ],
}
# se(mean@4): over problems; boxed: the share of responses with a box (the format rate).
EXPECTED = {
    "aime24": {
        "problems": 3,
        "mean@4": 5 / 12,
        "pass@1": 5 / 12,
        "pass@2": 0.5,
        "pass@4": 2 / 3,
        "se(mean@4)": np.std([1.0, 0.25, 0.0], ddof=1) / np.sqrt(3),
        "boxed": 11 / 12,
    },
    "math500": {
        "problems": 2,
        "mean@4": 0.25,
        "pass@1": 0.25,
        "pass@2": 5 / 12,
        "pass@4": 0.5,
        "se(mean@4)": np.std([0.5, 0.0], ddof=1) / np.sqrt(2),
        "boxed": 1.0,
    },
}


@pytest.fixture(scope="module")
def scripted_run(r1, grader, tmp_path_factory):
    benchmarks = [
        Benchmark(b.name, b.problems[: len(ANSWERS[b.name])])
        for b in load_benchmarks(["aime24", "math500"])
    ]
    template = TemplateConfig()
    script = {
        tuple(encode_prompt(prompt_message(p, template), r1, template)): ANSWERS[b.name][i]
        for b in benchmarks
        for i, p in enumerate(b.problems)
    }
    engine = ScriptedEngine(r1, script)
    out = tmp_path_factory.mktemp("eval")
    params = SamplingParams(n=4, temperature=0.6, top_p=0.95, max_new_tokens=64)
    # Two aime24 problems' samples per call (the longest aime24 prompt sets the budget).
    longest = max(len(p) for p, _ in zip(script, range(3)))
    budget = 2 * params.n * (longest + params.max_new_tokens)
    result = evaluate(
        engine,
        r1,
        benchmarks,
        params,
        grader,
        out_dir=out,
        max_tokens_per_call=budget,
        progress=False,
    )
    return result, engine, out


def test_metrics_on_known_generations(scripted_run):
    result, engine, _ = scripted_run
    assert result.n == 4
    for name, expected in EXPECTED.items():
        assert result.metrics[name] == pytest.approx(expected)
    assert result.average == pytest.approx(
        {
            k: (EXPECTED["aime24"][k] + EXPECTED["math500"][k]) / 2
            for k in EXPECTED["aime24"]
            if k != "problems"
        }
    )
    # Mixing off, calls of 2 prompts keyed by global problem index, eos as stop token.
    assert [c["keys"] for c in engine.calls][:2] == [[0, 1], [2]]
    assert sum((c["keys"] for c in engine.calls[2:]), []) == [0, 1]
    assert all(c["mixing"] is None and c["params"].stop_token_ids == [151643] for c in engine.calls)
    records = result.generations["aime24"]
    assert [r["score"] for r in records[4:8]] == [1.0, 0.0, 0.0, 0.0]
    assert (
        records[4]["extracted"] == "025" and records[4]["response"] == r"so \boxed{025}"
    )  # eos decoded away


def test_report_files(scripted_run):
    result, _, out = scripted_run
    saved = json.loads((out / "results.json").read_text())
    assert saved["metrics"]["math500"] == pytest.approx(EXPECTED["math500"])
    assert (
        saved["settings"]["sampling"]["temperature"] == 0.6
        and saved["settings"]["template"]["think"] == "force"
    )
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["benchmark"] for r in rows] == ["aime24", "math500", "average"]
    assert float(rows[0]["pass@2"]) == pytest.approx(0.5) and rows[2]["problems"] == "5"
    summary = (out / "summary.md").read_text()
    assert "| aime24 | 3 | 41.7 | 41.7 | 50.0 | 66.7 |" in summary
    assert (out / "passk.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The bootstrap interval over problems brackets every pass@k, and is not a point.
    interval = saved["passk_interval"]
    assert set(interval) == {"aime24", "math500"} and set(interval["aime24"]) == {
        "pass@1",
        "pass@2",
        "pass@4",
    }
    for name, per_k in interval.items():
        for k, (low, high) in per_k.items():
            assert low <= saved["metrics"][name][k] <= high
    assert interval["aime24"]["pass@4"][0] < interval["aime24"]["pass@4"][1]
    lines = (out / "generations" / "aime24.jsonl").read_text().splitlines()
    assert len(lines) == 12 and json.loads(lines[0])["answers"] == ["204"]


def test_regrade_and_cli(scripted_run, grader, tmp_path, capsys):
    _, _, out = scripted_run
    run = tmp_path / "run"
    (run / "generations").mkdir(parents=True)
    for name in ("aime24", "math500"):
        records = [
            json.loads(line)
            for line in (out / "generations" / f"{name}.jsonl").read_text().splitlines()
        ]
        if name == "aime24":
            records[8]["response"] = r"\boxed{809}"  # problem 2, sample 0 becomes correct
        (run / "generations" / f"{name}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records)
        )
    result = regrade(run, grader, out_dir=tmp_path / "regraded")
    assert result.metrics["aime24"]["mean@4"] == pytest.approx(6 / 12)
    assert result.metrics["aime24"]["pass@4"] == pytest.approx(1.0)
    assert result.metrics["math500"] == pytest.approx(EXPECTED["math500"])
    assert (tmp_path / "regraded" / "summary.md").is_file()
    # The CLI's re-grade mode (no model, no engine).
    assert (
        eval_main(
            [
                f"regrade={run}",
                f"output_dir={tmp_path / 'cli'}",
                "reward.workers=1",
                "reward.timeout_s=30",
                "ks=[1,4]",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| aime24 | 3 | 50.0 | 50.0 | 100.0 |" in printed
    assert json.loads((tmp_path / "cli" / "results.json").read_text())["settings"][
        "regraded_from"
    ] == str(run)


def test_multiple_choice_benchmark(r1, grader, tmp_path):
    path = tmp_path / "gpqa_like.jsonl"
    rows = [
        {"question": "Which is prime?\nA) 4\nB) 6\nC) 7\nD) 9", "letter": "C"},
        {"question": "Which is even?\nA) 3\nB) 8\nC) 5\nD) 7", "letter": "B"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    [bench] = load_benchmarks(
        [SourceConfig(path=str(path), problem_key="question", answer_key="letter", kind="mcq")]
    )
    template = TemplateConfig()
    messages = [prompt_message(p, template) for p in bench.problems]
    assert messages[0] == rows[0]["question"] + "\n\n" + MCQ_INSTRUCTION
    script = {
        tuple(encode_prompt(m, r1, template)): texts
        for m, texts in zip(
            messages, [["Answer: C", r"\boxed{C}"], ["thinking\nAnswer: B", "Answer: A"]]
        )
    }
    result = evaluate(
        ScriptedEngine(r1, script),
        r1,
        [bench],
        SamplingParams(n=2),
        {"math": grader, "mcq": ChoiceGrader("paper")},
        progress=False,
    )
    assert [r["score"] for r in result.generations[bench.name]] == [1.0, 0.0, 1.0, 0.0]
    assert result.metrics[bench.name] == pytest.approx(
        {"problems": 2, "mean@2": 0.5, "pass@1": 0.5, "pass@2": 1.0, "se(mean@2)": 0.0}
    )


def test_instruction_none_is_the_default_and_empty_is_none_for_every_kind():
    math, mcq = Problem("m", 0, "1+1?", ("2",)), Problem("c", 0, "Which?", ("A",), kind="mcq")
    assert prompt_message(math, TemplateConfig()) == f"1+1? {EVAL_INSTRUCTION}"
    assert prompt_message(mcq, TemplateConfig()) == f"Which?\n\n{MCQ_INSTRUCTION}"
    empty = TemplateConfig(instruction="")
    assert prompt_message(math, empty) == "1+1?" and prompt_message(mcq, empty) == "Which?"


def test_cli_config_error_is_one_line():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_ngrpo.eval",
            "--config",
            str(REPO / "configs" / "eval" / "paper.yaml"),
            "sampling.n=0",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: config field 'sampling.n' = 0: must be >= 1"


# ---- runner end to end on vLLM --------------------------------------------------------------


class VLLMAdapter(RolloutEngine):
    """Minimal RolloutEngine over vllm.LLM for this test (the project's engine is tested elsewhere)."""

    def __init__(self, llm):
        self.llm = llm

    def sync_weights(self, model_chunks) -> None:
        raise AssertionError("the test loads the checkpoint only")

    def set_neighbor_table(self, table) -> None:
        raise AssertionError("evaluation never mixes")

    def generate(self, prompts, params, mixing=None, keys=None):
        from vllm import SamplingParams as VLLMParams

        assert mixing is None
        sp = VLLMParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=max(params.top_k, 0),
            max_tokens=params.max_new_tokens,
            stop_token_ids=params.stop_token_ids,
            logprobs=0,
            detokenize=False,
        )
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        prompt_ids, responses, logprobs, reasons, index = [], [], [], [], []
        for i, out in enumerate(outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                prompt_ids.append(list(prompts[i]))
                responses.append(list(c.token_ids))
                logprobs.append([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
                reasons.append("length" if c.finish_reason == "length" else "stop")
                index.append(i)
        return RolloutBatch(
            prompt_ids, responses, logprobs, reasons, MixRecord.empty(len(responses), 1), index
        )


def test_evaluate_on_vllm_tiny_qwen2(r1, grader, tmp_path):
    for key, value in {
        "OMP_NUM_THREADS": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }.items():
        os.environ.setdefault(key, value)
    import vllm

    from tests.harness.tiny import write_tiny_hf

    model = write_tiny_hf(
        tmp_path / "tiny",
        vocab_size=151936,
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        num_layers=2,
        tied=True,
        bos_token_id=151646,
        eos_token_id=151643,
    )
    llm = vllm.LLM(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        kv_cache_memory_bytes=256 * 2**20,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        seed=0,
    )
    try:
        benchmarks = load_benchmarks(["aime24", "math500"], limit=2)
        params = SamplingParams(n=3, temperature=0.6, top_p=0.95, max_new_tokens=12)
        result = evaluate(
            VLLMAdapter(llm),
            r1,
            benchmarks,
            params,
            grader,
            out_dir=tmp_path / "out",
            max_tokens_per_call=1,
            progress=False,
        )
    finally:
        del llm
    assert result.n == 3 and set(result.metrics) == {"aime24", "math500"}
    for name in ("aime24", "math500"):
        records = result.generations[name]
        assert len(records) == 2 * 3
        assert all(
            1 <= r["response_tokens"] <= 12 and r["finish_reason"] in ("stop", "length")
            for r in records
        )
        assert all(r["score"] == 0.0 for r in records)  # random text answers nothing
        assert result.metrics[name]["pass@3"] == 0.0 and result.metrics[name]["problems"] == 2
    assert len((tmp_path / "out" / "generations" / "math500.jsonl").read_text().splitlines()) == 6


# ---- at data-parallel scale (2 ranks: tests/dist/eval_worker.py) ----------------------------


@pytest.fixture(scope="module")
def dist_results():
    from tests.harness.multiproc import launch

    return launch(
        Path(__file__).parent / "dist" / "eval_worker.py",
        nproc=2,
        timeout=600,
        env={"NGRPO_TEST_PG_TIMEOUT": "60"},
    )


@pytest.mark.parametrize(
    "name",
    [
        "validation_dp2_generates_like_dp1",
        "validation_dp2_metrics_like_dp1",
        "mixing_at_eval",
        "keep_best_disagreement_is_decided_by_rank0",
    ],
)
def test_validation_at_data_parallel_scale(dist_results, name):
    from tests.harness.multiproc import check

    check(dist_results, name)
