"""Pass@k (unbiased estimator) and Mean@n (N-GRPO paper §4.1; Chen et al. 2021), per problem and
as a curve over k with a bootstrap interval over problems."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 − C(n−c, k)/C(n, k): the chance that k of the n samples, drawn without replacement,
    include one of the c correct ones. 1 when n − c < k. Product form Π_{i=n−c+1}^{n} (1 − k/i),
    stable for any n (no huge binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): need 0 <= c <= n and 1 <= k <= n")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_at_n(correct: Sequence[float]) -> float:
    """Mean@n of one problem: the fraction of its n samples that are correct."""
    return float(np.mean(correct))


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else ks + [n]


def benchmark_metrics(correct: np.ndarray, ks: Sequence[int] | None = None) -> dict[str, float]:
    """``correct`` [problems, n] of 0/1 → ``mean@n``, its standard error ``se(mean@n)`` (over
    problems: the samples of one problem are not independent) and ``pass@k``, averaged over
    problems."""
    correct = np.asarray(correct, dtype=np.float64)
    if correct.ndim != 2 or correct.size == 0:
        raise ValueError(f"correct must be [problems, n] and non-empty, got shape {correct.shape}")
    problems, n = correct.shape
    counts = (correct > 0.5).sum(axis=1)
    out = {f"mean@{n}": float(correct.mean())}
    for k in ks or default_ks(n):
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in counts]))
    out[f"se(mean@{n})"] = (
        float(correct.mean(axis=1).std(ddof=1) / np.sqrt(problems)) if problems > 1 else 0.0
    )
    return out


def pass_at_k_curve(counts: Sequence[int], n: int, ks: Sequence[int]) -> np.ndarray:
    """``counts`` [problems] correct samples out of ``n`` → [problems, len(ks)] unbiased pass@k
    of each problem (the unbiased estimator, not 1 − (1 − c/n)^k, which is biased low)."""
    return np.array([[pass_at_k(n, int(c), k) for k in ks] for c in counts], dtype=np.float64)


def bootstrap_interval(
    per_problem: np.ndarray, resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap over problems of the mean of ``per_problem`` [problems, ...]: the
    problems are resampled with replacement (a seeded generator: the same interval every call);
    returns (low, high), each of shape ``per_problem.shape[1:]``."""
    values = np.asarray(per_problem, dtype=np.float64)
    if values.ndim < 1 or len(values) == 0:
        raise ValueError(f"per_problem must be [problems, ...] and non-empty, got {values.shape}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(resamples, len(values)))
    means = values[idx].mean(axis=1)  # [resamples, ...]
    tail = 100 * (1 - level) / 2
    return np.percentile(means, tail, axis=0), np.percentile(means, 100 - tail, axis=0)
