"""y = x W^T (+ b) that never splits K: the batch-invariant GEMM of --deterministic.

cuBLAS picks its kernel, tile and split-K from the shape, so a row's result depends on how many rows share
the call. Here no call splits K: each output element is one fp32 accumulator that the MMA steps over K add
into in order, and rows never meet, so a token's projection is the same bits alone or among 8,192 others,
whichever tile the row count picks (CONFIGS: two, by row count). The row count is a runtime argument that is
never specialised on, so one compile per config serves every step shape. Imported when the aiter_triton
backend is built with --deterministic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# The config from 65 rows up: the best overall of 7 on an H100 (scripts/bench_deterministic.py, llama-3.1-8b's
# five GEMMs against cuBLAS in one run: 0.70x at 1 row, 0.76x at 256, 0.90x at 1,024, 0.83x at 8,192). Per
# shape it is the fastest of 8 from 1,024 rows up; at 1 to 256 rows o_proj and down_proj run at 0.3-0.5x
# cuBLAS (16 programs for 4,096 columns; cuBLAS splits K there, which a row-invariant GEMM may not vary by M).
CONFIG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
# Up to 64 rows (decode at small batch): narrower tiles, 4x the programs: 1/16/64 rows at 0.76x/0.71x/0.73x
# cuBLAS against CONFIG's 0.57x/0.57x/0.59x (H100, bench_deterministic.py --gemm_configs, one run).
SMALL = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
# (most rows, config): the first that holds M; None: any. The configs may differ by M because none splits K:
# each output element is one fp32 accumulator the K steps add into in order, whatever the tile, so a row gets
# the same bits under each (measured: every swept config gave the bits of CONFIG; tests/test_deterministic_gpu.py
# compares rows across the boundary).
CONFIGS: tuple[tuple[int | None, dict], ...] = ((64, SMALL), (None, CONFIG))


def config_for(m: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """fp32 (an MoE router's logits): SMALL at any M (CONFIG's fp32 tiles overflow an H100's shared
    memory)."""
    if dtype == torch.float32:
        return SMALL
    return next(cfg for most, cfg in CONFIGS if most is None or m <= most)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program pid's (row tile, column tile) in grouped order: GROUP_M row tiles walk the columns together
    (W's tiles are reused from L2)."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N: tl.constexpr, K: tl.constexpr, stride_x, stride_y,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols[None, :] * K + ks[:, None]
    row_ok, col_ok = rows[:, None] < M, cols[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = ks < K - k
        a = tl.load(x_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=col_ok & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok & col_ok)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (unit stride in K), weight [N, K] (contiguous), bias [N] -> [..., N] in x's dtype; out
    ([rows, N], unit stride in N, x's dtype): written there and returned."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    assert weight.is_contiguous() and x.shape[-1] == k
    if out is None:
        out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    else:
        assert out.shape == (rows.shape[0], n) and out.stride(-1) == 1 and out.dtype == x.dtype, out.shape
    m = rows.shape[0]
    if m:
        cfg = config_for(m, x.dtype)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        _matmul_kernel[grid](rows, weight, bias if bias is not None else weight, out, m, n, k, rows.stride(0),
                             out.stride(0), HAS_BIAS=bias is not None, **cfg)
    return out if out.dim() == x.dim() else out.view(*x.shape[:-1], n)
