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
print("ok")
'''

EXPERTS = FP8_CAST + REFERENCE + r'''
from autoprofile.kernels import triton_moe
from autoprofile.layers.moe import Routing, route

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


def test_fp8_quant_gemv_and_gemm_equal_the_references():
    run_script(KERNELS)


@pytest.mark.skipif(importlib.util.find_spec("aiter") is None, reason="amd-aiter not installed")
def test_fp8_experts_through_aiters_block_scaled_path_equal_the_reference():
    run_script(EXPERTS)
