"""FP8 weights at 2 to 64 rows (decode steps past batch 1): a skinny GEMM that reads each weight byte once.

Past one row the FP8 linear quantizes its rows and runs a GEMM tiled for many rows (triton_fp8.gemm): at 8
rows its 64-row tiles are mostly padding, and a llama-3.1-8b-fp8 decode step ran at 0.57 of its bytes floor
where the one-row GEMV ran at 0.83 (H100, issue 48). Here the weight is the MMA's left side (swap-AB): a
program holds block_n weight rows and every activation row (padded to 16, 32 or 64), walks K once with fp32
accumulation, and scales as the checkpoint says: per output channel at the end, or per [bn, bk] block at each
K step. The activations come as the model's rows (W8A16: the weight converted to their dtype, exactly) or as a
producer quantized them (layers.quant.Fp8Rows: one scale a row or a K group). No scratch but split-K's
partials (below). launch_rules.fp8_skinny_launch chooses it by rows (and N, K); M is never specialized, so the
captured batch sizes' compiles (one per padded row count) serve every step.

split_k (SkinnyLaunch, the tables' launches): a narrow N (o_proj, down_proj: 64 column tiles of 64 on 132 SMs)
walks K in split_k programs a tile, keeping a column tile wide enough for the warpgroup MMA; partials to an
fp32 scratch the call allocates, the tile's last program (an atomic count a tile, COUNTERS, reset by that
program) sums them in split order, deterministic, and runs the epilogue (scales, bias, residual) once.
Measured beside it and removed (scripts/bench_fp8.py --skinny_variants, docs/measurements.md "Split-K for the
skinny FP8 GEMM"): TMA loads (device-side tensor descriptors) and o_proj's rows quantized in the kernel
(W8A8), each within 1-3% of split-K alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from autoprofile.kernels.launch_rules import SkinnyLaunch, skinny_block_m
from autoprofile.layers.quant import Fp8Rows, rows_linear

NO_SCALE, ROW_SCALE, GROUP_SCALE = 0, 1, 2  # the activations' scales: none (model dtype), a row's, a group's
COUNTERS = 1 << 16  # column tiles a split launch may have (int32 counters a device, zero between launches)
_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit(do_not_specialize=["M"])
def _skinny_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_split,
                       stride_x, stride_xs, stride_y, X_SCALE: tl.constexpr, X_GROUP: tl.constexpr,
                       HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCKWISE: tl.constexpr,
                       SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows: the outputs' columns
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_ok, row_ok = cols < N, rows < M
    if SPLIT_K > 1:  # this program's K range: k_split a split (a multiple of BLOCK_K), the last one short
        k_lo = tl.program_id(1) * k_split
        k_hi = tl.minimum(K, k_lo + k_split)
    else:
        k_lo = 0
        k_hi = K
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :]
    x_ptrs = x_ptr + rows.to(tl.int64)[None, :] * stride_x + ks[:, None]  # x^T: [BLOCK_K, BLOCK_M]
    ws_ptrs = ws_ptr + (cols // SCALE_N) * tl.cdiv(K, SCALE_K)  # "block": the columns' row of scales
    xs_ptrs = xs_ptr + rows * stride_xs
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        k_ok = ks < K - k
        w = tl.load(w_ptrs + k, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs + k, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        if X_SCALE == 0:
            w = w.to(x.dtype)  # exact: every e4m3 value is a bf16/fp16 value
        if BLOCKWISE or X_SCALE == 2:  # BLOCK_K divides SCALE_K and X_GROUP: the step lies in one block
            part = tl.dot(w, x)
            if BLOCKWISE:
                part *= tl.load(ws_ptrs + k // SCALE_K, mask=col_ok, other=0.0)[:, None]
            if X_SCALE == 2:
                part *= tl.load(xs_ptrs + k // X_GROUP, mask=row_ok, other=0.0)[None, :]
            acc += part
        else:
            acc = tl.dot(w, x, acc)
    if SPLIT_K > 1:
        # each split's partial [BLOCK_M, N] slab; the tile's last program (an atomic count, as triton_argmax)
        # sums them in split order (the same sum whichever program is last), resets the count, writes y
        slab = part_ptr + rows[None, :] * N + cols[:, None]
        tl.store(slab + tl.program_id(1) * (BLOCK_M * N), acc, mask=col_ok[:, None])
        tl.debug_barrier()  # every thread's partial stored before the count's release
        done = tl.atomic_add(count_ptr + pid_n, 1)  # NOTE: acq_rel, Triton's default
        if done == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(slab + s * (BLOCK_M * N), mask=col_ok[:, None], other=0.0,
                                 cache_modifier=".cg")  # L2: another SM wrote it
            tl.store(count_ptr + pid_n, 0)
            _epilogue(total, ws_ptr, xs_ptrs, b_ptr, y_ptr, rows, cols, row_ok, col_ok, stride_y, X_SCALE,
                      HAS_BIAS, HAS_RESIDUAL, BLOCKWISE)
    else:
        _epilogue(acc, ws_ptr, xs_ptrs, b_ptr, y_ptr, rows, cols, row_ok, col_ok, stride_y, X_SCALE, HAS_BIAS,
                  HAS_RESIDUAL, BLOCKWISE)


@triton.jit
def _epilogue(acc, ws_ptr, xs_ptrs, b_ptr, y_ptr, rows, cols, row_ok, col_ok, stride_y, X_SCALE: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCKWISE: tl.constexpr):
    """The scales left after the K walk (a channel's, a row's), bias, the residual; y's tile stored."""
    if not BLOCKWISE:
        acc *= tl.load(ws_ptr + cols, mask=col_ok, other=0.0)[:, None]
    if X_SCALE == 1:
        acc *= tl.load(xs_ptrs, mask=row_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + rows[None, :] * stride_y + cols[:, None]
    ok = row_ok[None, :] & col_ok[:, None]
    if HAS_RESIDUAL:  # y is the residual: each program reads its own tile before it writes it
        acc += tl.load(y_ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def x_scale_kind(x_scale: torch.Tensor | None) -> int:
    """NO_SCALE for rows in the model's dtype, ROW_SCALE for [M, 1] scales (one K group is a row's too),
    GROUP_SCALE for [M, groups]."""
    if x_scale is None:
        return NO_SCALE
    return ROW_SCALE if x_scale.shape[1] == 1 else GROUP_SCALE


def tile_counters(device: torch.device) -> torch.Tensor:
    """The split launches' per-column-tile arrival counts on `device`: COUNTERS int32 zeros, allocated on
    the first split launch (which must not be inside a graph's capture: a warm-up call comes first) and
    kept; each tile's last program sets its count back to zero. One stream at a time uses them."""
    counters = _counters.get(device)
    if counters is None:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        assert not capturing, "a split skinny launch runs once before a graph's capture"
        counters = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return counters


def gemm(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
         block: tuple[int, int] | None, out_dtype: torch.dtype, launch: SkinnyLaunch,
         bias: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (unit stride in K, M <= 64): the model's dtype with x_scale None, or fp8 with x_scale fp32
    [M, 1] or [M, ceil(K / bk)] (groups of the block's K); weight fp8 [N, K] contiguous with weight_scale fp32
    [N] (block None) or [ceil(N/bn), ceil(K/bk)] (block (bn, bk)) -> [M, N] in out_dtype. residual
    (contiguous [M, N]): the product is added to it in the epilogue, in place (rounded once), and it is
    returned. launch.split_k > 1: that many programs a column tile, over K ranges of whole K steps (an fp32
    scratch of split_k x [padded M, N])."""
    m, k = x.shape
    n = weight.shape[0]
    kind = x_scale_kind(x_scale)
    scale_n, scale_k = block if block is not None else (1, k)
    block_k = min(launch.block_k, scale_k) if block is not None else launch.block_k
    assert block is not None or kind != GROUP_SCALE, "FP8 activation groups come with block-scaled weights"
    assert block is None or (scale_k % block_k == 0 and block_k >= 32), \
        f"the skinny FP8 GEMM needs K steps of at least 32 that divide the scale block's {scale_k}"
    block_m = skinny_block_m(m)
    assert m <= block_m <= 64 and x.stride(-1) == 1 and weight.is_contiguous()
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == (m, n), "the epilogue adds into [M, N] rows"
        assert residual.dtype == out_dtype
    out = residual if residual is not None else torch.empty(m, n, dtype=out_dtype, device=x.device)
    if not m:
        return out
    splits = launch.split_k
    tiles = triton.cdiv(n, launch.block_n)
    k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    if splits > 1:
        assert tiles <= COUNTERS, "more column tiles than the split launch's counters"
        part = torch.empty(splits * block_m * n, dtype=torch.float32, device=x.device)
        count = tile_counters(x.device)
    else:
        part = count = weight_scale  # unused
    xs = x_scale if x_scale is not None else weight_scale
    _skinny_fp8_kernel[(tiles, splits)](
        x, xs, weight, weight_scale, bias if bias is not None else weight_scale, out, part, count, m, n, k,
        k_split, x.stride(0), xs.stride(0), out.stride(0), X_SCALE=kind, X_GROUP=scale_k,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCKWISE=block is not None,
        SCALE_N=scale_n, SCALE_K=scale_k, BLOCK_M=block_m, BLOCK_N=launch.block_n, BLOCK_K=block_k,
        SPLIT_K=splits, num_warps=launch.warps, num_stages=launch.stages)
    return out


def linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
           block: tuple[int, int] | None, launch: SkinnyLaunch, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """triton_fp8.linear's rows through the skinny GEMM: x [..., K] in the model's dtype (not quantized:
    W8A16, as the one-row GEMV) or Fp8Rows -> [..., N] in the model's dtype; with residual, added to it in
    place (in the epilogue where it is contiguous) and it is returned. weight_scale: [N] or the block
    scales."""
    return rows_linear(x, weight.shape[0], residual, lambda rows, x_scale, dtype, into: gemm(
        rows, x_scale, weight, weight_scale, block, dtype, launch, bias, into))
