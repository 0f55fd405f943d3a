"""Structured output's token mask on the logits, in place: a disallowed token's logit becomes -inf.

    apply_bitmask_(logits, bitmask, vocab_size, index)   # logits [rows, V], bitmask [rows, V / 32] int32

Bit j % 32 of word j // 32 of a row is token j: 1 allowed, 0 masked (xgrammar's layout and semantics:
`xgrammar.apply_token_bitmask_inplace`, the reference the tests compare with). `index` (int32 on the logits'
device) names the rows to mask, else every row; tokens at and past `vocab_size` are left as they are.

Ours rather than xgrammar's kernel: the mask is applied in every stress corner of every boot (the envelope's
sampled rows all masked), and `import xgrammar` imports transformers (5.7-7 s of host time on the GPU hosts,
most of a warm boot's stress); the engine now imports xgrammar only where a request has a grammar, the
serving layer after the boot (server.serve). One program a (row, BLOCK tokens): it reads the BLOCK / 32 words
and writes only the masked logits. No allocation, no host sync: CUDA-graph safe. Off CUDA: `reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # tokens a program: 128 words of the mask
NUM_WARPS = 4


@triton.jit
def _apply_bitmask(logits_ptr, mask_ptr, index_ptr, vocab, logits_stride, mask_stride,
                   HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.load(index_ptr + r).to(tl.int64) if HAS_INDEX else r.to(tl.int64)
    start = tl.program_id(1) * BLOCK
    words = tl.load(mask_ptr + row * mask_stride + start // 32 + tl.arange(0, BLOCK // 32),
                    mask=start // 32 + tl.arange(0, BLOCK // 32) < mask_stride, other=-1)
    masked = ((words[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0
    masked = tl.reshape(masked, [BLOCK])
    offs = start + tl.arange(0, BLOCK)
    tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=masked & (offs < vocab))


def check(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """The shapes xgrammar accepts: 2-D logits, int32 words enough for vocab_size, vocab_size <= the row."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"logits [rows, V] and an int32 bitmask [rows, words]; got {tuple(logits.shape)}, "
                         f"{tuple(bitmask.shape)} {bitmask.dtype}")
    if not 0 < vocab_size <= min(logits.shape[1], bitmask.shape[1] * 32):
        fits = min(logits.shape[1], bitmask.shape[1] * 32)
        raise ValueError(f"vocab_size {vocab_size} must be in (0, {fits}]: the logits' and the mask's width")


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int,
                   index: torch.Tensor | None = None) -> torch.Tensor:
    """Mask logits in place (see the module's text); returns logits. bitmask row i masks logits row i."""
    check(logits, bitmask, vocab_size)
    if logits.device.type != "cuda":
        return reference_(logits, bitmask, vocab_size, index)
    rows = logits.shape[0] if index is None else index.numel()
    if rows == 0:
        return logits
    grid = (rows, triton.cdiv(vocab_size, BLOCK))
    rows_ptr = index if index is not None else bitmask  # not read without an index
    _apply_bitmask[grid](logits, bitmask, rows_ptr, vocab_size, logits.stride(0), bitmask.stride(0),
                         HAS_INDEX=index is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return logits


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool, True where the token is allowed."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] != 0


def reference_(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int,
               index: torch.Tensor | None = None) -> torch.Tensor:
    """The same in torch ops (the CPU's path, and the GPU tests' reference)."""
    rows = torch.arange(logits.shape[0], device=logits.device) if index is None else index.long()
    allowed = unpack(bitmask[rows], vocab_size)
    logits[rows, :vocab_size] = logits[rows, :vocab_size].masked_fill(~allowed, float("-inf"))
    return logits
