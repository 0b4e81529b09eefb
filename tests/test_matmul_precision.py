"""The neighbour table's error bound reads the GPU matmul precision (mixing/gemm_cpu.py
``input_roundoff``) under torch's legacy flags and torch >= 2.9's ``fp32_precision`` API, where
reading a legacy flag after the new API was used raises. Each setting in a fresh process (the
flags are process-wide); the function reads flags only, so no GPU is needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    ("", 0.0),
    ("torch.backends.cuda.matmul.allow_tf32 = True", 2.0**-11),
    ("torch.set_float32_matmul_precision('high')", 2.0**-11),
    ("torch.set_float32_matmul_precision('medium')", 2.0**-8),
    ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", 2.0**-11),
    ("torch.backends.fp32_precision = 'tf32'", 2.0**-11),
    ("torch.backends.fp32_precision = 'bf16'", 2.0**-8),
    ("torch.backends.cuda.matmul.fp32_precision = 'ieee'", 0.0),
]


@pytest.mark.parametrize("setting,roundoff", CASES, ids=[c[0] or "default" for c in CASES])
def test_input_roundoff_under_every_precision_api(setting, roundoff):
    code = (
        "import torch\nfrom megatron_ngrpo.mixing.gemm_cpu import input_roundoff\n"
        + setting
        + "\nprint(repr(input_roundoff('cuda')), repr(input_roundoff('cpu')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [repr(roundoff), "0.0"]
