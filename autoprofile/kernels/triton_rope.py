"""One Triton kernel for what each attention layer does between the QKV projection and attention: RoPE
in place on the packed projection's q and k heads (Qwen3: each head RMS-normed first; Qwen3.5's gated
attention: normed, RoPE on the first rotary_dim channels, q written apart from its gate), and K/V written to
the paged cache. In torch ops that
is ~15 small kernels per layer (rotation in fp32, casts, index arithmetic, two index_puts), which
dominate a batch-1 decode step's launch count.

Same contract as AttentionBackend.rope_store (neox halves, rotation in fp32, then the model dtype; the
compiler may contract a multiply-add into an FMA, so results can differ from the torch ops by one bf16
rounding). An FP8 cache gets K/V divided by its scales (a [2] fp32 device tensor, read by the kernel),
saturated to the finite FP8 range. Imported when the aiter_triton backend is built (triton is imported here).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from autoprofile.kernels import pdl
from autoprofile.layers.quant import FP8_MAX


@triton.jit
def _rope_store_kernel(qkv_ptr, q_out_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, scale_ptr,
                       q_norm_ptr, k_norm_ptr, eps,
                       stride_t, stride_qo, stride_cos, stride_sin,
                       stride_cp, stride_ch, stride_co,  # cache strides: page, head, offset (dim: 1)
                       NQ: tl.constexpr, NKV: tl.constexpr, HALF: tl.constexpr, ROT_HALF: tl.constexpr,
                       Q_STRIDE: tl.constexpr, PAGE: tl.constexpr,
                       NQK_POW2: tl.constexpr, NKV_POW2: tl.constexpr, QUANT: tl.constexpr,
                       QK_NORM: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr = False):
    pdl.begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + t * stride_t
    # channel d of a head turns with channel p (neox halves of its first 2 * ROT_HALF channels); the rest
    # (Qwen3.5's partial rotary) keep their value: cos 1, sin 0
    d = tl.arange(0, 2 * HALF)
    rot, first = d < 2 * ROT_HALF, d < ROT_HALF
    p = tl.where(rot, tl.where(first, d + ROT_HALF, d - ROT_HALF), d)
    c = tl.load(cos_ptr + t * stride_cos + d % ROT_HALF, mask=rot, other=1.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_sin + d % ROT_HALF, mask=rot, other=0.0).to(tl.float32)
    s = tl.where(first, -s, s)[None, :]
    h = tl.arange(0, NQK_POW2)
    is_q = (h < NQ)[:, None]
    is_k = ((h >= NQ) & (h < NQ + NKV))[:, None]
    mask = is_q | is_k
    # q heads Q_STRIDE apart in the row (Qwen3.5: [q_h | gate_h], 4 * HALF), then the k heads
    head = row + tl.where(h < NQ, h * Q_STRIDE, NQ * Q_STRIDE + (h - NQ) * (2 * HALF))[:, None]
    x = tl.load(head + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(head + p[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # Qwen3: each head RMS-normed (q_norm, k_norm weights), rounded as the norm kernel rounds
        inv = tl.rsqrt(tl.sum(x * x, 1) / (2 * HALF) + eps)[:, None]
        w = tl.where(is_q, tl.load(q_norm_ptr + d).to(tl.float32)[None, :],
                     tl.load(k_norm_ptr + d).to(tl.float32)[None, :])
        wp = tl.where(is_q, tl.load(q_norm_ptr + p).to(tl.float32)[None, :],
                      tl.load(k_norm_ptr + p).to(tl.float32)[None, :])
        x = (x * inv * w).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        xp = (xp * inv * wp).to(qkv_ptr.dtype.element_ty).to(tl.float32)
    r = tl.where(rot[None, :], x * c + xp * s, x).to(qkv_ptr.dtype.element_ty)
    # q to q_out (qkv itself for Llama/Qwen3: in place), k in place
    tl.store(q_out_ptr + t * stride_qo + h[:, None] * (2 * HALF) + d[None, :], r, mask=is_q)
    tl.store(head + d[None, :], r, mask=is_k)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page, off = slot // PAGE, slot % PAGE
    kh = h - NQ
    k_dst = k_cache_ptr + page * stride_cp + kh[:, None] * stride_ch + off * stride_co + d[None, :]
    k = r.to(tl.float32)  # K as the model dtype rounds it (what attention reads from the cache without FP8)
    vh = tl.arange(0, NKV_POW2)
    v_mask = (vh < NKV)[:, None]
    v = tl.load(row + NQ * Q_STRIDE + (NKV + vh[:, None]) * (2 * HALF) + d[None, :], mask=v_mask, other=0.0)
    v = v.to(tl.float32)
    if QUANT:
        k_inv = 1.0 / tl.load(scale_ptr)
        v_inv = 1.0 / tl.load(scale_ptr + 1)
        k = tl.minimum(tl.maximum(k * k_inv, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v * v_inv, -FP8_MAX), FP8_MAX)
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    v_dst = v_cache_ptr + page * stride_cp + vh[:, None] * stride_ch + off * stride_co + d[None, :]
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int, num_kv_heads: int,
               head_dim: int, scales: torch.Tensor | None = None,
               qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, rotary_dim: int = 0,
               gated: bool = False) -> tuple[torch.Tensor, ...]:
    """qkv [T, (Hq + 2*Hkv) * D] with unit stride in its last dim; cos, sin [T, 1, rotary_dim/2] (any row
    stride); caches [pages, Hkv, page, D] with unit stride in D; scales: an FP8 cache's [2] fp32 (k, v);
    qk_norm: (q_norm weight [D], k_norm weight [D], eps): Qwen3's per-head RMSNorm of q and k before RoPE
    (AttentionBackend.norm_rope_store); rotary_dim: RoPE on each head's first rotary_dim channels (0: all D).
    gated: Qwen3.5's q part [Hq, 2, D] (each head's query, then its output gate;
    AttentionBackend.gated_norm_rope_store), qkv [T, (2*Hq + 2*Hkv) * D]: q goes to a new [T, Hq, D], the
    gate stays in qkv. Returns q, k, v: views of qkv (q a new tensor when gated)."""
    t, d = qkv.shape[0], head_dim
    q_stride = 2 * d if gated else d
    q = torch.empty(t, num_q_heads, d, dtype=qkv.dtype, device=qkv.device) if gated else None
    if t:
        assert qkv.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
        q_w, k_w, eps = qk_norm if qk_norm is not None else (qkv, qkv, 0.0)
        q_out = qkv if q is None else q
        _rope_store_kernel[(t,)](
            qkv, q_out, cos, sin, slot_mapping, k_cache, v_cache, slot_mapping if scales is None else scales,
            q_w, k_w, float(eps),
            qkv.stride(0), q_out.stride(0), cos.stride(0), sin.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NQ=num_q_heads, NKV=num_kv_heads, HALF=d // 2, ROT_HALF=(rotary_dim or d) // 2, Q_STRIDE=q_stride,
            PAGE=k_cache.shape[2], NQK_POW2=triton.next_power_of_2(num_q_heads + num_kv_heads),
            NKV_POW2=triton.next_power_of_2(num_kv_heads), QUANT=scales is not None,
            QK_NORM=qk_norm is not None, FP8_MAX=FP8_MAX,
            num_warps=4, **pdl.launch())
    q_end = num_q_heads * q_stride
    if q is None:
        q = qkv[:, :q_end].view(t, num_q_heads, d)
    k = qkv[:, q_end:q_end + num_kv_heads * d].view(t, num_kv_heads, d)
    v = qkv[:, q_end + num_kv_heads * d:].view(t, num_kv_heads, d)
    return q, k, v


@triton.jit
def _mla_rope_store_kernel(q_ptr, kv_ptr, norm_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, eps,
                           stride_qt, stride_qh, stride_kvt, stride_cos, stride_sin, stride_cp, stride_co,
                           H: tl.constexpr, H_POW2: tl.constexpr, NOPE: tl.constexpr, RANK: tl.constexpr,
                           RANK_POW2: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HALF)
    c = tl.load(cos_ptr + t * stride_cos + i).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_sin + i).to(tl.float32)[None, :]
    # q's rope channels, every head: pairs (2i, 2i + 1) rotated in place
    h = tl.arange(0, H_POW2)[:, None]
    q = q_ptr + t * stride_qt + h * stride_qh + NOPE + 2 * i[None, :]
    heads = h < H
    even = tl.load(q, mask=heads, other=0.0).to(tl.float32)
    odd = tl.load(q + 1, mask=heads, other=0.0).to(tl.float32)
    tl.store(q, (even * c - odd * s).to(q_ptr.dtype.element_ty), mask=heads)
    tl.store(q + 1, (even * s + odd * c).to(q_ptr.dtype.element_ty), mask=heads)
    # the latent: RMSNorm of its first RANK channels, its rope key rotated; in place and into the cache
    slot = tl.load(slot_ptr + t).to(tl.int64)
    dst = cache_ptr + (slot // PAGE) * stride_cp + (slot % PAGE) * stride_co
    row = kv_ptr + t * stride_kvt
    r = tl.arange(0, RANK_POW2)
    live = r < RANK
    x = tl.load(row + r, mask=live, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / RANK + eps)
    w = tl.load(norm_ptr + r, mask=live, other=0.0).to(tl.float32)
    normed = (x * inv * w).to(kv_ptr.dtype.element_ty)
    tl.store(row + r, normed, mask=live)
    tl.store(dst + r, normed.to(cache_ptr.dtype.element_ty), mask=live)
    k = RANK + 2 * i
    even = tl.load(row + k).to(tl.float32)
    odd = tl.load(row + k + 1).to(tl.float32)
    k_even = (even * tl.reshape(c, (HALF,)) - odd * tl.reshape(s, (HALF,))).to(kv_ptr.dtype.element_ty)
    k_odd = (even * tl.reshape(s, (HALF,)) + odd * tl.reshape(c, (HALF,))).to(kv_ptr.dtype.element_ty)
    tl.store(row + k, k_even)
    tl.store(row + k + 1, k_odd)
    tl.store(dst + k, k_even.to(cache_ptr.dtype.element_ty))
    tl.store(dst + k + 1, k_odd.to(cache_ptr.dtype.element_ty))


def mla_rope_store(q: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                   nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's per-layer work between the projections and attention in one launch, in place
    (AttentionBackend.mla_rope_store): q [T, H, nope + rope] (unit stride in its last dim) gets its rope
    channels rotated (pairs (2i, 2i + 1), fp32); kv_a [T, rank + rope] (contiguous rows) becomes the latent,
    RMSNorm(c) * norm_weight | rotated k_pe, written to the latent cache [pages, 1, page, rank + rope] at
    slot_mapping. cos, sin [T, 1, rope / 2]. Returns (q's rope part, the latent): views of q and kv_a."""
    t, heads, width = q.shape
    rope = width - nope
    rank = kv_a.shape[1] - rope
    if t:
        assert q.stride(-1) == 1 and kv_a.stride(-1) == 1 and cache.stride(-1) == 1
        _mla_rope_store_kernel[(t,)](
            q, kv_a, norm_weight, cos, sin, slot_mapping, cache, float(eps), q.stride(0), q.stride(1),
            kv_a.stride(0), cos.stride(0), sin.stride(0), cache.stride(0), cache.stride(2),
            H=heads, H_POW2=triton.next_power_of_2(heads), NOPE=nope, RANK=rank,
            RANK_POW2=triton.next_power_of_2(rank), HALF=rope // 2, PAGE=cache.shape[2], num_warps=4)
    return q[..., nope:], kv_a
