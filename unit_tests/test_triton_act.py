"""The fused SiLU * up Triton kernel (aiter_triton's silu_mul) against the torch reference, on the CPU through
Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the flag is read when the kernel module is
imported). The interpreter has no bfloat16: float16 and float32 here, bf16 on the GPU
(tests/test_kernels.py)."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = r'''
import torch
from autoprofile.kernels import triton_act
from autoprofile.engine.attention.torch_sdpa import TorchBackend

torch.manual_seed(0)
ref = TorchBackend(2, 1, 8, 16, torch.float32, torch.device("cpu"))
for dtype, rows, inter in [(torch.float32, 1, 37), (torch.float32, 300, 1000), (torch.float16, 7, 1024 + 3),
                           (torch.float32, 5, 2048)]:
    x = torch.randn(rows, 2 * inter, dtype=dtype) * 4
    got = triton_act.silu_mul(x)
    want = ref.silu_mul(x.float())
    assert got.shape == (rows, inter) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got.float(), want, **tol)
    first = triton_act.silu_mul(x[:1])  # a row's value does not depend on the row count
    assert torch.equal(first, got[:1])
x = torch.randn(3, 4, 2 * 64)  # leading dims kept
assert triton_act.silu_mul(x).shape == (3, 4, 64)
assert triton_act.silu_mul(torch.empty(0, 128)).shape == (0, 64)
print("ok")
'''


def test_fused_silu_mul_matches_the_torch_ops():
    run_script(CHECK)
