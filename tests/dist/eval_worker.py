"""Evaluation and validation at data-parallel scale, 2 ranks (tests/test_eval.py):

* the benchmark's problems split over DP = 2 give the same generations (the built-in Megatron
  engine on a tiny random model, sampled) and the same Mean@k / Pass@k (scripted answers with
  known grades) as one rank evaluating everything; each rank's engine only saw its share;
* ``mixing.at_eval``: evaluation generates with neighbour mixing, the table built from the
  evaluated weights (mixed steps in the records); at_eval false generates exactly as the paper's
  evaluation (no mixing);
* ``best_decision``: ranks whose validation numbers disagree still take one decision (global rank
  0's), so the collective checkpoint save that follows cannot hang.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_ngrpo.models.config import ModelConfig
from megatron_ngrpo.models.provider import build_model
from megatron_ngrpo.parallel import model_parallel_seed
from tests.harness.multiproc import case, run_cases, shared_tmpdir
from tests.harness.tiny import write_tiny_hf

N, MAX_NEW = 2, 6


def _setup():
    from megatron_ngrpo.data.tokenizer import load_tokenizer
    from megatron_ngrpo.eval.runner import load_benchmarks
    from megatron_ngrpo.parallel import initialize_model_parallel

    initialize_model_parallel(1, 1)  # DP = 2
    tokenizer = load_tokenizer("deepseek-r1-distill-qwen")
    # 5 problems over 2 ranks, one per rank and call: the last call has a share for rank 0 only.
    benchmarks = load_benchmarks(["aime24"], limit=5)
    return tokenizer, benchmarks


def _spy(engine):
    """Record the keys of every generate call of a real engine."""
    calls, generate = [], engine.generate

    def recording(prompts, params, mixing=None, keys=None):
        calls.append(list(keys))
        return generate(prompts, params, mixing=mixing, keys=keys)

    engine.generate = recording
    return calls


def _prompts(benchmark, tokenizer):
    from megatron_ngrpo.data.templates import TemplateConfig, encode_prompt
    from megatron_ngrpo.eval.runner import prompt_message

    template = TemplateConfig()
    return [
        encode_prompt(prompt_message(p, template), tokenizer, template) for p in benchmark.problems
    ]


def _evaluate(engine, tokenizer, benchmarks, grader, dp_group):
    from megatron_ngrpo.eval.runner import evaluate
    from megatron_ngrpo.rollout.types import SamplingParams

    params = SamplingParams(
        n=N,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=MAX_NEW,
        seed=3,
        stop_token_ids=[tokenizer.eos_token_id],
    )
    longest = max(map(len, _prompts(benchmarks[0], tokenizer)))
    return evaluate(
        engine,
        tokenizer,
        benchmarks,
        params,
        grader,
        max_tokens_per_call=N * (longest + MAX_NEW),
        dp_group=dp_group,
        progress=False,
    )


def _tiny_policy(vocab_size: int, num_real_tokens: int | None = None) -> list:
    """A tiny random Qwen2 (2 layers, h 64), the same weights on every rank (rank 0's)."""
    hf = os.path.join(shared_tmpdir("eval_worker_"), "m")
    if dist.get_rank() == 0:
        write_tiny_hf(
            hf,
            weights=False,
            vocab_size=vocab_size,
            hidden_size=64,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=128,
            num_layers=2,
        )
    dist.barrier()
    model_parallel_seed(0)
    chunks = build_model(ModelConfig(hf_path=hf, num_real_tokens=num_real_tokens))
    with torch.no_grad():
        for p in chunks[0].parameters():
            dist.broadcast(p, src=0)
    return chunks


@case
def validation_dp2_generates_like_dp1():
    from megatron_ngrpo.rewards import MathGrader
    from megatron_ngrpo.rollout.megatron_engine import MegatronEngine

    tokenizer, benchmarks = _setup()
    chunks = _tiny_policy(vocab_size=151936)
    engine = MegatronEngine(
        chunks,
        151936,
        eos_token_ids=[tokenizer.eos_token_id],
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )
    calls = _spy(engine)
    with MathGrader(timeout_s=30.0, workers=1) as grader:
        split = _evaluate(engine, tokenizer, benchmarks, grader, dist.group.WORLD)
        split_calls = list(calls)
        whole = _evaluate(engine, tokenizer, benchmarks, grader, None)

    def keys(result):
        return [
            (r["problem"], r["sample"], r["response"], r["response_tokens"])
            for r in result.generations["aime24"]
        ]

    assert keys(split) == keys(whole) and len(keys(split)) == 5 * N
    assert split.metrics == whole.metrics
    # Each rank generated its share; rank 1 repeated problem 4 in the last call (its result dropped).
    expected = [[0], [2], [4]] if dist.get_rank() == 0 else [[1], [3], [4]]
    assert split_calls == expected, split_calls
    return {"generated": len(keys(split))}


@case
def validation_dp2_metrics_like_dp1():
    from megatron_ngrpo.rewards import MathGrader
    from tests.support.scripted import ScriptedEngine

    tokenizer, benchmarks = _setup()
    answers = {
        0: ["\\boxed{204}", "\\boxed{3}"],
        1: ["\\boxed{25}", "\\boxed{25}"],
        2: ["no", "no"],
        3: ["\\boxed{197}", "x"],
        4: ["x", "\\boxed{110}"],
    }
    golds = [p.answers for p in benchmarks[0].problems]
    script = {tuple(p): answers[i] for i, p in enumerate(_prompts(benchmarks[0], tokenizer))}
    engine = ScriptedEngine(tokenizer, script)
    with MathGrader(timeout_s=30.0, workers=1) as grader:
        split = _evaluate(engine, tokenizer, benchmarks, grader, dist.group.WORLD)
        whole = _evaluate(engine, tokenizer, benchmarks, grader, None)
    assert split.metrics == whole.metrics and split.average == whole.average
    assert 0 < split.metrics["aime24"][f"mean@{N}"] < 1, (split.metrics, golds)
    return split.metrics["aime24"]


class _ByteTokenizer:
    """UTF-8 bytes as ids 3..258 (EOS 2): small enough for a 512-row model, whose neighbour table
    a CPU builds at once (the R1 vocabulary's takes minutes)."""

    eos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return type("Encoding", (), {"input_ids": [3 + b for b in text.encode()]})()

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")

    def batch_decode(self, seqs, skip_special_tokens=True):
        return [self.decode(s) for s in seqs]


@case
def mixing_at_eval():
    from megatron_ngrpo.data.datasets import Problem
    from megatron_ngrpo.data.templates import TemplateConfig
    from megatron_ngrpo.eval.runner import Benchmark, eval_mixing, evaluate
    from megatron_ngrpo.mixing.config import MixingConfig
    from megatron_ngrpo.parallel import initialize_model_parallel
    from megatron_ngrpo.rewards import MathGrader
    from megatron_ngrpo.rollout.megatron_engine import MegatronEngine
    from megatron_ngrpo.rollout.types import SamplingParams

    initialize_model_parallel(1, 1)  # DP = 2
    tok, real = _ByteTokenizer(), 259
    chunks = _tiny_policy(vocab_size=512, num_real_tokens=real)
    engine = MegatronEngine(chunks, real, eos_token_ids=[tok.eos_token_id], decode=tok.decode)
    benchmarks = [
        Benchmark(
            "toy", [Problem("toy", i, f"What is {i} + {i}?", (str(2 * i),)) for i in range(3)]
        )
    ]
    params = SamplingParams(
        n=N, temperature=1.0, max_new_tokens=MAX_NEW, seed=3, stop_token_ids=[tok.eos_token_id]
    )

    def run(mixing):
        return evaluate(
            engine,
            tok,
            benchmarks,
            params,
            grader,
            template=TemplateConfig(kind="plain"),
            dp_group=dist.group.WORLD,
            progress=False,
            mixing=mixing,
        )

    with MathGrader(timeout_s=30.0, workers=1) as grader:
        paper = run(None)
        positions = 2 * N * MAX_NEW  # this rank's 2 of the 3 problems
        off = eval_mixing(
            MixingConfig(rate=1.0, at_eval=False),
            engine,
            chunks,
            real,
            [tok.eos_token_id],
            positions=positions,
        )
        assert off is None and run(off).generations == paper.generations
        assert all("mixed_steps" not in r for r in paper.generations["toy"])
        # auto, resolved as the trainer's: over 100x this rank's positions → the table; 0.5 · 24
        # positions · 40 < 512 rows → on-demand rows, the earlier table dropped
        many = eval_mixing(
            MixingConfig(rate=0.5, k=3, at_eval=True),
            engine,
            chunks,
            real,
            [tok.eos_token_id],
            positions=100 * positions,
        )
        assert many.neighbor_lookup == "table" and engine._fixed_table.shape == (512, 3)
        on = eval_mixing(
            MixingConfig(rate=0.5, k=3, at_eval=True),
            engine,
            chunks,
            real,
            [tok.eos_token_id],
            positions=positions,
        )
        assert on.neighbor_lookup == "on_demand" and engine._fixed_table is None
        mixed = run(on)
        assert engine.neighbor_rows_searched() > 0
    steps = [r["mixed_steps"] for r in mixed.generations["toy"]]
    assert len(steps) == 3 * N and sum(steps) > 0, steps
    assert mixed.settings["mixing"]["at_eval"] is True
    return {"mixed_steps": sum(steps)}


@case
def keep_best_disagreement_is_decided_by_rank0():
    from megatron_ngrpo.training.trainer import best_decision

    rank = dist.get_rank()
    best = {"step": 1, "metric": "val/mean@4", "value": 0.3, "checkpoint": "iter_0000001"}
    out = []
    for improved_on_rank0 in (True, False):
        # Each rank's own numbers say the opposite of the other rank's.
        value = 0.5 if (rank == 0) == improved_on_rank0 else 0.1
        decision = best_decision({"val/mean@4": value}, best, 2, "iter_0000002")
        if decision is not None:
            dist.barrier()  # the collective save: every rank must get here, or none
        both = [None, None]
        dist.all_gather_object(both, decision)
        assert both[0] == both[1], both
        assert (decision is not None) == improved_on_rank0 and (
            decision is None or decision["value"] == 0.5
        )
        out.append(decision)
    return out


if __name__ == "__main__":
    run_cases()
