"""Our Gated DeltaNet decode kernels (kernels.triton_gdn) against the torch reference (layers.gdn), on the CPU
through Triton's interpreter (in a subprocess: the flag is read when the kernel module is imported): the
outputs, the states of the rows' slots advanced in place, every other slot untouched, strided q/k/v as the
model's split hands them over, grouped value heads (each key head serving Hv / Hk of them), and every launch
variant the rule may pick (launch_rules.GdnLaunch): blocks, heads a program, the conv step fused or apart, the
gated norm in the kernel or apart."""
from __future__ import annotations

import importlib.util

import pytest

from autoprofile.kernels import launch_rules
from autoprofile.kernels.launch_rules import GdnLaunch
from unit_tests.interpreter import run_script

triton_missing = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = r'''
import torch
from autoprofile.kernels import triton_gdn
from autoprofile.kernels.launch_rules import GdnLaunch
from autoprofile.layers import gdn

torch.manual_seed(0)
for (b, hk, hv, kd, vd, slots_n), launch in [((3, 2, 4, 16, 40, 6), GdnLaunch()),
                                             ((1, 1, 1, 32, 32, 2), GdnLaunch(block_v=16, stages=2)),
                                             ((5, 2, 6, 8, 8, 9), GdnLaunch(block_v=8, heads=3, warps=2)),
                                             ((2, 1, 2, 16, 80, 4), GdnLaunch(block_v=64))]:  # the served rule's
    qkv = torch.randn(b, 2 * hk * kd + hv * vd)  # the conv's output: q, k, v are views with its row stride
    q, k, v = qkv.split([hk * kd, hk * kd, hv * vd], dim=-1)
    q, k, v = q.reshape(b, hk, kd), k.reshape(b, hk, kd), v.reshape(b, hv, vd)
    g, beta = -torch.rand(b, hv), torch.rand(b, hv)
    ssm = torch.randn(slots_n, hv, kd, vd) * 0.1
    slots = torch.randperm(slots_n)[:b]
    ref_ssm = ssm.clone()
    ref = gdn.delta_rule_decode(q, k, v, g, beta, ref_ssm, slots)
    got = triton_gdn.decode(q, k, v, g, beta, ssm, slots, launch)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm, ref_ssm, rtol=1e-5, atol=1e-5)
    others = [i for i in range(slots_n) if i not in slots.tolist()]
    assert torch.equal(ssm[others], ref_ssm[others])
print("ok")
'''

# a layer's decode rows from its projections: 2 key heads, 3 value heads each (Qwen3.5's grouping), v_dim 24
# (not a power of two: masked channels), a conv of 4 taps; two steps, so the second reads the windows and
# states the first wrote
LAYER = r'''
import sys
import torch
from autoprofile.kernels import triton_gdn
from autoprofile.kernels.launch_rules import GdnLaunch
from autoprofile.layers import gdn

launch, dt = eval(sys.argv[1]), getattr(torch, sys.argv[2])
tol = {"rtol": 1e-5, "atol": 1e-5} if dt == torch.float32 else {"rtol": 5e-2, "atol": 1e-1}  # a rounding flip
torch.manual_seed(0)
b, hk, hv, kd, vd, slots_n, kw = 3, 2, 6, 16, 24, 7, 4
c = 2 * hk * kd + hv * vd
qkvz = torch.randn(2, b, c + hv * vd, dtype=dt)  # qkv, z: views with the projection's row stride (Qwen3-Next)
ba = (torch.randn(2, b, 2 * hv) * 3).to(dt)
weight, a_log, dt_bias = torch.randn(c, 1, kw, dtype=dt), torch.randn(hv), torch.randn(hv)
norm = torch.randn(vd, dtype=dt)
conv, ssm = torch.randn(slots_n, c, kw - 1, dtype=dt), torch.randn(slots_n, hv, kd, vd) * 0.1  # fp32 state
slots = torch.randperm(slots_n)[:b]
ref_conv, ref_ssm = conv.clone(), ssm.clone()
for step in range(2):
    qkv, z = qkvz[step].split([c, hv * vd], dim=-1)
    args = (qkv, z, ba[step], weight, a_log, dt_bias, norm, 1e-6)
    want = gdn.decode_layer(*args, ref_conv, ref_ssm, slots)
    if step:  # into the caller's rows (the piecewise graphs' static output): nothing else of it written
        static = torch.full((b + 2, hv * vd), float("nan"), dtype=dt)
        got = triton_gdn.decode_layer(*args, conv, ssm, slots, launch, out=static[1:1 + b])
        assert got.data_ptr() == static[1].data_ptr() and static[[0, b + 1]].isnan().all()
    else:
        got = triton_gdn.decode_layer(*args, conv, ssm, slots, launch)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(conv, ref_conv), "conv windows"
    torch.testing.assert_close(ssm, ref_ssm, **tol)
others = [i for i in range(slots_n) if i not in slots.tolist()]
assert torch.equal(ssm[others], ref_ssm[others]) and torch.equal(conv[others], ref_conv[others])
print("ok")
'''

