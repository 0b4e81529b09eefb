"""The one timing harness of every benchmark: paired, interleaved runs of two workloads and the
ratio of their costs with a 95% confidence interval, repeated until the interval is narrow
enough.

    from bench._timing import compare
    r = compare(mixed, plain, label="mixing / plain")   # each call returns its work units or None
    print(r)   # mixing / plain: cpu ratio 1.012 [0.998, 1.027] ...

Method (why each piece):

* **Pairs, interleaved, alternating order** (A B, B A, A B, ...): load from other processes and
  slow drifts (frequency, cache state) hit both members of a pair alike.
* **Blocks of two pairs** (A B then B A): each block's ratio is the geometric mean of its two
  pair ratios, which cancels a multiplicative first-/second-position effect exactly. The median of
  the pair ratios themselves would not: with a position effect they fall in two clusters and
  their median lands in either one.
* **Process CPU time** (``time.process_time``, all threads of this process) is the primary
  clock: on a shared machine wall time mostly measures waiting for a core. Wall time
  (``time.perf_counter``) is measured and reported alongside.
* **Per-block ratio, then the median** over blocks: robust to the occasional pair that a
  context switch storm or a page-fault burst inflates.
* **Distribution-free 95% interval of that median** from the blocks' order statistics (the sign
  test's interval, ``scipy.stats.quantile_test``): it holds for any distribution of independent
  blocks, is finite from 6 blocks (12 pairs) on and needs no random seed.
* **Stopping rule**: after ``min_pairs`` (20: ten blocks), stop as soon as the 99% interval lies
  within ``±precision`` of the ratio; give up at ``max_seconds`` (or ``max_pairs``) and say so
  (``converged`` False, printed as "did not reach ±1.5%"). Each look is a chance to stop on an
  interval narrow by luck, which would then under-cover: hence the stricter level for the
  decision and a look only after every ~20% more pairs. With the known ratios of
  ``tests/test_bench_timing.py`` the reported 95% interval covered the truth in 93-98% of 100
  runs each; the harness before (pair ratios, a bootstrap interval, the 95% interval deciding,
  from 10 pairs) covered one of them in 5 of 10 runs on a CI machine, and blocks with a
  bootstrap interval 72-97% here.

A workload may return its number of work units (e.g. generated tokens): the ratio is then one of
costs per unit (``cost``) or of units per second (``rate``, throughput ratios such as
tokens/s). Under ``torch.distributed`` pass ``group`` so that all ranks run the same number of
pairs (each rank's own clock is reported; the decision to stop is taken jointly).
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy.stats import quantile_test

from megatron_ngrpo.compat.notices import quiet_cpu_notices

# Every CPU benchmark imports this module before megatron: its output is the figures, not the
# libraries' CPU-only notices.
quiet_cpu_notices()

_BOOTSTRAP = 2000
STOP_LEVEL = 0.99


@dataclass
class Ratio:
    """A median ratio with its 95% interval (:func:`median_interval`, :func:`paired_median_ratio`)."""

    value: float
    lo: float
    hi: float

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.lo:.3f}, {self.hi:.3f}]"

    def half_width(self) -> float:
        """Largest relative distance of an interval end from the ratio."""
        return (
            max(self.hi / self.value - 1.0, 1.0 - self.lo / self.value)
            if self.value > 0
            else math.inf
        )


@dataclass
class Comparison:
    """Result of :func:`compare`: ``cpu`` (primary) and ``wall`` ratios with their 95% intervals,
    the per-call medians (seconds per unit), the number of pairs and whether ``cpu``'s stopping
    interval (``STOP_LEVEL``, half width ``stop_half_width``) reached the precision."""

    label: str
    kind: str
    cpu: Ratio
    wall: Ratio
    pairs: int
    converged: bool
    precision: float
    stop_half_width: float
    seconds: float
    a_cpu: float
    b_cpu: float
    samples: dict = field(default_factory=dict, repr=False)

    def __str__(self) -> str:
        stop = f"{100 * STOP_LEVEL:.0f}% CI"
        status = (
            f"{stop} within ±{100 * self.precision:.1f}%"
            if self.converged
            else f"{stop} did not reach ±{100 * self.precision:.1f}% in {self.seconds:.0f} s "
            f"(±{100 * self.stop_half_width:.1f}%)"
        )
        return (
            f"{self.label}: {self.kind} ratio {self.cpu} (cpu time; 95% CI of the median of "
            f"{self.pairs // 2} blocks of 2 pairs, {status}); wall {self.wall}"
        )

    def row(self) -> str:
        """Markdown table cells: ratio [lo, hi] | pairs | precision reached."""
        return f"{self.cpu} | {self.pairs} | {'yes' if self.converged else 'no (±%.1f%%)' % (100 * self.stop_half_width)}"


def median_interval(x: np.ndarray, level: float = 0.95) -> Ratio:
    """Median of ``x`` with its distribution-free ``level`` interval (order statistics); infinite
    with too few values for two order statistics to bracket the median that often (6 at 95%)."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return Ratio(math.nan, -math.inf, math.inf)
    value = float(np.median(x))
    ci = quantile_test(x, q=value, p=0.5).confidence_interval(level)  # nan bounds when too few
    if not (math.isfinite(ci.low) and math.isfinite(ci.high)):
        return Ratio(value, -math.inf, math.inf)
    return Ratio(value, float(ci.low), float(ci.high))


