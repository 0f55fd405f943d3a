"""Split-KV ("flash-decoding") paged decode attention, GQA-grouped, over FP8 or bf16/fp16 pages.

Stage 1: one program per (row, kv head, split) holds the kv head's whole query group (Hq / Hkv rows, padded
to >= 16 for tl.dot) and walks its part of the row's keys in tiles of BLOCK_N tokens, so each K/V page is
read once per group. K/V tiles are loaded as their own bytes (one a value for FP8) and converted in registers,
never through fp32: FP8 pages to fp16, with q and P in fp16 too (Config.f16_dots: one PTX conversion a pair
of values where bf16 takes two; V's tile joined from its converted pairs, _e4m3x2_to_f16; a query beyond
fp16's 65,504 would overflow), bf16/fp16 pages in the query's dtype. Scores and the online softmax are fp32
from tl.dot. An FP8 cache's scales are device tensors read inside the kernel (a captured graph follows scales
set after capture): k_scale folds into the score scale, v_scale into the output.

Each row's tokens split evenly in `splits` parts (rounded up to BLOCK_N tokens; parts past a short row's end
exit at once). One split: stage 1 writes the output and nothing else runs. More: stage 1 writes each part's
normalized fp32 output and its log2-sum-exp, stage 2 (one program per row and query head) merges the row's
live parts. Scratch per call: launch_rules.split_decode_scratch_bytes (in a graph it stays in the graph's
pool).

Splits follow launch_rules.split_decode_splits(rows, kv heads, max_seq_len): static values, so a captured
graph replays one count. The launch config (BLOCK_N, warps, stages; splits to override) is `Config`; `config()`
picks it, a benchmark passes its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from autoprofile.kernels import launch_rules, pdl

LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr: a jit function reads no plain global
MIN_DOT_ROWS = 16  # tl.dot needs >= 16 rows: the query group is padded up to it


@dataclass(frozen=True)
class Config:
    """Launch config of stage 1 (stage 2 takes STAGE2_WARPS). splits None: launch_rules'."""
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    splits: int | None = None
    f16_dots: bool = False  # FP8 pages: both dots in fp16 (q, P and the converted pages)


# The fastest launch configs of scripts/bench_decode_attention.py --configs on an H100 (docs/measurements.md,
# "FP8 KV cache accuracy and decode"): FP8 pages 64-key tiles, 2 warps, 3 stages, dots in fp16, at 1 to 256
# rows; bf16 pages (ours at launch_rules.SPLIT_DECODE_ROWS: every row count) 32-key tiles, 4 warps
DEFAULT = Config(32, 4, 3)
FP8 = Config(64, 2, 3, f16_dots=True)
STAGE2_WARPS = 4
# What scripts/bench_decode_attention.py --configs times beside DEFAULT and FP8 (tests/test_local_memory.py
# checks that none spills)
SWEEP = (Config(128, 4, 3), Config(64, 4, 3), Config(32, 2, 3), Config(128, 4, 3, f16_dots=True),
         Config(64, 4, 3, f16_dots=True), Config(64, 4, 2, f16_dots=True), Config(32, 2, 3, f16_dots=True),
         Config(32, 4, 3, f16_dots=True), Config(64, 4, 4, f16_dots=True), Config(128, 8, 3, f16_dots=True),
         Config(64, 2, 3, splits=2, f16_dots=True), Config(64, 2, 3, splits=4, f16_dots=True))


def config(rows: int, kv_heads: int, max_seq_len: int, override: Config | None = None,
           fp8: bool = False) -> tuple[int, Config]:
    """(splits, stage-1 config) of a call (fp8: FP8 pages): a pure function of static values (fixed for a
    captured graph)."""
    cfg = override or (FP8 if fp8 else DEFAULT)
    splits = cfg.splits or launch_rules.split_decode_splits(rows, kv_heads, max_seq_len)
    return splits, cfg


