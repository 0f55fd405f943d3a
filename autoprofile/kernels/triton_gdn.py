"""Gated DeltaNet's one-token decode in one Triton kernel, over the state cache in place by request slot.

One program per (row, value head, block of BV value channels): it loads the row's q and k of the value head's
key head (l2-normalised in fp32, q scaled by k_dim^-1/2), its [k_dim, BV] tile of the row's state, and writes
the advanced tile back where it was read and the output's BV channels. So the state is read once and written
once (the bytes floor of a decode step's linear layers), with no gather into a temporary and no scatter back;
a padded graph row reads and writes the pad slot. Same math as the torch reference
(layers.gdn.delta_rule_decode). Imported when the aiter_triton backend is built.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from autoprofile.kernels import pdl

BLOCK_V = 32  # value channels a program: [k_dim, 32] fp32 of state in registers (128 x 32: 32 a thread)


@triton.jit
def _normed(ptr, stride, kd, BK: tl.constexpr):
    """A [BK] fp32 vector (0 past kd), l2-normalised (eps 1e-6, as fla)."""
    cols = tl.arange(0, BK)
    x = tl.load(ptr + cols * stride, mask=cols < kd, other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _gdn_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, ssm_ptr, slots_ptr, out_ptr,
                       sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sb_b, so_b, so_h,
                       ss_slot, ss_h, ss_k, kd, vd, group, scale, BK: tl.constexpr, BV: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl.begin(PDL)
    b, h, j = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
    kh = h // group
    q = _normed(q_ptr + b * sq_b + kh * sq_h, 1, kd, BK) * scale
    k = _normed(k_ptr + b * sk_b + kh * sk_h, 1, kd, BK)
    vc = j * BV + tl.arange(0, BV)
    vmask = vc < vd
    v = tl.load(v_ptr + b * sv_b + h * sv_h + vc, mask=vmask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * sg_b + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * sb_b + h).to(tl.float32)
    slot = tl.load(slots_ptr + b)
    kc = tl.arange(0, BK)
    tile = ssm_ptr + slot * ss_slot + h * ss_h + kc[:, None] * ss_k + vc[None, :]
    mask = (kc[:, None] < kd) & vmask[None, :]
    s = tl.load(tile, mask=mask, other=0.0).to(tl.float32) * tl.exp(g)
    delta = beta * (v - tl.sum(s * k[:, None], axis=0))
    s += k[:, None] * delta[None, :]
    tl.store(tile, s.to(ssm_ptr.dtype.element_ty), mask=mask)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + b * so_b + h * so_h + vc, o.to(out_ptr.dtype.element_ty), mask=vmask)


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           ssm: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv] (unit stride along their last dim), ssm [slots, Hv,
    Dk, Dv] (contiguous in its last three dims), slots [B] int64 -> o [B, Hv, Dv] in v's dtype; ssm[slots]
    advanced in place."""
    b, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    out = torch.empty(b, hv, vd, dtype=v.dtype, device=v.device)
    if b:
        grid = (b, hv, triton.cdiv(vd, BLOCK_V))
        _gdn_decode_kernel[grid](q, k, v, g, beta, ssm, slots, out,
                                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                 g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
                                 ssm.stride(0), ssm.stride(1), ssm.stride(2), kd, vd, hv // hk, kd ** -0.5,
                                 BK=triton.next_power_of_2(kd), BV=BLOCK_V, num_warps=4, **pdl.launch())
    return out
