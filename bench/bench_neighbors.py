"""Neighbour-table build vs faiss-cpu exact search (IndexFlatIP on normalised rows = cosine).

    OMP_NUM_THREADS=1 python -m bench.bench_neighbors [--vocab 16384 --slice-vocab 32768 --dim 512]

Both run single-threaded on the same random fp32 matrix, timed in interleaved pairs by
``bench/_timing.py`` (process CPU time, median ratio over A B / B A blocks with its 95% interval,
repeated until ±1.5%). The ratio printed is throughput ours / faiss (a "rate" ratio; goal
≥ 1.0). Ours includes the certification that makes the table exact (its scoring screen is bf16
where this CPU's bf16 GEMM times faster than its fp32 one, fp32 otherwise; faiss scores in
fp32); the result is checked equal to faiss's ids.

1. The full table (every row a query, V = --vocab): the single-rank path, which scores each pair
   once (the cosine matrix is symmetric), against faiss's search of all rows.
2. A query slice (--queries rows of V = --slice-vocab): the general path that tensor- and
   data-parallel ranks run on their share, against faiss's search of the same rows.
3. Memory: peak RSS growth of a full build (measured first, in a fresh process state).
4. Qwen2-1.5B shape (V=151936, d=1536): a query slice through the general path, extrapolated to
   the full table (an upper bound for the single-rank path, which does half the matmul work).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench._timing import compare
from megatron_ngrpo.mixing.gemm_cpu import screen_dtype
from megatron_ngrpo.mixing.neighbors import build_neighbor_table


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def blas_cores() -> dict[str, str]:
    """Kernel family ("core") each loaded OpenBLAS chose, by library file name."""
    import ctypes

    cores = {}
    for path in sorted(
        {line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.lower()}
    ):
        lib = ctypes.CDLL(path)
        for name in (
            "openblas_get_corename",
            "scipy_openblas_get_corename64_",
            "openblas_get_corename64_",
        ):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                cores[Path(path).name] = fn().decode()
                break
    return cores


def same_blas_kernels() -> None:
    """faiss-cpu's bundled OpenBLAS (0.3.15) does not recognise some (virtual) CPUs and falls
    back to generic kernels ("Prescott", ~4× slower sgemm here) where numpy's OpenBLAS picks
    the right ones: re-run with OPENBLAS_CORETYPE set to numpy's choice so that both sides use
    the same kernels."""
    import faiss  # noqa: F401  (loads its OpenBLAS)

    cores = blas_cores()
    print(f"OpenBLAS kernels: {cores}", flush=True)
    if len(set(cores.values())) > 1 and "OPENBLAS_CORETYPE" not in os.environ:
        core = next(c for lib, c in cores.items() if "scipy" in lib or "numpy" in lib)
        print(f"re-running with OPENBLAS_CORETYPE={core}", flush=True)
        os.execve(
            sys.executable, [sys.executable, *sys.argv], {**os.environ, "OPENBLAS_CORETYPE": core}
        )


def faiss_ids(w: torch.Tensor, k: int, queries: int) -> torch.Tensor:
    import faiss

    x = torch.nn.functional.normalize(w, dim=1).numpy()
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    return torch.from_numpy(index.search(x[:queries], k)[1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--slice-vocab", type=int, default=32768)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--queries", type=int, default=4096)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--qwen-queries", type=int, default=1024)
    p.add_argument("--max-seconds", type=float, default=200.0)
    args = p.parse_args()
    same_blas_kernels()
    import faiss

    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)
    screen = screen_dtype(torch.device("cpu"), "cosine")
    print(
        f"threads {torch.get_num_threads()}, d={args.dim}, k={args.k}, chunk {args.chunk}, "
        f"scoring screen {screen} (faiss: fp32)",
        flush=True,
    )

    w = torch.randn(args.vocab, args.dim, generator=torch.Generator().manual_seed(0))
    base = rss_mb()
    table = build_neighbor_table(w, 0, args.k, "cosine", chunk_size=args.chunk)
    extra = peak_rss_mb() - base
    same = torch.equal(table, faiss_ids(w, args.k, args.vocab))
    print(
        f"full table V={args.vocab}: identical to faiss: {same}; peak RSS growth {extra:.0f} MiB "
        f"(bound: scores {screen.itemsize * args.chunk * args.vocab / 2**20:.0f} + normalised copy "
        f"{screen.itemsize * args.vocab * args.dim / 2**20:.0f} MiB + small buffers)",
        flush=True,
    )
    r = compare(
        lambda: build_neighbor_table(w, 0, args.k, "cosine", chunk_size=args.chunk),
        lambda: faiss_ids(w, args.k, args.vocab),
        kind="rate",
        label=f"full table V={args.vocab}, throughput ours / faiss",
        max_seconds=args.max_seconds,
    )
    print(r, f"| ours {r.a_cpu:.2f} s, faiss {r.b_cpu:.2f} s (goal >= 1.0)", flush=True)
    x = torch.nn.functional.normalize(w, dim=1).numpy()
    c0 = time.process_time()
    np.matmul(x, x.T)
    print(
        f"for scale: one bare sgemm of all V x V scores (numpy) {time.process_time() - c0:.2f} s cpu",
        flush=True,
    )

    ws = torch.randn(args.slice_vocab, args.dim, generator=torch.Generator().manual_seed(1))
    q = args.queries
    sl = build_neighbor_table(ws, 0, args.k, "cosine", chunk_size=args.chunk, rows=(0, q))
    print(
        f"query slice {q} of V={args.slice_vocab}: identical to faiss: {torch.equal(sl, faiss_ids(ws, args.k, q))}"
    )
    r = compare(
        lambda: build_neighbor_table(ws, 0, args.k, "cosine", chunk_size=args.chunk, rows=(0, q)),
        lambda: faiss_ids(ws, args.k, q),
        kind="rate",
        label=f"query slice {q} of V={args.slice_vocab}, throughput ours / faiss",
        max_seconds=args.max_seconds,
    )
    print(r, f"| ours {r.a_cpu:.2f} s, faiss {r.b_cpu:.2f} s", flush=True)

    v, d, q = 151936, 1536, args.qwen_queries
    wq = torch.randn(v, d, generator=torch.Generator().manual_seed(2))
    base = rss_mb()
    c0, w0 = time.process_time(), time.perf_counter()
    build_neighbor_table(wq, 0, args.k, "cosine", chunk_size=args.chunk, rows=(0, q))
    t, wall = time.process_time() - c0, time.perf_counter() - w0
    print(
        f"Qwen2-1.5B shape V={v}, d={d}: {q} query rows (general path) in cpu {t:.1f} s (wall {wall:.1f} s), "
        f"peak RSS growth {peak_rss_mb() - base:.0f} MiB -> full table, extrapolated: general path "
        f"≈ {t * v / q / 60:.1f} cpu-min on one core, single-rank symmetric path ≈ {t * v / q / 120:.1f} "
        f"cpu-min (half the matmul work; not measured at this shape)"
    )


if __name__ == "__main__":
    main()
