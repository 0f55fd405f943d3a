"""SiLU(gate) * up in one Triton kernel: the MLP's activation between gate_up_proj and down_proj.

In torch ops that is two kernels and an intermediate [T, I] tensor (silu, then the product, each rounded to
the model dtype); here one pass, computed in fp32 and rounded once. The row count is the launch grid, not
an argument, so one compile serves every step shape. Imported when the aiter_triton backend is built.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from autoprofile.kernels import pdl

BLOCK = 1024


@triton.jit
def silu_mul_at(x_row, cols, mask, INTER: tl.constexpr):
    """silu(gate) * up in fp32 at columns `cols` of one gate | up row (0 where masked). Also the activation of
    triton_fp8's silu_mul_quant."""
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, INTER: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    out = silu_mul_at(x_ptr + row * stride_x, cols, mask, INTER)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] (gate | up, unit stride in the last dim) -> silu(gate) * up [..., I]."""
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    assert rows.stride(-1) == 1
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, BLOCK))](rows, out, rows.stride(0), out.stride(0),
                                                                     INTER=inter, BLOCK=BLOCK, num_warps=4,
                                                                     **pdl.launch())
    return out.view(*x.shape[:-1], inter)
