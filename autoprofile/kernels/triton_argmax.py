"""Greedy sampling on CUDA: argmax over the vocabulary at the copy rate, several programs a row.

One program a row (torch.argmax, the one-kernel sampler's greedy rows) leaves an H100 waiting on memory at
256 rows x 128,256 bf16 logits: 0.073 ms against 0.022 ms of bytes (issue 48, item 3). Here the grid is
(rows, splits), splits chosen so that rows * splits covers the GPU PROGRAMS_PER_SM times over (`splits_for`);
each program reads one contiguous chunk of its row (whole BLOCK tiles) and reduces it to one packed int64
key, (order-preserving int32 of the fp32 logit) << 32 | (0xFFFFFFFF - index): the largest key is the largest
logit at its FIRST index. A row's programs combine their keys by tl.atomic_max into a scratch; the row's last
program (an atomic count of its programs done: CUDA's threadFenceReduction sample) unpacks the index into
the output. The max of the keys does not depend on the order the programs arrive in: deterministic.
Launches: the scratch's fill and the kernel (a row in one program: the kernel alone, no scratch). No host
sync, no allocation beyond the scratch and the output: CUDA-graph safe.

Semantics are torch.argmax(dim=-1)'s: the first index of the max; a row of -inf gives 0; -0.0 ties with
0.0; NaN is above every number (either sign: its key is the largest int32), so the first NaN wins, as in
torch.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# H100, 256 x 128,256 bf16, graphed: BLOCK 1024-4096, 4-16 warps, 4-16 programs an SM all took 0.029-0.035 ms
BLOCK = 2048  # logits a program reads at a time: 8 a thread (one 16-byte load of bf16) at 8 warps
NUM_WARPS = 8
PROGRAMS_PER_SM = 4  # programs the grid aims at per SM when the rows are few (each program a chunk)
H100_SMS = 132  # the SM count off CUDA (the interpreter, the sm_90 compile check)
INT64_MIN = -2**63  # the scratch's fill: below every key, and the count of programs done before any


@triton.jit
def _key(x):
    """fp32 -> int32 in the same order: negative floats' low 31 bits flipped; -0.0 as 0.0 (+ 0.0), and NaN
    (either sign) the largest int32, above +inf."""
    x = x + 0.0
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(x != x, 2147483647, bits ^ ((bits >> 31) & 0x7FFFFFFF))


@triton.jit(do_not_specialize=["last"])
def _argmax_kernel(x_ptr, stride, V, chunk, scratch_ptr, last, out_ptr, BLOCK: tl.constexpr,
                   SPLIT: tl.constexpr):
    row = tl.program_id(0)
    lo = tl.program_id(1) * chunk
    hi = tl.minimum(lo + chunk, V)
    base = x_ptr + row.to(tl.int64) * stride
    lanes = tl.arange(0, BLOCK)
    # per lane (tokens lo + l, lo + l + BLOCK, ...): the max and its first index by float compares (fewer
    # instructions a logit than keys: a little faster on an H100); keys once, at the end. A lane of -inf
    # keeps its first index
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    arg = lo + lanes
    for start in range(lo, hi, BLOCK):
        offs = start + lanes
        x = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        up = (x > m) | ((x != x) & (m == m))  # strictly: a lane keeps its first max; its first NaN above all
        m = tl.where(up, x, m)
        arg = tl.where(up, offs, arg)
    key = _key(m)
    top = tl.max(key, axis=0)
    first = tl.min(tl.where(key == top, arg, 2147483647), axis=0)
    if SPLIT:
        packed = (top.to(tl.int64) << 32) | (0xFFFFFFFF - first.to(tl.int64))
        tl.atomic_max(scratch_ptr + row, packed)
        # NOTE: acq_rel (Triton's default): the row's last program sees every program's atomic_max
        done = tl.atomic_add(scratch_ptr + tl.num_programs(0) + row, 1)
        if done == last:
            final = tl.atomic_max(scratch_ptr + row, packed)  # the row's key, read atomically
            tl.store(out_ptr + row, 0xFFFFFFFF - (final & 0xFFFFFFFF))
    else:
        tl.store(out_ptr + row, first.to(tl.int64))


def splits_for(rows: int, vocab: int, sms: int) -> int:
    """Programs a row: rows * splits reaches PROGRAMS_PER_SM * sms, at most one a BLOCK tile of the row."""
    return max(1, min(triton.cdiv(vocab, BLOCK), triton.cdiv(PROGRAMS_PER_SM * sms, rows)))


def chunks(vocab: int, splits: int) -> tuple[int, int]:
    """(programs a row, logits each reads): a chunk is a whole number of BLOCK tiles, so a row asked for
    `splits` programs may get fewer (none of them empty)."""
    chunk = triton.cdiv(triton.cdiv(vocab, splits), BLOCK) * BLOCK
    return triton.cdiv(vocab, chunk), chunk


@functools.cache
def _sms(device: torch.device) -> int:
    """The device's SM count (an H100's off CUDA: what the interpreter and the compile check launch)."""
    if device.type != "cuda":
        return H100_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def argmax(x: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """Token ids [rows] int64: torch.argmax(x, dim=-1) of logits x [rows, vocab] (bf16, fp16 or fp32; unit
    stride in vocab, any row stride). splits: the programs a row (None: `splits_for` this GPU; tests force
    several)."""
    rows, vocab = x.shape
    if vocab == 0:
        raise ValueError("argmax over an empty vocabulary")
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    if x.stride(-1) != 1 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"argmax takes bf16/fp16/fp32 logits of unit stride in the vocabulary, got "
                         f"{x.dtype} strides {x.stride()}")
    splits, chunk = chunks(vocab, splits or splits_for(rows, vocab, _sms(x.device)))
    # the keys [rows], then the count of the row's programs done [rows]: one fill, INT64_MIN below every key
    scratch = torch.full((2 * rows,), INT64_MIN, dtype=torch.int64, device=x.device) if splits > 1 else out
    _argmax_kernel[(rows, splits)](x, x.stride(0), vocab, chunk, scratch, INT64_MIN + splits - 1, out,
                                   BLOCK=BLOCK, SPLIT=splits > 1, num_warps=NUM_WARPS)
    return out
