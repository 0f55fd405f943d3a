"""DeepSeek-V3's noaux_tc router in one launch (kernels.triton_route.biased_grouped_topk) on the CPU through
Triton's interpreter (in a subprocess, as test_triton_route) against the torch path (layers.moe's
biased_grouped_topk, then Routing.apply): the same ids and weights within 1e-6 relative in fp32 on random
logits and biases at DeepSeek-V3's widths (256 experts, 8 groups, 4 kept, top 8), on crafted ties (equal
scores: the lower expert; equal group sums: the lower group; a group whose best expert alone would win but
whose two best do not), norm_topk_prob on and off, under each forced routing, and under hypothesis. The
aiter_triton backend routes a grouped router through the kernel, the forced routings included. On a GPU the
same scripts run compiled (tests/test_moe_gpu.py)."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

COMMON = r'''
import sys
import torch
from autoprofile.kernels import triton_route
from autoprofile.layers.moe import ROUTINGS, Routing
from autoprofile.layers.moe import biased_grouped_topk as reference

device = sys.argv[1]


def check(logits, bias, top_k, n_group, topk_group, renormalize, scale, routing="model", case=""):
    r = Routing(torch.device(device))
    r.set(routing)
    got_w, got_ids = triton_route.biased_grouped_topk(logits, bias, top_k, n_group, topk_group, renormalize,
                                                      scale, r.mode)
    want_w, want_ids = reference(logits, bias, top_k, n_group, topk_group, renormalize, scale)
    want_ids = r.apply(want_ids, logits.shape[1])
    assert got_ids.dtype == torch.int32 and got_w.dtype == want_w.dtype == logits.dtype, case
    assert torch.equal(got_ids, want_ids), (case, got_ids, want_ids)
    rtol = 1e-6 if logits.dtype == torch.float32 else 8e-3  # bf16: one rounding step apart at most
    torch.testing.assert_close(got_w, want_w, rtol=rtol, atol=0, msg=lambda m: f"{case}: {m}")
    return got_w, got_ids
'''

FIXED = COMMON + r'''
torch.manual_seed(0)
V3 = (8, 8, 4)  # top_k, n_group, topk_group at 256 experts
n = 0
for tokens in (1, 3, 64, 130):
    logits = torch.randn(tokens, 256, device=device) * 2
    for dtype in (torch.float32, torch.bfloat16):
        # a bias as large as the scores' spread: it changes the choice
        bias = torch.randn(256, device=device) * 0.2
        for renormalize in (True, False):
            for routing in ROUTINGS if tokens < 130 else [ROUTINGS[n % 3]]:
                check(logits.to(dtype), bias, *V3, renormalize, (2.5, 1.0)[n % 2], routing,
                      (tokens, dtype, renormalize, routing))
                n += 1

# crafted at 256 experts (logits 0: every score 0.5; the bias sets each choice value exactly)
bias = torch.full((256,), -1.0, device=device)
bias[0:64] = 0.5  # groups 0 and 1: two best sum 2.0
bias[64] = bias[65] = 0.5  # group 2: two best sum 2.0
bias[96] = 1.0  # group 3: 1.5 + 0.5 = 2.0, the same sum from unequal experts
bias[97] = 0.0
bias[224] = 1.75  # group 7: its best alone (2.25) is the largest, its two best (2.25 - 0.5 = 1.75) are not
logits = torch.zeros(2, 256, device=device)
logits[1] = torch.randn(256, device=device)  # row 1: the reference's word only
for renormalize in (True, False):
    w, ids = check(logits, bias, *V3, renormalize, 2.5, case=("crafted", renormalize))
    # row 0: groups 0..3 (equal sums: the lower; not 7), then 96 (1.5), then the equal 1.0s lowest first
    assert ids[0].tolist() == [96, 0, 1, 2, 3, 4, 5, 6], ids
    plain = torch.full((8,), 0.5)  # the bias chose, the unbiased scores weigh
    want = plain / plain.sum() * 2.5 if renormalize else plain * 2.5
    torch.testing.assert_close(w[0].cpu(), want)

# all equal: the lowest groups, the lowest experts
logits = torch.zeros(1, 256, device=device)
_, ids = check(logits, torch.zeros(256, device=device), *V3, True, 1.0)
assert ids.tolist() == [list(range(8))], ids
# fewer experts in the kept groups than top_k: the rest from the dropped ones, lowest first (as torch's -inf)
check(torch.randn(4, 16, device=device), torch.zeros(16, device=device), 6, 8, 2, True, 1.0, case="short")
# groups of one expert (its best alone), layouts that are no power of two, DeepSeek-V2's 160 experts
for experts, n_group, topk_group, top_k in ((8, 8, 3, 2), (12, 3, 1, 4), (160, 8, 3, 6), (96, 3, 2, 5)):
    check(torch.randn(5, experts, device=device), torch.randn(experts, device=device) * 0.3, top_k, n_group,
          topk_group, True, 2.5, case=(experts, n_group, topk_group, top_k))
# no tokens; layouts the router cannot take
w, ids = triton_route.biased_grouped_topk(torch.empty(0, 256, device=device), torch.zeros(256, device=device),
                                          8, 8, 4, True, 1.0, Routing(torch.device(device)).mode)
assert w.shape == ids.shape == (0, 8)
for bad, word in (((8, 6, 4), "n_group"), ((8, 8, 9), "topk_group"), ((300, 8, 4), "top_k")):
    try:
        check(torch.randn(1, 256, device=device), torch.zeros(256, device=device), *bad, True, 1.0)
    except ValueError as e:
        assert word in str(e), e
    else:
        raise AssertionError(bad)

if device == "cuda":  # captured once, replayed under each routing: mode is read on the device
    logits = torch.randn(4, 256, device=device).bfloat16()
    bias = torch.randn(256, device=device) * 0.2
    r = Routing(torch.device(device))
    call = lambda: triton_route.biased_grouped_topk(logits, bias, 8, 8, 4, True, 2.5, r.mode)
    call()  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for routing in ROUTINGS:
        r.set(routing)
        graph.replay()
        want_w, want_ids = reference(logits, bias, 8, 8, 4, True, 2.5)
        assert torch.equal(out[1], r.apply(want_ids, 256)), routing
        torch.testing.assert_close(out[0], want_w, rtol=8e-3, atol=0)
print("ok")
'''

HYPOTHESIS = COMMON + r'''
from hypothesis import given, settings
from hypothesis import strategies as st

# few logits and biases: equal scores, equal group sums, a bias that flips a choice. The logits' fp32 sigmoids
# are the same in numpy (the interpreter) and torch: a sum equal in reals (0.25 + s(a) + 1 + s(b) against
# 1 + s(a) + 0.25 + s(b)) then rounds alike in both (at -1 and -2 they differ by one ulp: not drawn)
LAYOUTS = st.sampled_from([(8, 1, 1, 2), (8, 4, 2, 3), (16, 4, 2, 4), (16, 8, 3, 5), (32, 8, 4, 8),
                           (12, 3, 1, 4), (256, 8, 4, 8)])  # (experts, n_group, topk_group, top_k)


@settings(max_examples=int(sys.argv[2]), deadline=None, database=None)
@given(layout=LAYOUTS, data=st.data(), renormalize=st.booleans(), scale=st.sampled_from([1.0, 2.5]),
       routing=st.sampled_from(ROUTINGS))
def router_equals_torch(layout, data, renormalize, scale, routing):
    experts, n_group, topk_group, top_k = layout
    tokens = data.draw(st.integers(1, 6))
    values = st.sampled_from([-3.0, -1.5, -0.5, 0.0, 0.5, 1.0, 3.0])
    logits = torch.tensor(data.draw(st.lists(st.lists(values, min_size=experts, max_size=experts),
                                             min_size=tokens, max_size=tokens)), device=device)
    bias = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.0, -0.25, 0.25, 1.0, -8.0]),
                                           min_size=experts, max_size=experts)), device=device)
    check(logits, bias, top_k, n_group, topk_group, renormalize, scale, routing)


router_equals_torch()
print("ok")
'''

BACKEND = COMMON + r'''
import types
from autoprofile.engine.attention import aiter_triton, get_backend_class
from autoprofile.layers.moe import GroupedTopk

# AITER's Triton modules need a GPU driver to import: a stand-in loader (the router is ours)
aiter_triton.load_aiter_triton = lambda: types.SimpleNamespace(seq_partition_size=aiter_triton.SEQ_PARTITION)
calls = []
real = triton_route.biased_grouped_topk
triton_route.biased_grouped_topk = lambda *a, **k: calls.append(1) or real(*a, **k)
ours = aiter_triton.AiterTritonBackend(4, 4, 16, 16, torch.bfloat16, torch.device(device))
torch_ops = get_backend_class("torch")(4, 4, 16, 16, torch.bfloat16, torch.device(device))
torch.manual_seed(1)
logits = (torch.randn(6, 256, device=device) * 2).bfloat16()
grouped = GroupedTopk(torch.randn(256, device=device) * 0.2, 8, 4)
for routing in ROUTINGS:
    r = Routing(torch.device(device))
    r.set(routing)
    before = len(calls)
    got = ours.route_experts(logits, 8, True, 2.5, r, grouped)
    want = torch_ops.route_experts(logits, 8, True, 2.5, r, grouped)
    assert len(calls) == before + 1, "the grouped router did not take the kernel"
    assert torch.equal(got[1], want[1]), (routing, got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=8e-3, atol=0)
    if routing == "worst":
        assert got[1].tolist() == [list(range(8))] * 6
print("ok")
'''


def test_the_grouped_router_kernel_equals_the_torch_router():
    run_script(FIXED, "cpu")


def test_the_grouped_router_kernel_equals_the_torch_router_under_hypothesis():
    run_script(HYPOTHESIS, "cpu", "120")


def test_aiter_triton_routes_noaux_tc_through_the_kernel():
    run_script(BACKEND, "cpu")
