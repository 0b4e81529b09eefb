"""Neighbour-table build vs faiss-cpu exact search (IndexFlatIP on normalised rows = cosine).

    OMP_NUM_THREADS=1 python bench/bench_neighbors.py [--vocab 32768 --dim 512 --queries 4096]

Both run single-threaded on the same query slice of one random [V, d] fp32 matrix, alternating;
times are process CPU seconds (on a shared machine wall time mostly measures waiting for a core;
wall is printed too). The ratio is faiss time / ours (≥ 0.8 is the goal, i.e. our throughput at
least 0.8× faiss's). Ours includes
the float64 certification that makes the table exact. Peak memory is the growth of the process's
peak RSS during the build. Then the Qwen2.5-1.5B shape (V=151936, d=1536) is timed on a query
slice and extrapolated to the full table.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ngrpo.mixing.neighbors import build_neighbor_table  # noqa: E402


def rss_mb() -> float:
    """Current resident set size (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn):
    """(cpu seconds, wall seconds, result)."""
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - c0, time.perf_counter() - w0, out


def ours(w: torch.Tensor, k: int, queries: int, chunk: int):
    return timed(lambda: build_neighbor_table(w, 0, k, "cosine", chunk_size=chunk, rows=(0, queries)))


def faiss_search(w: torch.Tensor, k: int, queries: int):
    import faiss

    faiss.omp_set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    x = torch.nn.functional.normalize(w, dim=1).numpy()

    def run():
        index = faiss.IndexFlatIP(x.shape[1])
        index.add(x)
        return torch.from_numpy(index.search(x[:queries], k)[1])

    return timed(run)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--queries", type=int, default=4096)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--qwen-queries", type=int, default=1024)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"threads {torch.get_num_threads()}, V={args.vocab}, d={args.dim}, queries {args.queries}, "
          f"k={args.k}, chunk {args.chunk}")

    w = torch.randn(args.vocab, args.dim, generator=torch.Generator().manual_seed(0))
    ours(w, args.k, 64, args.chunk)  # warm-up
    base, peak0 = rss_mb(), peak_rss_mb()
    t_ours, t_faiss = [], []
    for _ in range(args.reps):  # alternate so machine load hits both alike
        *t, table = ours(w, args.k, args.queries, args.chunk)
        t_ours.append(t)
        *t, ids = faiss_search(w, args.k, args.queries)
        t_faiss.append(t)
    agree = float((table[:, 0] == torch.arange(args.queries)).double().mean())
    same = float((table == ids).all(1).double().mean())
    extra = max(0.0, peak_rss_mb() - max(base, peak0))
    bound = (4 * args.chunk * args.vocab + 4 * args.vocab * args.dim) / 2**20
    (c_ours, w_ours), (c_faiss, w_faiss) = min(t_ours), min(t_faiss)
    print(f"ours : cpu {c_ours:.2f} s ({args.queries / c_ours:.0f} rows/s), wall {w_ours:.2f} s")
    print(f"faiss: cpu {c_faiss:.2f} s ({args.queries / c_faiss:.0f} rows/s), wall {w_faiss:.2f} s")
    print(f"throughput ratio ours/faiss = {c_faiss / c_ours:.2f}x by cpu time, {w_faiss / w_ours:.2f}x by wall "
          f"(goal >= 0.8x); rows identical to faiss {100 * same:.1f}% (anchor first {100 * agree:.0f}%)")
    print(f"peak RSS growth during builds {extra:.0f} MiB (docstring bound: scores + normalised copy "
          f"{bound:.0f} MiB + small buffers)")

    v, d, q = 151936, 1536, args.qwen_queries
    wq = torch.randn(v, d, generator=torch.Generator().manual_seed(1))
    t, wall, _ = ours(wq, args.k, q, args.chunk)
    print(f"Qwen2.5-1.5B shape V={v}, d={d}: {q} rows in cpu {t:.1f} s (wall {wall:.1f} s) -> full table "
          f"≈ {t * v / q / 60:.1f} cpu-min on one core (≈ {t * v / q / 60 / 8:.1f} min split over 8 ranks)")


if __name__ == "__main__":
    main()
