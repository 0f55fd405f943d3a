"""FP8 (float8_e4m3fn) weight GEMMs on CUDA: the aiter_triton backend's fp8_gemm (TP.fp8_matmul).

  quantize_per_token / quantize_per_group / quantize_static   activations to FP8, one program per row
  gemv            one row: W8A16, reads one byte per weight, x stays in its dtype (decode at batch 1)
  gemm            our Triton W8A8 GEMM: "block" scales per [block_n, block_k] tile applied per K block,
                  "channel" scales once at the end (channel shapes that cuBLASLt refuses, fp16 models)
  linear          the dispatcher: one row -> gemv; rows where launch_rules.fp8_gemv_rows_launch says ->
                  triton_fp8_rows (2-16 rows on CUDA cores); rows where fp8_skinny_launch says ->
                  triton_fp8_skinny; "channel" -> per-token quant + torch._scaled_mm (cuBLASLt, row-wise
                  scales); "block" -> per-group quant + gemm

Numerics as layers.quant's references: scale = max(amax / 448, 1e-12), x_q = clamp(x * (1 / scale), +-448)
cast to float8_e4m3fn (round to nearest even); weight_scale multiplies (W_real = weight * weight_scale).

Not AITER's gemm_a8w8_blockscale: its GRID_MN heuristic is a constexpr of M (a compile per step size while
serving), its tuned configs carry AMD-only launch options and are keyed by MI300X/MI350X names.
Shape-following arguments: the quant kernels and the GEMV take none (rows are the grid), the GEMM's row count
M is never specialized, so the stress's compiles serve every step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from autoprofile.kernels import pdl, triton_fp8_rows, triton_fp8_skinny, triton_norm
from autoprofile.kernels.launch_rules import fp8_gemv_rows_launch, fp8_skinny_launch
from autoprofile.kernels.triton_act import silu_mul_at
from autoprofile.kernels.triton_matmul import grouped_tile
from autoprofile.kernels.triton_norm import normed_row
from autoprofile.layers import quant
from autoprofile.layers.quant import FP8, Fp8Rows

FP8_MAX = tl.constexpr(quant.FP8_MAX)  # NOTE: globals a kernel reads must be constexpr objects
SCALE_MIN = tl.constexpr(1e-12)
QUANT_BLOCK, QUANT_WARPS = 2048, 4  # elements of a row per step of the quant kernels
QUANT_GROUPS = 16  # 128-groups per step of the group kernel
# SiLU-mul per token: rows up to this wide in registers, one pass (llama-3.1-8b's 14,336: a prefill step of 7
# x 1,024 tokens spent 324 us a layer reading gate|up twice, on an H100); wider rows: amax, then again
SILU_QUANT_ROW = 16384
# One row (BLOCK_N, BLOCK_K, warps) by the weight's shape, from a sweep of 46 configs on an H100 (fraction of
# the copy floor, llama-3.1-8b, 32 weights a graph: qkv 0.73 and gate_up 0.91 at 4/512/w1; o 0.68 and down
# 0.86 at 2/1024/w1, where the H200's picks gave 0.65 and 0.76); manual prefetch of the next K step and
# num_stages 3 never won; the bf16 GEMV's 8 KiB steps gave 0.33-0.53. Up to 4,096 rows a weight has few
# programs: two rows a program make more of them.
GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS = 4, 512, 1
GEMV_FEW_ROWS = 4096
GEMV_FEW = (2, 1024, 1)


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    return (GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS) if n > GEMV_FEW_ROWS else GEMV_FEW


# (most rows, config): the first that holds M; None: any
GEMM_SMALL = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
GEMM_LARGE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
# block scales rescale every K step's product outside the MMA: smaller tiles win there
# (docs/measurements.md, "Kernel choices")
GEMM_BLOCK_LARGE = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4,
                    "num_stages": 4}
GEMM_CONFIGS: tuple[tuple[int | None, dict], ...] = ((64, GEMM_SMALL), (None, GEMM_LARGE))


@triton.jit
def _quant_token_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, STATIC: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * K
    ks = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(0, K, BLOCK):
            x = tl.load(x_row + k + ks, mask=ks < K - k, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), SCALE_MIN)
    inv = tl.math.div_rn(1.0, scale)  # one IEEE division a row, a multiply an element (as vLLM's quant)
    for k in range(0, K, BLOCK):
        ok = ks < K - k
        x = tl.load(x_row + k + ks, mask=ok, other=0.0).to(tl.float32)
        q = tl.clamp(x * inv, -FP8_MAX, FP8_MAX)
        tl.store(q_row + k + ks, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row, scale)


@triton.jit
def _quant_group_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * K
    num_groups = tl.cdiv(K, GROUP)
    gs, js = tl.arange(0, GROUPS), tl.arange(0, GROUP)
    for g in range(0, num_groups, GROUPS):
        offs = (g + gs)[:, None] * GROUP + js[None, :]
        ok = offs < K
        x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), SCALE_MIN)
        q = tl.clamp(x * tl.math.div_rn(1.0, scale)[:, None], -FP8_MAX, FP8_MAX)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row * num_groups + g + gs, scale, mask=g + gs < num_groups)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride in K) -> (x_q fp8 [M, K], scale fp32 [M, 1]): one scale per row."""
    rows = _rows(x)
    m, k = rows.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quant_token_kernel[(m,)](rows, q, s, s, k, rows.stride(0), STATIC=False, BLOCK=QUANT_BLOCK,
                                  num_warps=QUANT_WARPS)
    return q, s


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] with the checkpoint's one scale (fp32 [1]) -> (x_q, that scale repeated [M, 1])."""
    rows = _rows(x)
    m, k = rows.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quant_token_kernel[(m,)](rows, q, s, input_scale, k, rows.stride(0), STATIC=True,
                                  BLOCK=QUANT_BLOCK, num_warps=QUANT_WARPS)
    return q, s


def quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q fp8 [M, K], scale fp32 [M, ceil(K / group)]): one scale per row and group of
    `group` (a power of two) consecutive columns."""
    assert group & (group - 1) == 0, f"FP8 activation groups must be a power of two, not {group}"
    rows = _rows(x)
    m, k = rows.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, triton.cdiv(k, group), dtype=torch.float32, device=x.device)
    if m:
        _quant_group_kernel[(m,)](rows, q, s, k, rows.stride(0), GROUP=group,
                                  GROUPS=max(1, QUANT_BLOCK // group), num_warps=QUANT_WARPS)
    return q, s


@triton.jit
def _gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, r_ptr, y_ptr, N, K, HAS_BIAS: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, BLOCKWISE: tl.constexpr, SCALE_N: tl.constexpr,
                     SCALE_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < N
    # "block": BLOCK_N divides SCALE_N, so the program's rows share one row of scales
    s_row = s_ptr + (pid * BLOCK_N // SCALE_N) * tl.cdiv(K, SCALE_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    # the first weight tile before the wait: weights are constant, so with PDL it streams in while the kernel
    # before still runs (kernels.pdl)
    w = tl.load(w_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
    pdl.begin(PDL)
    x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    if BLOCKWISE:
        x *= tl.load(s_row + ks // SCALE_K, mask=ks < K, other=0.0)
    # NOTE: the first step peeled; a loop from 0 that loads under `if k > 0` made w a loop-carried tile and
    # the batch-1 replay slower (docs/measurements.md, "Kernel choices")
    acc = w.to(tl.float32) * x[None, :]
    for k in range(BLOCK_K, K, BLOCK_K):
        k_ok = ks < K - k
        x = tl.load(x_ptr + k + ks, mask=k_ok, other=0.0).to(tl.float32)
        if BLOCKWISE:
            x *= tl.load(s_row + (k + ks) // SCALE_K, mask=k_ok, other=0.0)
        w = tl.load(w_rows + k + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if not BLOCKWISE:
        y *= tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # y_ptr may be r_ptr: each program reads its rows before it writes them
        y += tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None,
         bias: torch.Tensor | None = None, config: tuple[int, int, int] | None = None,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """y = x (weight * weight_scale)^T (+ bias) for one contiguous row x [1, K] (or [K]) in bf16/fp16;
    weight fp8 [N, K] contiguous; weight_scale fp32 [N] (block None) or [ceil(N/bn), ceil(K/bk)].
    residual (contiguous, N elements): y is added to it in the epilogue, in place (rounded once), and it is
    returned."""
    n, k = weight.shape
    block_n, block_k, num_warps = config or gemv_config(n, k)
    scale_n, scale_k = block if block is not None else (block_n, 1)
    assert scale_n % block_n == 0, f"{block_n} GEMV rows a program must divide the scale block's {scale_n}"
    if residual is not None:
        assert residual.is_contiguous() and residual.numel() == n, "the GEMV adds into one contiguous row"
    out = residual if residual is not None else torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _gemv_fp8_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out, out, n, k,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCKWISE=block is not None,
        SCALE_N=scale_n, SCALE_K=scale_k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        **pdl.launch())
    return out


@triton.jit(do_not_specialize=["M"])
def _gemm_fp8_kernel(a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, c_ptr, M, N: tl.constexpr, K: tl.constexpr,
                     stride_a, stride_c, stride_as_m, stride_as_k, HAS_BIAS: tl.constexpr,
                     BLOCKWISE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    a_ptrs = a_ptr + rows[:, None] * stride_a + ks[None, :]
    b_ptrs = b_ptr + cols[None, :] * K + ks[:, None]
    KB: tl.constexpr = (K + SCALE_K - 1) // SCALE_K
    # a's scales: [M, KB] per group or [M, 1] per token (stride_as_k 0); b's: [ceil(N/SCALE_N), KB] or [N]
    as_ptrs = as_ptr + rows * stride_as_m
    bs_ptrs = bs_ptr + (cols // SCALE_N) * KB
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = ks < K - k
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if BLOCKWISE:  # BLOCK_K divides SCALE_K: the tile lies in one K block
            sa = tl.load(as_ptrs + (k // SCALE_K) * stride_as_k, mask=row_ok, other=0.0)
            sb = tl.load(bs_ptrs + k // SCALE_K, mask=col_ok, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCKWISE:
        acc *= tl.load(as_ptrs, mask=row_ok, other=0.0)[:, None]
        acc *= tl.load(bs_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows[:, None] * stride_c + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def gemm_config(m: int, blockwise: bool = False) -> dict:
    cfg = next(cfg for most, cfg in GEMM_CONFIGS if most is None or m <= most)
    return GEMM_BLOCK_LARGE if blockwise and cfg is GEMM_LARGE else cfg


def gemm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
         block: tuple[int, int] | None, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
         config: dict | None = None) -> torch.Tensor:
    """x_q fp8 [M, K] (unit stride in K) with x_scale fp32 [M, ceil(K/bk)] or [M, 1], weight fp8 [N, K]
    contiguous with weight_scale fp32 [ceil(N/bn), ceil(K/bk)] (block (bn, bk)) or [N] (block None)
    -> [M, N] in out_dtype."""
    m, k = x_q.shape
    n = weight.shape[0]
    cfg = dict(config or gemm_config(m, block is not None))
    scale_n, scale_k = block if block is not None else (1, k)
    if block is not None:
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], scale_k)
        assert scale_k % cfg["BLOCK_K"] == 0 and cfg["BLOCK_K"] >= 32, \
            f"block-scaled FP8 needs K blocks that are multiples of 32, not {scale_k}"
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m:
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        _gemm_fp8_kernel[grid](x_q, weight, x_scale, weight_scale, bias if bias is not None else weight_scale,
                               out, m, n, k, x_q.stride(0), out.stride(0), x_scale.stride(0),
                               x_scale.stride(1) if x_scale.shape[1] > 1 else 0,
                               HAS_BIAS=bias is not None, BLOCKWISE=block is not None, SCALE_N=scale_n,
                               SCALE_K=scale_k, **cfg)
    return out


def scaled_mm_serves(x_dtype: torch.dtype, n: int, k: int) -> bool:
    """cuBLASLt's row-wise FP8 GEMM (torch._scaled_mm): bf16 output, N and K multiples of 16."""
    return x_dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0


