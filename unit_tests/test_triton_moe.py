"""The experts as the aiter_triton backend runs them (kernels.triton_moe: our expert sort, then AITER's Triton
fused_moe_silu and fused_moe) on the CPU through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess:
the flag is read when a kernel module is imported), against the torch reference, under the router's own,
the worst and the balanced routing, at the small and the large launch config. The interpreter has no bfloat16:
float32 and float16 here; bf16 on the GPU (tests/test_moe_gpu.py)."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
              pytest.mark.skipif(importlib.util.find_spec("aiter") is None, reason="amd-aiter not installed")]

EXPERTS = r'''
import torch
from autoprofile.kernels import launch_rules, triton_moe
from autoprofile.layers.moe import Routing, moe_reference, route

torch.manual_seed(0)
E, K, H, I = 16, 4, 64, 40  # I: not a multiple of the blocks
configs = set()
for dtype, weight_dtype, tol in ((torch.float32, torch.float32, 1e-5), (torch.float16, torch.float16, 3e-3),
                                 (torch.float16, torch.float32, 3e-3)):  # fp32 weights: DeepSeek's router
    for tokens in (1, 40, 60):  # small blocks (40 pairs on one expert under worst: 3 blocks), then large
        for routing in ("model", "worst", "balanced"):
            w13 = (torch.randn(E, 2 * I, H) * H ** -0.5).to(dtype)
            w2 = (torch.randn(E, H, I) * I ** -0.5).to(dtype)
            x = torch.randn(tokens, H).to(dtype)
            weights, ids = route(torch.randn(tokens, E), K, True)
            r = Routing()
            r.set(routing)
            ids = r.apply(ids, E)
            got = triton_moe.fused_moe(x, w13, w2, weights.to(weight_dtype), ids).float()
            want = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
            err = float((got - want).norm() / want.norm())
            assert err < tol, (dtype, weight_dtype, tokens, routing, err)
            configs.add(launch_rules.moe_block_m(tokens, K, E))
assert configs == {launch_rules.MOE_SMALL_BLOCK_M, launch_rules.MOE_LARGE_BLOCK_M}, configs
print("ok")
'''


def test_aiters_fused_moe_kernels_over_our_sort_equal_the_reference():
    run_script(EXPERTS)


SUM = r'''
import torch
from autoprofile.kernels import triton_moe
from autoprofile.layers.moe import moe_reference, route

torch.manual_seed(0)
E, K, H, I = 8, 3, 48, 24
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
    for tokens in (1, 5):
        w13 = (torch.randn(E, 2 * I, H) * H ** -0.5).to(dtype)
        w2 = (torch.randn(E, H, I) * I ** -0.5).to(dtype)
        x = torch.randn(tokens, H).to(dtype)
        shared, residual = torch.randn(tokens, H).to(dtype), (torch.randn(tokens, H) * 4).to(dtype)
        weights, ids = route(torch.randn(tokens, E), K, True)
        experts = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
        for add in ((), (residual,), (shared, residual)):
            got = triton_moe.fused_moe(x, w13, w2, weights.to(dtype), ids, add=add).float()
            want = experts + sum(a.float() for a in add) if add else experts
            err = float((got - want).norm() / want.norm())
            assert err < tol, (dtype, tokens, len(add), err)
        # the sum kernel alone: every top-k row and both addends, rounded once
        down = torch.randn(tokens, K, H).to(dtype)
        out = triton_moe.moe_sum(down, torch.empty(tokens, H, dtype=dtype), (shared, residual))
        want = (down.float().sum(1) + shared.float() + residual.float()).to(dtype)
        torch.testing.assert_close(out, want, rtol=tol, atol=tol)
try:
    triton_moe.moe_sum(down, torch.empty(tokens, H, dtype=dtype), (shared, residual, shared))
except ValueError as e:
    assert "at most 2" in str(e)
else:
    raise AssertionError("three addends accepted")
print("ok")
'''


def test_the_top_k_sum_with_the_shared_experts_and_the_residual_in_one_kernel():
    run_script(SUM)
