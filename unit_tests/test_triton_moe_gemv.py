"""The experts as GEMVs (kernels.triton_moe_gemv) on the CPU through Triton's interpreter: against the torch
reference over the same weights (FP8 experts dequantized: the GEMV is W8A16, its activations are not
quantized), for unscaled, per-channel and block-scaled weights, under the model's, the worst and the balanced
routing, rows of x with a stride; and triton_moe.fused_moe's dispatch to it (launch_rules.MOE_GEMV_MAX_PAIRS),
with its addends summed by moe_sum. The interpreter has no bfloat16: float32/float16 here."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script
from unit_tests.test_triton_fp8 import FP8_CAST, REFERENCE

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
              pytest.mark.skipif(importlib.util.find_spec("aiter") is None, reason="amd-aiter not installed")]

GEMV = FP8_CAST + REFERENCE + r'''
from autoprofile.kernels import launch_rules, triton_moe, triton_moe_gemv
from autoprofile.layers.moe import Routing, moe_reference, route

import sys
torch.manual_seed(0)
FULL, ran_cases = sys.argv[1:] == ["full"], []
SHIPPED = launch_rules.MOE_GEMV_MAX_PAIRS
E, K = 8, 2
channel, block = Scheme("channel"), Scheme("block", (128, 128), "group")
for case, (scheme, H, I, dtype, tol) in enumerate(((None, 96, 40, torch.float32, 1e-5),
                                                   (None, 96, 40, torch.float16, 3e-3),
                                                   (channel, 96, 40, torch.float32, 1e-5),
                                                   (block, 256, 128, torch.float32, 1e-5))):
    w13 = (torch.randn(E, 2 * I, H) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I) * I ** -0.5).to(dtype)
    quant, d13, d2 = None, w13.float(), w2.float()
    if scheme is not None:
        (w13, s13), (w2, s2) = quantize_weight(w13, scheme), quantize_weight(w2, scheme)
        quant = MoeQuant(s13, s2, scheme)
        d13, d2 = dequantize_weight(w13, s13, scheme), dequantize_weight(w2, s2, scheme)
    assert triton_moe_gemv.serves(w13, quant)
    routings = ((1, "model"), (3, "worst"), (5, "balanced"))
    # the full grid (the slow set), or every routing for the first case and one, rotating, for the others
    for tokens, routing in routings if FULL or case == 0 else routings[case % 3:case % 3 + 1]:
        ran_cases.append((case, tokens))
        wide = torch.randn(tokens, H + 8).to(dtype)
        x = wide[:, :H]  # rows with a stride
        weights, ids = route(torch.randn(tokens, E), K, True)
        r = Routing()
        r.set(routing)
        ids = r.apply(ids, E)
        want = moe_reference(x.float(), d13, d2, weights, ids)
        down = triton_moe_gemv.experts(x, w13, w2, weights.to(dtype), ids, quant)
        assert down.shape == (tokens, K, H) and down.dtype == dtype
        err = float((down.float().sum(1) - want).norm() / want.norm())
        assert err < tol, (scheme, dtype, tokens, routing, err)
        # through fused_moe: the GEMVs up to MOE_GEMV_MAX_PAIRS pairs, the addends summed by moe_sum
        residual = torch.randn(tokens, H).to(dtype)
        calls = []
        real = triton_moe_gemv.experts
        triton_moe_gemv.experts = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        cases = ((tokens * K, 1),) + (((tokens * K - 1, 0),) if tokens == 1 and scheme is None else ())
        try:
            for most, ran in cases:  # (AITER's blocked path, interpreted, once: it is slow here)
                launch_rules.MOE_GEMV_MAX_PAIRS = most
                calls.clear()
                got = triton_moe.fused_moe(x.contiguous(), w13, w2, weights.to(dtype), ids, quant,
                                           add=(residual,))
                assert len(calls) == ran, (most, calls)
                if ran:
                    err = float((got.float() - want - residual.float()).norm() / want.norm())
                    assert err < tol, (scheme, dtype, tokens, routing, "fused_moe", err)
        finally:
            triton_moe_gemv.experts = real
assert len(ran_cases) == (12 if FULL else 6) and {t for _, t in ran_cases} == {1, 3, 5}, ran_cases
# what a GEMV step allocates (fused_moe's output, the act and down intermediates; moe_sum writes the output)
# lies inside the envelope's term for a step of experts, budget.moe_scratch_bytes: the sum of every allocation
# (more than the peak), at the most pairs the rule sends to the GEMVs, under the worst routing
from autoprofile import budget
E2, K2, H2, I2 = 16, 4, 256, 128
launch_rules.MOE_GEMV_MAX_PAIRS = SHIPPED
tokens = SHIPPED // K2
assert tokens >= 1
w13, w2 = torch.randn(E2, 2 * I2, H2) * H2 ** -0.5, torch.randn(E2, H2, I2) * I2 ** -0.5
weights, ids = route(torch.randn(tokens, E2), K2, True)
r = Routing()
r.set("worst")
ids = r.apply(ids, E2)
gemvs, allocated, allocators = triton_moe_gemv.experts, [], (torch.empty, torch.empty_like)
calls = []
triton_moe_gemv.experts = lambda *a, **kw: calls.append(1) or gemvs(*a, **kw)
torch.empty = lambda *a, **kw: allocated.append(allocators[0](*a, **kw)) or allocated[-1]
torch.empty_like = lambda *a, **kw: allocated.append(allocators[1](*a, **kw)) or allocated[-1]
try:
    triton_moe.fused_moe(torch.randn(tokens, H2), w13, w2, weights, ids)
finally:
    torch.empty, torch.empty_like = allocators
    triton_moe_gemv.experts = gemvs
assert calls == [1], calls
held = sum(t.nbytes for t in allocated)
assert held <= budget.moe_scratch_bytes(tokens, K2, E2, I2, H2, 4), (held, [tuple(t.shape) for t in allocated])
# block scales whose rows do not divide the intermediate size: not served (fused_moe keeps AITER's kernels)
w13, s13 = quantize_weight(torch.randn(E, 2 * 192, 256), block)
assert not triton_moe_gemv.serves(w13, MoeQuant(s13, s13, block))
print("ok")
'''


def test_the_experts_gemvs_match_the_reference_and_fused_moe_dispatches_to_them():
    run_script(GEMV)


@pytest.mark.slow
def test_the_experts_gemvs_over_every_scheme_and_routing():
    run_script(GEMV, "full")