def quantize_activation(rows: torch.Tensor, scheme, input_scale: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheme's activation quantization: "static" the checkpoint's scale, "group" per (row, block_k)
    group, else per row."""
    if scheme.activation == "static":
        assert input_scale is not None, "FP8 activation 'static' needs the layer's input_scale"
        return quantize_static(rows, input_scale)
    if scheme.activation == "group":
        return quantize_per_group(rows, scheme.block[1])
    return quantize_per_token(rows)


def linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor, scheme,
           input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """TP.fp8_matmul on CUDA: x [..., K] bf16/fp16 (or Fp8Rows: quantized by the kernel that made them),
    weight fp8 [N, K] -> [..., N] in x's dtype; with residual, that is added to residual in place (one row:
    in the GEMV's epilogue) and residual is returned.

    One contiguous row: the W8A16 GEMV (x is not quantized). Rows the multi-row GEMV's rule takes
    (triton_fp8_rows): that GEMV; then rows the skinny launch rule takes: its GEMM (x as it comes, either
    way). More: the scheme's activation quantization, then cuBLASLt's row-wise _scaled_mm ("channel") or our
    block-scaled GEMM ("block")."""
    n, k = weight.shape
    block = tuple(scheme.block) if scheme.weight == "block" else None
    scale = weight_scale if block is not None else weight_scale.reshape(n)
    rows = x.q.shape[0] if isinstance(x, Fp8Rows) else x.numel() // k
    if rows > 1 and (few := fp8_gemv_rows_launch(rows, n, k, block=block is not None)) is not None:
        return triton_fp8_rows.linear(x, weight, scale, block, few, bias, residual)
    if rows > 1 and (launch := fp8_skinny_launch(rows, n, k, block=block is not None)) is not None:
        return triton_fp8_skinny.linear(x, weight, scale, block, launch, bias, residual)
    if isinstance(x, Fp8Rows):
        (x_q, x_s), dtype, lead = (x.q, x.scale), x.dtype, x.q.shape[:-1]
    elif x.numel() == k and x.is_contiguous() and (residual is None or residual.is_contiguous()):
        return gemv(x, weight, scale, block, bias, residual=residual)
    else:
        (x_q, x_s), dtype, lead = quantize_activation(_rows(x), scheme, input_scale), x.dtype, x.shape[:-1]
    if block is None and scaled_mm_serves(dtype, n, k):
        y = torch._scaled_mm(x_q, weight.t(), scale_a=x_s, scale_b=scale.view(1, n), out_dtype=dtype)
        if bias is not None:
            y += bias
    else:
        y = gemm(x_q, x_s, weight, scale, block, dtype, bias)
    y = y.view(*lead, n)
    return y if residual is None else residual.add_(y)


# ---------------------------------------------------------------- producers that quantize their own output
# An FP8 layer read by one producer (the decoder's RMSNorm before qkv_proj, SiLU-mul before down_proj) takes
# its rows quantized by that producer's kernel (layers.quant.Fp8Rows): no [M, K] bf16 tensor, no second pass
# over it. Each value is rounded to the model dtype first, so the bytes and scales are the unfused path's (the
# producer's output quantized by quantize_per_token / quantize_per_group); the norm's sum of squares is
# reduced in this kernel's own register layout, so a value on a bf16 rounding boundary may land one FP8 step
# away (1-3 bytes of 300 x 4,096 in 1 run of 6 on an H100; tests/test_fp8_gpu.py bounds it).

@triton.jit
def _quant_store(y, q_row, offs, ok, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """y [BLOCK] (fp32, 0 past the row) -> fp8 at q_row + offs; returns the scale of each GROUP values."""
    g = tl.reshape(tl.abs(y), (BLOCK // GROUP, GROUP))
    scale = tl.maximum(tl.math.div_rn(tl.max(g, axis=1), FP8_MAX), SCALE_MIN)
    inv = tl.reshape(tl.broadcast_to(tl.math.div_rn(1.0, scale)[:, None], (BLOCK // GROUP, GROUP)), (BLOCK,))
    q = tl.clamp(y * inv, -FP8_MAX, FP8_MAX)
    tl.store(q_row + offs, q.to(q_row.dtype.element_ty), mask=ok)
    return scale


@triton.jit
def _rms_norm_quant_kernel(x_ptr, w_ptr, q_ptr, s_ptr, stride_x, eps, N: tl.constexpr, GROUP: tl.constexpr,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    y, cols, ok = normed_row(x_ptr, w_ptr, row, stride_x, eps, N, BLOCK)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # triton_norm's output, rounded as it stores it
    scale = _quant_store(y, q_ptr + row * N, cols, ok, GROUP, BLOCK)
    NG: tl.constexpr = (N + GROUP - 1) // GROUP
    gs = tl.arange(0, BLOCK // GROUP)
    tl.store(s_ptr + row * NG + gs, scale, mask=gs < NG)


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, INTER: tl.constexpr, GROUP: tl.constexpr,
                           BLOCK: tl.constexpr, PER_ROW: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * INTER
    cols = tl.arange(0, BLOCK)
    NG: tl.constexpr = (INTER + GROUP - 1) // GROUP
    if PER_ROW and BLOCK >= INTER:  # one scale a row, the whole row in registers: one pass
        ok = cols < INTER
        y = silu_mul_at(x_row, cols, ok, INTER).to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), FP8_MAX), SCALE_MIN)
        q = tl.clamp(y * tl.math.div_rn(1.0, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row, scale)
    elif PER_ROW:  # a longer row: its amax first, then the values again
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for c in range(0, INTER, BLOCK):
            ok = cols < INTER - c
            y = silu_mul_at(x_row, c + cols, ok, INTER).to(x_ptr.dtype.element_ty).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(y))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), SCALE_MIN)
        inv = tl.math.div_rn(1.0, scale)
        for c in range(0, INTER, BLOCK):
            ok = cols < INTER - c
            y = silu_mul_at(x_row, c + cols, ok, INTER).to(x_ptr.dtype.element_ty).to(tl.float32)
            q = tl.clamp(y * inv, -FP8_MAX, FP8_MAX)
            tl.store(q_row + c + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row, scale)
    else:  # a scale per GROUP columns: each step's groups are whole (GROUP divides BLOCK)
        gs = tl.arange(0, BLOCK // GROUP)
        for c in range(0, INTER, BLOCK):
            ok = cols < INTER - c
            y = silu_mul_at(x_row, c + cols, ok, INTER).to(x_ptr.dtype.element_ty).to(tl.float32)
            scale = _quant_store(y, q_row + c, cols, ok, GROUP, BLOCK)
            g = c // GROUP + gs
            tl.store(s_ptr + row * NG + g, scale, mask=g < NG)


def _fp8_rows(m: int, k: int, groups: int, dtype: torch.dtype, device) -> Fp8Rows:
    return Fp8Rows(torch.empty(m, k, dtype=FP8, device=device),
                   torch.empty(m, groups, dtype=torch.float32, device=device), dtype)


def _group(scheme, k: int) -> int | None:
    """The activation group of a fused producer: None per token ("token"), else the block's K."""
    assert scheme.dynamic, f"no fused quantization for {scheme.activation} activations"
    if scheme.activation == "token":
        return None
    group = scheme.block[1]
    assert group & (group - 1) == 0, f"FP8 activation groups must be a power of two, not {group}"
    return group


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, scheme) -> Fp8Rows:
    """RMSNorm(x) * weight (triton_norm's output) quantized as the scheme's activations, x [M, N]."""
    rows = _rows(x)
    m, n = rows.shape
    block = triton.next_power_of_2(n)
    group = _group(scheme, n)
    out = _fp8_rows(m, n, 1 if group is None else triton.cdiv(n, group), x.dtype, x.device)
    if m:
        _rms_norm_quant_kernel[(m,)](rows, weight, out.q, out.scale, rows.stride(0), eps, N=n,
                                     GROUP=min(group or block, block), BLOCK=block,
                                     num_warps=triton_norm.num_warps(block))
    return out


def silu_mul_quant(x: torch.Tensor, scheme) -> Fp8Rows:
    """silu(gate) * up of x [M, 2 * I] (triton_act's output) quantized as the scheme's activations."""
    rows = x.reshape(-1, x.shape[-1])
    assert rows.stride(-1) == 1
    m, inter = rows.shape[0], rows.shape[1] // 2
    group = _group(scheme, inter)
    out = _fp8_rows(m, inter, 1 if group is None else triton.cdiv(inter, group), x.dtype, x.device)
    if m:
        whole = triton.next_power_of_2(inter)
        if group is None and whole <= SILU_QUANT_ROW:  # the row in registers, 32 values a thread
            block, warps = whole, max(QUANT_WARPS, whole // 1024)
        else:
            block = QUANT_BLOCK if group is None else max(group, QUANT_BLOCK // group * group)
            warps = QUANT_WARPS
        _silu_mul_quant_kernel[(m,)](rows, out.q, out.scale, rows.stride(0), INTER=inter,
                                     GROUP=group or block, BLOCK=block, PER_ROW=group is None,
                                     num_warps=warps)
    return out
