"""The FP8 kernels (kernels.triton_fp8: activation quant, the one-row GEMV, the block/channel GEMM, linear's
dispatch; kernels.triton_moe's FP8 experts) on the CPU through Triton's interpreter, against torch references.

The interpreter's float -> float8 cast drops the rounding carry (127.2 -> 64.0, where torch and the GPU give
128.0): the scripts replace that one conversion with torch's cast (FP8_CAST), so what is checked is our
arithmetic (scales, division, clamping, scale indexing), not the interpreter's cast. The interpreter has no
bfloat16: float32/float16 here; bf16 on the GPU (tests/test_fp8_gpu.py)."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

FP8_CAST = r'''
import numpy as np
import torch
import triton.language as tl
import triton.runtime.interpreter as interpreter

_convert = interpreter._convert_float


def convert_float(data, src, dst, rounding):
    if dst == tl.float8e4nv and src == tl.float32:
        f32 = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
        return f32.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(data.shape)
    return _convert(data, src, dst, rounding)


interpreter._convert_float = convert_float
'''

# layers.quant's references, with the shapes these tests use: weights per expert ([E, N, K]), fp32 results
REFERENCE = r'''
import torch
from autoprofile.layers import quant as _q
from autoprofile.layers.quant import FP8, MoeQuant, dequantize_weight, quantize_per_group, quantize_per_token
from autoprofile.layers.quant import Fp8Scheme as Scheme


def quantize_weight(w, scheme):
    if w.dim() == 2:
        return _q.quantize_weight(w, scheme)
    pairs = [_q.quantize_weight(e, scheme) for e in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def expand(s, rows, cols, bn, bk):
    return _q.expand_block_scale(s, rows, cols, (bn, bk))


def fp8_linear_reference(x, w, s, scheme, input_scale=None, bias=None):
    return _q.fp8_linear_reference(x.float(), w, s, scheme, input_scale, bias)


def moe_reference_fp8(x, w13, w2, weights, ids, quant):
    return _q.moe_reference_fp8(x.float(), w13, w2, weights.float(), ids, quant)
'''

KERNELS = FP8_CAST + REFERENCE + r'''
from autoprofile.kernels import triton_fp8 as f
from autoprofile.kernels import launch_rules
# today's quantize + GEMM path at every row count (unit_tests/test_triton_fp8_skinny.py: the skinny GEMM's rows)
launch_rules.FP8_SKINNY_LAUNCHES = launch_rules.FP8_SKINNY_BLOCK_LAUNCHES = ()
launch_rules.FP8_GEMV_ROWS_LAUNCHES = launch_rules.FP8_GEMV_ROWS_BLOCK_LAUNCHES = ()

torch.manual_seed(0)

# activation quant: the same bytes and scales as the reference (odd K, a zero row, values past +-448)
for m, k in [(3, 5000), (5, 128), (2, 130), (1, 7)]:
    x = torch.randn(m, k) * 300
    x[0] = 0
    q, s = f.quantize_per_token(x)
    rq, rs = quantize_per_token(x)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), (m, k)
    q, s = f.quantize_per_group(x.half(), 128)
    rq, rs = quantize_per_group(x.half(), 128)
    assert s.shape == (m, -(-k // 128)) and torch.equal(s, rs), (m, k)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), (m, k)
    static = torch.tensor([0.5])
    q, s = f.quantize_static(x, static)
    assert torch.equal(s, static.expand(m, 1))
    assert torch.equal(q.float(), (x / 0.5).clamp(-448, 448).to(FP8).float()), (m, k)
# a strided input: rows of a wider tensor
wide = torch.randn(4, 300)
q, s = f.quantize_per_token(wide[:, :200])
rq, rs = quantize_per_token(wide[:, :200])
assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))

channel, block = Scheme("channel"), Scheme("block", (128, 128), "group")
block_token = Scheme("block", (128, 128), "token")  # block weights, one activation scale a row
for n, k in [(37, 300), (130, 1000), (256, 128)]:
    w = torch.randn(n, k) * 0.1
    for scheme in (channel, block, block_token):
        wq, ws = quantize_weight(w, scheme)
        deq = dequantize_weight(wq, ws, scheme)
        bias = torch.randn(n)
        # one row: W8A16 (x not quantized)
        for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 3e-3)):
            x = torch.randn(1, k).to(dtype)
            got = f.linear(x, wq, ws, scheme, bias=bias.to(dtype))
            want = x.float() @ deq.T + bias
            assert got.shape == (1, n) and got.dtype == dtype
            assert torch.allclose(got.float(), want, rtol=tol, atol=tol), (scheme, n, k, dtype)
        # rows: W8A8 through the Triton GEMM (float32/float16: not _scaled_mm's bf16)
        for m in (2, 7, 70):
            x = torch.randn(m, k)
            got = f.linear(x, wq, ws, scheme, bias=bias)
            want = fp8_linear_reference(x, wq, ws, scheme, bias=bias)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-3), (scheme, n, k, m,
                                                                     (got - want).abs().max())
    static = Scheme("channel", None, "static")
    wq, ws = quantize_weight(w, static)
    x, scale = torch.randn(5, k), torch.tensor([0.01])
    got = f.linear(x.unsqueeze(0), wq, ws, static, input_scale=scale)
    assert got.shape == (1, 5, n)
    assert torch.allclose(got[0], fp8_linear_reference(x, wq, ws, static, scale), rtol=1e-4, atol=1e-3)
# one row over K past the GEMV's first weight tile (loaded before the PDL wait) and its K steps: 3 tiles of
# 1,024 at 37 rows (2/1024/w1), a masked last one
for scheme in (channel, block):
    w = torch.randn(37, 2500) * 0.1
    wq, ws = quantize_weight(w, scheme)
    x = torch.randn(1, 2500)
    got = f.linear(x, wq, ws, scheme)
    want = x @ dequantize_weight(wq, ws, scheme).T
    assert f.gemv_config(37, 2500)[1] < 2500
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (scheme, (got - want).abs().max())
print("ok")
'''

EXPERTS = FP8_CAST + REFERENCE + r'''
from autoprofile.kernels import launch_rules, triton_moe
from autoprofile.layers.moe import Routing, route
# AITER's blocked path at every token count (a few pairs take the experts' GEMVs, W8A16:
# unit_tests/test_triton_moe_gemv.py)
launch_rules.MOE_GEMV_MAX_PAIRS = 0

torch.manual_seed(0)
E, K = 8, 2
for scheme, H, I in ((Scheme("channel"), 96, 40), (Scheme("block", (128, 128), "group"), 256, 128)):
    w13, s13 = quantize_weight(torch.randn(E, 2 * I, H) * H ** -0.5, scheme)
    w2, s2 = quantize_weight(torch.randn(E, H, I) * I ** -0.5, scheme)
    quant = MoeQuant(s13, s2, scheme)
    for tokens, routing in ((1, "model"), (3, "worst"), (9, "balanced")):
        x = torch.randn(tokens, H)
        weights, ids = route(torch.randn(tokens, E), K, True)
        r = Routing()
        r.set(routing)
        ids = r.apply(ids, E)
        got = triton_moe.fused_moe(x, w13, w2, weights, ids, quant)
        want = moe_reference_fp8(x, w13, w2, weights, ids, quant)
        err = float((got - want).norm() / want.norm())
        assert err < 1e-2, (scheme, tokens, routing, err)
print("ok")
'''

FUSED = FP8_CAST + REFERENCE + r'''
from autoprofile.kernels import triton_act, triton_fp8 as f, triton_norm
from autoprofile.kernels import launch_rules
# today's quantize + GEMM path at every row count (unit_tests/test_triton_fp8_skinny.py: the skinny GEMM's rows)
launch_rules.FP8_SKINNY_LAUNCHES = launch_rules.FP8_SKINNY_BLOCK_LAUNCHES = ()
launch_rules.FP8_GEMV_ROWS_LAUNCHES = launch_rules.FP8_GEMV_ROWS_BLOCK_LAUNCHES = ()
from autoprofile.layers.quant import Fp8Rows

torch.manual_seed(0)
token, group = Scheme("channel"), Scheme("block", (128, 128), "group")


def same(got, q, s):
    assert isinstance(got, Fp8Rows) and got.dtype == torch.float16
    assert got.scale.shape == s.shape and torch.equal(got.scale, s), (got.scale - s).abs().max()
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))


# the producers' rows quantized in their kernels: the bytes and scales of the unfused path (the producer's
# fp16 output through the reference quantization), per token and per 128-group, odd widths, a zero row
for m, n in [(3, 4096), (2, 130), (4, 1000)]:
    x = (torch.randn(m, n) * 3).half()
    x[1] = 0
    w = (torch.rand(n) + 0.5).half()
    normed = triton_norm.rms_norm(x, w, 1e-6)
    gu = (torch.randn(m, 2 * n) * 4).half()
    act = triton_act.silu_mul(gu)
    for scheme, quant in ((token, quantize_per_token), (group, lambda t: quantize_per_group(t, 128))):
        same(f.rms_norm_quant(x, w, 1e-6, scheme), *quant(normed.float()))
        same(f.silu_mul_quant(gu, scheme), *quant(act.float()))
    f.SILU_QUANT_ROW = 128  # rows past it: the two-pass kernel (amax, then the values again)
    same(f.silu_mul_quant(gu, token), *quantize_per_token(act.float()))
    f.SILU_QUANT_ROW = 16384
# linear over Fp8Rows: what it gives for the producer's output; a residual is added in place (one row: in
# the GEMV's epilogue, rounded once)
wt = torch.randn(96, 1000) * 0.05
for scheme in (token, group):
    wq, ws = quantize_weight(wt, scheme)
    x = torch.randn(5, 1000).half()
    q, s = quantize_per_token(x.float()) if scheme is token else quantize_per_group(x.float(), 128)
    rows = Fp8Rows(q, s, torch.float16)
    got = f.linear(rows, wq, ws, scheme)
    want = f.linear(x, wq, ws, scheme)
    assert got.dtype == torch.float16 and torch.equal(got, want)
    res = torch.randn(5, 96).half()
    keep = res.clone()
    out = f.linear(rows, wq, ws, scheme, residual=res)
    assert out is res and torch.equal(res, keep + want)
    one, res1 = torch.randn(1, 1000).half(), torch.randn(1, 96).half()
    keep1 = res1.clone()
    out = f.linear(one, wq, ws, scheme, residual=res1)
    want1 = one.float() @ dequantize_weight(wq, ws, scheme).T + keep1.float()
    assert out is res1 and torch.allclose(res1.float(), want1, rtol=2e-3, atol=2e-3), (res1 - want1).abs().max()
print("ok")
'''


def test_fp8_quant_gemv_and_gemm_equal_the_references():
    run_script(KERNELS)


@pytest.mark.skipif(importlib.util.find_spec("aiter") is None, reason="amd-aiter not installed")
def test_fp8_experts_through_aiters_block_scaled_path_equal_the_reference():
    run_script(EXPERTS)


def test_norm_and_silu_quantize_their_rows_as_the_unfused_path_does():
    run_script(FUSED)
