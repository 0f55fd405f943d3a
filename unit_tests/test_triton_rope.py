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


# both norm-rope scripts' inputs: a packed row, the norm weights, cos/sin of `rotary` channels, cache slots
NORM_CASE = r'''
def norm_case(dtype, t, width, d, rotary, page, pages):
    qkv = (torch.randn(t, width) * 3).to(dtype)
    q_w, k_w = (torch.rand(d) + 0.5).to(dtype), (torch.rand(d) + 0.5).to(dtype)
    table = torch.randn(64, rotary)
    cos, sin = table[torch.randint(0, 64, (t,))].chunk(2, dim=-1)
    slots = torch.randperm((pages - 1) * page)[:t] + page
    return qkv, q_w, k_w, cos.unsqueeze(1), sin.unsqueeze(1), slots, slots // page, slots % page
'''

QK_NORM = r'''
import torch
from autoprofile.kernels import triton_rope
from autoprofile.layers.attention import KVLayer
from autoprofile.engine.attention.torch_sdpa import TorchBackend

torch.manual_seed(0)


def reference(qkv, q_w, k_w, eps, cos, sin, hq, hkv, d):
    """Qwen3's path as the model ran it before the fusion: per-head RMSNorm (fp32, rounded), then HF's
    rotate_half RoPE in fp32 (rounded)."""
    def norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)

    def rope(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    t = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = rope(norm(q.reshape(t, hq, d), q_w))
    k = rope(norm(k.reshape(t, hkv, d), k_w))
    return q, k, v.reshape(t, hkv, d)


for dtype, hq, hkv, d, t in [(torch.float32, 8, 2, 32, 5), (torch.float16, 4, 1, 64, 3),
                             (torch.float16, 6, 6, 16, 1)]:
    page, pages, eps = 16, 6, 1e-6
    qkv, q_w, k_w, cos, sin, slots, pages_of, offs = norm_case(dtype, t, (hq + 2 * hkv) * d, d, d,
                                                               page, pages)
    want = reference(qkv, q_w, k_w, eps, cos, sin, hq, hkv, d)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=4e-3)
    be = TorchBackend(hq, hkv, d, page, dtype, torch.device("cpu"))
    caches = [torch.zeros(pages, hkv, page, d, dtype=dtype) for _ in range(4)]
    ref_qkv, got_qkv = qkv.clone(), qkv.clone()
    base = be.norm_rope_store(ref_qkv, q_w, k_w, eps, cos, sin, KVLayer(caches[0], caches[1]), slots)
    got = triton_rope.rope_store(got_qkv, cos, sin, caches[2], caches[3], slots, hq, hkv, d,
                                 qk_norm=(q_w, k_w, eps))
    for a, b, c in zip(got, base, want):
        torch.testing.assert_close(b, c, rtol=0, atol=0)  # the backend's torch ops: the old path, bit for bit
        torch.testing.assert_close(a, c, **tol)
    torch.testing.assert_close(caches[2][pages_of, :, offs], want[1], **tol)  # K normed and rotated
    torch.testing.assert_close(caches[3][pages_of, :, offs], want[2], rtol=0, atol=0)
    torch.testing.assert_close(caches[2], caches[0], **tol)
    assert got[0].data_ptr() == got_qkv.data_ptr()  # in place: views of the packed projection
    assert not torch.equal(got[0], qkv[:, :hq * d].view(t, hq, d))
print("ok")
'''


def test_fused_qk_norm_rope_store_matches_the_torch_ops():
    """Qwen3's per-head q/k RMSNorm + RoPE + KV store in the one kernel equals the unfused ops."""
    run_script(NORM_CASE + QK_NORM)


