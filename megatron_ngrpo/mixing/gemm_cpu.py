"""The screen matmul of the neighbour search (`topk_certified`): which dtype it runs in and the
GEMM that runs it (numpy's BLAS for fp32 on CPU, torch otherwise). Exactness never depends on
these choices: the certificate's error bound follows the dtype and the input rounding of the
matmul (`input_roundoff`)."""

from __future__ import annotations

import contextlib
import functools
import math
import time

import numpy as np
import torch

# Metrics whose score is the bare product q·r (of normalised rows under cosine): the bf16 screen
# applies, and the fp32 score matrix is symmetric (the full single-rank table scores each pair once).
PRODUCT_METRICS = ("cosine", "dot")


def screen_dtype(device_type: str, metric: str) -> torch.dtype:
    """dtype of the scoring matmul of key rows on a ``device_type`` device ("cpu", "cuda", ...):
    bf16 (fp32 accumulation, one rounding: see `mm_into`) for the matmul metrics whose score is
    the bare product (cosine, dot) on CUDA and on CPUs where that GEMM runs faster than the fp32
    one; fp32 otherwise. On a GPU the bf16 screen is the fast one: at the 7B shape (152,064 ×
    3,584, cosine, k = 3) on an H200 the fp32 screen's table took 4.23 s, a bf16 screen with its
    top candidates re-scored in fp32 0.43 s. Exactness does not depend on it: the certificate's
    bound follows the dtype, and candidates are re-scored in fp32 (float64 on near-ties)."""
    if metric not in PRODUCT_METRICS:
        return torch.float32
    if device_type == "cuda" or (device_type == "cpu" and cpu_bf16_matmul_is_faster()):
        return torch.bfloat16
    return torch.float32


@functools.cache
def cpu_bf16_matmul_is_faster() -> bool:
    """Whether the bf16 screen's GEMM (torch, oneDNN) beats the fp32 one (`mm_into`: numpy's
    BLAS) on this CPU, timed once per process (~50 ms). The instruction flags do not decide it:
    with AVX512-BF16, bf16 ran 2.2× fp32's FLOP rate on the AMD EPYC machines here and 0.55-0.63×
    on an Intel Xeon VM (no AMX), where the bf16 screen made the full table 0.73× faiss's
    throughput. Without bf16 instructions torch emulates bf16 and the timing says so too. Its own
    generator: the global RNG stream stays as it was."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, 2048, generator=g)
    best = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16):
        x, y, out = a.to(dtype), b.to(dtype), torch.empty(256, 2048, dtype=dtype)
        mm_into(x, y, out)  # warm-up
        for _ in range(2):
            t0 = time.perf_counter()
            mm_into(x, y, out)
            best[dtype] = min(best.get(dtype, math.inf), time.perf_counter() - t0)
    return best[torch.bfloat16] < best[torch.float32]


def input_roundoff(device_type: str) -> float:
    """Unit roundoff to which an fp32 matmul on a ``device_type`` device rounds its inputs: 0 for
    IEEE fp32 products (CPU: numpy's BLAS), 2^-11 under TF32 (``torch.set_float32_matmul_precision("high")``,
    ``allow_tf32``, or torch >= 2.9's ``fp32_precision = "tf32"``; bf16x3 is more accurate),
    2^-8 under "medium" / ``"bf16"`` (bf16 inputs)."""
    if device_type != "cuda":
        return 0.0
    # torch >= 2.9: once the new fp32_precision API was used, reading the legacy flags raises;
    # the new one is always readable ("none": the backend-wide setting), and reflects legacy "high".
    mode = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if mode == "none":
        mode = torch.backends.fp32_precision
    try:
        legacy = torch.get_float32_matmul_precision()
        tf32 = torch.backends.cuda.matmul.allow_tf32
    except RuntimeError:
        legacy, tf32 = None, False
    if mode == "bf16" or legacy == "medium":
        return 2.0**-8
    if mode == "tf32" or legacy == "high" or tf32:
        return 2.0**-11
    return 0.0


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b. fp32 on CPU through numpy's BLAS (OpenBLAS): on the AMD EPYC machines here
    torch's MKL sgemm is ~10% slower, and this matmul is nearly all of the table's cost. Other
    cases through torch with full-precision reductions (`_fp32_reductions`)."""
    if out.device.type == "cpu" and out.dtype == torch.float32:
        np.matmul(a.numpy(), b.numpy(), out=out.numpy())
        return
    with _fp32_reductions():
        torch.mm(a, b, out=out)


@contextlib.contextmanager
def _fp32_reductions():
    """cuBLAS may reduce a bf16 GEMM in reduced precision (torch's
    ``allow_bf16_reduced_precision_reduction``, on by default: split-K partial sums in bf16),
    where the certificate's bound assumes fp32 accumulation and one rounding of the result; off
    within the block (split-K with fp32 reductions stays allowed), the setting restored after.
    The flag is process-wide: a bf16 GEMM of another thread in the block reduces in fp32 too.
    Off CUDA the flag is read by nothing."""
    matmul = torch.backends.cuda.matmul
    # torch >= 2.8 keeps (reduced precision, split-K) together; earlier ones have the bool only
    split_k = getattr(matmul, "allow_bf16_reduced_precision_reduction_split_k", None)
    saved = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = (
            saved if split_k is None else (saved, split_k)
        )
