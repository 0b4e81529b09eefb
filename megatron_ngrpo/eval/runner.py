"""Evaluation: generate n samples per problem with mixing off, grade, Mean@n and Pass@k.

Protocol (N-GRPO paper §4.1, App. B.3; docs/ALGORITHM.md §9): user message = problem + " " +
EVAL_INSTRUCTION (with the trailing period) in the R1 chat template ending in ``<think>\\n``
(templates.py); T = 0.6, top-p 0.95, 8192 new tokens, n = 32; math graded on the last
``\\boxed{}``, multiple choice on the "Answer: X" line. Every response is kept (JSONL) so a run can
be re-graded later without generating again (:func:`regrade`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megatron_ngrpo.data.config import SourceConfig
from megatron_ngrpo.data.datasets import Problem, load_source
from megatron_ngrpo.data.templates import EVAL_INSTRUCTION, MCQ_INSTRUCTION, TemplateConfig, encode_prompt, \
    math_message, mcq_message
from megatron_ngrpo.eval.passk import benchmark_metrics
from megatron_ngrpo.eval.report import write_report
from megatron_ngrpo.eval.result import EvalResult, read_generations
from megatron_ngrpo.rewards.extract import extract_answer
from megatron_ngrpo.rollout.types import RolloutEngine, SamplingParams

# Paper defaults (§4.1).
PAPER_SAMPLING = SamplingParams(n=32, temperature=0.6, top_p=0.95, max_new_tokens=8192)


@dataclass
class Benchmark:
    name: str
    problems: list[Problem]

    @property
    def kind(self) -> str:
        return self.problems[0].kind if self.problems else "math"


def load_benchmarks(names: Sequence[str | SourceConfig], limit: int = 0, cache_dir: str | None = None,
                    max_bad_fraction: float = 0.0) -> list[Benchmark]:
    """Benchmarks by registry name or file path; the first ``limit`` problems of each (0 = all).
    Evaluation files must be clean (``max_bad_fraction`` 0 by default)."""
    benchmarks = []
    for name in names:
        source = name if isinstance(name, SourceConfig) else (
            SourceConfig(path=name) if Path(name).suffix else SourceConfig(name=name))
        problems, _ = load_source(source, max_bad_fraction=max_bad_fraction, cache_dir=cache_dir)
        benchmarks.append(Benchmark(problems[0].source if problems else str(name),
                                    problems[:limit] if limit else problems))
    return benchmarks


def prompt_message(problem: Problem, template: TemplateConfig) -> str:
    if problem.kind == "mcq":
        return mcq_message(problem.problem, instruction=template.instruction or MCQ_INSTRUCTION)
    instruction = template.instruction if template.instruction is not None else EVAL_INSTRUCTION
    return math_message(problem.problem, instruction)


def _grader_for(grader, kind: str):
    if isinstance(grader, Mapping):
        if kind not in grader:
            raise KeyError(f"no grader for benchmark kind {kind!r} (have {sorted(grader)})")
        return grader[kind]
    return grader


def _generate(engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, tokenizer,
              prompts_per_call: int, desc: str, progress: bool) -> list[list[tuple[str, str, int]]]:
    """Per prompt, its n samples as (text, finish_reason, response tokens)."""
    out: list[list[tuple[str, str, int]]] = [[] for _ in prompts]
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress)
    for start in range(0, len(prompts), prompts_per_call):
        chunk = prompts[start:start + prompts_per_call]
        # Keys = global problem index: chunking does not change any sequence's seed.
        batch = engine.generate(chunk, params, mixing=None, keys=list(range(start, start + len(chunk))))
        texts = batch.texts if batch.texts is not None else tokenizer.batch_decode(
            batch.response_ids, skip_special_tokens=True)
        for r, local in enumerate(batch.prompt_index):
            out[start + local].append((texts[r], batch.finish_reasons[r], len(batch.response_ids[r])))
        bar.update(len(chunk))
    bar.close()
    for i, samples in enumerate(out):
        if len(samples) != params.n:
            raise RuntimeError(f"engine returned {len(samples)} samples for prompt {i}, expected {params.n}")
    return out


def _records(bench: Benchmark, samples: list[list[tuple[str, str, int]]]) -> list[dict]:
    return [{"benchmark": bench.name, "problem": i, "row": p.row, "sample": j, "response": text,
             "finish_reason": reason, "response_tokens": tokens, "answers": list(p.answers),
             "kind": p.kind}
            for i, p in enumerate(bench.problems) for j, (text, reason, tokens) in enumerate(samples[i])]


def _grade(records: list[dict], grader, kind: str) -> None:
    """Adds ``score`` (0/1) and ``extracted`` (the parsed final answer, for reading) to each."""
    grader = _grader_for(grader, kind)
    golds = [r["answers"] if kind == "math" else r["answers"][0] for r in records]
    scores = grader.score_batch([(r["response"], g) for r, g in zip(records, golds)])
    for r, s in zip(records, scores):
        r["score"] = float(s)
        if kind == "math":
            r["extracted"] = extract_answer(r["response"]) if len(r["response"]) <= 200_000 else None
        else:
            r["extracted"] = grader.extract(r["response"]) if hasattr(grader, "extract") else None


def _metrics(records: list[dict], ks: Sequence[int] | None) -> tuple[int, dict[str, float]]:
    problems = 1 + max(r["problem"] for r in records)
    n = 1 + max(r["sample"] for r in records)
    correct = np.zeros((problems, n))
    for r in records:
        correct[r["problem"], r["sample"]] = r["score"]
    return n, {"problems": float(problems), **benchmark_metrics(correct, ks)}


def _result(generations: dict[str, list[dict]], ks, settings: dict) -> EvalResult:
    metrics, ns = {}, set()
    for name, records in generations.items():
        n, metrics[name] = _metrics(records, ks)
        ns.add(n)
    if len(ns) != 1:
        raise ValueError(f"benchmarks have different sample counts {sorted(ns)}")
    common = [k for k in next(iter(metrics.values())) if k != "problems"
              and all(k in m for m in metrics.values())]
    average = {k: float(np.mean([m[k] for m in metrics.values()])) for k in common}
    return EvalResult(n=ns.pop(), metrics=metrics, average=average, generations=generations, settings=settings)


def evaluate(engine: RolloutEngine, tokenizer, benchmarks: Sequence[Benchmark],
             params: SamplingParams = PAPER_SAMPLING, grader=None, *,
             template: TemplateConfig | None = None, ks: Sequence[int] | None = None,
             out_dir: str | Path | None = None, prompts_per_call: int = 64,
             progress: bool = True) -> EvalResult:
    """Generate ``params.n`` samples per problem (mixing off), grade, compute metrics.

    ``grader``: one grader with ``score_batch([(text, gold)])`` for every benchmark, or a mapping
    benchmark kind ("math" / "mcq") → grader. ``ks``: Pass@k values (default 1, 2, 4, ..., n).
    With ``out_dir`` the reports and generations are written there (:mod:`.report`).
    """
    if grader is None:
        raise ValueError("evaluate needs a grader (e.g. MathGrader) or a kind → grader mapping")
    template = template or TemplateConfig()
    params.validate()
    if params.stop_token_ids == [] and tokenizer.eos_token_id is not None:
        params = dataclasses.replace(params, stop_token_ids=[tokenizer.eos_token_id])
    generations = {}
    for bench in benchmarks:
        prompts = [encode_prompt(prompt_message(p, template), tokenizer, template) for p in bench.problems]
        samples = _generate(engine, prompts, params, tokenizer, prompts_per_call, bench.name, progress)
        records = _records(bench, samples)
        _grade(records, grader, bench.kind)
        generations[bench.name] = records
    settings = {"sampling": dataclasses.asdict(params), "template": dataclasses.asdict(template)}
    result = _result(generations, ks, settings)
    if out_dir is not None:
        write_report(result, out_dir)
    return result


def regrade(run_dir: str | Path, grader, *, ks: Sequence[int] | None = None,
            out_dir: str | Path | None = None) -> EvalResult:
    """Re-grade the saved generations of ``run_dir`` (e.g. after a grader fix) and recompute the
    metrics; reports go to ``out_dir`` (default: ``run_dir`` itself)."""
    generations = read_generations(run_dir)
    for records in generations.values():
        _grade(records, grader, records[0].get("kind", "math"))
    settings = {"regraded_from": str(run_dir)}
    previous = Path(run_dir) / "results.json"
    if previous.is_file():
        settings = {**json.loads(previous.read_text()).get("settings", {}), **settings}
    result = _result(generations, ks, settings)
    write_report(result, out_dir if out_dir is not None else run_dir)
    return result
