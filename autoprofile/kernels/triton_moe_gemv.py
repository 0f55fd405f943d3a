"""The experts at a few tokens as GEMVs: one program a (token, slot) pair and a tile of its expert's output
rows, each weight read once at its own width (FP8 experts: W8A16, one byte a weight, the activations not
quantized), no sort and no padding to a block of rows. The one-row dense GEMV's design
(kernels.triton_fp8.gemv) over the experts the pairs reach; triton_moe.fused_moe runs it while a step has at
most launch_rules.MOE_GEMV_MAX_PAIRS pairs.

  gate_up   act [P, I] = silu(x_t W_gate[e]^T) * (x_t W_up[e]^T) for pair p = t k + j, e = ids[t, j]
  down      down [P, H] = weights[t, j] * (act_p W_down[e]^T)
then triton_moe.moe_sum adds the k rows of each token (and the layer's addends). Buffers: act and down in
the model's dtype, as the blocked path's (budget.moe_scratch_bytes); none of its sort or FP8 activation
copies.

Scales (layers.quant.MoeQuant): "channel" w13 [E, 2I], w2 [E, H]; "block" [E, ceil(2I/bn), ceil(H/bk)],
[E, ceil(H/bn), ceil(I/bk)], where a program's BLOCK_N rows must share one row of scales (BLOCK_N divides
bn, and I is a multiple of bn: the up rows start on a scale row): `serves` says whether a layer's shapes
allow it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

NONE, CHANNEL, BLOCK = 0, 1, 2  # the weights' scales (SCALES)
# (BLOCK_N, BLOCK_K, num_warps) of the gate/up kernel and of the down kernel, for bf16/fp16 experts and for
# FP8 ones. scripts/tune_moe.py --gemv_configs on an H200 (three models' experts at 1, 2 and 4 tokens, one
# kernel's candidates at a time): bf16 keeps the dense one-row GEMV's shape (4 rows a program, 1 warp;
# every candidate 1.01-1.46x slower, geometric mean); FP8, a byte a weight, takes wider programs: down 16
# rows of 256 with 2 warps (0.89 of the first shape's time), gate/up 8 rows, 2 warps (0.91).
# docs/measurements.md, "The experts as GEMVs at a few tokens".
CONFIGS = {"bf16": ((4, 256, 1), (4, 512, 1)), "fp8": ((8, 256, 2), (16, 256, 2))}


def configs(quant) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(gate/up, down) launch configs of these experts (quant None: unquantized)."""
    return CONFIGS["bf16" if quant is None else "fp8"]


