"""Our one-launch expert sort (kernels.triton_moe_sort) on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess: the flag is read when a kernel module is imported): bit-equal to
layers.moe.sort_by_expert, every output slot included, under the router's own, the worst and the balanced
routing, at both block sizes; and the fused MoE path over it against the torch reference."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SORT = r'''
import torch
from autoprofile.kernels.triton_moe_sort import sort_by_expert
from autoprofile.layers import moe
from autoprofile.layers.moe import Routing, route

torch.manual_seed(0)
cases = [(t, k, e, m) for t in (1, 2, 7, 16, 33, 256, 300) for k in (6, 8) for e in (64, 128)
         for m in (16, 64)]
cases += [(1024, 8, 256, 64), (2048, 8, 256, 64), (50, 3, 60, 16)]  # many chunks (2048 x 8: the most pairs
# fused_moe gives it, triton_moe.SORT_KERNEL_MAX_PAIRS); experts not a power of two
for tokens, top_k, experts, block_m in cases:
    _, ids = route(torch.randn(tokens, experts), top_k, True)
    for routing in moe.ROUTINGS:
        r = Routing()
        r.set(routing)
        routed = r.apply(ids, experts)
        got, want = sort_by_expert(routed, experts, block_m), moe.sort_by_expert(routed, experts, block_m)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), (
                tokens, top_k, experts, block_m, routing, g, w)
# an expert repeated within a token (no router does it): still the torch version's pair order
ids = torch.randint(0, 8, (40, 6), dtype=torch.int32)
assert all(torch.equal(g, w) for g, w in zip(sort_by_expert(ids, 64, 16), moe.sort_by_expert(ids, 64, 16)))
print("ok")
'''

FUSED = r'''
import torch
from autoprofile.kernels import triton_moe
from autoprofile.layers.moe import ROUTINGS, Routing, moe_reference, route

assert 0 < triton_moe.SORT_KERNEL_MAX_PAIRS
torch.manual_seed(0)
E, K, H, I = 16, 4, 64, 40
for tokens in (3, 40):  # the small and the large blocks, both through our kernel's sort
    assert tokens * K <= triton_moe.SORT_KERNEL_MAX_PAIRS
    for routing in ROUTINGS:
        w13, w2 = torch.randn(E, 2 * I, H) * H ** -0.5, torch.randn(E, H, I) * I ** -0.5
        x = torch.randn(tokens, H)
        weights, ids = route(torch.randn(tokens, E), K, True)
        r = Routing()
        r.set(routing)
        ids = r.apply(ids, E)
        got = triton_moe.fused_moe(x, w13, w2, weights, ids)
        want = moe_reference(x, w13, w2, weights, ids)
        assert float((got - want).norm() / want.norm()) < 1e-5, (tokens, routing)
print("ok")
'''


@pytest.mark.slow  # minutes on 2 cores (the interpreter or a crowd); the slow run has it
def test_the_one_launch_sort_equals_the_torch_sort_slot_for_slot():
    run_script(SORT)


@pytest.mark.skipif(importlib.util.find_spec("aiter") is None, reason="amd-aiter not installed")
def test_aiters_fused_moe_kernels_over_the_one_launch_sort_equal_the_reference():
    run_script(FUSED)
