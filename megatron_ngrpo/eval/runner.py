"""Evaluation: generate n samples per problem with mixing off, grade, Mean@n and Pass@k.

Protocol (N-GRPO paper §4.1, App. B.3; docs/ALGORITHM.md §9): user message = problem + " " +
EVAL_INSTRUCTION (with the trailing period) in the R1 chat template ending in ``<think>\\n``
(templates.py); T = 0.6, top-p 0.95, 8192 new tokens, n = 32; math graded on the last
``\\boxed{}``, multiple choice on the "Answer: X" line. Every response is kept (JSONL) so a run can
be re-graded later without generating again (:func:`regrade`).

At scale (:func:`evaluate` with ``dp_group``): the problems of a benchmark are split over the
data-parallel ranks, each rank generates and grades its share, and the graded records are
gathered, so every rank computes the same metrics. Generation goes in bounded calls: each rank
asks its engine for at most ``max_tokens_per_call`` tokens' worth of sequences (rows × (longest
prompt + max_new_tokens)) per call, never less than one problem's ``n`` samples; the Megatron
engine keeps a KV cache of that size (a benchmark × 32 samples in one static batch would need
hundreds of GB), vLLM queues them itself.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_ngrpo.architecture import unwrap
from megatron_ngrpo.data.config import SourceConfig
from megatron_ngrpo.data.datasets import Problem, as_source, load_source, prompt_too_long
from megatron_ngrpo.data.templates import (
    EVAL_INSTRUCTION,
    MCQ_INSTRUCTION,
    TemplateConfig,
    encode_prompt,
    math_message,
    mcq_message,
)
from megatron_ngrpo.eval.passk import benchmark_metrics
from megatron_ngrpo.eval.report import write_report
from megatron_ngrpo.eval.result import EvalResult, read_generations
from megatron_ngrpo.mixing.config import MixingConfig
from megatron_ngrpo.mixing.neighbor_mode import resolve_mode
from megatron_ngrpo.mixing.neighbors import neighbor_table_for_model
from megatron_ngrpo.rewards.extract import extract_answer, last_boxed
from megatron_ngrpo.rollout.types import RolloutEngine, SamplingParams

# Paper defaults (§4.1).
PAPER_SAMPLING = SamplingParams(n=32, temperature=0.6, top_p=0.95, max_new_tokens=8192)
# Tokens of sequences one rank generates per engine call: 21 full-length (12,288-token) sequences.
DEFAULT_TOKENS_PER_CALL = 2**18


@dataclass
class Benchmark:
    name: str
    problems: list[Problem]
    path: str = ""  # the file the problems came from (for errors)

    @property
    def kind(self) -> str:
        return self.problems[0].kind if self.problems else "math"


def load_benchmarks(
    names: Sequence[str | SourceConfig],
    limit: int = 0,
    cache_dir: str | None = None,
    max_bad_fraction: float = 0.0,
) -> list[Benchmark]:
    """Benchmarks by registry name or file path; the first ``limit`` problems of each (0 = all).
    Evaluation files must be clean (``max_bad_fraction`` 0 by default)."""
    benchmarks = []
    for name in names:
        problems, report = load_source(
            as_source(name), max_bad_fraction=max_bad_fraction, cache_dir=cache_dir
        )
        benchmarks.append(
            Benchmark(
                problems[0].source if problems else str(name),
                problems[:limit] if limit else problems,
                report.path,
            )
        )
    return benchmarks


def check_prompt_lengths(
    benchmarks: Sequence[Benchmark],
    tokenizer,
    template: TemplateConfig,
    max_tokens: int,
    limit: str,
) -> None:
    """Refuse, in one line naming file, row and field, a benchmark whose templated prompt is over
    ``max_tokens`` (``limit`` names where that comes from): before any process group starts, not
    the engine's error on every rank mid-evaluation."""
    for bench in benchmarks:
        for p in bench.problems:
            n = len(encode_prompt(prompt_message(p, template), tokenizer, template))
            if n > max_tokens:
                raise prompt_too_long(p, bench.path or p.source, n, f"{max_tokens}: {limit}")


def prompt_message(problem: Problem, template: TemplateConfig) -> str:
    if problem.kind == "mcq":
        return mcq_message(problem.problem, instruction=template.instruction_or(MCQ_INSTRUCTION))
    return math_message(problem.problem, template.instruction_or(EVAL_INSTRUCTION))


def _grader_for(grader, kind: str):
    if isinstance(grader, Mapping):
        if kind not in grader:
            raise KeyError(f"no grader for benchmark kind {kind!r} (have {sorted(grader)})")
        return grader[kind]
    return grader


