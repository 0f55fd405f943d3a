"""Greedy sampling on CUDA: argmax over the vocabulary at the copy rate, several programs a row.

One program a row (torch.argmax, the one-kernel sampler's greedy rows) leaves an H100 waiting on memory at
256 rows x 128,256 bf16 logits: 0.073 ms against 0.022 ms of bytes (issue 48, item 3). Here a row is cut into
BLOCK tiles and the programs share the tiles out. GRID "flat": the rows' tiles laid end to end, program p of
`programs` (PROGRAMS_PER_SM a SM, as many as fill the GPU once) takes tiles [p * total // programs,
(p + 1) * total // programs): every program the same work to a tile, whatever the rows, and a program may end
one row and start the next. GRID "rows": the grid (rows, splits), program (row, s) a span of whole tiles of
its row (`splits_for`, `chunks`). Each program reduces its part of a row to one packed int64 key,
(order-preserving int32 of the fp32 logit) << 32 | (0xFFFFFFFF - index): the largest key is the largest logit
at its FIRST index. A program holding a whole row writes its index; the parts of a split row combine by
tl.atomic_max into the row's key, and the program whose atomic count of tiles done completes the row (CUDA's
threadFenceReduction sample) unpacks the index into the output and sets the key and the count back to
INT64_MIN. The max of the keys does not depend on the order the programs arrive in: deterministic.

The scan (FAST, the default): each lane's max in the logits' own dtype (bf16: two a register, compared and
maxed without a conversion), "strictly above" keeping its first tile, a NaN-propagating max flagging a NaN,
whose part is scanned again by compares (first NaN). By the sm_90 compile's SASS (CPU, not timed): 2.5
instructions a bf16 logit, 4 tiles unrolled (4 loads in flight a thread), against 8.4 and 1 for the kernel
before (fp32 compares for the first max and the first NaN): at 256 rows about 19 us of issue on 132 SMs
beside the bytes' 22 us, an estimate of why no BLOCK, warps or grid moved it. On Triton 3.6 (the GPU
hosts') tl.maximum of two bf16 blocks gives fp32: the max is cast back to the lanes' dtype (without it the
kernel did not compile there).

The keys and counts (SCRATCH "kept", the default): one process-lived buffer a device (`scratch`, SCRATCH_ROWS
rows, 16 bytes a row: 16 KiB), clean between launches since each split row's last program resets its two
entries, so a call is one launch (rows past SCRATCH_ROWS: one launch each SCRATCH_ROWS, in stream order).
Allocated on the first call, which must not be inside a graph's capture (the engine's stress reserves it:
engine.sampling.sample(stress=True), so the probe's measured peak holds it). NOTE: launches on ONE stream at a
time, as triton_fp8_skinny's tile counters: two calls in flight on two streams would mix their rows' keys.
SCRATCH "fill" (benchmarks): a fresh buffer a call, filled by torch.full (a second launch). No host sync, no
allocation beyond the output (and "fill"'s buffer): CUDA-graph safe.

Semantics are torch.argmax(dim=-1)'s: the first index of the max; a row of -inf gives 0; -0.0 ties with
0.0; NaN is above every number (either sign: its key is the largest int32), so the first NaN wins, as in
torch.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from autoprofile.kernels import pdl

# H100, 256 x 128,256 bf16, graphed, the kernel before (GRID "rows", SCRATCH "fill", the compares): BLOCK
# 1024-4096, 4-16 warps, 4-16 programs an SM all took 0.029-0.035 ms (bytes: 0.022). These knobs' defaults
# (flat, kept, FAST): not measured yet (scripts/bench_sampler.py --argmax_sweep)
BLOCK = 2048  # logits a program reads at a time: 8 a thread (one 16-byte load of bf16) at 8 warps
NUM_WARPS = 8
PROGRAMS_PER_SM = 4  # programs the grid aims at per SM (each program a part of the tiles)
GRID = "flat"  # "flat": the tiles end to end over PROGRAMS_PER_SM x SMs programs; "rows": (rows, splits)
SCRATCH = "kept"  # "kept": the process-lived keys and counts (`scratch`); "fill": a buffer filled a call
FAST = True  # the scan (`_scan`): a max in the logits' dtype (a NaN's part scanned again), or compares
PDL = False  # launched as a programmatic dependent launch (pdl.launch) where the GPU takes it
SCRATCH_ROWS = 1024  # rows a launch takes (the kept buffer's rows): more rows, more launches
H100_SMS = 132  # the SM count off CUDA (the interpreter, the sm_90 compile check)
INT64_MIN = -2**63  # the keys' and counts' idle value: below every key
_scratch: dict[torch.device, torch.Tensor] = {}
_NATIVE = tl.constexpr(not pdl.interpreted())  # `_scan_max` in the logits' dtype (interpreted bf16: bits)


@triton.jit
def _key(x):
    """fp32 -> int32 in the same order: negative floats' low 31 bits flipped; -0.0 as 0.0 (+ 0.0), and NaN
    (either sign) the largest int32, above +inf."""
    x = x + 0.0
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(x != x, 2147483647, bits ^ ((bits >> 31) & 0x7FFFFFFF))


@triton.jit
def _first_of_top(m, index):
    """(the largest key of the lanes' maxes m, the first index among the lanes that hold it)."""
    key = _key(m.to(tl.float32))
    top = tl.max(key, axis=0)
    return top, tl.min(tl.where(key == top, index, 2147483647), axis=0)


@triton.jit
def _scan_max(base, lo, full, hi, BLOCK: tl.constexpr):
    """`_scan`'s lanes in the logits' own dtype (bf16: two a register, no conversion; the compiler unrolls
    4 tiles): "strictly above" keeps a lane's first max, then a NaN-propagating max. A NaN sticks in its
    lane's max without its index: the caller scans the part again (`_scan_compare`)."""
    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), base.dtype.element_ty if _NATIVE else tl.float32)
    arg = tl.zeros([BLOCK], tl.int32) + lo
    for start in range(lo, full, BLOCK):
        x = tl.load(base + start + lanes).to(m.dtype)
        arg = tl.where(x > m, start, arg)
        m = tl.maximum(m, x, propagate_nan=tl.PropagateNan.ALL).to(m.dtype)  # Triton 3.6: bf16 -> fp32
    if full < hi:
        x = tl.load(base + full + lanes, mask=full + lanes < hi, other=float("-inf")).to(m.dtype)
        arg = tl.where(x > m, full, arg)
        m = tl.maximum(m, x, propagate_nan=tl.PropagateNan.ALL).to(m.dtype)  # Triton 3.6: bf16 -> fp32
    return _first_of_top(m, arg + lanes)


