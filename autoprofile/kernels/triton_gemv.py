"""y = x W^T (+ b) for a single row: the batch-1 decode's GEMMs as one Triton GEMV.

At one row every linear layer is a read of its weight, and cuBLAS's kernels for it leave bandwidth behind: on
an H100 a llama-3.1-8b batch-1 step spent 20.7 us in each 4,096 x 4,096 o_proj (1.6 TB/s of the 3.0 the card
copies at) and split K elsewhere, with a reduce kernel after (scripts/profile_decode.py). Here each program
reads BLOCK_N whole rows of W in BLOCK_K slices, multiplies by x in fp32 and sums once: no split, no second
kernel. Rows beyond one go to cuBLAS (linear()). Imported when the aiter_triton backend is built.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from autoprofile.kernels import pdl
from autoprofile.layers.quant import linear_out

# scripts/bench_gemv.py --sweep on an H100, llama-3.1-8b's shapes (32 distinct weights a shape, so L2 holds
# none), against cuBLAS: qkv 1.13x, o_proj 1.25x, gate_up 1.08x, down_proj 1.07x, lm_head 1.31x (best or
# within 3% of the best of 7 configs on each)
BLOCK_N, BLOCK_K, WARPS = 2, 2048, 8


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, N, K, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl.begin(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = ks < K - k
        x = tl.load(x_ptr + k + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + k + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # y_ptr may be r_ptr: each program reads its rows before it writes them
        y += tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, residual: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x [K] or [1, K] (contiguous), weight [N, K] (contiguous) -> [N] or [1, N] in out_dtype (None: x's).
    Both are read in their own dtypes and multiplied in fp32. residual (contiguous, N elements): the product
    is added to it in the epilogue, in place (rounded once), and it is returned. out (N contiguous elements):
    the product is written there and it is returned."""
    n, k = weight.shape
    if residual is not None:
        assert residual.is_contiguous() and residual.numel() == n, "the GEMV adds into one contiguous row"
    if residual is not None:
        out = residual
    elif out is None:
        out = torch.empty(*x.shape[:-1], n, dtype=out_dtype or x.dtype, device=x.device)
    else:
        assert out.is_contiguous() and out.numel() == n, "the GEMV writes one contiguous row"
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](x, weight, bias if bias is not None else weight, out, out, n, k,
                                             HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                                             BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=WARPS,
                                             **pdl.launch())
    return out


def one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.numel() == x.shape[-1] and x.is_contiguous() and weight.is_contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMV for one contiguous row, cuBLAS (F.linear) otherwise; out: written there (TP.linear)."""
    if one_row(x, weight) and (out is None or out.is_contiguous()):
        return gemv(x, weight, bias, out=out)
    return linear_out(x, weight, bias, out)


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual += x W^T, in place (TP.linear_add on one rank): one contiguous row through the GEMV's
    epilogue (where a GEMV and an add kernel ran: 64 adds a llama-3.1-8b batch-1 step), more through cuBLAS's
    (addmm_, beta = 1)."""
    if one_row(x, weight) and residual.is_contiguous():
        return gemv(x, weight, residual=residual)
    return residual.addmm_(x, weight.t())


def router_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits x W^T of an fp32 router weight [E, H] (DeepSeek's, which HF computes in fp32): one row
    through the GEMV in one kernel, x read in its own dtype (cuBLAS took three at a batch-1 decode: x's fp32
    copy, a dot and a reduce, 6.2 us a layer on an H100); more rows: F.linear over x in fp32."""
    if one_row(x, weight):
        return gemv(x, weight, out_dtype=torch.float32)
    return F.linear(x.float(), weight)
