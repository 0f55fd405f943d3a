"""Our RMSNorm Triton kernel against the torch reference backend, on the CPU
through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the flag is read when the kernel module
is imported). The interpreter has no bfloat16: float16 and float32 here, bf16 on the GPU
(tests/test_kernels.py)."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = r'''
import torch
from autoprofile.kernels import triton_norm
from autoprofile.engine.attention.torch_sdpa import TorchBackend

torch.manual_seed(0)
for dtype, rows, n in [(torch.float32, 1, 4096), (torch.float32, 300, 37), (torch.float16, 7, 3584),
                       (torch.float32, 130, 128)]:
    ref = TorchBackend(2, 1, 8, 16, dtype, torch.device("cpu"))
    x = torch.randn(rows, n, dtype=dtype) * 3
    w = torch.randn(n, dtype=dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    got = triton_norm.rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, ref.rms_norm(x, w, 1e-6), **tol)
    assert torch.equal(triton_norm.rms_norm(x[:1], w, 1e-6), got[:1])  # a row does not depend on the rows
x = torch.randn(2, 3, 64)
assert triton_norm.rms_norm(x, torch.ones(64), 1e-6).shape == (2, 3, 64)
strided = torch.randn(4, 128)[:, :64]
assert triton_norm.rms_norm(strided, torch.ones(64), 1e-6).shape == (4, 64)
print("ok")
'''


def test_rms_norm_matches_the_torch_reference():
    run_script(CHECK)