@triton.jit
def _scan_compare(base, lo, full, hi, BLOCK: tl.constexpr):
    """`_scan`'s lanes in fp32 by compares: "strictly above, or the first NaN"."""
    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK], tl.int32) + lo
    for start in range(lo, hi, BLOCK):
        x = tl.load(base + start + lanes, mask=start + lanes < hi, other=float("-inf")).to(tl.float32)
        up = (x > m) | ((x != x) & (m == m))
        m = tl.where(up, x, m)
        arg = tl.where(up, start, arg)
    return _first_of_top(m, arg + lanes)


@triton.jit
def _scan(base, lo, hi, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """(the largest key, its first index) of logits [lo, hi) at `base` (lo a whole tile). Per lane (tokens
    lo + l, lo + l + BLOCK, ...): its max and the tile it first came in; keys once, at the end. A lane of -inf
    keeps its first tile. FAST: `_scan_max` (whole tiles unmasked, the row's short last tile masked), and a
    part holding a NaN again by `_scan_compare`; else `_scan_compare` alone."""
    if FAST:
        top, first = _scan_max(base, lo, lo + (hi - lo) // BLOCK * BLOCK, hi, BLOCK)
        if top == 2147483647:  # a NaN (rare: broken logits)
            top, first = _scan_compare(base, lo, hi, hi, BLOCK)
    else:
        top, first = _scan_compare(base, lo, hi, hi, BLOCK)
    return top, first


@triton.jit(do_not_specialize=["rows", "tiles", "span"])
def _argmax_kernel(x_ptr, stride, V, rows, tiles, span, keys_ptr, counts_ptr, empty, out_ptr,
                   BLOCK: tl.constexpr, FLAT: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr):
    """tiles: BLOCK tiles a row. FLAT: program p of the 1-D grid takes the tiles [t0, t1) of the rows laid end
    to end; else program (row, s) of the grid (rows, splits) the tiles [s * span, (s + 1) * span) of its row.
    keys, counts: [rows] int64, `empty` (INT64_MIN) each at the launch, and again when it ends."""
    if FLAT:
        total = rows.to(tl.int64) * tiles
        t0 = tl.program_id(0).to(tl.int64) * total // tl.num_programs(0)
        t1 = (tl.program_id(0).to(tl.int64) + 1) * total // tl.num_programs(0)
    else:
        t0 = tl.program_id(0).to(tl.int64) * tiles + tl.program_id(1) * span
        t1 = tl.minimum(t0 + span, (tl.program_id(0).to(tl.int64) + 1) * tiles)
    pdl.begin(PDL)
    for row in range(t0 // tiles, (t1 - 1) // tiles + 1):
        a = (tl.maximum(t0, row * tiles) - row * tiles).to(tl.int32)  # this program's tiles of the row
        b = (tl.minimum(t1, row * tiles + tiles) - row * tiles).to(tl.int32)
        top, first = _scan(x_ptr + row * stride, a * BLOCK, tl.minimum(b * BLOCK, V), BLOCK, FAST)
        if b - a == tiles:  # the whole row
            tl.store(out_ptr + row, first.to(tl.int64))
        else:
            tl.atomic_max(keys_ptr + row, (top.to(tl.int64) << 32) | (0xFFFFFFFF - first.to(tl.int64)))
            # NOTE: acq_rel (Triton's default): the row's last program sees every program's atomic_max
            done = tl.atomic_add(counts_ptr + row, (b - a).to(tl.int64))
            if done == empty + (tiles - (b - a)):  # the row's other tiles were done before: the last part
                final = tl.atomic_xchg(keys_ptr + row, empty)  # the row's key, read and reset at once
                tl.store(counts_ptr + row, empty)
                tl.store(out_ptr + row, 0xFFFFFFFF - (final & 0xFFFFFFFF))


def splits_for(rows: int, vocab: int, sms: int) -> int:
    """Programs a row: rows * splits reaches PROGRAMS_PER_SM * sms, at most one a BLOCK tile of the row."""
    return max(1, min(triton.cdiv(vocab, BLOCK), triton.cdiv(PROGRAMS_PER_SM * sms, rows)))


def chunks(vocab: int, splits: int) -> tuple[int, int]:
    """(programs a row, logits each reads), GRID "rows": a chunk is a whole number of BLOCK tiles, so a row
    asked for `splits` programs may get fewer (none of them empty)."""
    chunk = triton.cdiv(triton.cdiv(vocab, splits), BLOCK) * BLOCK
    return triton.cdiv(vocab, chunk), chunk


def programs_for(rows: int, vocab: int, sms: int, splits: int | None = None) -> int:
    """Programs of GRID "flat": PROGRAMS_PER_SM a SM (rows * splits where the caller asks), at most one a tile
    (so none is empty)."""
    return max(1, min(rows * triton.cdiv(vocab, BLOCK), rows * splits if splits else PROGRAMS_PER_SM * sms))


def scratch_bytes() -> int:
    """The process-lived scratch of each device the argmax runs on (`scratch`)."""
    return 2 * 8 * SCRATCH_ROWS


def scratch(device: torch.device) -> torch.Tensor:
    """The keys [SCRATCH_ROWS] then the counts [SCRATCH_ROWS] (int64, INT64_MIN between launches: a split
    row's last program sets its two back) of `device`: allocated on the first call, which must not be inside a
    graph's capture (a warm-up call, or the engine's stress, comes first), and kept for the process."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _scratch.get(device)
    if buf is None:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        assert not capturing, "the greedy argmax runs once before a graph's capture (its scratch is kept)"
        buf = _scratch[device] = torch.full((2 * SCRATCH_ROWS,), INT64_MIN, dtype=torch.int64, device=device)
    return buf


@functools.cache
def _sms(device: torch.device) -> int:
    """The device's SM count (an H100's off CUDA: what the interpreter and the compile check launch)."""
    if device.type != "cuda":
        return H100_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch(x: torch.Tensor, out: torch.Tensor, splits: int | None) -> None:
    """One launch over x's rows (at most SCRATCH_ROWS) into out."""
    rows, vocab = x.shape
    tiles = triton.cdiv(vocab, BLOCK)
    sms = _sms(x.device)
    if GRID == "flat":
        grid, span = (programs_for(rows, vocab, sms, splits),), tiles
        whole = grid[0] == rows  # program p takes row p
    else:
        n, chunk = chunks(vocab, splits or splits_for(rows, vocab, sms))
        grid, span = (rows, n), chunk // BLOCK
        whole = n == 1
    if whole:  # no row split: no keys
        keys = counts = out
    else:
        buf = scratch(x.device) if SCRATCH == "kept" else torch.full(
            (2 * rows,), INT64_MIN, dtype=torch.int64, device=x.device)
        keys, counts = buf[:rows], buf[buf.numel() // 2:][:rows]
    _argmax_kernel[grid](x, x.stride(0), vocab, rows, tiles, span, keys, counts, INT64_MIN, out, BLOCK=BLOCK,
                         FLAT=GRID == "flat", FAST=FAST, num_warps=NUM_WARPS,
                         **(pdl.launch() if PDL else {"PDL": False}))


def argmax(x: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """Token ids [rows] int64: torch.argmax(x, dim=-1) of logits x [rows, vocab] (bf16, fp16 or fp32; unit
    stride in vocab, any row stride). splits: the programs a row (None: this GPU's, `programs_for` or
    `splits_for`; tests force several, or 1: a program a row)."""
    rows, vocab = x.shape
    if vocab == 0:
        raise ValueError("argmax over an empty vocabulary")
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    if x.stride(-1) != 1 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"argmax takes bf16/fp16/fp32 logits of unit stride in the vocabulary, got "
                         f"{x.dtype} strides {x.stride()}")
    for lo in range(0, rows, SCRATCH_ROWS):
        _launch(x[lo:lo + SCRATCH_ROWS], out[lo:lo + SCRATCH_ROWS], splits)
    return out
