"""The benchmarks' timing harness (bench/_timing.py): its 95% interval contains the true ratio of
synthetic workloads whose relative costs are known by construction (one CPU-bound kernel run
3× vs 2×, 1× vs 1×, and the same work counted in 3 vs 2 units as a rate).

A 95% interval misses 1 time in 20 by design, so each check repeats the comparison and counts
hits: a biased ratio or a too narrow interval fails the count, chance alone almost never does
(measured coverage here ≈ 92% under the stopping rule;
P(≤ 5 hits of 10 | 92%) < 1e-3).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _timing import compare, paired_median_ratio  # noqa: E402


def _kernel(n: int = 10_000) -> int:
    """~1 ms of interpreter work with a tiny working set (insensitive to cache pressure from
    other processes; process CPU time excludes the time spent waiting for a core)."""
    x = 0
    for i in range(n):
        x ^= i * 7
    return x


def _times(k: int, units: int | None = None):
    def run():
        for _ in range(k):
            _kernel()
        return units
    return run


def _hits(truth: float, a, b, trials: int = 10, **kw) -> tuple[int, list[str]]:
    runs = [compare(a, b, warmup=0, max_seconds=20, **kw) for _ in range(trials)]
    assert all(r.converged for r in runs), [str(r) for r in runs]
    return sum(r.cpu.lo <= truth <= r.cpu.hi for r in runs), [str(r) for r in runs]


def test_interval_contains_known_cost_ratios():
    hits, runs = _hits(1.5, _times(3), _times(2), label="3 kernels / 2 kernels")
    assert hits >= 6, runs
    hits, runs = _hits(1.0, _times(1), _times(1), label="1 kernel / 1 kernel")
    assert hits >= 6, runs


def test_rate_ratio_uses_work_units():
    # the same work counted as 3 vs 2 units: 1.5× the units per second
    hits, runs = _hits(1.5, _times(2, units=3), _times(2, units=2), kind="rate", label="units/s")
    assert hits >= 6, runs


def test_reports_when_precision_is_not_reached():
    r = compare(_times(1), _times(1), precision=1e-9, max_seconds=0.3, min_pairs=3)
    assert not r.converged and "did not reach" in str(r)


def test_bootstrap_interval_of_exact_ratios_is_a_point():
    r = paired_median_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert (r.value, r.lo, r.hi) == (2.0, 2.0, 2.0)
