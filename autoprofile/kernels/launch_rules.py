"""How the kernels are launched, and what one launch allocates: pure functions of static values, no torch.

A rule here picks a kernel's grid split (partitions, splits, rows per block) and the captured decode batch
sizes; the kernels (autoprofile.kernels) and the attention backends call it to launch, and budget.py and
plan.py call it to count the memory those launches take. Measurements behind the constants:
docs/measurements.md.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

# ---------------------------------------------------------------- native AITER paged decode (ROCm)
AITER_PARTITION = 256  # native AITER paged_attention_ragged partition size (tokens)


def aiter_num_partitions(context_len: int, tokens: int | None = None,
                         partition: int = AITER_PARTITION) -> int:
    """Partitions per sequence; no sequence can outgrow the cache, so cap by min(context_len, T)."""
    longest = context_len if tokens is None else min(context_len, tokens)
    return math.ceil(longest / partition)


# ---------------------------------------------------------------- AITER's Triton paged decode (v1 / v2)
TRITON_PARTITION = 1024  # aiter.ops.triton.pa_decode._SEQ_PARTITION_SIZE (checked when the kernels load)
TRITON_V1_MAX_SEQ_LEN = 8192
TRITON_V1_MIN_ROWS = 512  # num_seqs * q_heads above which v1 runs even with several partitions
TRITON_MIN_PARTITION = 128  # tokens: the smallest v2 partition autoprofile launches
TRITON_MAX_PARTITIONS = 256  # partitions per row at most (the reduce kernel holds them all in registers)


def triton_decode_uses_v1(num_seqs: int, q_heads: int, max_seq_len: int,
                          partition: int = TRITON_PARTITION) -> bool:
    """AITER's rule: one pass (v1) up to 8192 tokens when there is one partition or enough rows to fill
    the GPU; otherwise split into partitions (v2) and reduce."""
    return max_seq_len <= TRITON_V1_MAX_SEQ_LEN and (
        math.ceil(max_seq_len / partition) == 1 or num_seqs * q_heads > TRITON_V1_MIN_ROWS)


def triton_decode_partition(num_seqs: int, q_heads: int, max_seq_len: int, page_size: int = 16) -> int:
    """Tokens per v2 partition for this call. AITER fixes 1024: a batch of 1 at ~1k tokens then runs on
    num_kv_heads programs (8 of 132 SMs) and its attention took 74 us per layer, 28% of the step (H100,
    scripts/profile_decode.py). Smaller partitions for fewer rows, in proportion: partition =
    1024 * num_seqs * q_heads / TRITON_V1_MIN_ROWS (rounded up to a power of two), so num_seqs *
    partitions never exceeds what AITER's rule allocates at the v1 threshold; the scratch stays within
    the default's worst case at any batch. At least TRITON_MIN_PARTITION and a page, at most
    TRITON_MAX_PARTITIONS partitions per row; AITER's 1024 where a page does not divide it. Only inside
    CUDA graphs (AttentionMetadata.captured): each captured shape is measured at build, while eager decode
    keeps AITER's 1024, whose scratch grows with the rows as the stress's eager corner assumes."""
    share = -(-TRITON_PARTITION * num_seqs * q_heads // TRITON_V1_MIN_ROWS)
    longest = -(-max_seq_len // TRITON_MAX_PARTITIONS)
    p = 1 << (max(share, longest, TRITON_MIN_PARTITION, page_size) - 1).bit_length()
    p = min(p, TRITON_PARTITION)
    return p if p % page_size == 0 else TRITON_PARTITION


# ---------------------------------------------------------------- our split-KV decode (triton_decode)
# Each row's keys in `splits` parts, one program per (row, kv head, split). Enough parts to give the GPU
# SPLIT_DECODE_PROGRAMS programs, each part at least SPLIT_DECODE_MIN_TOKENS of max_seq_len, at most
# SPLIT_DECODE_MAX_SPLITS.
SPLIT_DECODE_PROGRAMS = 512
SPLIT_DECODE_MIN_TOKENS = 128
SPLIT_DECODE_MAX_SPLITS = 64
# bf16/fp16 caches take the split decode at up to this many rows, AITER's v1/v2 past them (aiter_triton):
# every row count, the faster at each on an H200 (33-256 rows: 2.9-28.6% less graph replay;
# docs/measurements.md, "Our split decode at every row count"); an H100 chose 32 on 2026-11-26 (tied at
# 256), not re-measured since
SPLIT_DECODE_ROWS = 1 << 30


def split_decode_splits(num_seqs: int, kv_heads: int, max_seq_len: int) -> int:
    """Parts of each row's keys: static values only (a captured graph replays one count)."""
    want = -(-SPLIT_DECODE_PROGRAMS // max(num_seqs * kv_heads, 1))
    return max(1, min(want, -(-max_seq_len // SPLIT_DECODE_MIN_TOKENS), SPLIT_DECODE_MAX_SPLITS))


def split_decode_scratch_bytes(num_seqs: int, q_heads: int, head_dim: int, splits: int) -> int:
    """One split decode call's scratch: each split's fp32 partial output and log-sum-exp per query head;
    none at one split (the program writes the output)."""
    return 0 if splits == 1 else num_seqs * q_heads * splits * (4 * head_dim + 4)


# ---------------------------------------------------------------- fused MoE (triton_moe, triton_moe_sort)
MOE_SMALL_BLOCK_M, MOE_LARGE_BLOCK_M = 16, 64  # the fused kernels' rows per block (kernels.triton_moe)


# Pairs per expert (T * k / E) up to which the small blocks win. scripts/tune_moe.py --block_m on an H200
# (uniform random routing; deepseek-v2-lite's, qwen3-30b-a3b's and qwen3.5-35b-a3b's experts, bf16 and FP8
# block-scaled): the small block's time over the large one's 0.56-0.98 at 0.03-12 pairs an expert, 0.85-1.01
# at 16-16.5, 1.04-1.20 at 24 (docs/measurements.md, "The experts' row blocks by tokens")
MOE_SMALL_BLOCK_PAIRS = 12


# Pairs (T * k) up to which the experts run as GEMVs (kernels.triton_moe_gemv: each weight read once at its
# own width, FP8 as W8A16, no sort or block padding) instead of AITER's blocked kernels; 0: never.
# scripts/tune_moe.py --gemv on an H200 (deepseek-v2-lite's, qwen3-30b-a3b's and qwen3.5-35b-a3b's experts, a
# layer's time, blocked over GEMV): bf16 1.05-1.20 at 1-4 tokens (6-32 pairs), 0.95-1.09 at 8 (48-64); FP8
# block-scaled at its configs 1.53-1.56 at 1 token, 1.08-1.49 at 2, 1.03-1.25 at 4, 0.78-1.17 at 8
# (docs/measurements.md, "The experts as GEMVs at a few tokens")
MOE_GEMV_MAX_PAIRS = 32


def moe_gemv(pairs: int) -> bool:
    """Whether a step's experts at this many (token, slot) pairs run as GEMVs."""
    return pairs <= MOE_GEMV_MAX_PAIRS


def moe_block_m(tokens: int, top_k: int, num_experts: int) -> int:
    """Rows per block of the fused MoE kernels: small blocks while the T * k pairs are at most
    MOE_SMALL_BLOCK_PAIRS an expert (decode's steps, and small prefills), else large."""
    return MOE_SMALL_BLOCK_M if tokens * top_k <= MOE_SMALL_BLOCK_PAIRS * num_experts else MOE_LARGE_BLOCK_M


def sorted_slots(tokens: int, top_k: int, num_experts: int, block_m: int) -> int:
    """Length of the expert-sorted (token, slot) ids: every pair, plus each expert's padding to a block (at
    most block_m - 1 for each expert reached), never more than every pair alone in a block."""
    pairs = tokens * top_k
    return min(pairs + num_experts * (block_m - 1), pairs * block_m)


# ---------------------------------------------------------------- MLA's absorbed decode (triton_mla)
MLA_SPLIT_PROGRAMS = 132  # rows x splits the decode aims at: one program per SM of an H100
MLA_MAX_SPLITS = 32
# --deterministic: every row's tokens in this many splits whatever the rows (a row's merged output follows its
# splits; mla_kv_splits follows the row count); triton_mla.INVARIANT_SPLITS
MLA_INVARIANT_SPLITS = 16


def mla_kv_splits(rows: int) -> int:
    """Splits of each row's tokens in MLA's decode (kernels.triton_mla) at a padded row count:
    ceil(MLA_SPLIT_PROGRAMS / rows), at most MLA_MAX_SPLITS (H100, deepseek-v2-lite's widths: 1 split at 256
    rows, 3 at 64, 9 at 16, 32 at 1 were the fastest measured; a row's split holds at least
    triton_mla.MIN_SPLIT_TOKENS, so a short row leaves the later splits empty)."""
    return min(MLA_MAX_SPLITS, -(-MLA_SPLIT_PROGRAMS // max(rows, 1)))


def mla_partials_bytes(rows: int, heads: int, kv_lora_rank: int, splits: int) -> int:
    """The splits' fp32 partial outputs and log2-sums of an MLA decode call; none at one split."""
    return 0 if splits == 1 else 4 * rows * heads * splits * (kv_lora_rank + 1)


@functools.cache
def mla_decode_scratch_bytes(rows: int, heads: int, kv_lora_rank: int) -> int:
    """One MLA decode call's scratch at a padded row count (kernels.triton_mla, outside --deterministic):
    the most partials any count of 1..rows takes (fewer rows take more splits: one split from 132 rows, 262
    row-splits at 131), held by the call whether its own splits need them or not. So its scratch grows
    with its rows, and the stress's corners at the most decode rows hold what any call of fewer rows
    holds (an eager decode in a mixed step, a graph's capture). Cached: a pure function of ints, asked
    every call."""
    return max(mla_partials_bytes(n, heads, kv_lora_rank, mla_kv_splits(n))
               for n in range(1, min(rows, MLA_SPLIT_PROGRAMS) + 1))


# ---------------------------------------------------------------- captured decode batch sizes
def batch_ladder(max_bs: int) -> list[int]:
    """Captured decode batch sizes, ascending: 1, 2, 4, 8, 16, 24, 32, ... and max_bs itself."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_bs} | set(range(16, max_bs, 8)) | {max_bs}
    return sorted(sizes)


def coarse_ladder(max_bs: int) -> list[int]:
    """Powers of two below max_bs, and max_bs: the batch sizes captured for the longer buckets."""
    return sorted({1 << i for i in range(max_bs.bit_length()) if 1 << i < max_bs} | {max_bs})


# ---------------------------------------------------------------- Gated DeltaNet decode (triton_gdn)
class GdnLaunch(NamedTuple):
    """One launch of triton_gdn's decode: value channels a block (a block holding a whole head also runs the
    gated norm in the kernel), value heads a program, warps, pipeline stages, and whether the conv step runs
    in the same kernel (then one program per (row, key head): its heads and blocks in a loop)."""

    block_v: int = 32
    heads: int = 1
    warps: int = 4
    stages: int = 1
    fuse_conv: bool = False


# (most rows, launch) ascending: the first entry whose rows reach the call's padded rows. Chosen from
# scripts/bench_gdn.py --sweep (docs/measurements.md, "Gated DeltaNet decode"): one launch at every row count,
# the fastest at 64 and 256 rows and within 2% of the fastest at 1 row, with no spill
GDN_DECODE_LAUNCHES: tuple[tuple[int, GdnLaunch], ...] = ((1 << 30, GdnLaunch(block_v=64)),)


def gdn_decode_launch(rows: int, k_heads: int, v_heads: int, v_dim: int,
                      table: tuple[tuple[int, GdnLaunch], ...] = GDN_DECODE_LAUNCHES) -> GdnLaunch:
    """The decode launch at a padded row count (static: a captured graph replays one launch). A table's
    heads that do not divide v_heads fall back to 1; a fused conv needs whole key-head groups."""
    launch = next((cfg for most, cfg in table if rows <= most), table[-1][1])
    if v_heads % launch.heads:
        launch = launch._replace(heads=1)
    if launch.fuse_conv and v_heads % k_heads:
        launch = launch._replace(fuse_conv=False)
    return launch


# ---------------------------------------------------------------- FP8 weights, 2-64 rows (triton_fp8_skinny)
class SkinnyLaunch(NamedTuple):
    """One launch of triton_fp8_skinny's GEMM: weight rows a program (halved for a narrow N, see
    fp8_skinny_launch), K a step (capped by a block scale's K), warps, pipeline stages; split_k: at most this
    many programs a column tile, each over a K range (a narrow N keeps block_n and splits K instead, see
    fp8_skinny_launch; partials in an fp32 scratch, summed in a fixed order by the tile's last program)."""

    block_n: int = 32
    block_k: int = 256
    warps: int = 4
    stages: int = 3
    split_k: int = 1


SkinnyTable = tuple[tuple[int, SkinnyLaunch | None], ...]
SKINNY_MAX_ROWS = 64  # activation rows one program holds at most (its tile pads them to 16, 32 or 64)
SKINNY_MIN_BLOCK_N = 16  # tl.dot's smallest side
SKINNY_MIN_PROGRAMS = 256  # about two programs an SM of an H100: block_n halves until N gives this many
# (most rows, launch or None) ascending: the first entry whose rows reach the call's rows; None, or rows past
# every entry: the quantize + GEMM path (triton_fp8.linear). One table a weight layout (per-channel scales,
# 128x128 block scales), as scripts/bench_fp8.py --skinny_variants printed them on an H100
# (docs/measurements.md, "Split-K for the skinny FP8 GEMM"): split-K at every row count, a llama-3.1-8b layer
# at 0.74-0.77 (channel) and 0.72-0.76 (block) of its bytes floor at 4-32 rows against 0.62-0.67 and
# 0.56-0.60 before; 64 rows 1.08x and 1.09x the quantize + GEMM path. TMA loads and in-kernel W8A8 measured
# within 1-3% of these and were removed.
FP8_SKINNY_LAUNCHES: SkinnyTable = (
    (64, SkinnyLaunch(block_n=64, block_k=256, warps=4, stages=3, split_k=8)),)
FP8_SKINNY_BLOCK_LAUNCHES: SkinnyTable = (  # (K steps within the 128-wide scale block, as the sweep ran them)
    (64, SkinnyLaunch(block_n=64, block_k=128, warps=4, stages=3, split_k=8)),)


def skinny_block_m(rows: int) -> int:
    """The padded activation rows of a skinny launch: 16, 32 or 64."""
    return max(16, 1 << (rows - 1).bit_length())


def fp8_skinny_launch(rows: int, n: int, k: int, table: SkinnyTable | None = None,
                      block: bool = False) -> SkinnyLaunch | None:
    """The skinny FP8 GEMM's launch for `rows` activation rows against an [n, k] weight, or None: one row
    (the W8A16 GEMV), more than SKINNY_MAX_ROWS, or the table's choice (None: the weight layout's,
    FP8_SKINNY_BLOCK_LAUNCHES for block scales, else FP8_SKINNY_LAUNCHES). Static values only (a captured
    graph replays one launch)."""
    if table is None:
        table = FP8_SKINNY_BLOCK_LAUNCHES if block else FP8_SKINNY_LAUNCHES
    launch = _table_launch(rows, SKINNY_MAX_ROWS, table)
    if launch is None:
        return None
    block_k = min(launch.block_k, max(32, 1 << (k - 1).bit_length()))
    if launch.split_k > 1:
        return launch._replace(block_k=block_k, split_k=skinny_splits(n, k, launch.block_n, block_k,
                                                                      launch.split_k))
    return launch._replace(block_n=_narrowed(launch.block_n, n, SKINNY_MIN_BLOCK_N, SKINNY_MIN_PROGRAMS),
                           block_k=block_k)


def skinny_splits(n: int, k: int, block_n: int, block_k: int, most: int) -> int:
    """K splits of a skinny launch whose table allows `most`: enough for n's column tiles to give
    SKINNY_MIN_PROGRAMS programs, at most `most` and one K step a split (1: no split, a wide N)."""
    want = -(-SKINNY_MIN_PROGRAMS // -(-n // block_n))
    return max(1, min(want, most, -(-k // block_k)))


def _table_launch(rows: int, most_rows: int, table):
    """A few-row table's launch for `rows` (the first entry whose rows reach it), or None: one row, more than
    most_rows, past every entry, or an entry of None."""
    if rows < 2 or rows > most_rows:
        return None
    return next((cfg for most, cfg in table if rows <= most), None)


def _narrowed(block_n: int, n: int, least: int, programs: int) -> int:
    """block_n halved (not below `least`) until n's weight rows give `programs` programs."""
    while block_n > least and -(-n // block_n) < programs:
        block_n //= 2
    return block_n


# ---------------------------------------------------------------- FP8 weights, 2-8 rows (triton_fp8_rows)
class GemvRowsLaunch(NamedTuple):
    """One launch of triton_fp8_rows' GEMV: weight rows a program (halved for a narrow N until it gives
    min_programs programs, see fp8_gemv_rows_launch), K a step, K columns summed each step before they are
    accumulated (sum_k: 1 keeps every column, block_k reduces the step across the warp), warps."""

    block_n: int = 4
    block_k: int = 512
    sum_k: int = 16
    warps: int = 1
    min_programs: int = 1536


GemvRowsTable = tuple[tuple[int, GemvRowsLaunch | None], ...]
GEMV_ROWS_MAX = 16  # activation rows one GEMV program holds at most (padded to 2, 4, 8 or 16)
# (most rows, launch or None) ascending, as FP8_SKINNY_LAUNCHES: the first entry whose rows reach the call's
# rows; None, or rows past every entry: the skinny rule (fp8_skinny_launch). From scripts/bench_fp8.py
# --rows_gemv on an H100 (llama-3.1-8b's four GEMMs a layer, fraction of the bytes floor, per-channel / block
# scales; docs/measurements.md, "FP8 at 2-64 rows"): 2 rows 0.82 / 0.82 (the skinny GEMM 0.63 / 0.59) at the
# one-row GEMV's shape; 4 rows 0.63 / 0.64 at best (skinny 0.63 / 0.59), but llama-3.1-8b-fp8's decode step
# at 4 rows replayed in 5.14 ms with it against 4.79 with the skinny GEMM (bench_decode); 8 rows 0.44 / 0.42
# at best (CUDA cores: 8 FMAs a weight byte), where the skinny GEMM keeps 0.63. So: 2 rows only
FP8_GEMV_ROWS_LAUNCHES: GemvRowsTable = ((2, GemvRowsLaunch(4, 512, 16, 1)),)
FP8_GEMV_ROWS_BLOCK_LAUNCHES: GemvRowsTable = FP8_GEMV_ROWS_LAUNCHES


def gemv_rows_padded(rows: int) -> int:
    """The GEMV's activation rows at `rows` (its ROWS constexpr): 2, 4, 8 or 16, a compile each."""
    return max(2, 1 << (rows - 1).bit_length())


def fp8_gemv_rows_launch(rows: int, n: int, k: int, table: GemvRowsTable | None = None,
                         block: bool = False) -> GemvRowsLaunch | None:
    """The multi-row FP8 GEMV's launch for `rows` activation rows against an [n, k] weight, or None: one row
    (the one-row GEMV), more than GEMV_ROWS_MAX, or the table's choice (None: the weight layout's,
    FP8_GEMV_ROWS_BLOCK_LAUNCHES for block scales, else FP8_GEMV_ROWS_LAUNCHES). block_n halves (not below
    1) until n gives min_programs programs; the K step is capped by K's power of two. Static values only."""
    if table is None:
        table = FP8_GEMV_ROWS_BLOCK_LAUNCHES if block else FP8_GEMV_ROWS_LAUNCHES
    launch = _table_launch(rows, GEMV_ROWS_MAX, table)
    if launch is None:
        return None
    block_k = min(launch.block_k, max(16, 1 << (k - 1).bit_length()))
    return launch._replace(block_n=_narrowed(launch.block_n, n, 1, launch.min_programs), block_k=block_k,
                           sum_k=min(launch.sum_k, block_k))
