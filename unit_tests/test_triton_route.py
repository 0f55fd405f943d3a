"""Our one-launch router (kernels.triton_route) on the CPU through Triton's interpreter (TRITON_INTERPRET=1,
in a subprocess: the flag is read when a kernel module is imported) against the torch path (layers.moe.route,
then Routing.apply): the same ids, weights within 1e-6 relative in fp32 (bf16: the same rounding of nearly
the same fp32 values), under the router's own, the worst and the balanced routing. On a GPU the same script
runs compiled (tests/test_moe_gpu.py), and once captured in a CUDA graph that then replays each routing."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

ROUTE = r'''
import itertools
import sys
import torch
from autoprofile.kernels.triton_route import route_topk
from autoprofile.layers.moe import ROUTINGS, Routing, route

device = sys.argv[1]
torch.manual_seed(0)


def check(logits, top_k, renormalize, scale, r, case):
    got_w, got_ids = route_topk(logits, top_k, renormalize, scale, r.mode)
    want_w, want_ids = route(logits, top_k, renormalize, scale)
    want_ids = r.apply(want_ids, logits.shape[1])
    assert got_ids.dtype == torch.int32 and got_w.dtype == want_w.dtype == logits.dtype, case
    assert torch.equal(got_ids, want_ids), (case, got_ids, want_ids)
    rtol = 1e-6 if logits.dtype == torch.float32 else 8e-3  # bf16: one rounding step apart at most
    torch.testing.assert_close(got_w, want_w, rtol=rtol, atol=0, msg=lambda m: f"{case}: {m}")


options = list(itertools.product((6, 8), (True, False), (1.0, 1.5)))  # top_k, renormalize, scale
n = 0
for tokens in (1, 3, 64, 300):
    for experts in (64, 128):
        # bf16 logits tie often (8 bits) and torch.topk orders ties its own way: distinct sixteenths there
        distinct = torch.rand(tokens, experts, device=device).argsort(1) / 16 - 2
        for dtype, logits in ((torch.float32, torch.randn(tokens, experts, device=device) * 3),
                              (torch.bfloat16, distinct.bfloat16())):
            for routing in ROUTINGS:
                r = Routing(torch.device(device))
                r.set(routing)
                # 300 tokens (slow in the interpreter): each routing at one of the options, in turn
                for top_k, renormalize, scale in options if tokens < 300 else [options[n % len(options)]]:
                    check(logits, top_k, renormalize, scale, r,
                          (tokens, experts, dtype, top_k, renormalize, scale, routing))
                    n += 1
# experts not a power of two (DeepSeek-V2's 160), k not one either
r = Routing(torch.device(device))
check(torch.randn(5, 160, device=device), 3, True, 2.5, r, "160 experts")
# equal probabilities: the lower expert first; a row of -inf but k experts: those k, in order
logits = torch.zeros(2, 64, device=device)
logits[1, :60] = float("-inf")
_, ids = route_topk(logits, 4, True, 1.0, r.mode)
assert ids.tolist() == [[0, 1, 2, 3], [60, 61, 62, 63]], ids
# no tokens
w, ids = route_topk(torch.empty(0, 64, device=device), 8, True, 1.0, r.mode)
assert w.shape == ids.shape == (0, 8)

if device == "cuda":  # captured once, replayed under each routing: mode is read on the device
    logits = torch.randn(4, 128, device=device).bfloat16()
    route_topk(logits, 8, True, 1.0, r.mode)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = route_topk(logits, 8, True, 1.0, r.mode)
    for routing in ROUTINGS:
        r.set(routing)
        graph.replay()
        want_w, want_ids = route(logits, 8, True)
        assert torch.equal(out[1], r.apply(want_ids, 128)), routing
        torch.testing.assert_close(out[0], want_w, rtol=8e-3, atol=0)
print("ok")
'''


@pytest.mark.slow  # minutes on 2 cores (the interpreter or a crowd); the slow run has it
def test_the_one_launch_router_equals_route_then_the_forced_routing():
    run_script(ROUTE, "cpu")