@triton.jit
def _e4m3x2_to_f16(pairs, ASM: tl.constexpr):
    """int16 pairs of FP8 e4m3 values [.., n] -> fp16 [.., 2n] (even, odd interleaved, joined): the values
    reach the P.V dot as fp16, whose transposing shared-memory loads are ldmatrix's. Converted by Triton after
    the load (the PTX of an H100 build), a V tile took one-byte shared loads (V's keys are its strided dim),
    and the FP8 decode read 0.69 of the copy rate at 256 x 1,024 where bf16 pages read 0.95. ASM: one PTX
    conversion per pair, opaque to Triton's layout passes; else (Triton's interpreter) Triton's own, the same
    values."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }", "=h,=h,h", [pairs],
            dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        lo = (pairs & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        hi = ((pairs >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    x = tl.join(lo, hi)
    return tl.reshape(x, (x.shape[0], x.shape[1] * 2))


@triton.jit(do_not_specialize=["splits", "sm_scale", "stride_table"])
def _split_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
                         lse_ptr, part_ptr, sm_scale, splits,
                         stride_qb, stride_qh, stride_kp, stride_kh, stride_kt,
                         stride_vp, stride_vh, stride_vt, stride_table, stride_ob, stride_oh,
                         Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                         HEAD: tl.constexpr, HEAD_POW2: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_N: tl.constexpr, HAS_SCALES: tl.constexpr, DIRECT: tl.constexpr,
                         F16_DOTS: tl.constexpr = False, ASM: tl.constexpr = True, PDL: tl.constexpr = False):
    pdl.begin(PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    per = tl.cdiv(tl.cdiv(seq_len, splits), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, seq_len)
    if start < end:
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_POW2)
        heads = kv_head * GROUP + g
        live_g = g < GROUP
        live_d = d < HEAD
        q = tl.load(q_ptr + row.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=live_g[:, None] & live_d[None, :], other=0.0)
        if F16_DOTS:
            q = q.to(tl.float16)
        qk_scale = sm_scale * LOG2E
        if HAS_SCALES:
            qk_scale = qk_scale * tl.load(k_scale_ptr)
        table = tables_ptr + row.to(tl.int64) * stride_table
        k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
        v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_POW2], tl.float32)
        # Each tile's pages are loaded one iteration ahead and carried: a page load in the same iteration as
        # the K/V loads it addresses leaves Triton's pipeliner one K/V buffer and a wait for every load (the
        # TTGIR of an H100 build), so a program's loads never overlapped its dots; carried, the K/V loads get
        # num_stages - 1 buffers (docs/measurements.md, "Kernel choices")
        t = start + tl.arange(0, BLOCK_N)
        next_page = tl.load(table + t // PAGE, mask=t < end, other=0)
        for n0 in range(start, end, BLOCK_N):
            t = n0 + tl.arange(0, BLOCK_N)
            live_t = t < end
            page = next_page.to(tl.int64)
            next_page = tl.load(table + (t + BLOCK_N) // PAGE, mask=t + BLOCK_N < end, other=0)
            off = t % PAGE
            k = tl.load(k_head + page[None, :] * stride_kp + off[None, :] * stride_kt + d[:, None],
                        mask=live_t[None, :] & live_d[:, None], other=0.0)
            s = tl.dot(q, k.to(q.dtype)) * qk_scale  # [GROUP_PAD, BLOCK_N] fp32, log2 units
            s = tl.where(live_t[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            if F16_DOTS:  # pairs of FP8 values as int16 (HEAD is even and the strides are)
                d2 = tl.arange(0, HEAD_POW2 // 2)
                v_pairs = v_head.to(tl.pointer_type(tl.int16), bitcast=True)
                v = _e4m3x2_to_f16(tl.load(v_pairs + page[:, None] * (stride_vp // 2) + off[:, None] * (
                    stride_vt // 2) + d2[None, :], mask=live_t[:, None] & (d2 < HEAD // 2)[None, :], other=0),
                    ASM)
            else:
                v = tl.load(v_head + page[:, None] * stride_vp + off[:, None] * stride_vt + d[None, :],
                            mask=live_t[:, None] & live_d[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
            m = m_new
        acc = acc / l_sum[:, None]
        if HAS_SCALES:
            acc = acc * tl.load(v_scale_ptr)
        store_part(out_ptr, lse_ptr, part_ptr, acc, m, l_sum, row, heads, d,
                   live_g[:, None] & live_d[None, :], live_g, splits, split, stride_ob, stride_oh, Q_HEADS,
                   HEAD, DIRECT)


@triton.jit
def store_part(out_ptr, lse_ptr, part_ptr, acc, m, l_sum, row, heads, cols, mask, live_heads, splits, split,
               stride_ob, stride_oh, Q_HEADS: tl.constexpr, HEAD: tl.constexpr, DIRECT: tl.constexpr):
    """A split decode program's end (ours, triton_mla's): its normalized acc [heads, cols] to the output
    (DIRECT: one split), else to its split's fp32 part with the log2-sum-exp m + log2(l_sum), the layout
    _merge_splits_kernel reads."""
    if DIRECT:
        tl.store(out_ptr + row.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        at = (row.to(tl.int64) * Q_HEADS + heads) * splits + split
        tl.store(part_ptr + at[:, None] * HEAD + cols[None, :], acc, mask=mask)
        tl.store(lse_ptr + at, m + tl.log2(l_sum), mask=live_heads)


@triton.jit(do_not_specialize=["splits"])
def _merge_splits_kernel(out_ptr, lse_ptr, part_ptr, seq_lens_ptr, splits, stride_ob, stride_oh,
                         Q_HEADS: tl.constexpr, HEAD: tl.constexpr, HEAD_POW2: tl.constexpr,
                         BLOCK_N: tl.constexpr, MIN_PER: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Stage 2 of a split decode (ours, and triton_mla's): stage 1 split each row's keys in parts of
    cdiv(max(cdiv(seq_len, splits), MIN_PER), BLOCK_N) * BLOCK_N tokens."""
    pdl.begin(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row)
    per = tl.cdiv(tl.maximum(tl.cdiv(seq_len, splits), MIN_PER), BLOCK_N) * BLOCK_N
    live = tl.cdiv(seq_len, per)  # stage 1's parts that held a key (the rest wrote nothing)
    d = tl.arange(0, HEAD_POW2)
    base = (row.to(tl.int64) * Q_HEADS + head) * splits
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([HEAD_POW2], tl.float32)
    for s in range(0, live):
        lse = tl.load(lse_ptr + base + s)
        part = tl.load(part_ptr + (base + s) * HEAD + d, mask=d < HEAD, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + w * part
        total = total * alpha + w
        m = m_new
    tl.store(out_ptr + row.to(tl.int64) * stride_ob + head * stride_oh + d, (acc / total).to(
        out_ptr.dtype.element_ty), mask=d < HEAD)


def scratch_bytes(rows: int, q_heads: int, kv_heads: int, head_dim: int, max_seq_len: int,
                  override: Config | None = None) -> int:
    """What one call allocates besides its output."""
    splits, _ = config(rows, kv_heads, max_seq_len, override)
    return launch_rules.split_decode_scratch_bytes(rows, q_heads, head_dim, splits)


def decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float,
           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
           override: Config | None = None) -> torch.Tensor:
    """out[b, h] = softmax(scale * q[b, h] . K[b, :seq_lens[b], h // group]) V[...] over the paged cache.

    q, out: [B, Hq, D] (any row and head strides, unit stride in D); k/v caches [num_pages, Hkv, page, D]
    (unit stride in D), FP8 (float8_e4m3fn) or q's dtype; block_tables [B, >= pages of the longest row] int32;
    seq_lens [B] int32, each >= 1 and <= max_seq_len (static: it picks the splits). k_scale, v_scale: 0-d or
    [1] fp32 device tensors, read by the kernel (an FP8 cache's dequantisation scales), or None."""
    rows, q_heads, head_dim = q.shape
    kv_heads, page = k_cache.shape[1], k_cache.shape[2]
    if q_heads % kv_heads or q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1 \
            or v_cache.stride(3) != 1:
        raise ValueError(f"split decode needs Hq divisible by Hkv and unit stride in D: q {tuple(q.shape)} "
                         f"{q.stride()}, out {out.stride()}, k cache {tuple(k_cache.shape)} "
                         f"{k_cache.stride()}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("split decode takes both k_scale and v_scale or neither")
    group = q_heads // kv_heads
    splits, cfg = config(rows, kv_heads, max_seq_len, override, fp8=k_scale is not None)
    if rows == 0:
        return out
    direct = splits == 1
    lse, part = split_scratch(out, splits)
    has_scales = k_scale is not None
    # V read as int16 pairs of FP8 values: an even head_dim and even strides (a contiguous cache's)
    f16_dots = cfg.f16_dots and has_scales and head_dim % 2 == 0 and all(st % 2 == 0 for st in
                                                                         v_cache.stride()[:3])
    _split_decode_kernel[(rows, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, k_scale if has_scales else seq_lens,
        v_scale if has_scales else seq_lens, out, lse, part, scale, splits,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1),
        Q_HEADS=q_heads, GROUP=group, GROUP_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        HEAD=head_dim, HEAD_POW2=max(16, triton.next_power_of_2(head_dim)), PAGE=page, BLOCK_N=cfg.block_n,
        HAS_SCALES=has_scales, DIRECT=direct, F16_DOTS=f16_dots, ASM=not pdl.interpreted(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.launch())
    if not direct:
        merge_splits(out, lse, part, seq_lens, splits, cfg.block_n)
    return out


def split_scratch(out: torch.Tensor, splits: int,
                  reserve_bytes: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse [B, H, splits], part [B, H, splits, D]) fp32 of a split decode into out [B, H, D]: the splits'
    log2-sum-exps and outputs (launch_rules.split_decode_scratch_bytes); one split needs none (out stands
    in).
    reserve_bytes: the call holds at least this many bytes (one buffer the two are carved from, the rest
    unread) while it runs: triton_mla's, so that its scratch grows with its rows
    (launch_rules.mla_decode_scratch_bytes)."""
    rows, heads, dim = out.shape
    need = 0 if splits == 1 else rows * heads * splits * (dim + 1)
    if not reserve_bytes:
        if not need:
            return out, out
        return (torch.empty(rows, heads, splits, dtype=torch.float32, device=out.device),
                torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=out.device))
    flat = torch.empty(max(need, -(-reserve_bytes // 4)), dtype=torch.float32, device=out.device)
    if not need:
        return flat, flat  # unread (one split writes out): the reserve alone
    parts = rows * heads * splits * dim
    return flat[parts:need].view(rows, heads, splits), flat[:parts].view(rows, heads, splits, dim)


def merge_splits(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, seq_lens: torch.Tensor,
                 splits: int, block_n: int, min_per: int = 1) -> None:
    """out [B, H, D] (unit stride in D) from stage 1's parts: part [B, H, splits, D] fp32 and lse [B, H,
    splits] (log2 units), each row's keys split as stage 1 split them (block_n, min_per)."""
    rows, q_heads, head_dim = out.shape
    _merge_splits_kernel[(rows, q_heads)](
        out, lse, part, seq_lens, splits, out.stride(0), out.stride(1), Q_HEADS=q_heads, HEAD=head_dim,
        HEAD_POW2=triton.next_power_of_2(head_dim), BLOCK_N=block_n, MIN_PER=min_per, num_warps=STAGE2_WARPS,
        **pdl.launch())
