"""Pass@k (unbiased estimator) and Mean@n (N-GRPO paper §4.1; Chen et al. 2021)."""

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
