"""The skinny FP8 GEMM's split-K launches (SkinnyLaunch.split_k; kernels.triton_fp8_skinny) on the CPU through
Triton's interpreter, against layers.quant's dequantized references: rows 1 to 64, ragged N and K (a K tail
inside a tile and a block scale), per-channel and block scales, rows in the model's dtype or the producers'
Fp8Rows, bias, the residual, rows of a wider tensor; a split's partials summed in split order (the same bits
twice), its tile counters back at zero after each call. The interpreter has no bfloat16."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script
from unit_tests.test_triton_fp8_skinny import SETUP

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

DEFS = SETUP + r'''
from autoprofile.kernels.launch_rules import fp8_skinny_launch

# block_k 64: two K steps a 128-wide scale block; split_k 3 over 1040's 17 steps (the last split short)
VARIANTS = (SkinnyLaunch(16, 64, 4, 1, split_k=3), SkinnyLaunch(16, 128, 4, 1, split_k=4),
            SkinnyLaunch(32, 64, 4, 2, split_k=2))


def check(n, k, m, scheme, cfg):
    wq, ws, block, deq = weight(n, k, scheme)
    launch = fp8_skinny_launch(m, n, k, ((64, cfg),)) if m > 1 else cfg
    bias = torch.randn(n)
    what = (n, k, scheme.weight, scheme.block, m, launch)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        x = torch.randn(m, k).to(dtype)
        got = s.gemm(x, None, wq, ws, block, dtype, launch, bias.to(dtype))
        want = x.float() @ deq.T
        close(got, want + bias.to(dtype).float(), tol, what + (dtype,))
        if launch.split_k > 1:
            assert torch.equal(got, s.gemm(x, None, wq, ws, block, dtype, launch, bias.to(dtype))), what
    rows = rows_of(torch.randn(m, k), scheme)
    got = s.gemm(rows.q, rows.scale, wq, ws, block, torch.float32, launch, bias)
    close(got, q.fp8_linear_reference(rows, wq, ws, scheme, bias=bias), 1e-5, what + ("fp8",))
    res = torch.randn(m, n)
    keep = res.clone()
    out = s.gemm(rows.q, rows.scale, wq, ws, block, torch.float32, launch, residual=res)
    assert out is res
    close(res, keep + q.fp8_linear_reference(rows, wq, ws, scheme), 1e-5, what + ("residual",))
    wide = torch.randn(m, k + 16)
    got = s.linear(wide[:, :k], wq, ws, block, launch)
    want = wide[:, :k] @ deq.T
    close(got, want, 1e-5, what + ("strided",))
    for counters in s._counters.values():
        assert not counters.any(), what + ("a tile's count left",)

'''

VARIANTS = DEFS + r'''
for cfg in VARIANTS:
    for n, k in [(130, 1040), (37, 300)]:
        for scheme in (CHANNEL, BLOCK, TALL):
            for m in (1, 3, 17):
                check(n, k, m, scheme, cfg)
    check(96, 512, 64, BLOCK_TOKEN, cfg)
print("ok")
'''


# the tables' launch (split-K at 2-64 rows): one shape a scale layout, fast enough for every CI run
TABLES = DEFS + r'''
from autoprofile.kernels import launch_rules
for scheme, table in ((CHANNEL, launch_rules.FP8_SKINNY_LAUNCHES),
                      (BLOCK, launch_rules.FP8_SKINNY_BLOCK_LAUNCHES)):
    cfg = table[-1][1]
    assert cfg.split_k > 1
    for m in (2, 17):
        check(130, 1040, m, scheme, cfg)
print("ok")
'''


def test_the_tables_split_k_launch_equals_the_dequantized_matmul():
    run_script(TABLES)


@pytest.mark.slow
def test_skinny_variants_equal_the_dequantized_matmul():
    run_script(VARIANTS)
