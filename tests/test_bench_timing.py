"""The benchmarks' timing harness (bench/_timing.py): its 95% interval contains the true ratio of
synthetic workloads whose relative costs are known by construction (one CPU-bound kernel run
3× vs 2×, 1× vs 1×, the same work counted in 3 vs 2 units as a rate, and 3× vs 2× when whichever
runs first in its pair does twice its work).

A 95% interval misses 1 time in 20 by design, so each check repeats the comparison and counts
hits: a biased ratio or a too narrow interval fails the count, chance alone almost never does
(coverage of these four checks measured here under the stopping rule, 100 runs each: 93-98%;
P(≤ 5 hits of 10 | 93%) < 1e-3). The rate check times 1 ms calls: with 2 ms calls a side its
coverage measured 71-85% in three sets of 60-100 runs (cause not found; long runs of those calls
show no bias).
"""

from __future__ import annotations

import numpy as np

from bench._timing import compare, median_interval, paired_median_ratio


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


def _first_doubles(k: int, calls: list[int]):
    """k kernels, 2k when this call opens its pair (calls alternate: even count = first)."""

    def run():
        first = calls[0] % 2 == 0
        calls[0] += 1
        for _ in range(k * (2 if first else 1)):
            _kernel()

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


def test_position_effect_cancels():
    # pair ratios fall at 3 (a first) and 0.75 (b first): their median is not 1.5, each block's is
    calls = [0]
    hits, runs = _hits(1.5, _first_doubles(3, calls), _first_doubles(2, calls), label="position")
    assert hits >= 6, runs


def test_rate_ratio_uses_work_units():
    # the same work counted as 3 vs 2 units: 1.5× the units per second
    hits, runs = _hits(1.5, _times(1, units=3), _times(1, units=2), kind="rate", label="units/s")
    assert hits >= 6, runs


def test_reports_when_precision_is_not_reached():
    r = compare(_times(1), _times(1), precision=1e-9, max_seconds=0.3, min_pairs=3)
    assert not r.converged and "did not reach" in str(r)


def test_bootstrap_interval_of_exact_ratios_is_a_point():
    r = paired_median_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert (r.value, r.lo, r.hi) == (2.0, 2.0, 2.0)


def test_median_interval_is_the_sign_tests_order_statistics():
    # 10 values: P(Binomial(10, 1/2) <= 1) = 0.011 <= 0.025 < P(<= 2) = 0.055, so [x(2), x(9)]
    r = median_interval(np.arange(1.0, 11.0))
    assert (r.value, r.lo, r.hi) == (5.5, 2.0, 9.0)
    # 5 values: even [min, max] brackets the median only 1 - 2/32 = 94% of the time
    assert median_interval(np.arange(1.0, 6.0)).hi == float("inf")
