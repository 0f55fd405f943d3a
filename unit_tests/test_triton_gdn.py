"""Our Gated DeltaNet decode kernel (kernels.triton_gdn) against the torch reference (layers.gdn), on the CPU
through Triton's interpreter (in a subprocess: the flag is read when the kernel module is imported): the
outputs, the states of the rows' slots advanced in place, every other slot untouched, strided q/k/v as the
model's split hands them over, and grouped value heads (each key head serving Hv / Hk of them)."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = r'''
import torch
from autoprofile.kernels import triton_gdn
from autoprofile.layers import gdn

torch.manual_seed(0)
for b, hk, hv, kd, vd, slots_n in [(3, 2, 4, 16, 40, 6), (1, 1, 1, 32, 32, 2), (5, 2, 6, 8, 8, 9)]:
    qkv = torch.randn(b, 2 * hk * kd + hv * vd)  # the conv's output: q, k, v are views with its row stride
    q, k, v = qkv.split([hk * kd, hk * kd, hv * vd], dim=-1)
    q, k, v = q.reshape(b, hk, kd), k.reshape(b, hk, kd), v.reshape(b, hv, vd)
    g, beta = -torch.rand(b, hv), torch.rand(b, hv)
    ssm = torch.randn(slots_n, hv, kd, vd) * 0.1
    slots = torch.randperm(slots_n)[:b]
    ref_ssm = ssm.clone()
    ref = gdn.delta_rule_decode(q, k, v, g, beta, ref_ssm, slots)
    got = triton_gdn.decode(q, k, v, g, beta, ssm, slots)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm, ref_ssm, rtol=1e-5, atol=1e-5)
    others = [i for i in range(slots_n) if i not in slots.tolist()]
    assert torch.equal(ssm[others], ref_ssm[others])
print("ok")
'''


def test_gdn_decode_matches_the_torch_reference_in_place_by_slot():
    run_script(CHECK)