def call_plan(
    num_prompts: int,
    longest_prompt: int,
    params: SamplingParams,
    max_tokens_per_call: int,
    dp: int = 1,
) -> list[range]:
    """Global prompt ranges of the generate calls: per call each of the ``dp`` ranks gets
    ``max(1, max_tokens_per_call // (n × (longest_prompt + max_new_tokens)))`` prompts."""
    per_rank = max(1, max_tokens_per_call // (params.n * (longest_prompt + params.max_new_tokens)))
    size = per_rank * dp
    return [range(start, min(start + size, num_prompts)) for start in range(0, num_prompts, size)]


def _generate(
    engine: RolloutEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    tokenizer,
    max_tokens_per_call: int,
    dp_group,
    desc: str,
    progress: bool,
    mixing: MixingConfig | None,
) -> dict[int, list[tuple]]:
    """Per prompt of this rank's share, its n samples as (text, finish_reason, response tokens),
    plus the number of mixed steps when ``mixing`` is given."""
    dp, rank = (
        (dist.get_world_size(dp_group), dist.get_rank(dp_group)) if dp_group is not None else (1, 0)
    )
    calls = call_plan(
        len(prompts), max(map(len, prompts), default=1), params, max_tokens_per_call, dp
    )
    out: dict[int, list[tuple]] = {}
    bar = tqdm(
        total=sum(len(c[rank::dp]) for c in calls), desc=desc, unit="prompt", disable=not progress
    )
    for call in calls:
        mine = list(call[rank::dp])
        # Every rank calls its engine as often as the others (colocated vLLM is a collective of all
        # ranks): a rank without a share in the last call repeats the call's first prompt under
        # its key (vLLM's replicas generate a key once) and drops the result.
        # Keys = global problem index: the split and the call sizes do not change any sequence's seed.
        keys = mine or [call[0]]
        batch = engine.generate([prompts[k] for k in keys], params, mixing=mixing, keys=keys)
        if not mine:
            continue
        texts = (
            batch.texts
            if batch.texts is not None
            else tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
        )
        mixed = (
            torch.bincount(batch.mixes.seq, minlength=batch.mixes.num_seqs).tolist()
            if mixing
            else None
        )
        for r, local in enumerate(batch.prompt_index):
            sample = (texts[r], batch.finish_reasons[r], len(batch.response_ids[r]))
            out.setdefault(mine[local], []).append(
                sample + (mixed[r],) if mixed is not None else sample
            )
        bar.update(len(mine))
    bar.close()
    for i in (k for c in calls for k in c[rank::dp]):
        if len(out.get(i, ())) != params.n:
            raise RuntimeError(
                f"engine returned {len(out.get(i, ()))} samples for prompt {i}, expected {params.n}"
            )
    return out


def _gather(records: list[dict], dp_group) -> list[dict]:
    """Every rank's records, in (problem, sample) order, on every rank of ``dp_group``."""
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        parts: list = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(parts, records, group=dp_group)
        records = [r for part in parts for r in part]
    return sorted(records, key=lambda r: (r["problem"], r["sample"]))


def _records(bench: Benchmark, samples: dict[int, list[tuple]]) -> list[dict]:
    return [
        {
            "benchmark": bench.name,
            "problem": i,
            "row": bench.problems[i].row,
            "sample": j,
            "response": text,
            "finish_reason": reason,
            "response_tokens": tokens,
            "answers": list(bench.problems[i].answers),
            "kind": bench.problems[i].kind,
            **({"mixed_steps": rest[0]} if rest else {}),
        }
        for i in sorted(samples)
        for j, (text, reason, tokens, *rest) in enumerate(samples[i])
    ]


def _grade(records: list[dict], grader, kind: str) -> None:
    """Adds ``score`` (0/1), ``extracted`` (the parsed final answer, for reading, by the grader's
    own rules) and, for math, ``boxed`` (the response boxes an answer: the format rate) to each."""
    if not records:
        return
    grader = _grader_for(grader, kind)
    golds = [r["answers"] if kind == "math" else r["answers"][0] for r in records]
    scores = grader.score_batch([(r["response"], g) for r, g in zip(records, golds)])
    for r, s in zip(records, scores):
        r["score"] = float(s)
        if kind == "math":
            readable = len(r["response"]) <= 200_000
            r["extracted"] = (
                extract_answer(
                    r["response"],
                    getattr(grader, "fallback", True),
                    getattr(grader, "free_text", "off"),
                )
                if readable
                else None
            )
            r["boxed"] = readable and last_boxed(r["response"]) is not None
        else:
            r["extracted"] = grader.extract(r["response"]) if hasattr(grader, "extract") else None


def _metrics(records: list[dict], ks: Sequence[int] | None) -> tuple[int, dict[str, float]]:
    problems = 1 + max(r["problem"] for r in records)
    n = 1 + max(r["sample"] for r in records)
    correct = np.zeros((problems, n))
    for r in records:
        correct[r["problem"], r["sample"]] = r["score"]
    boxed = (
        {"boxed": float(np.mean([r["boxed"] for r in records]))} if "boxed" in records[0] else {}
    )
    return n, {"problems": float(problems), **benchmark_metrics(correct, ks), **boxed}


def _result(generations: dict[str, list[dict]], ks, settings: dict) -> EvalResult:
    metrics, ns = {}, set()
    for name, records in generations.items():
        n, metrics[name] = _metrics(records, ks)
        ns.add(n)
    if len(ns) != 1:
        raise ValueError(f"benchmarks have different sample counts {sorted(ns)}")
    common = [
        k
        for k in next(iter(metrics.values()))
        if k != "problems" and all(k in m for m in metrics.values())
    ]
    average = {k: float(np.mean([m[k] for m in metrics.values()])) for k in common}
    return EvalResult(
        n=ns.pop(), metrics=metrics, average=average, generations=generations, settings=settings
    )


def eval_mixing(
    mixing: MixingConfig,
    engine: RolloutEngine,
    model_chunks: list,
    num_real_tokens: int,
    special_ids=(),
    *,
    positions: int,
) -> MixingConfig | None:
    """The mixing an evaluation generates with: None (the paper) unless ``mixing.at_eval`` (the
    inference-time ablation) and mixing is enabled; then its neighbour source resolved as the
    trainer's is (:func:`~megatron_ngrpo.mixing.neighbor_mode.resolve_mode` over the
    ``positions`` this DP rank decodes): ``engine`` gets the neighbour table of the evaluated
    weights ``model_chunks`` (a collective of the model-parallel group) or, on demand, none."""
    if not (mixing.at_eval and mixing.enabled):
        return None
    vocab = unwrap(model_chunks[0]).vocab_size
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mode = resolve_mode(mixing, engine.neighbors_on_demand, positions, vocab, device_type)
    if mode == "none":
        return mixing
    table = None
    if mode == "table":
        table = neighbor_table_for_model(model_chunks, mixing, num_real_tokens, special_ids).cpu()
    engine.set_neighbor_table(table)
    return dataclasses.replace(mixing, neighbor_lookup=mode)


def evaluate(
    engine: RolloutEngine,
    tokenizer,
    benchmarks: Sequence[Benchmark],
    params: SamplingParams = PAPER_SAMPLING,
    grader=None,
    *,
    template: TemplateConfig | None = None,
    ks: Sequence[int] | None = None,
    out_dir: str | Path | None = None,
    max_tokens_per_call: int = DEFAULT_TOKENS_PER_CALL,
    dp_group=None,
    progress: bool = True,
    mixing: MixingConfig | None = None,
) -> EvalResult:
    """Generate ``params.n`` samples per problem, grade, compute metrics.

    ``mixing``: None (the paper's evaluation) or the inference-time mixing ablation (see
    :func:`eval_mixing`); each record then has ``mixed_steps``, the response's mixed positions.

    ``grader``: one grader with ``score_batch([(text, gold)])`` for every benchmark, or a mapping
    benchmark kind ("math" / "mcq") → grader. ``ks``: Pass@k values (default 1, 2, 4, ..., n).
    With ``out_dir`` the reports and generations are written there (:mod:`.report`).
    ``max_tokens_per_call`` bounds each engine call (module docstring). ``dp_group``: the
    data-parallel group to split the problems over (a collective of all its ranks; every rank
    returns the same result); None: this rank evaluates everything.
    """
    if grader is None:
        raise ValueError("evaluate needs a grader (e.g. MathGrader) or a kind → grader mapping")
    template = template or TemplateConfig()
    params.validate()
    if params.stop_token_ids == [] and tokenizer.eos_token_id is not None:
        params = dataclasses.replace(params, stop_token_ids=[tokenizer.eos_token_id])
    generations = {}
    for bench in benchmarks:
        prompts = [
            encode_prompt(prompt_message(p, template), tokenizer, template) for p in bench.problems
        ]
        samples = _generate(
            engine,
            prompts,
            params,
            tokenizer,
            max_tokens_per_call,
            dp_group,
            bench.name,
            progress,
            mixing,
        )
        records = _records(bench, samples)
        _grade(records, grader, bench.kind)
        generations[bench.name] = _gather(records, dp_group)
    settings = {"sampling": dataclasses.asdict(params), "template": dataclasses.asdict(template)}
    if mixing is not None:
        settings["mixing"] = dataclasses.asdict(mixing)
    result = _result(generations, ks, settings)
    if out_dir is not None:
        write_report(result, out_dir)
    return result


def regrade(
    run_dir: str | Path,
    grader,
    *,
    ks: Sequence[int] | None = None,
    out_dir: str | Path | None = None,
) -> EvalResult:
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
