"""Evaluation: Pass@k / Mean@n, the benchmark runner (mixing off), reports, re-grading."""

from megatron_ngrpo.eval.passk import benchmark_metrics, default_ks, mean_at_n, pass_at_k
from megatron_ngrpo.eval.runner import (
    PAPER_SAMPLING,
    Benchmark,
    EvalResult,
    evaluate,
    load_benchmarks,
    regrade,
)

__all__ = [
    "Benchmark",
    "EvalResult",
    "PAPER_SAMPLING",
    "benchmark_metrics",
    "default_ks",
    "evaluate",
    "load_benchmarks",
    "mean_at_n",
    "pass_at_k",
    "regrade",
]