MLA = r'''
import torch
from autoprofile.kernels import triton_rope
from autoprofile.layers.attention import KVLayer
from autoprofile.engine.attention.torch_sdpa import TorchBackend
from autoprofile.layers.attention import rope_interleaved

torch.manual_seed(0)
for dtype, heads, nope, rope, rank, t in [(torch.float32, 4, 16, 8, 32, 3), (torch.float16, 8, 32, 32, 128, 2),
                                         (torch.float16, 3, 8, 16, 24, 1)]:  # 3 heads, rank 24: no powers of 2
    page, pages, eps = 16, 5, 1e-6
    q = (torch.randn(t, heads * (nope + rope)) * 2).to(dtype).view(t, heads, nope + rope)
    kv_a = (torch.randn(t, rank + rope) * 2).to(dtype)
    w = (torch.rand(rank) + 0.5).to(dtype)
    table = torch.randn(64, rope)
    cos, sin = table[torch.randint(0, 64, (t,))].chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    slots = torch.randperm((pages - 1) * page)[:t] + page
    # the model's ops before the fusion
    xf = kv_a[:, :rank].float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(dtype)
    want_latent = torch.cat([normed, rope_interleaved(kv_a[:, None, rank:], cos, sin)[:, 0]], dim=-1)
    want_q_pe = rope_interleaved(q[..., nope:], cos, sin)
    be = TorchBackend(heads, 1, rank + rope, page, dtype, torch.device("cpu"))
    caches = [torch.zeros(pages, 1, page, rank + rope, dtype=dtype) for _ in range(2)]
    base = be.mla_rope_store(q.clone(), kv_a.clone(), w, eps, cos, sin, KVLayer(caches[0], caches[0]), slots, nope)
    torch.testing.assert_close(base[0], want_q_pe, rtol=0, atol=0)
    torch.testing.assert_close(base[1], want_latent, rtol=0, atol=0)
    got_q, got_kv = q.clone(), kv_a.clone()
    q_pe, latent = triton_rope.mla_rope_store(got_q, got_kv, w, eps, cos, sin, caches[1], slots, nope)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=4e-3)
    torch.testing.assert_close(q_pe, want_q_pe, **tol)
    torch.testing.assert_close(latent, want_latent, **tol)
    torch.testing.assert_close(got_q[..., :nope], q[..., :nope], rtol=0, atol=0)  # q_nope untouched
    assert q_pe.data_ptr() == got_q[..., nope:].data_ptr() and latent.data_ptr() == got_kv.data_ptr()
    torch.testing.assert_close(caches[1][slots // page, 0, slots % page], want_latent, **tol)
    torch.testing.assert_close(caches[1], caches[0], **tol)  # nothing else written
print("ok")
'''


def test_fused_mla_rope_norm_and_latent_store_match_the_torch_ops():
    """MLA's q/k rope, the latent's norm and its cache store in one kernel equal the unfused ops."""
    run_script(MLA)


