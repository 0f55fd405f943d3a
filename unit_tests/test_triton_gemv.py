"""The batch-1 GEMV (aiter_triton's linear layers at one row) against torch, on the CPU through Triton's
interpreter (float16 and float32; bf16 on the GPU: scripts/bench_gemv.py, tests/test_kernels.py)."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = r'''
import torch
from autoprofile.kernels import triton_gemv

torch.manual_seed(0)
for n, k, bias, dtype in [(6, 4096, False, torch.float32), (37, 2050, True, torch.float32),
                          (64, 100, True, torch.float16), (3, 5000, False, torch.float16)]:
    w = (torch.randn(n, k) * k ** -0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    x = torch.randn(1, k).to(dtype)
    got = triton_gemv.linear(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float() if bias else None)
    assert got.shape == (1, n) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    assert torch.allclose(got.float(), want, rtol=tol, atol=tol), (n, k, (got.float() - want).abs().max())
    assert triton_gemv.gemv(x[0], w, b).shape == (n,)
    # the residual add in the epilogue, in place (TP.linear_add at one row)
    res = torch.randn(1, n).to(dtype)
    want_add = want + res.float()
    out = triton_gemv.linear_add(x, w, res) if b is None else triton_gemv.gemv(x, w, b, residual=res)
    assert out is res and torch.allclose(res.float(), want_add, rtol=tol, atol=tol), (n, k)
# more than one row, or a strided row: cuBLAS (F.linear), the same values
x, w = torch.randn(3, 64), torch.randn(8, 64)
assert torch.equal(triton_gemv.linear(x, w), torch.nn.functional.linear(x, w))
rows_res = torch.randn(3, 8)
want = rows_res + torch.nn.functional.linear(x, w)
assert triton_gemv.linear_add(x, w, rows_res) is rows_res and torch.allclose(rows_res, want, atol=1e-5)
col = torch.randn(64, 2)[:, :1].T  # one row, not contiguous
assert torch.allclose(triton_gemv.linear(col, w), col @ w.T, atol=1e-5)
# an fp32 router (DeepSeek's): x read in its own dtype, fp32 logits; more rows: F.linear over x in fp32
w = torch.randn(64, 2048) * 2048 ** -0.5
x = torch.randn(1, 2048).to(torch.float16)
got = triton_gemv.router_linear(x, w)
want = torch.nn.functional.linear(x.float(), w)
assert got.dtype == torch.float32 and got.shape == (1, 64)
assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
rows = torch.randn(5, 2048).to(torch.float16)
assert torch.equal(triton_gemv.router_linear(rows, w), torch.nn.functional.linear(rows.float(), w))
print("ok")
'''


def test_the_one_row_gemv_equals_torch_and_more_rows_go_to_torch():
    run_script(CHECK)
