"""K and V of a prefill step's chunks, gathered from the paged cache in one launch
(AttentionBackend.gather_kv: a chunk over a cached prefix or an earlier chunk attends to the prefix and its
own tokens, packed).

In torch that is `kv.k[pages, :, offs]` and the same for V: two advanced-indexing kernels a layer. In a trace
of llama-3.1-8b served at c256 on an H200 (scripts/trace_steps.py) they took 62 us each, 64 a prefill step of
about 8,000 tokens: 4.3 ms, 2.3% of the step, a fifth of the copy rate (each element's offset computed from
two index tensors). Here program (block of tokens, K or V) reads each token's slot once and copies its
[Hkv, D] cells, D contiguous per head, as the cache's dtype (an FP8 cache is dequantised after, as before).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16  # tokens a program


# n follows the step (its rows' prefixes and chunks): unspecialized, so that every count runs the one compile
# the stress's corners made. Specialized, a served step compiled it after the boot of qwen3-30b-a3b-fp8 on an
# H200 (0.10 s); that model's corners gather 262,143 slots alone, so a count divisible by 16 was a new key.
@triton.jit(do_not_specialize=["n"])
def _gather_kernel(k_cache_ptr, v_cache_ptr, k_out_ptr, v_out_ptr, slot_ptr, n,
                   stride_cp, stride_ch, stride_co,  # cache strides: page, head, offset (dim: 1)
                   PAGE: tl.constexpr, D: tl.constexpr, HD: tl.constexpr, HD_POW2: tl.constexpr,
                   BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < n
    slot = tl.load(slot_ptr + t, mask=live, other=0).to(tl.int64)
    page, off = slot // PAGE, slot % PAGE
    c = tl.arange(0, HD_POW2)  # column h * D + d of the packed row
    src = (page[:, None] * stride_cp + (c // D)[None, :] * stride_ch + off[:, None] * stride_co
           + (c % D)[None, :])
    dst = t.to(tl.int64)[:, None] * HD + c[None, :]
    mask = live[:, None] & (c < HD)[None, :]
    if tl.program_id(1) == 0:
        tl.store(k_out_ptr + dst, tl.load(k_cache_ptr + src, mask=mask), mask=mask)
    else:
        tl.store(v_out_ptr + dst, tl.load(v_cache_ptr + src, mask=mask), mask=mask)


def gather(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) [N, Hkv, D] in the cache's dtype: the cells of cache slots `slots` [N] (slot = page * page_size
    + offset) of caches [num_pages, Hkv, page_size, D] (unit stride in D; K and V of one layout)."""
    same = k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    if not same or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"K and V caches differ: {tuple(k_cache.shape)} {k_cache.dtype}, "
                         f"{tuple(v_cache.shape)} {v_cache.dtype}")
    if k_cache.stride(-1) != 1:
        raise ValueError("gather needs caches with unit stride in head_dim")
    _, hkv, page, d = k_cache.shape
    n = slots.shape[0]
    k = k_cache.new_empty((n, hkv, d))
    v = v_cache.new_empty((n, hkv, d))
    if n == 0:
        return k, v
    hd = hkv * d
    _gather_kernel[(triton.cdiv(n, BLOCK_T), 2)](
        k_cache, v_cache, k, v, slots.contiguous(), n, *k_cache.stride()[:3], PAGE=page, D=d, HD=hd,
        HD_POW2=triton.next_power_of_2(hd), BLOCK_T=BLOCK_T, num_warps=8)
    return k, v
