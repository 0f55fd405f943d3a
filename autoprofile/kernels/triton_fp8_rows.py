"""FP8 weights at 2 to 16 rows on CUDA cores: the one-row GEMV (triton_fp8.gemv) widened to a few rows.

A decode step of 2-8 rows through the skinny GEMM (triton_fp8_skinny: tensor cores, x padded to 16 rows)
read its weights at ~0.66 of the copy rate on an H100, where the one-row GEMV reads them at 0.78-0.93 (issue
48). Here each program loads a tile of weight rows once (one byte a weight), converts it once, and multiplies
it by each of ROWS activation rows (the call's rows rounded up to a power of two; rows from M on repeat the
last and are not stored), with fp32 accumulation: W8A16 where the rows come in the model's dtype, or the
producer's FP8 rows (layers.quant.Fp8Rows) times their scales. Per-channel and per-row scales multiply at the
end; 128 x 128 block scales and the rows' K-group scales multiply each step's partial sums (a program's
weight rows share one row of block scales, and a partial sum lies within one K group).

Each row keeps its own accumulator [BLOCK_N, BLOCK_K // SUM_K] (a tuple of ROWS 2-D tiles): each K step sums
SUM_K neighbouring products (within a thread where SUM_K is at most the 16 weights a thread loads), the rest
of K is summed once after the loop. SUM_K = 1 keeps every product (the one-row GEMV's accumulator, the most
registers); SUM_K = BLOCK_K reduces each step across the warp. NOTE: one [ROWS, BLOCK_N, BLOCK_K] product
instead of the tuple got a layout of one value a thread from Triton, and both tiles went through shared
memory every step (its sm_90 compile, on the CPU). launch_rules.fp8_gemv_rows_launch chooses the launch by
rows; M is never specialized, so one compile per ROWS (2, 4, 8, 16) serves every row count of a captured
batch. Measured on an H100 (docs/measurements.md, "A multi-row FP8 GEMV at 2 rows"): 0.82 of the bytes
floor at 2 rows (the skinny GEMM 0.59-0.63), level at 4 and slower inside the decode step, 0.44 at 8 (CUDA
cores: ROWS FMAs a weight byte); its table takes 2 rows only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from autoprofile.kernels import pdl
from autoprofile.kernels.launch_rules import GemvRowsLaunch, gemv_rows_padded
from autoprofile.kernels.triton_fp8_skinny import GROUP_SCALE, x_scale_kind
from autoprofile.layers.quant import Fp8Rows, rows_linear


@triton.jit
def _x_row(x_ptr, src, k, ks, K, stride_x):
    """Activation row src at K step k in fp32 [BLOCK_K]."""
    return tl.load(x_ptr + src * stride_x + k + ks, mask=ks < K - k, other=0.0).to(tl.float32)


@triton.jit
def _partial(w, x, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUM_K: tl.constexpr):
    """w [BLOCK_N, BLOCK_K] (fp32) times one row x [BLOCK_K], each SUM_K neighbouring columns summed:
    [BLOCK_N, BLOCK_K // SUM_K]."""
    p = w * x[None, :]
    if SUM_K == 1:
        return p
    return tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // SUM_K, SUM_K)), axis=2)


@triton.jit
def _k_scales(row_ptr, k, js, K, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The per-GROUP scales at row_ptr of K step k's partial sums (js: their first columns): one load
    where the step lies in one group, else one a partial sum (SUM_K divides GROUP: each lies in one)."""
    if GROUP % BLOCK_K == 0:
        scale = tl.load(row_ptr + k // GROUP)
    else:
        scale = tl.load(row_ptr + (k + js) // GROUP, mask=js < K - k, other=0.0)
    return scale


@triton.jit
def _step(w, x_ptr, xs_ptr, ws_row, k, ks, M, K, stride_x, stride_xs, X_SCALE: tl.constexpr,
          X_GROUP: tl.constexpr, BLOCKWISE: tl.constexpr, SCALE_K: tl.constexpr, ROWS: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUM_K: tl.constexpr):
    """One K step's partial sums of every row: a tuple of ROWS [BLOCK_N, BLOCK_K // SUM_K], each times the
    scales of its columns (the weight's block scales, the row's K-group scales: a partial sum lies in one
    group); the weight tile w (fp8) converted once for all rows."""
    w = w.to(tl.float32)
    js = tl.arange(0, BLOCK_K // SUM_K) * SUM_K
    if BLOCKWISE:
        w_scale = _k_scales(ws_row, k, js, K, SCALE_K, BLOCK_K)
    parts = ()
    for r in tl.static_range(ROWS):
        src = tl.minimum(r, M - 1)  # rows from M on repeat the last (never stored): no row masks
        part = _partial(w, _x_row(x_ptr, src, k, ks, K, stride_x), BLOCK_N, BLOCK_K, SUM_K)
        if BLOCKWISE:
            part *= w_scale
        if X_SCALE == 2:
            part *= _k_scales(xs_ptr + src * stride_xs, k, js, K, X_GROUP, BLOCK_K)
        parts = parts + (part,)
    return parts


@triton.jit
def _epilogue(y, r, cols, M, N, xs_ptr, ws_ptr, b_ptr, y_ptr, stride_xs, stride_y, X_SCALE: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCKWISE: tl.constexpr):
    """Row r's outputs y [BLOCK_N] (fp32 sums): the per-channel and per-row scales, bias, the residual
    (y_ptr is then the residual: each program reads its own columns before it writes them), stored where
    r < M."""
    col_ok = cols < N
    if not BLOCKWISE:
        y *= tl.load(ws_ptr + cols, mask=col_ok, other=0.0)
    if X_SCALE == 1:
        y *= tl.load(xs_ptr + tl.minimum(r, M - 1) * stride_xs)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    ok = cols < tl.where(r < M, N, 0)  # NOTE: a vector compare (the interpreter refuses a scalar mask)
    if HAS_RESIDUAL:
        y += tl.load(y_ptr + r * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + r * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _gemv_rows_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_xs, stride_y,
                          X_SCALE: tl.constexpr, X_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HAS_RESIDUAL: tl.constexpr, BLOCKWISE: tl.constexpr, SCALE_N: tl.constexpr,
                          SCALE_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, SUM_K: tl.constexpr, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows: the outputs' columns
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :]
    # "block": BLOCK_N divides SCALE_N, so the program's weight rows share one row of scales
    ws_row = ws_ptr + (pid * BLOCK_N // SCALE_N) * tl.cdiv(K, SCALE_K)
    # the first weight tile before the wait, as the one-row GEMV (kernels.pdl); the first step peeled
    w = tl.load(w_ptrs, mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
    pdl.begin(PDL)
    accs = _step(w, x_ptr, xs_ptr, ws_row, 0, ks, M, K, stride_x, stride_xs, X_SCALE, X_GROUP, BLOCKWISE,
                 SCALE_K, ROWS, BLOCK_N, BLOCK_K, SUM_K)
    for k in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(w_ptrs + k, mask=col_ok[:, None] & (ks < K - k)[None, :], other=0.0)
        parts = _step(w, x_ptr, xs_ptr, ws_row, k, ks, M, K, stride_x, stride_xs, X_SCALE, X_GROUP,
                      BLOCKWISE, SCALE_K, ROWS, BLOCK_N, BLOCK_K, SUM_K)
        summed = ()
        for r in tl.static_range(ROWS):
            summed = summed + (accs[r] + parts[r],)
        accs = summed
    for r in tl.static_range(ROWS):
        _epilogue(tl.sum(accs[r], axis=1), r, cols, M, N, xs_ptr, ws_ptr, b_ptr, y_ptr, stride_xs, stride_y,
                  X_SCALE, HAS_BIAS, HAS_RESIDUAL, BLOCKWISE)


def gemv(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
         block: tuple[int, int] | None, out_dtype: torch.dtype, launch: GemvRowsLaunch,
         bias: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (unit stride in K, M at most launch_rules.GEMV_ROWS_MAX): the model's dtype with x_scale
    None, or fp8 with x_scale fp32 [M, 1] or [M, ceil(K / bk)] (groups of the block's K); weight fp8 [N, K]
    contiguous with weight_scale fp32 [N] (block None) or [ceil(N/bn), ceil(K/bk)] (block (bn, bk)) -> [M, N]
    in out_dtype. residual (contiguous [M, N], out_dtype): the product is added to it in the epilogue, in
    place (rounded once), and it is returned."""
    m, k = x.shape
    n = weight.shape[0]
    kind = x_scale_kind(x_scale)
    scale_n, scale_k = block if block is not None else (launch.block_n, 1)  # channel: neither read
    assert block is not None or kind != GROUP_SCALE, "FP8 activation groups come with block-scaled weights"
    assert scale_n % launch.block_n == 0, f"{launch.block_n} rows a program must divide the block's {scale_n}"
    sum_k = min(launch.sum_k, scale_k) if block is not None else launch.sum_k  # a sum lies in one block
    assert launch.block_k % sum_k == 0 and (block is None or scale_k % sum_k == 0), \
        f"{sum_k} columns summed a step must divide the K step {launch.block_k} and the block's {scale_k}"
    assert x.stride(-1) == 1 and weight.is_contiguous()
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == (m, n) and residual.dtype == out_dtype
    out = residual if residual is not None else torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m:
        xs = x_scale if x_scale is not None else weight_scale
        _gemv_rows_fp8_kernel[(triton.cdiv(n, launch.block_n),)](
            x, xs, weight, weight_scale, bias if bias is not None else weight_scale, out, m, n, k,
            x.stride(0), xs.stride(0), out.stride(0), X_SCALE=kind,
            X_GROUP=scale_k, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
            BLOCKWISE=block is not None, SCALE_N=scale_n, SCALE_K=scale_k, ROWS=gemv_rows_padded(m),
            BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, SUM_K=sum_k, num_warps=launch.warps,
            **pdl.launch())
    return out


def linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
           block: tuple[int, int] | None, launch: GemvRowsLaunch, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """triton_fp8.linear's few rows through this GEMV: x [..., K] in the model's dtype (W8A16, not quantized)
    or Fp8Rows -> [..., N] in the model's dtype; with residual, added to it in place (in the epilogue where
    it is contiguous) and it is returned. weight_scale: [N] or the block scales."""
    return rows_linear(x, weight.shape[0], residual, lambda rows, x_scale, dtype, into: gemv(
        rows, x_scale, weight, weight_scale, block, dtype, launch, bias, into))
