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


NORM = r'''
import torch
from autoprofile.kernels import triton_fp8, triton_gemv
from autoprofile.layers.quant import Fp8Scheme, dequantize_weight, quantize_weight

torch.manual_seed(0)


def rms_norm(x, g, eps):  # in fp32, not rounded (the fused GEMV's)
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g.float()


# K past one step (2,048) with a masked tail, and K within one
for n, k, bias, dtype in [(37, 5000, True, torch.float32), (6, 300, False, torch.float16)]:
    w = (torch.randn(n, k) * k ** -0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    x, g = (torch.randn(1, k) * 4).to(dtype), (torch.rand(k) + 0.5).to(dtype)
    got = triton_gemv.norm_linear(x, g, 1e-5, w, b)
    want = torch.nn.functional.linear(rms_norm(x, g, 1e-5), w.float(), b.float() if bias else None)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    assert got.dtype == dtype and torch.allclose(got.float(), want, rtol=tol, atol=tol), (n, k)
    plain = triton_gemv.linear(x, w, b).float()  # x itself: far off (its rms is ~4)
    assert not torch.allclose(plain, want, rtol=0.1, atol=0.1)
    for scheme in (Fp8Scheme("channel"), Fp8Scheme("block", (128, 128), "group")):
        wq, ws = quantize_weight(w.float(), scheme)
        got = triton_fp8.norm_linear(x, g, 1e-5, wq, ws, scheme, b)
        want = rms_norm(x, g, 1e-5) @ dequantize_weight(wq, ws, scheme).T + (b.float() if bias else 0)
        assert got.dtype == dtype and torch.allclose(got.float(), want, rtol=tol, atol=tol), (n, k, scheme)
print("ok")
'''


def test_one_rows_norm_fused_into_the_gemv_equals_norm_then_linear():
    """TP.norm_matmul / fp8_norm_matmul at one row: RMSNorm(x) * g, times W, in one kernel (fp32 throughout),
    against torch's norm then linear."""
    run_script(NORM)


NORM_MODELS = r'''
import torch
from autoprofile.engine.attention import get_backend_class
from autoprofile.engine.kv_cache import KVCache
from autoprofile.engine.weights import load_weights
from autoprofile.kernels import triton_fp8, triton_gemv
from autoprofile.layers.attention import AttentionMetadata
from autoprofile.layers.parallel import TP
from autoprofile.layers.quant import fp8_linear_reference
from models import model_class
from models.config import load_model_config

PAGE = 16
# 32 rows a program (tiny-fp8's scale blocks are 32 rows): the interpreter runs programs one by one (2 rows a
# program took 100 s here)
triton_gemv.BLOCK_N, triton_fp8.GEMV_BLOCK_N, triton_fp8.GEMV_FEW = 32, 32, (32, 1024, 1)


def built(name, fused):
    mc = load_model_config(name)
    backend = get_backend_class("torch")(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE, torch.float32,
                                         torch.device("cpu"))
    calls = []
    norm = backend.rms_norm
    backend.rms_norm = lambda *a: calls.append(1) or norm(*a)
    # one row: the W8A16 GEMV either way (more: the torch reference, the interpreter's GEMM being slow)
    tp = TP(fp8_matmul=lambda x, *a: (triton_fp8.linear if x.shape[0] == 1 else fp8_linear_reference)(x, *a))
    if fused:
        tp.norm_matmul, tp.fp8_norm_matmul = triton_gemv.norm_linear, triton_fp8.norm_linear
    model = model_class(mc)(mc, backend, tp, dtype=torch.float32)
    load_weights(model, [], seed=0, show_progress=False)
    return model, mc, calls


def step(model, mc, ids):
    """A prefill of ids, then one decode row: the logits of both."""
    kv = KVCache(mc.num_layers, 8, mc.num_kv_heads, PAGE, mc.head_dim, torch.float32, torch.device("cpu"))
    out = []
    for start, chunk in ((0, ids[:-1]), (len(ids) - 1, ids[-1:])):
        n = len(chunk)
        meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(start, start + n) + PAGE,
                                 cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n)
        if start:
            meta.kv_slots = torch.arange(start + n) + PAGE
            meta.cu_seqlens_k, meta.max_seqlen_k = torch.tensor([0, start + n], dtype=torch.int32), start + n
        with torch.no_grad():
            out.append(model.compute_logits(model(torch.tensor(chunk), torch.arange(start, start + n), meta,
                                                  kv.layers)))
    return out


ids = [5, 17, 250, 3, 99, 140, 7]
for name, fused_norms in (("tiny", 2), ("tiny-fp8", 2), ("tiny-moe", None)):
    plain, mc, plain_calls = built(name, False)
    fused, _, fused_calls = built(name, True)
    (p_prefill, p_row), (f_prefill, f_row) = step(plain, mc, ids), step(fused, mc, ids)
    assert torch.equal(p_prefill, f_prefill), name  # more than one row: the norms run as before
    err = float((f_row - p_row).norm() / p_row.norm())
    assert err < 1e-4 and torch.equal(f_row.argmax(-1), p_row.argmax(-1)), (name, err)
    layers = mc.num_layers
    # the prefill ran every norm; the row ran only those no GEMV took (the final norm; an MoE layer's)
    readers = [(l.input_layernorm.reader is not None) + (l.post_attention_layernorm.reader is not None)
               for l in fused.model.layers]
    if fused_norms is not None:
        assert readers == [fused_norms] * layers, (name, readers)
    else:  # experts and the router both read the MoE layers' post-attention norm: not fused there
        assert readers == [1 + (not mc.is_moe_layer(i)) for i in range(layers)], (name, readers)
    assert len(plain_calls) - len(fused_calls) == sum(readers), (name, len(plain_calls), len(fused_calls))
    assert all(l.input_layernorm.reader is None for l in plain.model.layers)
print("ok")
'''


def test_a_models_one_row_norms_go_into_its_gemvs_with_the_same_logits():
    """Dense, FP8 and MoE tiny models with TP.norm_matmul set (as aiter_triton sets it): a one-row step
    leaves each norm read by one linear layer to that layer's GEMV (fewer norm calls by exactly those) and
    gives the logits of the norm-then-GEMV model; more rows run the norms as before."""
    run_script(NORM_MODELS)
