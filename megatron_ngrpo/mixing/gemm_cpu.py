"""The screen matmul of the neighbour search (`topk_certified`): which dtype it runs in and the
CPU GEMM that runs it. Exactness never depends on these choices: the certificate's error bound
follows the dtype and the input rounding of the matmul (`input_roundoff`)."""

from __future__ import annotations

import functools
import math
import time

import numpy as np
import torch

# Metrics whose score is the bare product q·r (of normalised rows under cosine): the bf16 screen
# applies, and the fp32 score matrix is symmetric (the full single-rank table scores each pair once).
PRODUCT_METRICS = ("cosine", "dot")


def screen_dtype(device: torch.device, metric: str) -> torch.dtype:
    """dtype of the scoring matmul: bf16 (with fp32 accumulation) on CPUs where that GEMM runs
    faster than the fp32 one, for the matmul metrics whose score is the bare product (cosine,
    dot); fp32 otherwise. Exactness does not depend on it: the certificate's bound follows the
    dtype. GPUs keep fp32 (TF32 per torch's setting, `input_roundoff`)."""
    if device.type != "cpu" or metric not in PRODUCT_METRICS or not cpu_bf16_matmul_is_faster():
        return torch.float32
    return torch.bfloat16


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


def input_roundoff(device: torch.device) -> float:
    """Unit roundoff to which an fp32 matmul on ``device`` rounds its inputs: 0 for IEEE fp32
    products (CPU: numpy's BLAS), 2^-11 under TF32 (``torch.set_float32_matmul_precision("high")``,
    ``allow_tf32``, or torch >= 2.9's ``fp32_precision = "tf32"``; bf16x3 is more accurate),
    2^-8 under "medium" / ``"bf16"`` (bf16 inputs)."""
    if device.type != "cuda":
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
    torch's MKL sgemm is ~10% slower, and this matmul is nearly all of the table's cost."""
    if out.device.type == "cpu" and out.dtype == torch.float32:
        np.matmul(a.numpy(), b.numpy(), out=out.numpy())
    else:
        torch.mm(a, b, out=out)
