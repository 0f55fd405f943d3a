"""GPU: the skinny FP8 GEMM (kernels.triton_fp8_skinny) and the multi-row FP8 GEMV (kernels.triton_fp8_rows)
compiled, in bf16, against the dequantized fp32 matmul at llama-3.1-8b's shapes and odd ones, 2 to 64 rows
(the GEMV: 2 to 16), channel and 128 x 128 block scales, bf16 rows and the producers' Fp8Rows; one compile for
every row count of a padded tile; the residual added in the epilogue. Then the skinny GEMM's variants
(SkinnyLaunch.split_k) at 2-64 rows, ragged shapes, bias, the residual, strided rows, a split's sum
the same bits twice, and a TMA + split launch replayed in a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from autoprofile.kernels import triton_fp8, triton_fp8_rows, triton_fp8_skinny
from autoprofile.kernels.launch_rules import GemvRowsLaunch, SkinnyLaunch, fp8_gemv_rows_launch
from autoprofile.kernels.launch_rules import fp8_skinny_launch
from autoprofile.layers import quant
from autoprofile.layers.quant import Fp8Rows, Fp8Scheme
from tests.test_fp8_gpu import rel_err, weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CHANNEL, BLOCK = Fp8Scheme("channel"), Fp8Scheme("block", (128, 128), "group")
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (37, 300), (1000, 4100)]
LAUNCHES = [SkinnyLaunch(), SkinnyLaunch(64, 128, 4, 4), SkinnyLaunch(128, 256, 8, 2)]


def rows_for(x: torch.Tensor, scheme: Fp8Scheme) -> Fp8Rows:
    if scheme.activation == "group":
        return Fp8Rows(*triton_fp8.quantize_per_group(x, scheme.block[1]), x.dtype)
    return Fp8Rows(*triton_fp8.quantize_per_token(x), x.dtype)


def weight_case(n: int, k: int, scheme: Fp8Scheme) -> tuple:
    """(weight, its scales, the block or None, the dequantized fp32 weight) on the GPU."""
    wq, ws = weights(n, k, scheme)
    block = tuple(scheme.block) if scheme.weight == "block" else None
    return wq, ws, block, quant.dequantize_weight(wq, ws, scheme)


def check_linear(linear, wq, ws, block, deq, scheme, m: int, launch) -> None:
    """linear(x, weight, weight_scale, block, launch) of m bf16 rows, then of their Fp8Rows, against the
    dequantized fp32 matmul."""
    k = wq.shape[1]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = linear(x, wq, ws, block, launch)
    assert got.dtype == torch.bfloat16 and rel_err(got, x.float() @ deq.T) < 1e-2, (m, launch)
    rows = rows_for(x, scheme)
    got = linear(rows, wq, ws, block, launch)
    want = quant.fp8_linear_reference(rows, wq, ws, scheme).float()
    assert rel_err(got, want) < 1e-2, (m, launch, "fp8 rows")


@pytest.mark.parametrize("scheme", [CHANNEL, BLOCK], ids=["channel", "block"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_skinny_gemm_equals_the_dequantized_matmul(scheme, n, k):
    wq, ws, block, deq = weight_case(n, k, scheme)
    for m in (2, 8, 24, 64):
        for cfg in LAUNCHES:
            check_linear(triton_fp8_skinny.linear, wq, ws, block, deq, scheme, m,
                         fp8_skinny_launch(m, n, k, ((64, cfg),)))
    res = torch.randn(16, n, device="cuda", dtype=torch.bfloat16)
    keep = res.float()
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    out = triton_fp8_skinny.linear(x, wq, ws, block, fp8_skinny_launch(16, n, k, ((64, LAUNCHES[0]),)),
                                   residual=res)
    assert out is res and rel_err(res, keep + x.float() @ deq.T) < 1e-2


def test_one_compile_serves_every_row_count_of_a_tile():
    n, k = 4096, 4096
    wq, ws = weights(n, k, CHANNEL)
    launch = fp8_skinny_launch(17, n, k, ((64, SkinnyLaunch()),))
    kernel = triton_fp8_skinny._skinny_fp8_kernel

    def compiled() -> int:
        return sum(len(cache[0]) for cache in kernel.device_caches.values())

    triton_fp8_skinny.linear(torch.randn(17, k, device="cuda", dtype=torch.bfloat16), wq, ws, None, launch)
    before = compiled()
    for m in range(18, 33):
        triton_fp8_skinny.linear(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), wq, ws, None, launch)
    assert compiled() == before


# ------------------------------------------------------------ the multi-row GEMV (kernels.triton_fp8_rows)
GEMV_LAUNCHES = [GemvRowsLaunch(), GemvRowsLaunch(2, 512, 16, 1), GemvRowsLaunch(8, 512, 16, 4),
                 GemvRowsLaunch(4, 512, 512, 1)]


@pytest.mark.parametrize("scheme", [CHANNEL, BLOCK], ids=["channel", "block"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_multi_row_gemv_equals_the_dequantized_matmul(scheme, n, k):
    wq, ws, block, deq = weight_case(n, k, scheme)
    for m in (2, 3, 8, 16):
        for cfg in GEMV_LAUNCHES:
            check_linear(triton_fp8_rows.linear, wq, ws, block, deq, scheme, m,
                         fp8_gemv_rows_launch(m, n, k, ((16, cfg),), block=block is not None))
    res = torch.randn(2, n, device="cuda", dtype=torch.bfloat16)
    keep = res.float()
    rows = rows_for(torch.randn(2, k, device="cuda", dtype=torch.bfloat16), scheme)
    out = triton_fp8.linear(rows, wq, ws, scheme, residual=res)  # the table's launch, in its epilogue
    want = quant.fp8_linear_reference(rows, wq, ws, scheme).float()
    assert out is res and rel_err(res, keep + want) < 1e-2


def test_one_multi_row_gemv_compile_serves_every_row_count_of_its_rows():
    n, k = 4096, 4096
    wq, ws = weights(n, k, CHANNEL)
    kernel = triton_fp8_rows._gemv_rows_fp8_kernel

    def compiled() -> int:
        return sum(len(cache[0]) for cache in kernel.device_caches.values())

    def run(m: int) -> None:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        triton_fp8_rows.linear(x, wq, ws, None, fp8_gemv_rows_launch(m, n, k, ((16, GemvRowsLaunch()),)))

    run(5)
    before = compiled()
    for m in (6, 7, 8):
        run(m)
    assert compiled() == before


# ------------------------------------------------------------ the skinny GEMM's variants (issue 48)
# split launches: the tables' and a deeper pipeline
VARIANTS = [SkinnyLaunch(64, 256, 4, 3, split_k=8), SkinnyLaunch(64, 128, 4, 4, split_k=8)]
# o_proj's; ragged N and K (a K tail inside a tile and a block scale); a short K (300)
VARIANT_SHAPES = [(4096, 4096), (1000, 4112), (37, 300)]


@pytest.mark.parametrize("scheme", [CHANNEL, BLOCK], ids=["channel", "block"])
@pytest.mark.parametrize("n,k", VARIANT_SHAPES)
def test_skinny_variants_equal_the_dequantized_matmul(scheme, n, k):
    """Each variant at 2-64 rows: bf16 rows and the producers' Fp8Rows, bias, the residual; a split's sum is
    the same bits twice; rows of a wider tensor; the split counters are back at zero after every call."""
    wq, ws, block, deq = weight_case(n, k, scheme)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for cfg in VARIANTS:
        for m in (2, 5, 24, 64):
            launch = fp8_skinny_launch(m, n, k, ((64, cfg),))
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            got = triton_fp8_skinny.linear(x, wq, ws, block, launch, bias=bias)
            assert rel_err(got, x.float() @ deq.T + bias.float()) < 1e-2, (m, launch)
            if launch.split_k > 1:
                assert torch.equal(got, triton_fp8_skinny.linear(x, wq, ws, block, launch, bias=bias))
            if m in (5, 64):
                rows = rows_for(x, scheme)
                got = triton_fp8_skinny.linear(rows, wq, ws, block, launch)
                want = quant.fp8_linear_reference(rows, wq, ws, scheme).float()
                assert rel_err(got, want) < 1e-2, (m, launch, "fp8 rows")
        launch = fp8_skinny_launch(24, n, k, ((64, cfg),))
        res = torch.randn(24, n, device="cuda", dtype=torch.bfloat16)
        keep = res.float()
        rows = rows_for(torch.randn(24, k, device="cuda", dtype=torch.bfloat16), scheme)
        out = triton_fp8_skinny.linear(rows, wq, ws, block, launch, residual=res)
        want = keep + quant.fp8_linear_reference(rows, wq, ws, scheme).float()
        assert out is res and rel_err(res, want) < 1e-2, (launch, "residual")
        wide = torch.randn(7, k + 64, device="cuda", dtype=torch.bfloat16)
        got = triton_fp8_skinny.linear(wide[:, :k], wq, ws, block, fp8_skinny_launch(7, n, k, ((64, cfg),)))
        assert rel_err(got, wide[:, :k].float() @ deq.T) < 1e-2, (launch, "strided rows")
    torch.cuda.synchronize()
    for counters in triton_fp8_skinny._counters.values():
        assert not counters.any(), "a split launch left a tile's count"


def test_split_launch_replays_in_a_cuda_graph():
    """A split launch captured (its partials from the graph's pool), replayed on new rows: the eager result,
    bit for bit."""
    n, k = 4096, 14336
    wq, ws, block, deq = weight_case(n, k, BLOCK)
    launch = fp8_skinny_launch(16, n, k, ((64, VARIANTS[0]),))
    assert launch.split_k > 1
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    rows = rows_for(x, BLOCK)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        triton_fp8_skinny.linear(rows, wq, ws, block, launch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_fp8_skinny.linear(rows, wq, ws, block, launch)
    for _ in range(2):
        fresh = rows_for(torch.randn(16, k, device="cuda", dtype=torch.bfloat16), BLOCK)
        rows.q.copy_(fresh.q)
        rows.scale.copy_(fresh.scale)
        graph.replay()
        assert torch.equal(out, triton_fp8_skinny.linear(rows, wq, ws, block, launch))
        assert rel_err(out, quant.fp8_linear_reference(rows, wq, ws, BLOCK).float()) < 1e-2
