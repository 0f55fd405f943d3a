"""The fused RoPE + KV-store Triton kernel (aiter_triton's rope_store) against the torch ops it replaces,
on the CPU through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the flag is read when the
kernel module is imported). The interpreter has no bfloat16: float16 and float32 here, bf16 on the GPU."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = r'''
import torch
from autoprofile.kernels import triton_rope
from autoprofile.layers.attention import KVLayer
from autoprofile.engine.attention.torch_sdpa import TorchBackend

torch.manual_seed(0)
for dtype, hq, hkv, d, t in [(torch.float32, 8, 2, 32, 37), (torch.float16, 32, 8, 128, 5),
                             (torch.float16, 6, 6, 16, 3), (torch.float32, 4, 1, 64, 1)]:
    page, pages = 16, 12
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=dtype)
    table = torch.randn(64, d)  # fp32 cos | sin rows, gathered at the positions as the model does
    cos, sin = table[torch.randint(0, 64, (t,))].chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    slots = torch.randperm((pages - 1) * page)[:t] + page  # page 0 untouched
    ref_qkv, got_qkv = qkv.clone(), qkv.clone()
    caches = [torch.zeros(pages, hkv, page, d, dtype=dtype) for _ in range(4)]
    be = TorchBackend(hq, hkv, d, page, dtype, torch.device("cpu"))
    want = be.rope_store(ref_qkv, cos, sin, KVLayer(caches[0], caches[1]), slots)
    got = triton_rope.rope_store(got_qkv, cos, sin, caches[2], caches[3], slots, hq, hkv, d)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=2e-3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(got_qkv, ref_qkv, **tol)
    torch.testing.assert_close(caches[2], caches[0], **tol)
    torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0)  # V is copied, not computed
    assert got[0].data_ptr() == got_qkv.data_ptr()  # views of the packed projection
    # an FP8 cache: K/V divided by the layer's scales, saturated, in float8_e4m3fn
    fp8 = [torch.zeros(pages, hkv, page, d, dtype=torch.float8_e4m3fn) for _ in range(4)]
    scales = torch.tensor([0.02, 0.005])
    ref_qkv, got_qkv = qkv.clone(), qkv.clone()
    got_qkv[0, -d:] = ref_qkv[0, -d:] = 1e4  # a V row past the FP8 range: saturates, never NaN
    be.rope_store(ref_qkv, cos, sin, KVLayer(fp8[0], fp8[1], scales), slots)
    triton_rope.rope_store(got_qkv, cos, sin, fp8[2], fp8[3], slots, hq, hkv, d, scales)
    torch.testing.assert_close(got_qkv, ref_qkv, **tol)
    # NOTE: the interpreter's FP8 cast is not the GPU's (ties away from zero, subnormals flushed, and a
    # rounding that carries into the next power of two halves it instead): most values agree within a step
    # here; tests/test_kernels.py compares on the GPU
    for a, b in ((fp8[2], fp8[0]), (fp8[3], fp8[1])):
        close = (a.float() - b.float()).abs() <= 0.13 * b.float().abs() + 2 ** -6
        assert close.float().mean() > 0.97, close.float().mean()
    assert not fp8[3].float().isnan().any() and fp8[3].float().abs().max() == 448
print("ok")
'''


def test_fused_rope_store_matches_the_torch_ops():
    run_script(CHECK)