# prefill rows through the conv's two launches, as the GPU backend's gdn_prefill runs them: rows shorter than
# the window (1 and 2 tokens: their new window keeps part of the old), a long one, slots out of order; x a
# view with the projection's row stride; then the rule and the gated norm on the conv's q, k, v against the
# reference layer (layers.gdn.prefill_layer), windows and states moved on at the rows' slots only; then the
# backend's layer itself
PREFILL = r'''
import sys
import torch
from autoprofile.kernels import triton_gdn
from autoprofile.layers import gdn

dt = getattr(torch, sys.argv[1])
tol = {"rtol": 1e-5, "atol": 1e-5} if dt == torch.float32 else {"rtol": 5e-2, "atol": 1e-1}
torch.manual_seed(0)
hk, hv, kd, vd, slots_n, kw = 2, 6, 16, 24, 7, 4
c = 2 * hk * kd + hv * vd
lens = [1, 37, 2, 5]
t = sum(lens)
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
slots = torch.tensor([5, 0, 3, 6])
qkvz = torch.randn(t, c + hv * vd, dtype=dt)
qkv, z = qkvz.split([c, hv * vd], dim=-1)
ba = (torch.randn(t, 2 * hv) * 3).to(dt)
weight, a_log, dt_bias = torch.randn(c, kw, dtype=dt), torch.randn(hv), torch.randn(hv)
norm = torch.randn(vd, dtype=dt)
conv, ssm = torch.randn(slots_n, c, kw - 1, dtype=dt), torch.randn(slots_n, hv, kd, vd) * 0.1
conv0, ssm0 = conv.clone(), ssm.clone()
ref_conv, ref_ssm = conv.clone(), ssm.clone()
want_c = gdn.conv_prefill(qkv, weight, ref_conv.clone(), slots, cu)
q, k, v = triton_gdn.conv_prefill(qkv, weight, conv, slots, cu, hk, kd, hv, vd)
assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
for got, want in zip((q, k, v), gdn.split_qkv(want_c, hk, kd, hv, vd)):
    torch.testing.assert_close(got, want, **tol)
want = gdn.prefill_layer(qkv, z, ba, weight, a_log, dt_bias, norm, 1e-6, ref_conv, ref_ssm, slots, cu)
assert torch.equal(conv, ref_conv), "conv windows"
o = gdn.delta_rule_prefill(q, k, v, *gdn.gating(ba, a_log, dt_bias), ssm, slots, cu)
got = triton_gdn.gated_rms_norm(o, z, norm, 1e-6)
torch.testing.assert_close(got, want, **tol)
torch.testing.assert_close(ssm, ref_ssm, **tol)
others = [i for i in range(slots_n) if i not in slots.tolist()]
assert torch.equal(ssm[others], ref_ssm[others]) and torch.equal(conv[others], ref_conv[others])

# the GPU backend's layer (AiterTritonBackend.gdn_prefill, its kernels here through the interpreter) from the
# same windows and states: the reference's output, each token's row derived once for a forward's layers
from types import SimpleNamespace
from autoprofile.engine.attention.aiter_triton import AiterTritonBackend
from autoprofile.layers.attention import AttentionMetadata
conv, ssm, ref_conv, ref_ssm = conv0.clone(), ssm0.clone(), conv0.clone(), ssm0.clone()
meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.zeros(t, dtype=torch.long), cu_seqlens=cu,
                         max_seqlen=max(lens), state_slots=slots,
                         gdn_chunk_indices=torch.from_numpy(gdn.chunk_indices(cu.numpy())))
backend = SimpleNamespace(triton_gdn=triton_gdn)
chunks_seen, rule = [], gdn.delta_rule_prefill
def recording(*args):  # fla's chunk indices as the backend hands them to the rule (unused on a CPU); the
    if len(args) > 8:  # reference's calls pass none
        chunks_seen.append(args[8])
    return rule(*args)
gdn.delta_rule_prefill = recording
for layer in range(2):
    want = gdn.prefill_layer(qkv, z, ba, weight, a_log, dt_bias, norm, 1e-6, ref_conv, ref_ssm, slots, cu)
    got = AiterTritonBackend.gdn_prefill(backend, qkv, z, ba, weight, a_log, dt_bias, norm, 1e-6, conv, ssm,
                                         meta)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(conv, ref_conv), "conv windows"
    torch.testing.assert_close(ssm, ref_ssm, **tol)
assert torch.equal(meta._per_forward["gdn_token_rows"], torch.repeat_interleave(torch.arange(len(lens)),
                                                                                 torch.tensor(lens)))
# the step's uploaded indices, handed to every layer (no sync a layer on a GPU), one (row, chunk) a 64 tokens
assert len(chunks_seen) == 2 and chunks_seen[0] is chunks_seen[1] is meta.gdn_chunk_indices
assert chunks_seen[0].tolist() == [[i, j] for i, n in enumerate(lens) for j in range(-(-n // 64))]
assert meta._per_forward["gdn_cu_seqlens"].dtype == torch.int64
print("ok")
'''

