"""A budget of kernels per MoE decode layer (issue 34: batch-1 decode is launch-bound): one decode forward of
tiny-moe (Qwen3-MoE: q/k norm), tiny-mla (DeepSeek-V2: MLA, shared experts) and tiny-hybrid-moe (Qwen3.5-MoE)
with the aiter_triton backend,
on the CPU through Triton's interpreter (unit_tests/decode_ops.py counts the torch ops that launch a kernel and
the Triton launches). A fusion undone (a torch rope, a separate sum or residual add, per-layer slot math) goes
over the budget."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
              pytest.mark.skipif(importlib.util.find_spec("aiter") is None, reason="amd-aiter not installed"),
              pytest.mark.slow]

CHECK = r'''
import sys
from unit_tests.decode_ops import ops_per_layer

name, budget = sys.argv[1], int(sys.argv[2])
must = dict(arg.split("=") for arg in sys.argv[3:])
total, layer, layers = ops_per_layer(name)
shown = ", ".join(f"{op} x{c}" for op, c in sorted(layer.items()))
assert sum(layer.values()) <= budget, f"{name}: {sum(layer.values())} ops in an MoE decode layer > {budget}: {shown}"
for op, count in must.items():
    assert total[op] == int(count), f"{name}: {op} x{total[op]} in the forward, expected {count}: {shown}"
print("ok")
'''

# Before the fusions (same counter): tiny-moe 37 ops per MoE layer, tiny-mla 50
CASES = {
    # rope_store with the q/k norm once a layer (4 layers), the experts' sum + residual one kernel, no index_put
    "tiny-moe": (13, {"triton._rope_store_kernel": 4, "triton._moe_sum_kernel": 3, "aten.index_put_": 0,
                      "aten.sum": 0}),
    # MLA's rope/norm/store one kernel a layer; the absorbed decode one kernel a layer over the block tables
    # (and the splits' merge: one row takes several), no token slots
    "tiny-mla": (22, {"triton._mla_rope_store_kernel": 4, "triton._mla_decode_kernel": 4,
                      "triton._kv_slots_kernel": 0, "aten.cumsum": 0, "triton._moe_sum_kernel": 3,
                      "aten.index_put_": 0, "aten.stack": 0}),
    # Qwen3.5-MoE (its last layer: gated attention + MoE with a gated shared expert; 48 before, 44 with the
    # gates fused): each sigmoid gate one kernel (no fp32 casts around it), the q/k norm, partial RoPE and K/V
    # store one rope_store (no casts, no index_put), the linear layers' decode in one rule kernel each
    "tiny-hybrid-moe": (21, {"aten._to_copy": 0, "aten.sigmoid": 5, "triton._gdn_decode_kernel": 3,
                             "triton._moe_sum_kernel": 4, "triton._rope_store_kernel": 1,
                             "aten.index_put_": 0}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_moe_decode_layer_stays_within_its_kernel_budget(name):
    budget, must = CASES[name]
    run_script(CHECK, name, str(budget), *(f"{op}={c}" for op, c in must.items()))
