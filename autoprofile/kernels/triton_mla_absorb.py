"""MLA's absorbed decode around its attention kernel, at steps of few decode rows: the aiter_triton backend's
mla_absorb / mla_unabsorb.

  absorb      each head's query into the latent space, q_lat = q_nope W_UK [T, H, rank], with q_pe copied
              beside it: the decode kernel's input [T, H, rank + rope] in one launch
  unabsorb    the output out of it, o = o_lat W_UV^T per head [T, H * v]

At a batch-1 decode on an H100 (scripts/profile_decode.py, deepseek-v2-lite) cuBLAS's batched GEMMs took 5.7
and 3.3 us a layer for about 2 MB of weights each, and the concatenation another 2.0. Here a program holds one
head's slice of the weight in registers and runs every row against it: one read of the weights whatever the
rows. Up to MAX_ROWS rows; more: the einsums (cuBLAS), whose tiles then pay. Products and sums in fp32, one
rounding to the output's dtype (as cuBLAS). The row count is not specialized: one compile serves every count.
No buffer beyond the step's outputs, which the einsums allocate as well.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 4
ABSORB_BLOCK_R = 64  # latent channels a program of absorb writes
UNABSORB_BLOCK_V = 16  # output channels a program of unabsorb writes


@triton.jit(do_not_specialize=["T"])
def _absorb_kernel(qn_ptr, qpe_ptr, w_ptr, out_ptr, T, H, stride_qn_t, stride_qn_h, stride_qpe_t,
                   stride_qpe_h, stride_w_h, NOPE: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    h = tl.program_id(0)
    rb = tl.program_id(1)
    rs = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    ns = tl.arange(0, NOPE)
    w = tl.load(w_ptr + h * stride_w_h + ns[:, None] * RANK + rs[None, :]).to(tl.float32)  # [NOPE, BLOCK_R]
    ps = tl.arange(0, ROPE)
    for t in range(T):
        q = tl.load(qn_ptr + t * stride_qn_t + h * stride_qn_h + ns).to(tl.float32)
        y = tl.sum(q[:, None] * w, axis=0)
        row = out_ptr + (t * H + h) * (RANK + ROPE)
        tl.store(row + rs, y.to(out_ptr.dtype.element_ty))
        if rb == 0:
            tl.store(row + RANK + ps, tl.load(qpe_ptr + t * stride_qpe_t + h * stride_qpe_h + ps))


@triton.jit(do_not_specialize=["T"])
def _unabsorb_kernel(o_ptr, w_ptr, out_ptr, T, H, stride_o_t, stride_o_h, stride_w_h, RANK: tl.constexpr,
                     V: tl.constexpr, BLOCK_V: tl.constexpr):
    h = tl.program_id(0)
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rs = tl.arange(0, RANK)
    w = tl.load(w_ptr + h * stride_w_h + vs[:, None] * RANK + rs[None, :]).to(tl.float32)  # [BLOCK_V, RANK]
    for t in range(T):
        x = tl.load(o_ptr + t * stride_o_t + h * stride_o_h + rs).to(tl.float32)
        y = tl.sum(w * x[None, :], axis=1)
        tl.store(out_ptr + (t * H + h) * V + vs, y.to(out_ptr.dtype.element_ty))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _head_rows(w: torch.Tensor) -> bool:
    """[H, n, rank] with each head's n rows of rank contiguous (views of kv_b_proj's [H, nope + v, rank])."""
    return w.stride(-1) == 1 and w.stride(-2) == w.shape[-1]


def absorb_serves(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> bool:
    """absorb takes the step: few rows, power-of-two widths that its block divides, unit last strides."""
    rows, _, nope = q_nope.shape
    rank, rope = w_uk.shape[2], q_pe.shape[2]
    return (0 < rows <= MAX_ROWS and _pow2(nope) and _pow2(rope) and _pow2(rank)
            and rank % ABSORB_BLOCK_R == 0 and q_nope.stride(-1) == 1 and q_pe.stride(-1) == 1
            and _head_rows(w_uk))


def unabsorb_serves(o_lat: torch.Tensor, w_uv: torch.Tensor) -> bool:
    rows, _, rank = o_lat.shape
    v = w_uv.shape[1]
    return (0 < rows <= MAX_ROWS and _pow2(rank) and v % UNABSORB_BLOCK_V == 0 and o_lat.stride(-1) == 1
            and _head_rows(w_uv))


def absorb(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, nope], q_pe [T, H, rope] (unit stride in their last dim), w_uk [H, nope, rank] ->
    [T, H, rank + rope]: q_nope's heads through their W_UK, then q_pe."""
    t, h, nope = q_nope.shape
    rank, rope = w_uk.shape[2], q_pe.shape[2]
    out = torch.empty(t, h, rank + rope, dtype=q_nope.dtype, device=q_nope.device)
    _absorb_kernel[(h, rank // ABSORB_BLOCK_R)](
        q_nope, q_pe, w_uk, out, t, h, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        w_uk.stride(0), NOPE=nope, RANK=rank, ROPE=rope, BLOCK_R=ABSORB_BLOCK_R, num_warps=4)
    return out


def unabsorb(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [T, H, rank] (unit stride in its last dim), w_uv [H, v, rank] -> [T, H * v] in o_lat's dtype."""
    t, h, rank = o_lat.shape
    v = w_uv.shape[1]
    out = torch.empty(t, h * v, dtype=o_lat.dtype, device=o_lat.device)
    _unabsorb_kernel[(h, v // UNABSORB_BLOCK_V)](
        o_lat, w_uv, out, t, h, o_lat.stride(0), o_lat.stride(1), w_uv.stride(0), RANK=rank, V=v,
        BLOCK_V=UNABSORB_BLOCK_V, num_warps=4)
    return out
