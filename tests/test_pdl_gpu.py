"""GPU: programmatic dependent launch (kernels.pdl). A decode layer's chain of our kernels (RMSNorm, the bf16
GEMV, SiLU-mul, the FP8 GEMV adding into the residual in place, RMSNorm again), captured in one CUDA graph
and replayed over fresh inputs; and each PDL kernel after a writer that lets it in at once and writes its
input late: a kernel that read its input before the kernel before it had written it (a missing gdc_wait, a
read moved above pdl.begin) reads the old values."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from autoprofile.kernels import (pdl, triton_act, triton_decode, triton_fp8, triton_fp8_rows, triton_gemv,
                                 triton_norm, triton_rope)
from autoprofile.kernels.launch_rules import GemvRowsLaunch
from autoprofile.layers.quant import Fp8Scheme, quantize_weight
from scripts.cuda_timing import capture
from unit_tests.test_attention_cpu import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, INTER, EPS = 4096, 2048, 1e-5


def reference(x, g1, w1, w2, s2, g2):
    def norm(v, g):
        v = v.float()
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * g.float()).bfloat16()

    y = (norm(x, g1).float() @ w1.float().t()).bfloat16()
    a = (torch.nn.functional.silu(y[:, :INTER].float()) * y[:, INTER:].float()).bfloat16()
    res = (x.float() + a.float() @ (w2.float() * s2[:, None]).t()).bfloat16()
    return res, norm(res, g2)


def test_pdl_is_on_where_the_gpu_has_it():
    assert pdl.enabled() == (torch.cuda.get_device_capability() >= (9, 0))


def test_a_graph_of_pdl_kernels_reads_each_replays_inputs():
    torch.manual_seed(0)
    dev = "cuda"
    g1, g2 = (torch.rand(H, device=dev) + 0.5).bfloat16(), (torch.rand(H, device=dev) + 0.5).bfloat16()
    w1 = (torch.randn(2 * INTER, H, device=dev) * H ** -0.5).bfloat16()
    w2, s2 = quantize_weight(torch.randn(H, INTER, device=dev) * INTER ** -0.5, Fp8Scheme("channel"))
    x, res = torch.zeros(1, H, device=dev, dtype=torch.bfloat16), torch.zeros(1, H, device=dev,
                                                                              dtype=torch.bfloat16)

    def chain():
        a = triton_act.silu_mul(triton_gemv.gemv(triton_norm.rms_norm(x, g1, EPS), w1))
        triton_fp8.gemv(a, w2, s2, None, residual=res)
        return triton_norm.rms_norm(res, g2, EPS)

    graph, out = capture(chain)
    for i in range(20):
        x.copy_(torch.randn(1, H, device=dev) * (1 + i))
        res.copy_(x)
        graph.replay()
        want_res, want = reference(x, g1, w1, w2, s2, g2)
        assert rel_err(res, want_res) < 0.02, i
        assert rel_err(out, want) < 0.02, i


@triton.jit
def _late_copy_kernel(src_ptr, dst_ptr, n, DELAY_NS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """dst = src, written DELAY_NS after the kernel starts; with PDL the next kernel is let in at once."""
    pdl.begin(PDL)
    start = tl.extra.cuda.globaltimer()
    while tl.extra.cuda.globaltimer() - start < DELAY_NS:
        pass
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def late_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    n = src.numel()
    _late_copy_kernel[(triton.cdiv(n, 1024),)](src, dst, n, DELAY_NS=2_000_000, BLOCK=1024, **pdl.launch())


def consumers():
    """name -> (an input's shape, prepare() -> call(input) -> the tensors it writes). Each is a PDL kernel of
    the decode step; prepare allocates what a call writes in place, so that nothing but the kernel runs
    between the late writer and it."""
    dev, gen = "cuda", torch.Generator(device="cuda").manual_seed(1)
    g = (torch.rand(H, device=dev, generator=gen) + 0.5).bfloat16()
    w = (torch.randn(2 * INTER, H, device=dev, generator=gen) * H ** -0.5).bfloat16()
    wq, ws = quantize_weight(torch.randn(H, 2 * INTER, device=dev, generator=gen) * H ** -0.5,
                             Fp8Scheme("channel"))
    fixed_x = torch.randn(1, 2 * INTER, device=dev, generator=gen).bfloat16()
    fixed_rows = torch.randn(4, 2 * INTER, device=dev, generator=gen).bfloat16()

    def rows_gemv(x, residual=None):  # the multi-row GEMV (kernels.triton_fp8_rows), 4 rows
        return triton_fp8_rows.gemv(x, None, wq, ws, None, torch.bfloat16, GemvRowsLaunch(),
                                    residual=residual)

    heads, kv_heads, d, page, seq = 32, 8, 128, 16, 1024
    caches = {kind: [torch.randn(seq // page, kv_heads, page, d, device=dev, generator=gen).to(kind)
                     for _ in range(2)] for kind in (torch.bfloat16, torch.float8_e4m3fn)}
    tables = torch.arange(seq // page, device=dev, dtype=torch.int32)[None]
    lens = torch.tensor([seq], device=dev, dtype=torch.int32)
    scale = torch.tensor([0.5], device=dev)
    cos, sin = torch.randn(2, 1, 1, d // 2, device=dev, generator=gen).unbind(0)
    slot = torch.tensor([5], device=dev)

    def decode(kind):
        kc, vc = caches[kind]
        scales = (scale, scale) if kind == torch.float8_e4m3fn else (None, None)
        return lambda: lambda q: [triton_decode.decode(torch.empty_like(q), q, kc, vc, tables, lens, seq,
                                                       d ** -0.5, *scales)]

    def rope():
        kc, vc = (torch.zeros(4, kv_heads, page, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        return lambda qkv: [*triton_rope.rope_store(qkv, cos, sin, kc, vc, slot, heads, kv_heads, d), kc, vc]

    return {
        "rms_norm": ((1, H), lambda: lambda x: [triton_norm.rms_norm(x, g, EPS)]),
        "bf16 gemv": ((1, H), lambda: lambda x: [triton_gemv.gemv(x, w)]),
        "silu_mul": ((1, 2 * INTER), lambda: lambda x: [triton_act.silu_mul(x)]),
        "fp8 gemv, its input": ((1, 2 * INTER), lambda: lambda x: [triton_fp8.gemv(x, wq, ws, None)]),
        "fp8 gemv, its residual": ((1, H), lambda: lambda r: [triton_fp8.gemv(fixed_x, wq, ws, None,
                                                                              residual=r)]),
        "fp8 rows gemv, its input": ((4, 2 * INTER), lambda: lambda x: [rows_gemv(x)]),
        "fp8 rows gemv, its residual": ((4, H), lambda: lambda r: [rows_gemv(fixed_rows, r)]),
        "rope_store": ((1, (heads + 2 * kv_heads) * d), rope),
        "split decode, bf16 pages": ((1, heads, d), decode(torch.bfloat16)),
        "split decode, fp8 pages": ((1, heads, d), decode(torch.float8_e4m3fn)),
    }


CONSUMERS = ("rms_norm", "bf16 gemv", "silu_mul", "fp8 gemv, its input", "fp8 gemv, its residual",
             "fp8 rows gemv, its input", "fp8 rows gemv, its residual", "rope_store",
             "split decode, bf16 pages", "split decode, fp8 pages")


@pytest.mark.parametrize("name", CONSUMERS)
def test_each_pdl_kernel_waits_for_a_late_writer_of_its_input(name):
    """The kernel before writes the input 2 ms after it starts (the host launches the next one well within
    that) and lets the next kernel in at once (as pdl.begin does): a kernel that read its input (or its
    residual) before its gdc_wait reads the old values. Its outputs must equal those over the input already
    written (bitwise: the same kernel, the same values)."""
    if not pdl.enabled():
        pytest.skip("PDL needs a Hopper or later GPU")
    table = consumers()
    assert tuple(table) == CONSUMERS
    shape, prepare = table[name]
    torch.manual_seed(0)
    for i in range(3):
        src = torch.randn(shape, device="cuda").bfloat16() * (1 + i)
        want = [t.clone() for t in prepare()(src.clone())]
        dst, call = torch.zeros_like(src), prepare()
        torch.cuda.synchronize()
        late_copy(src, dst)
        got = call(dst)  # launched right after the late writer: nothing between them
        torch.cuda.synchronize()
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (name, i)
