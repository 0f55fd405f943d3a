"""The skinny FP8 GEMM (kernels.triton_fp8_skinny: 2 to 64 rows, each weight byte read once) on the CPU
through Triton's interpreter, against layers.quant's dequantized references: rows 1, 3, 16, 32 (and 64),
ragged N and K, per-channel and block scales (128 x 128 and a 64 x 128 block), activations in the model's
dtype (W8A16) or quantized per row or per K group (Fp8Rows), bias, and the residual added in the epilogue.
Then triton_fp8.linear's dispatch: the default rule keeps the quantize + GEMM path, a table sends rows to the
skinny GEMM. The interpreter has no bfloat16: float32/float16 here."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script
from unit_tests.test_triton_fp8 import FP8_CAST

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SETUP = FP8_CAST + r'''
import torch
from autoprofile.kernels import launch_rules, triton_fp8, triton_fp8_skinny as s
from autoprofile.kernels.launch_rules import SkinnyLaunch
from autoprofile.layers import quant as q
from autoprofile.layers.quant import Fp8Rows, Fp8Scheme as Scheme

torch.manual_seed(0)
CHANNEL, BLOCK = Scheme("channel"), Scheme("block", (128, 128), "group")
BLOCK_TOKEN, TALL = Scheme("block", (128, 128), "token"), Scheme("block", (64, 128), "group")
# block_k 64: two K steps a scale block (a wrong block index shows); 256: capped by the block's K
LAUNCHES = (SkinnyLaunch(16, 64, 4, 1), SkinnyLaunch(32, 256, 4, 2))


def weight(n, k, scheme):
    wq, ws = q.quantize_weight(torch.randn(n, k) * k ** -0.5, scheme)
    block = tuple(scheme.block) if scheme.weight == "block" else None
    return wq, (ws if block else ws.reshape(n)), block, q.dequantize_weight(wq, ws, scheme)


def rows_of(x, scheme):
    if scheme.activation == "group":
        return Fp8Rows(*q.quantize_per_group(x.float(), scheme.block[1]), x.dtype)
    return Fp8Rows(*q.quantize_per_token(x.float()), x.dtype)


def close(got, want, tol, what):
    err = float((got.float() - want).abs().max())
    assert err <= tol * (1 + float(want.abs().max())), (what, err)


def check_rows(product, n, k, m, scheme, launch):
    """product(x, x_scale, weight, weight_scale, block, dtype, launch, bias) against the dequantized
    reference: W8A16 rows in the model's dtype (not quantized), then W8A8 rows a producer quantized (a
    scale a row, or a K group's)."""
    wq, ws, block, deq = weight(n, k, scheme)
    bias = torch.randn(n)
    what = (n, k, scheme.weight, scheme.block, scheme.activation, m, launch)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        x = torch.randn(m, k).to(dtype)
        got = product(x, None, wq, ws, block, dtype, launch, bias.to(dtype))
        assert got.shape == (m, n) and got.dtype == dtype
        close(got, x.float() @ deq.T + bias.to(dtype).float(), tol, what + (dtype,))
    rows = rows_of(torch.randn(m, k), scheme)
    got = product(rows.q, rows.scale, wq, ws, block, torch.float32, launch, bias)
    close(got, q.fp8_linear_reference(rows, wq, ws, scheme, bias=bias), 1e-5, what + ("fp8",))
'''

KERNEL = SETUP + r'''
for n, k in [(37, 300), (130, 1000), (256, 128)]:
    for scheme in (CHANNEL, BLOCK, BLOCK_TOKEN, TALL):
        for m in (1, 3, 16, 32):
            for launch in LAUNCHES:
                check_rows(s.gemm, n, k, m, scheme, launch)
# 64 rows, the widest tile; the residual added in the epilogue, in place
wq, ws, block, deq = weight(96, 520, BLOCK)
x, res = torch.randn(64, 520), torch.randn(64, 96)
keep = res.clone()
out = s.gemm(x, None, wq, ws, block, torch.float32, LAUNCHES[0], residual=res)
assert out is res
close(res, keep + x @ deq.T, 1e-5, "residual")
# a strided input: rows of a wider tensor, through linear
wide = torch.randn(5, 700)
got = s.linear(wide[:, :520], wq, ws, block, LAUNCHES[1])
close(got, wide[:, :520] @ deq.T, 1e-5, "strided")
print("ok")
'''

DISPATCH = SETUP + r'''
calls = []
skinny = s.linear


def counted(*args, **kw):
    calls.append(args[4])
    return skinny(*args, **kw)


triton_fp8.triton_fp8_skinny.linear = counted
n, k = 130, 1000
for scheme in (CHANNEL, BLOCK):
    wq, ws, block, deq = weight(n, k, scheme)
    wscale = ws
    x = torch.randn(8, k).half()
    # the default table: today's path (quantize + GEMM), bit for bit, and no skinny call
    launch_rules.FP8_SKINNY_LAUNCHES = launch_rules.FP8_SKINNY_BLOCK_LAUNCHES = ()
    launch_rules.FP8_GEMV_ROWS_LAUNCHES = launch_rules.FP8_GEMV_ROWS_BLOCK_LAUNCHES = ()
    today = triton_fp8.linear(x, wq, wscale, scheme)
    assert not calls
    assert torch.equal(today, triton_fp8.gemm(*q.quantize_per_token(x.float()) if scheme is CHANNEL
                                              else q.quantize_per_group(x.float(), 128),
                                              wq, ws, block, torch.float16))
    # a table that takes up to 16 rows: 8 rows go to the skinny GEMM (W8A16: x not quantized), 17 do not
    table = ((16, SkinnyLaunch(64, 128, 4, 1)), (64, None))
    if scheme is BLOCK:  # each layout reads its own table
        launch_rules.FP8_SKINNY_LAUNCHES = table
        triton_fp8.linear(x.unsqueeze(0), wq, wscale, scheme)
        assert not calls
        launch_rules.FP8_SKINNY_BLOCK_LAUNCHES, launch_rules.FP8_SKINNY_LAUNCHES = table, ()
    else:
        launch_rules.FP8_SKINNY_LAUNCHES = table
    got = triton_fp8.linear(x.unsqueeze(0), wq, wscale, scheme)
    assert got.shape == (1, 8, n) and got.dtype == torch.float16
    assert calls == [SkinnyLaunch(16, 128, 4, 1)], calls  # block_n halved to 16 for a narrow N
    close(got[0], x.float() @ deq.T, 2e-3, scheme.weight)
    rows = rows_of(x, scheme)
    res = torch.randn(8, n).half()
    keep = res.clone()
    out = triton_fp8.linear(rows, wq, wscale, scheme, residual=res)
    assert out is res and len(calls) == 2
    close(res, keep.float() + q.fp8_linear_reference(rows, wq, wscale, scheme), 2e-3, "fp8 rows")
    triton_fp8.linear(torch.randn(17, k).half(), wq, wscale, scheme)
    triton_fp8.linear(torch.randn(1, k).half(), wq, wscale, scheme)
    assert len(calls) == 2
    calls.clear()
print("ok")
'''


def test_skinny_gemm_equals_the_dequantized_matmul_at_1_to_64_rows():
    run_script(KERNEL)


def test_linear_sends_rows_to_the_skinny_gemm_only_where_the_rule_says():
    run_script(DISPATCH)