GATED = r'''
import torch
from autoprofile.kernels import triton_rope
from autoprofile.layers.attention import KVLayer
from autoprofile.engine.attention.torch_sdpa import TorchBackend

torch.manual_seed(0)


def reference(qkv, q_w, k_w, eps, cos, sin, hq, hkv, d, rotary):
    """Qwen3.5's gated attention as the model ran it before the fusion: q heads beside their gates
    ([q_h | gate_h]), per-head RMSNorm (fp32, rounded), HF's rotate_half RoPE on the first `rotary` channels
    in fp32 (rounded), the rest as normed."""
    def norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)

    def rope(x):
        x1, x2 = x[..., :rotary].float().chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        return torch.cat([rotated, x[..., rotary:]], dim=-1)

    t = qkv.shape[0]
    qg, k, v = qkv.split([2 * hq * d, hkv * d, hkv * d], dim=-1)
    q = rope(norm(qg.view(t, hq, 2, d)[:, :, 0], q_w))
    k = rope(norm(k.reshape(t, hkv, d), k_w))
    return q, k, v.reshape(t, hkv, d)


for dtype, hq, hkv, d, rotary, t in [(torch.float32, 8, 2, 32, 8, 5), (torch.float16, 6, 2, 64, 16, 3),
                                     (torch.float16, 4, 4, 16, 16, 1), (torch.float32, 24, 4, 256, 64, 3)]:
    page, pages, eps = 16, 6, 1e-6
    qkv, q_w, k_w, cos, sin, slots, pages_of, offs = norm_case(dtype, t, (2 * hq + 2 * hkv) * d, d, rotary,
                                                               page, pages)
    want = reference(qkv, q_w, k_w, eps, cos, sin, hq, hkv, d, rotary)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=4e-3)
    be = TorchBackend(hq, hkv, d, page, dtype, torch.device("cpu"))
    caches = [torch.zeros(pages, hkv, page, d, dtype=dtype) for _ in range(4)]
    ref_qkv, got_qkv = qkv.clone(), qkv.clone()
    base = be.gated_norm_rope_store(ref_qkv, q_w, k_w, eps, cos, sin, KVLayer(caches[0], caches[1]), slots,
                                    rotary)
    got = triton_rope.rope_store(got_qkv, cos, sin, caches[2], caches[3], slots, hq, hkv, d,
                                 qk_norm=(q_w, k_w, eps), rotary_dim=rotary, gated=True)
    for a, b, c in zip(got, base, want):
        assert a.shape == b.shape == c.shape
        torch.testing.assert_close(b, c, rtol=0, atol=0)  # the backend's torch ops: the old path, bit for bit
        torch.testing.assert_close(a, c, **tol)
        if dtype == torch.float16:  # no FMA in the interpreter: the same roundings, the norm's included
            assert (a == c).float().mean() > 0.99, (a == c).float().mean()
    assert got[0].is_contiguous() and got[0].data_ptr() != got_qkv.data_ptr()  # q: a new [T, Hq, D]
    assert got[1].data_ptr() == got_qkv[:, 2 * hq * d:].data_ptr()  # k: normed and rotated in place
    # the q part of qkv (the gates with it) untouched
    torch.testing.assert_close(got_qkv[:, :2 * hq * d], qkv[:, :2 * hq * d], rtol=0, atol=0)
    torch.testing.assert_close(caches[2][pages_of, :, offs], want[1], **tol)  # K normed and rotated
    torch.testing.assert_close(caches[3][pages_of, :, offs], want[2], rtol=0, atol=0)
    torch.testing.assert_close(caches[2], caches[0], **tol)  # nothing else written
    torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0)
    # an FP8 cache: the normed, rotated K and the V divided by the layer's scales (see CHECK's NOTE)
    fp8 = [torch.zeros(pages, hkv, page, d, dtype=torch.float8_e4m3fn) for _ in range(4)]
    scales = torch.tensor([0.02, 0.005])
    ref_qkv, got_qkv = qkv.clone(), qkv.clone()
    want = be.gated_norm_rope_store(ref_qkv, q_w, k_w, eps, cos, sin, KVLayer(fp8[0], fp8[1], scales), slots,
                                    rotary)
    got = triton_rope.rope_store(got_qkv, cos, sin, fp8[2], fp8[3], slots, hq, hkv, d, scales,
                                 (q_w, k_w, eps), rotary, gated=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    for a, b in ((fp8[2], fp8[0]), (fp8[3], fp8[1])):
        close = (a.float() - b.float()).abs() <= 0.13 * b.float().abs() + 2 ** -6
        assert close.float().mean() > 0.97, close.float().mean()
print("ok")
'''


def test_fused_gated_norm_partial_rope_store_matches_the_torch_ops():
    """Qwen3.5's gated attention: q beside its gate, per-head q/k RMSNorm, RoPE on the first rotary_dim
    channels and the KV store (an FP8 cache too) in the one kernel equal the unfused ops."""
    run_script(NORM_CASE + GATED)


HYBRID = r'''
import sys
from unit_tests import decode_ops
from autoprofile.engine.attention import aiter_triton
from autoprofile.engine.attention.torch_sdpa import TorchBackend
from autoprofile.kernels import triton_rope

name = sys.argv[1]
calls, fused = [], triton_rope.rope_store
triton_rope.rope_store = lambda *args, **kwargs: calls.append(kwargs.get("gated")) or fused(*args, **kwargs)
got = decode_ops.tiny_decode(name)[2]()
assert calls == [True], calls  # the one attention layer through the fused kernel
aiter_triton.AiterTritonBackend = TorchBackend  # the same seed: the same weights, caches and state
want = decode_ops.tiny_decode(name)[2]()
torch = decode_ops.torch
torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
print("ok")
'''


@pytest.mark.skipif(importlib.util.find_spec("aiter") is None, reason="amd-aiter not installed")
@pytest.mark.parametrize("name", ["tiny-hybrid", pytest.param("tiny-hybrid-moe", marks=pytest.mark.slow)])
def test_a_hybrid_decode_forward_on_aiter_triton_matches_the_torch_backend(name):
    """A whole decode forward (fp16, random weights, K/V and state; unit_tests/decode_ops.tiny_decode) of a
    Qwen3.5 hybrid: its gated attention layer through the fused norm + partial RoPE + KV store kernel, the
    linear layers through theirs, equal to the torch backend's."""
    run_script(HYBRID, name)
