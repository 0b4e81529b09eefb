"""``mix_rows`` (mixing/arithmetic.py), the one arithmetic of a 16-bit mixed row that vLLM's hook
and the trainer share: the same bits whatever the process's matmul settings (TF32) and whatever
the batch a row is mixed in. Both GPU effects are emulated on CPU with a TorchFunctionMode that
alters every GEMM, so a GEMM-based ``mix_rows`` fails here; the positive controls show that the
emulation changes a GEMM's rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_ngrpo.mixing.arithmetic import mix_rows
from tests.harness.reference import tf32

GEMMS = {
    torch.bmm, torch.mm, torch.matmul, torch.einsum, torch.baddbmm, torch.addmm, torch.addbmm,
    torch.Tensor.bmm, torch.Tensor.mm, torch.Tensor.matmul, torch.Tensor.__matmul__,
    torch.nn.functional.linear,
}  # fmt: skip


class _TF32Gemms(TorchFunctionMode):
    """Every GEMM rounds its fp32 inputs to TF32, as cuBLAS does under
    ``torch.set_float32_matmul_precision("high")`` (vLLM's GPU worker sets it process-wide)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            args = [tf32(a) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a
                    for a in args]  # fmt: skip
        return func(*args, **(kwargs or {}))


class _BatchedGemmsSumBackwards(TorchFunctionMode):
    """A batched product of more than one matrix sums its k terms in the reverse order (another
    valid order, as cuBLAS may pick another kernel per batch size)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.bmm, torch.Tensor.bmm) and args[0].shape[0] > 1:
            a, b = args[0], args[1]
            return func(a.flip(-1), b.flip(-2))
        return func(*args, **(kwargs or {}))


def _inputs(m: int, k: int, h: int, dtype: torch.dtype, seed: int = 0):
    """Candidate rows [m, k, h] in ``dtype``, softmax weights [m, k] and STHT-sized noise [m, h]."""
    g = torch.Generator().manual_seed(seed)
    cand = torch.randn(m, k, h, generator=g).to(dtype)
    weights = torch.softmax(torch.randn(m, k, generator=g) * 2, -1)
    noise = torch.randn(m, h, generator=g) * 1e-3
    return cand, weights, noise


def _gemm_mixture(cand, weights):
    """The fp32 mixture [M, h] as one batched GEMM (the formulation ``mix_rows`` must not use)."""
    return torch.bmm(weights.unsqueeze(1), cand.float()).squeeze(1)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_rows_are_the_fixed_order_fp32_sum(dtype):
    """fp32 products and sums in candidate order, ((w0·c0 + w1·c1) + w2·c2) + noise, rounded once:
    bit for bit a float32 numpy evaluation of that expression."""
    cand, weights, noise = _inputs(512, 3, 64, dtype)
    c, w = cand.float().numpy(), weights.numpy()
    want = w[:, 0, None] * c[:, 0]
    for j in (1, 2):
        want = want + w[:, j, None] * c[:, j]
    want = torch.from_numpy(want + noise.numpy()).to(dtype)
    assert want.dtype == dtype and w.dtype == np.float32
    assert torch.equal(_bits(mix_rows(cand, weights, noise)), _bits(want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_rows_ignore_tf32_matmuls(dtype):
    """One side with TF32 matmuls (GPU "high" precision, emulated): the same 16-bit rows."""
    cand, weights, noise = _inputs(2000, 3, 64, dtype, seed=1)
    plain, gemm = mix_rows(cand, weights, noise), _gemm_mixture(cand, weights)
    with _TF32Gemms():
        under_tf32, gemm_tf32 = mix_rows(cand, weights, noise), _gemm_mixture(cand, weights)
    differ = int((_bits(plain) != _bits(under_tf32)).any(-1).sum())
    assert differ == 0, f"{differ} of 2000 {dtype} rows differ under TF32"
    assert (gemm != gemm_tf32).any(-1).float().mean() > 0.5  # the emulation bites a GEMM


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_rows_do_not_depend_on_the_batch(dtype):
    """Rows mixed one at a time (a decode step with one mixed row) equal rows mixed 512 at a time
    (a micro-batch), bit for bit, also when a batched GEMM would sum in another order."""
    cand, weights, noise = _inputs(512, 4, 64, dtype, seed=2)
    with _BatchedGemmsSumBackwards():
        together = mix_rows(cand, weights, noise)
        alone = torch.cat([mix_rows(cand[i : i + 1], weights[i : i + 1], noise[i : i + 1])
                           for i in range(512)])  # fmt: skip
        gemm_alone = torch.cat([_gemm_mixture(cand[i : i + 1], weights[i : i + 1])
                                for i in range(512)])  # fmt: skip
        gemm_together = _gemm_mixture(cand, weights)
    assert torch.equal(_bits(together), _bits(alone))
    assert not torch.equal(gemm_together, gemm_alone)  # the emulation bites a GEMM
