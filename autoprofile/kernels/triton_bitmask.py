"""Structured output's token mask on the logits, in place: a disallowed token's logit becomes -inf.

    apply_bitmask_(logits, bitmask, vocab_size, index)   # logits [rows, V], bitmask [rows, V / 32] int32

Bit j % 32 of word j // 32 of a row is token j: 1 allowed, 0 masked (xgrammar's layout and semantics:
`xgrammar.apply_token_bitmask_inplace`, the reference the tests compare with). `index` (int32 on the logits'
device) names the rows to mask, else every row; tokens at and past `vocab_size` are left as they are.

Ours rather than xgrammar's kernel: the mask is applied in every stress corner of every boot (the envelope's
sampled rows all masked), and `import xgrammar` imports transformers (5.7-7 s of host time on the GPU hosts,
most of a warm boot's stress); the engine now imports xgrammar only where a request has a grammar, the
serving layer after the boot (server.serve). One program a (row, BLOCK tokens): it reads the BLOCK / 32 words
and writes only the masked logits. No allocation, no host sync: CUDA-graph safe. The torch path (off CUDA,
and the tests' reference) is its caller's: engine.grammar.mask_logits_.

H200 (`scripts/bench_sampler.py --mask`, bf16, 128,256 tokens, half masked at random): 256 rows all masked
0.124 ms of GPU against xgrammar's 0.078 (its grid persistent); 8-64 rows and a quarter of the rows named
within 0.001-0.004 ms of it; eager (the launch's host time in it) faster up to 64 rows. BLOCK 2048-16384 and
4-16 warps did not move the 256 rows. xgrammar's grid (one program an SM looping over the tiles) is the next
thing to try there; not built (not measured). 1 KiB of shared memory a program (the [words, 32] -> [BLOCK]
reshape), no local memory (sm_90, Triton 3.6 and 3.9: cuobjdump -res-usage LOCAL:0 STACK:0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # tokens a tile: 128 words of the mask
NUM_WARPS = 4


@triton.jit
def _apply_bitmask(logits_ptr, mask_ptr, index_ptr, vocab, logits_stride, mask_stride,
                   HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr):
    """Program (r, t): tile t (BLOCK tokens) of masked row r (the index's r-th row, else row r)."""
    r = tl.program_id(0)
    row = tl.load(index_ptr + r).to(tl.int64) if HAS_INDEX else r.to(tl.int64)
    start = tl.program_id(1) * BLOCK
    words = tl.load(mask_ptr + row * mask_stride + start // 32 + tl.arange(0, BLOCK // 32),
                    mask=start // 32 + tl.arange(0, BLOCK // 32) < mask_stride, other=-1)
    masked = ((words[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0
    masked = tl.reshape(masked, [BLOCK])
    offs = start + tl.arange(0, BLOCK)
    tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=masked & (offs < vocab))


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int,
                   index: torch.Tensor | None = None) -> torch.Tensor:
    """Mask CUDA logits in place (see the module's text; the caller checked the shapes:
    engine.grammar.mask_logits_); returns logits. bitmask row i masks logits row i."""
    rows = logits.shape[0] if index is None else index.numel()
    if rows == 0:
        return logits
    rows_ptr = index if index is not None else bitmask  # not read without an index
    _apply_bitmask[(rows, triton.cdiv(vocab_size, BLOCK))](
        logits, bitmask, rows_ptr, vocab_size, logits.stride(0), bitmask.stride(0),
        HAS_INDEX=index is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return logits