@triton.jit
def _pair_rows(ids_ptr, N, BLOCK_N: tl.constexpr):
    """The program's pair p, row tile nb, the pair's expert e (int64), the tile's rows and their mask < N."""
    p = tl.program_id(0)
    nb = tl.program_id(1)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    return p, nb, tl.load(ids_ptr + p).to(tl.int64), rows, rows < N


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, act_ptr, stride_x, H, INTER, TOP_K: tl.constexpr,
                    SCALES: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    p, nb, e, rows, row_ok = _pair_rows(ids_ptr, INTER, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_e = w_ptr + e * 2 * INTER * H
    g_rows = w_e + rows.to(tl.int64)[:, None] * H
    u_rows = w_e + (rows + INTER).to(tl.int64)[:, None] * H
    x_row = x_ptr + (p // TOP_K).to(tl.int64) * stride_x
    # "block": BLOCK_N divides SCALE_N and INTER is a multiple of it, so the gate rows share one row of scales
    # and the up rows another
    ks_n = tl.cdiv(H, SCALE_K)
    sg_row = s_ptr + (e * tl.cdiv(2 * INTER, SCALE_N) + nb * BLOCK_N // SCALE_N) * ks_n
    su_row = s_ptr + (e * tl.cdiv(2 * INTER, SCALE_N) + (INTER + nb * BLOCK_N) // SCALE_N) * ks_n
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        k_ok = ks < H - k
        x = tl.load(x_row + k + ks, mask=k_ok, other=0.0).to(tl.float32)
        w_ok = row_ok[:, None] & k_ok[None, :]
        wg = tl.load(g_rows + k + ks[None, :], mask=w_ok, other=0.0).to(tl.float32)
        wu = tl.load(u_rows + k + ks[None, :], mask=w_ok, other=0.0).to(tl.float32)
        if SCALES == 2:
            acc_g += wg * (x * tl.load(sg_row + (k + ks) // SCALE_K, mask=k_ok, other=0.0))[None, :]
            acc_u += wu * (x * tl.load(su_row + (k + ks) // SCALE_K, mask=k_ok, other=0.0))[None, :]
        else:
            acc_g += wg * x[None, :]
            acc_u += wu * x[None, :]
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if SCALES == 1:
        g *= tl.load(s_ptr + e * 2 * INTER + rows, mask=row_ok, other=0.0)
        u *= tl.load(s_ptr + e * 2 * INTER + INTER + rows, mask=row_ok, other=0.0)
    a = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + p.to(tl.int64) * INTER + rows, a.to(act_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, ids_ptr, rw_ptr, out_ptr, H, INTER, SCALES: tl.constexpr,
                 SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p, nb, e, rows, row_ok = _pair_rows(ids_ptr, H, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + e * H * INTER + rows.to(tl.int64)[:, None] * INTER
    a_row = act_ptr + p.to(tl.int64) * INTER
    s_row = s_ptr + (e * tl.cdiv(H, SCALE_N) + nb * BLOCK_N // SCALE_N) * tl.cdiv(INTER, SCALE_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, INTER, BLOCK_K):
        k_ok = ks < INTER - k
        a = tl.load(a_row + k + ks, mask=k_ok, other=0.0).to(tl.float32)
        if SCALES == 2:
            a *= tl.load(s_row + (k + ks) // SCALE_K, mask=k_ok, other=0.0)
        w = tl.load(w_rows + k + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * a[None, :]
    y = tl.sum(acc, axis=1)
    if SCALES == 1:
        y *= tl.load(s_ptr + e * H + rows, mask=row_ok, other=0.0)
    y *= tl.load(rw_ptr + p).to(tl.float32)
    tl.store(out_ptr + p.to(tl.int64) * H + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def _scales(quant) -> tuple[int, int, int]:
    """(SCALES, SCALE_N, SCALE_K) of the experts' weights (quant: layers.quant.MoeQuant or None)."""
    if quant is None:
        return NONE, 1, 1
    if quant.scheme.weight == "block":
        return (BLOCK, *quant.scheme.block)
    return CHANNEL, 1, 1


def serves(w13: torch.Tensor, quant) -> bool:
    """Whether the GEMVs take these experts: block scales need each program's rows inside one scale row
    (the configs' BLOCK_N divides the scale block's rows, and the intermediate size is a multiple of them)."""
    kind, scale_n, _ = _scales(quant)
    if kind != BLOCK:
        return True
    inter = w13.shape[1] // 2
    return inter % scale_n == 0 and all(scale_n % cfg[0] == 0 for cfg in configs(quant))


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            quant=None) -> torch.Tensor:
    """down [T, k, H] (each pair's expert output, times its routing weight) of x [T, H] (unit stride in H),
    w13 [E, 2I, H], w2 [E, H, I] (contiguous; float8_e4m3fn with quant's scales, else x's dtype), weights and
    ids [T, k]: triton_moe.moe_sum's input."""
    tokens, top_k = ids.shape
    _, two_i, hidden = w13.shape
    inter = two_i // 2
    kind, scale_n, scale_k = _scales(quant)
    if not serves(w13, quant):
        raise ValueError(f"the experts' GEMV takes block scales of rows dividing the intermediate size "
                         f"({inter}) and a multiple of {max(c[0] for c in configs(quant))}, got {scale_n}")
    if x.stride(-1) != 1 or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("the experts' GEMV reads x with unit stride in H and contiguous expert weights")
    pairs = tokens * top_k
    ids, weights = ids.contiguous(), weights.contiguous()
    s13, s2 = (w13, w2) if quant is None else (quant.w13_scale, quant.w2_scale)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    down = torch.empty(tokens, top_k, hidden, dtype=x.dtype, device=x.device)
    if pairs == 0:
        return down
    (bn, bk, warps), down_cfg = configs(quant)
    _gate_up_kernel[(pairs, triton.cdiv(inter, bn))](
        x, w13, s13, ids, act, x.stride(0), hidden, inter, TOP_K=top_k, SCALES=kind, SCALE_N=scale_n,
        SCALE_K=scale_k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    bn, bk, warps = down_cfg
    _down_kernel[(pairs, triton.cdiv(hidden, bn))](
        act, w2, s2, ids, weights, down, hidden, inter, SCALES=kind, SCALE_N=scale_n, SCALE_K=scale_k,
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return down