LAYER_LAUNCHES = {
    "apart": GdnLaunch(),  # conv kernel, rule with its gates, norm kernel
    "apart-norm-fused": GdnLaunch(block_v=32, heads=2, warps=2),  # a block holds a head: the norm in the rule
    "apart-3-heads": GdnLaunch(block_v=8, heads=3, stages=2),
    "conv-fused": GdnLaunch(block_v=8, fuse_conv=True, stages=2),  # a key head's 3 heads x 3 blocks in a loop
    "conv-norm-fused": GdnLaunch(block_v=32, warps=8, fuse_conv=True),  # one launch for the layer
}


GATES = r'''
import sys
import torch
from autoprofile.kernels import triton_gdn
from autoprofile.layers import gdn

dt = getattr(torch, sys.argv[1])
torch.manual_seed(0)
for t, hv in ((1, 4), (33, 48), (70, 32)):  # tokens past a program's 32; value heads not a power of two
    ba = (torch.randn(t, 2 * hv) * 8).to(dt)  # a + dt_bias past softplus's threshold of 20 and below it
    ba[0, hv] = 30.0
    a_log, dt_bias = torch.randn(hv), torch.randn(hv) * 4
    g, beta = triton_gdn.gates(ba, a_log, dt_bias)
    want_g, want_beta = gdn.gating(ba, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dt and g.is_contiguous() and beta.is_contiguous()
    torch.testing.assert_close(g, want_g, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(beta, want_beta, rtol=0, atol=1e-2 if dt == torch.bfloat16 else 1e-6)
g, beta = triton_gdn.gates(torch.zeros(0, 8), torch.zeros(4), torch.zeros(4))
assert g.shape == beta.shape == (0, 4)
print("ok")
'''


@triton_missing
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_gates_in_one_launch_equal_the_reference(dtype):
    run_script(GATES, dtype)


@triton_missing
def test_gdn_decode_matches_the_torch_reference_in_place_by_slot():
    run_script(CHECK)


@triton_missing
@pytest.mark.parametrize("name", LAYER_LAUNCHES)
def test_a_layers_decode_rows_match_the_reference_with_every_launch_variant(name):
    run_script(LAYER, repr(LAYER_LAUNCHES[name]), "float32")


@triton_missing
@pytest.mark.parametrize("name", ["apart", "conv-norm-fused"])
def test_bf16_rows_keep_the_references_roundings(name):
    """A bf16 model (fp32 state): the conv's output, beta and the norm's product rounded where the
    reference rounds them (the interpreter's bf16 multiply gave 5e37 for the norm's weight x rows)."""
    run_script(LAYER, repr(LAYER_LAUNCHES[name]), "bfloat16")


def test_the_launch_rule_reads_its_table_by_padded_rows():
    table = ((8, GdnLaunch(block_v=64)), (128, GdnLaunch(heads=3, fuse_conv=True)), (1 << 30, GdnLaunch()))
    assert launch_rules.gdn_decode_launch(1, 16, 48, 128, table).block_v == 64
    assert launch_rules.gdn_decode_launch(64, 16, 48, 128, table) == GdnLaunch(heads=3, fuse_conv=True)
    assert launch_rules.gdn_decode_launch(512, 16, 48, 128, table) == GdnLaunch()
    # heads that do not divide the value heads fall back to 1; a conv fused needs whole key-head groups
    assert launch_rules.gdn_decode_launch(64, 7, 50, 128, table) == GdnLaunch(heads=1, fuse_conv=False)
    assert launch_rules.gdn_decode_launch(4, 16, 48, 128) == launch_rules.GDN_DECODE_LAUNCHES[0][1]


@triton_missing
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_rows_conv_and_layer_match_the_reference_in_place_by_slot(dtype):
    run_script(PREFILL, dtype)