def paired_median_ratio(a: np.ndarray, b: np.ndarray, seed: int = 0) -> Ratio:
    """Median of a[i]/b[i] with a percentile-bootstrap 95% interval (pairs resampled): the
    summary across a few processes, too few for :func:`median_interval`'s bounds."""
    r = np.asarray(a, dtype=np.float64) / np.asarray(b, dtype=np.float64)
    value = float(np.median(r))
    if r.size < 2:
        return Ratio(value, -math.inf, math.inf)
    rng = np.random.default_rng(seed)
    meds = np.median(r[rng.integers(0, r.size, size=(_BOOTSTRAP, r.size))], axis=1)
    lo, hi = np.percentile(meds, [2.5, 97.5])
    return Ratio(value, float(lo), float(hi))


def compare(
    a: Callable[[], float | None],
    b: Callable[[], float | None],
    *,
    label: str = "a / b",
    kind: str = "cost",
    precision: float = 0.015,
    min_pairs: int = 20,
    max_pairs: int = 10_000,
    max_seconds: float = 300.0,
    warmup: int = 1,
    group=None,
) -> Comparison:
    """Time ``a`` and ``b`` in interleaved pairs until the CPU-time ratio's 95% interval is
    within ``±precision`` (or ``max_seconds`` / ``max_pairs`` pass).

    Args:
        a, b: workloads; each call returns its work units (a number; anything else counts 1).
        kind: "cost" → ratio of seconds per unit a/b (≤ 1 is better for a);
            "rate" → ratio of units per second a/b (≥ 1 is better for a).
        group: a torch.distributed group whose ranks call ``compare`` together (same pairs).
    """
    if kind not in ("cost", "rate"):
        raise ValueError(f"kind {kind!r}: expected 'cost' or 'rate'")
    for _ in range(warmup):
        a(), b()
    per = {"a": ([], []), "b": ([], [])}  # name -> (cpu s/unit, wall s/unit)
    start = time.perf_counter()
    order = (("a", a), ("b", b))
    look, done = min_pairs, False
    while True:
        for name, fn in order:
            c0, w0 = time.process_time(), time.perf_counter()
            units = fn()
            c1, w1 = time.process_time(), time.perf_counter()
            units = float(units) if isinstance(units, numbers.Real) else 1.0
            per[name][0].append(max(c1 - c0, 1e-9) / units)
            per[name][1].append(max(w1 - w0, 1e-9) / units)
        order = order[::-1]
        n = len(per["a"][0])
        elapsed = time.perf_counter() - start
        stop = n >= max_pairs or elapsed >= max_seconds
        if (n >= look and n % 2 == 0) or stop:
            look = max(n + 2, math.ceil(1.2 * n))
            stop_ratio = _ratio(per, 0, kind, STOP_LEVEL)
            done = n >= min_pairs and stop_ratio.half_width() <= precision
            stop = stop or done
        if _joint_continue(not stop, group) is False:
            break  # only after a look of this rank's: stop_ratio is of the final n
    return Comparison(
        label=label,
        kind=kind,
        cpu=_ratio(per, 0, kind),
        wall=_ratio(per, 1, kind),
        pairs=n,
        converged=done,
        precision=precision,
        stop_half_width=stop_ratio.half_width(),
        seconds=elapsed,
        a_cpu=float(np.median(per["a"][0])),
        b_cpu=float(np.median(per["b"][0])),
        samples={k: (list(c), list(w)) for k, (c, w) in per.items()},
    )


def _ratio(per: dict, clock: int, kind: str, level: float = 0.95) -> Ratio:
    """Median over complete A B / B A blocks of the geometric mean of their two pair ratios."""
    a, b = np.array(per["a"][clock]), np.array(per["b"][clock])
    m = len(a) // 2 * 2
    pair = a[:m] / b[:m] if kind == "cost" else b[:m] / a[:m]
    return median_interval(np.sqrt(pair[0::2] * pair[1::2]), level)


def _joint_continue(mine: bool, group) -> bool:
    """True while any rank of ``group`` wants more pairs (all ranks stop together)."""
    if group is None:
        return mine
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if mine else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
