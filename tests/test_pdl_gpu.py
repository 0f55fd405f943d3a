"""GPU: programmatic dependent launch (kernels.pdl). A decode layer's chain of our kernels (RMSNorm, the bf16
GEMV, SiLU-mul, the FP8 GEMV adding into the residual in place, RMSNorm again), captured in one CUDA graph
and replayed over fresh inputs: a kernel that read its input before the kernel before it had written it
(a missing gdc_wait) would read the previous replay's values."""
from __future__ import annotations

import pytest
import torch

from autoprofile.kernels import pdl, triton_act, triton_fp8, triton_gemv, triton_norm
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
