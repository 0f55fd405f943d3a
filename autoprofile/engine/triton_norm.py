"""RMSNorm, and the residual add fused into it, in one Triton kernel: one program per row.

AITER's rms_norm launches min(rows, SMs) programs with that count a compile-time constant, so every row
count below the SM count was a compile of its own (a cold start compiled ~40 of them while capturing the
decode graphs, and a sealed backend had to fall back to torch ops for a count it had not seen). Here the row
count is the launch grid and nothing else: one compile per model serves every step. Same math as the torch
reference (AttentionBackend.rms_norm: fp32, x * rsqrt(mean(x^2) + eps) * weight, rounded once); the fused
form first rounds x + residual to the model dtype (what the unfused add stores), then normalises it.
Imported when the aiter_triton backend is built.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                     stride_res_out, eps, N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)  # in the model dtype
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    n = x.shape[-1]
    rows = _rows(x)
    res = _rows(residual) if residual is not None else rows
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(rows.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    block = triton.next_power_of_2(n)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, res, weight, out, res_out, rows.stride(0), res.stride(0),
                                           out.stride(0), res_out.stride(0), eps, N=n, BLOCK=block,
                                           ADD=residual is not None, num_warps=min(max(block // 512, 1), 16))
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> RMSNorm(x) * weight, in x's dtype."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual): the decoder layer's residual stream in one pass."""
    return _launch(x, residual, weight, eps)
