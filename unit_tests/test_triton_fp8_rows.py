"""The multi-row FP8 GEMV (kernels.triton_fp8_rows: 2 to 16 rows on CUDA cores, each weight byte read once)
on the CPU through Triton's interpreter, against layers.quant's dequantized references: every row count of
each padded ROWS (M below it masked), ragged N and K, per-channel and block scales (128 x 128 and a 64 x 128
block), activations in the model's dtype (W8A16) or quantized per row or per K group (Fp8Rows), K steps
inside a scale block and across several, each step's columns summed 1, 16 or all at a time, bias, and the
residual added in the epilogue. Then triton_fp8.linear's dispatch: the multi-row GEMV at 2..GEMV_ROWS_MAX rows
where its table says, the skinny GEMM past them. The interpreter has no bfloat16: float32/float16 here."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script
from unit_tests.test_triton_fp8_skinny import SETUP

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

ROWS = SETUP + r'''
from autoprofile.kernels import triton_fp8_rows as g
from autoprofile.kernels.launch_rules import GemvRowsLaunch
# K steps of 64 (two a 128-wide scale block: one scale a step), 256 (several blocks a step: a scale per
# summed column group); columns summed 16, 1 (every product kept) and the whole step at a time
FEW = (GemvRowsLaunch(4, 64, 16, 1), GemvRowsLaunch(2, 256, 1, 1), GemvRowsLaunch(8, 256, 256, 2))
'''

KERNEL = ROWS + r'''
import itertools, sys
FULL, checked = sys.argv[1:] == ["full"], []
CASES = [((37, 300), (CHANNEL, BLOCK, BLOCK_TOKEN, TALL), (1, 3, 8), FEW),
         ((130, 1000), (CHANNEL, BLOCK), (2, 5), FEW[:1])]  # interpreted: minutes past these
for (n, k), schemes, ms, launches in CASES:
    for (i, scheme), (j, launch) in itertools.product(enumerate(schemes), enumerate(launches)):
        # the full grid, or each (scheme, launch) at one row count, the row counts rotating (each scheme
        # and each launch still meets every row count): a third of the grid's 5 minutes interpreted
        for m in ms if FULL else ms[(i + j) % len(ms)::len(ms)]:
            check_rows(g.gemv, n, k, m, scheme, launch)
            checked.append(m)
assert len(checked) == (4 * 3 * 3 + 2 * 2 if FULL else 4 * 3 + 2) and set(checked) == {1, 2, 3, 5, 8}, checked
# 16 rows, the widest ROWS; the residual added in the epilogue, in place, from bf16-like and FP8 rows
wq, ws, block, deq = weight(24, 520, BLOCK)
for m in (16, 6):
    x, res = torch.randn(m, 520), torch.randn(m, 24)
    keep = res.clone()
    out = g.gemv(x, None, wq, ws, block, torch.float32, FEW[0], residual=res)
    assert out is res
    close(res, keep + x @ deq.T, 1e-5, ("residual", m))
    rows, keep = rows_of(x, BLOCK), res.clone()
    g.linear(rows, wq, ws, block, FEW[1], residual=res)
    close(res, keep + q.fp8_linear_reference(rows, wq, ws, BLOCK), 1e-5, ("fp8 residual", m))
# a strided input: rows of a wider tensor, through linear, with leading dims kept
wide = torch.randn(5, 700)
got = g.linear(wide[:, :520].reshape(1, 5, 520), wq, ws, block, FEW[2])
assert got.shape == (1, 5, 24)
close(got[0], wide[:, :520] @ deq.T, 1e-5, "strided")
print("ok")
'''

DISPATCH = ROWS + r'''
from autoprofile.kernels.launch_rules import GEMV_ROWS_MAX, fp8_gemv_rows_launch, fp8_skinny_launch
calls = {"rows": [], "skinny": []}
originals = {"rows": g.linear, "skinny": s.linear}


def counting(kind):
    def call(*args, **kw):
        calls[kind].append(args[0].shape[0] if torch.is_tensor(args[0]) else args[0].q.shape[0])
        return originals[kind](*args, **kw)
    return call


triton_fp8.triton_fp8_rows.linear = counting("rows")
triton_fp8.triton_fp8_skinny.linear = counting("skinny")
n, k = 130, 1000
for scheme in (CHANNEL, BLOCK):
    wq, ws, block, deq = weight(n, k, scheme)
    is_block = block is not None
    for m in range(1, 40):
        x = torch.randn(m, k).half()
        got = triton_fp8.linear(x, wq, ws, scheme)
        close(got, x.float() @ deq.T, 2e-3 if m < 33 else 0.1, (scheme.weight, m))  # past 32: x quantized
        few = fp8_gemv_rows_launch(m, n, k, block=is_block) is not None
        skinny = not few and fp8_skinny_launch(m, n, k, block=is_block) is not None
        assert calls["rows"] == ([m] if few else []), (m, calls)
        assert calls["skinny"] == ([m] if skinny else []), (m, calls)
        calls["rows"].clear(), calls["skinny"].clear()
    # the measured tables' shape: the GEMV from 2 rows, the skinny GEMM after it up to 32
    takes = [m for m in range(1, 65) if fp8_gemv_rows_launch(m, n, k, block=is_block) is not None]
    assert takes and takes[0] == 2 and takes == list(range(2, takes[-1] + 1)) and takes[-1] <= GEMV_ROWS_MAX
    # FP8 rows from a producer and the residual, through the GEMV's epilogue
    rows = rows_of(torch.randn(2, k).half(), scheme)
    res = torch.randn(2, n).half()
    keep = res.clone()
    assert triton_fp8.linear(rows, wq, ws, scheme, residual=res) is res and calls["rows"] == [2]
    close(res, keep.float() + q.fp8_linear_reference(rows, wq, ws, scheme), 2e-3, "fp8 rows")
    calls["rows"].clear()
print("ok")
'''


def test_multi_row_gemv_equals_the_dequantized_matmul_at_1_to_16_rows():
    run_script(KERNEL)


@pytest.mark.slow
def test_multi_row_gemv_over_the_full_grid_of_schemes_launches_and_rows():
    run_script(KERNEL, "full")


def test_linear_sends_2_to_gemv_rows_max_rows_to_the_gemv_and_more_to_the_skinny_gemm():
    run_script(DISPATCH)
