"""pass@k curves: the unbiased estimator per problem against exact enumeration and the closed form
(a biased 1 − (1 − c/n)^k fails both), and the seeded bootstrap interval over problems."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from megatron_ngrpo.eval.passk import bootstrap_interval, default_ks, pass_at_k_curve


def _enumerated(n: int, c: int, k: int) -> Fraction:
    """Exact pass@k: the fraction of all k-subsets of n samples (the first c correct) that hold
    a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def _closed_form(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_curve_matches_enumeration_of_all_subsets():
    for n in range(1, 9):
        ks = default_ks(n)
        counts = list(range(n + 1))
        curve = pass_at_k_curve(counts, n, ks)
        assert curve.shape == (n + 1, len(ks)) and curve.dtype == np.float64
        for c in counts:
            for j, k in enumerate(ks):
                assert curve[c, j] == pytest.approx(float(_enumerated(n, c, k)), abs=1e-12)


def test_curve_matches_closed_form_at_large_n():
    """n = 64 and n = 1024 (binomials far beyond float range for the naive ratio at 1024)."""
    for n in (64, 1024):
        ks = default_ks(n)
        assert ks[0] == 1 and ks[-1] == n and all(b == 2 * a for a, b in zip(ks, ks[1:]))
        counts = [0, 1, 2, 5, n // 4, n // 2, n - 1, n]
        curve = pass_at_k_curve(counts, n, ks)
        for i, c in enumerate(counts):
            for j, k in enumerate(ks):
                assert curve[i, j] == pytest.approx(float(_closed_form(n, c, k)), abs=1e-12)
        assert np.all(np.diff(curve, axis=1) >= -1e-15)  # non-decreasing in k
    # Where the biased plug-in estimate is far off: 1 correct of 64, k = 32 → exactly 1/2.
    assert pass_at_k_curve([1], 64, [32])[0, 0] == pytest.approx(0.5, abs=1e-12)
    assert 1 - (1 - 1 / 64) ** 32 == pytest.approx(0.395, abs=1e-3)


def test_bootstrap_interval_is_seeded_and_covers_the_mean():
    rng = np.random.default_rng(1)
    values = rng.random((200, 3))  # [problems, ks]
    low, high = bootstrap_interval(values, resamples=1000, seed=0)
    again = bootstrap_interval(values, resamples=1000, seed=0)
    assert np.array_equal(low, again[0]) and np.array_equal(high, again[1])
    mean = values.mean(axis=0)
    assert low.shape == (3,) and np.all(low < mean) and np.all(mean < high)
    # The percentile interval of a mean of 200 uniform values: about ± 1.96 · sd / √200.
    half = 1.96 * values.std(axis=0, ddof=1) / math.sqrt(200)
    assert (high - low) / 2 == pytest.approx(half, rel=0.15)
    # A constant per-problem value has a zero-width interval; 4× the problems halve the width.
    lo, hi = bootstrap_interval(np.full((10, 2), 0.25))
    assert np.allclose(lo, 0.25) and np.allclose(hi, 0.25)
    lo4, hi4 = bootstrap_interval(np.tile(values, (4, 1)), resamples=1000, seed=0)
    assert (hi4 - lo4) == pytest.approx((high - low) / 2, rel=0.2)
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_interval(np.zeros((0, 2)))
