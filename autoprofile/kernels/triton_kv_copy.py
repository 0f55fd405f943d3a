"""KV pages between the GPU cache and the host tier's pinned buffer in one launch (SGLang HiCache's "kernel"
io backend): the host buffer is read and written through its mapped device address (pinned with
cudaHostRegisterMapped: Triton's launcher resolves a host tensor's pointer to it), so a list of scattered
pages costs one launch instead of one cudaMemcpyAsync per run of pages, part and layer.

Both buffers are [parts, layers, pages, heads, page, width] (KVCache.buffer, HostKVPool.buffer); a page of one
part and layer is contiguous. Program (pair, part x layer) reads its (src, dst) page ids once and copies that
page's slice in blocks. The bytes move as integers (any cache dtype: bf16, fp8, fp32 in the interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_BYTES = 4096  # bytes a program moves per loop iteration


@triton.jit
def _copy_pages_kernel(src_ptr, dst_ptr, pairs_ptr, n_pairs, src_stride, dst_stride, PAGE: tl.constexpr,
                       BLOCK: tl.constexpr):
    i = tl.program_id(0)
    part_layer = tl.program_id(1).to(tl.int64)
    s = tl.load(pairs_ptr + i).to(tl.int64)
    d = tl.load(pairs_ptr + n_pairs + i).to(tl.int64)
    src = src_ptr + part_layer * src_stride + s * PAGE
    dst = dst_ptr + part_layer * dst_stride + d * PAGE
    for off in range(0, PAGE, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < PAGE
        tl.store(dst + cols, tl.load(src + cols, mask=mask), mask=mask)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """[parts * layers, pages, page elements] of the widest integer type that divides a page's bytes."""
    flat = t.reshape(t.shape[0] * t.shape[1], t.shape[2], -1).view(torch.uint8)
    for dtype in (torch.int32, torch.int16):
        if flat.shape[-1] % dtype.itemsize == 0:
            return flat.view(dtype)
    return flat


def copy_pages(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    """dst[:, :, pairs[1, i]] = src[:, :, pairs[0, i]] for every i, on the current stream. src, dst:
    contiguous [parts, layers, pages, ...] buffers of one dtype and page shape (one may be a pinned, mapped
    host tensor); pairs: int32 [2, n] (a host tensor the device can read, or on the device)."""
    if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:] or src.dtype != dst.dtype:
        raise ValueError(f"page layouts differ: {tuple(src.shape)} {src.dtype} -> {tuple(dst.shape)} "
                         f"{dst.dtype}")
    if not (src.is_contiguous() and dst.is_contiguous() and pairs.is_contiguous()):
        raise ValueError("copy_pages needs contiguous buffers and page list")
    n = pairs.shape[1]
    if n == 0:
        return
    s, d = _as_words(src), _as_words(dst)
    page = s.shape[-1]
    block = min(max(BLOCK_BYTES // s.element_size(), 16), triton.next_power_of_2(page))
    _copy_pages_kernel[(n, s.shape[0])](s, d, pairs, n, s.stride(0), d.stride(0), PAGE=page, BLOCK=block,
                                        num_warps=4)
