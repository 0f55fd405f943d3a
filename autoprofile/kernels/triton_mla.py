"""MLA's absorbed decode over the paged latent cache (our kernel), the aiter_triton backend's mla_decode.

One program per (row, block of BLOCK_H query heads, split) walks its part of the row's tokens in tiles of
BLOCK_N: each tile's latents [BLOCK_N, kv_lora_rank + rope] are loaded once, scored against the absorbed query
(q_lat . latent + q_pe . rope part) and reused as the values (the latent's first kv_lora_rank channels). The
tile's pages come from the block table, loaded one iteration ahead and carried (as triton_decode: loaded in
the same iteration as the latents they address, Triton's pipeliner gives the latents one buffer and waits for
every copy; carried, two). Scores and the online softmax are fp32 from tl.dot.

It replaced AITER's Triton MLA decode (aiter.ops.triton.mla_decode_rope, SGLang's grouped decode) over token
slots we packed: that kernel reads the latents twice a tile (as keys [C, N] and as values [N, C]), its slot
load sat in the same iteration as the loads it addresses (one buffer, the TTGIR of an H100 build), and it
needed a slot-packing kernel and rows x max_seq_len int32 of scratch. Ours against it on an H100:
docs/measurements.md, "MoE and MLA".

Each row's tokens split in `splits` parts of at least MIN_SPLIT_TOKENS (rounded up to BLOCK_N; parts past a
row's end exit at once): the split points follow the row's own length, so a fixed split count
(INVARIANT_SPLITS, --deterministic) gives a row the same result whatever else the step holds. One split: the
program writes the output. More: each part's normalized fp32 output and log2-sum-exp, merged by
triton_decode's merge kernel. Splits follow launch_rules.mla_kv_splits(rows) at the compiled row count
(padded_rows): static values, so a captured graph replays one count. Scratch per call:
launch_rules.mla_decode_scratch_bytes (the most any count of 1..rows takes, held whatever the call's own
splits need: it grows with the rows, so the stress's corner at the most rows holds the most).
"""
from __future__ import annotations

import bisect

import torch
import triton
import triton.language as tl

from autoprofile.kernels import launch_rules, pdl, triton_decode

INVARIANT_SPLITS = launch_rules.MLA_INVARIANT_SPLITS  # --deterministic's splits, whatever the rows
# H100, deepseek-v2-lite's widths (an uncommitted side-by-side of BLOCK_N 16/32/64, 4/8 warps, 3 stages):
# 32-key tiles, 4 warps, 3 stages (two latent buffers) the fastest at 1 to 256 rows
CONFIG = {"BLOCK_N": 32, "BLOCK_H": 16, "num_warps": 4, "num_stages": 3}
MIN_SPLIT_TOKENS = 128  # a split holds at least this many of a row's tokens (4 tiles)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit(do_not_specialize=["splits", "sm_scale", "stride_table"])
def _mla_decode_kernel(q_ptr, lat_ptr, tables_ptr, seq_lens_ptr, out_ptr, lse_ptr, part_ptr, sm_scale,
                       splits, stride_qb, stride_qh, stride_lp, stride_lt, stride_table, stride_ob, stride_oh,
                       HEADS: tl.constexpr, BLOCK_H: tl.constexpr, RANK: tl.constexpr,
                       RANK_POW2: tl.constexpr,
                       ROPE: tl.constexpr, ROPE_POW2: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                       MIN_PER: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr = False):
    pdl.begin(PDL)
    row = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    per = tl.cdiv(tl.maximum(tl.cdiv(seq_len, splits), MIN_PER), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, seq_len)
    if start < end:
        c = tl.arange(0, RANK_POW2)
        r = tl.arange(0, ROPE_POW2)
        live_h = h < HEADS
        live_c = c < RANK
        live_r = r < ROPE
        q_row = q_ptr + row.to(tl.int64) * stride_qb + h[:, None] * stride_qh
        q_c = tl.load(q_row + c[None, :], mask=live_h[:, None] & live_c[None, :], other=0.0)
        q_r = tl.load(q_row + RANK + r[None, :], mask=live_h[:, None] & live_r[None, :], other=0.0)
        qk_scale = sm_scale * LOG2E
        table = tables_ptr + row.to(tl.int64) * stride_table
        t = start + tl.arange(0, BLOCK_N)
        next_page = tl.load(table + t // PAGE, mask=t < end, other=0)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, RANK_POW2], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            t = n0 + tl.arange(0, BLOCK_N)
            live_t = t < end
            page = next_page.to(tl.int64)
            next_page = tl.load(table + (t + BLOCK_N) // PAGE, mask=t + BLOCK_N < end, other=0)
            tok = lat_ptr + page * stride_lp + (t % PAGE) * stride_lt  # [BLOCK_N]
            lat = tl.load(tok[:, None] + c[None, :], mask=live_t[:, None] & live_c[None, :], other=0.0)
            pe = tl.load(tok[:, None] + RANK + r[None, :], mask=live_t[:, None] & live_r[None, :], other=0.0)
            s = tl.dot(q_c, tl.trans(lat))
            s = tl.dot(q_r, tl.trans(pe), s) * qk_scale  # [BLOCK_H, BLOCK_N] fp32, log2 units
            s = tl.where(live_t[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)
            m = m_new
        acc = acc / l_sum[:, None]
        triton_decode.store_part(out_ptr, lse_ptr, part_ptr, acc, m, l_sum, row, h, c,
                                 live_h[:, None] & live_c[None, :], live_h, splits, split, stride_ob,
                                 stride_oh, HEADS, RANK, DIRECT)


def padded_rows(rows: int, graph_rows: int, max_rows: int) -> int:
    """The row count a decode of `rows` rows takes its splits (and declares its scratch) at: the graph
    ladder's next size while one holds it, else the envelope's most decode rows."""
    if rows <= graph_rows:
        ladder = launch_rules.batch_ladder(graph_rows)
        return ladder[bisect.bisect_left(ladder, rows)]
    return max(rows, max_rows)


def launch_for(rows: int) -> tuple[int, dict]:
    """(splits of each row's tokens, the kernel's launch config) at a padded row count."""
    return launch_rules.mla_kv_splits(rows), CONFIG


def mla_decode(q: torch.Tensor, latents: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, v_dim: int, rows: int,
               launch: tuple[int, dict] | None = None) -> torch.Tensor:
    """q [B, H, L] (L = kv_lora_rank + rope; unit stride in L) against the latent cache [pages, 1, page, L]
    (contiguous) -> [B, H, v_dim], v_dim = kv_lora_rank; tables [B, >= pages of the longest row] int32,
    seq_lens [B] int32, each >= 1 (the tables hold its pages). Splits and config at `rows` (>= B: padded_rows)
    unless `launch` gives them (scripts/tune_mla_decode.py, --deterministic's INVARIANT_SPLITS)."""
    b, heads, width = q.shape
    if q.stride(2) != 1 or not latents.is_contiguous() or width != latents.shape[-1] or not 0 < v_dim < width:
        raise ValueError(f"MLA decode needs q [B, H, L] with unit stride in L over a contiguous latent cache "
                         f"[pages, 1, page, L], 0 < v_dim < L: q {tuple(q.shape)} {q.stride()}, latents "
                         f"{tuple(latents.shape)}, v_dim {v_dim}")
    splits, cfg = launch or launch_for(rows)
    out = q.new_empty(b, heads, v_dim)
    if b == 0:
        return out
    direct = splits == 1
    # --deterministic's (and a tuning launch's) fixed splits: partials grow with the rows as they are
    lse, part = triton_decode.split_scratch(
        out, splits, 0 if launch else launch_rules.mla_decode_scratch_bytes(rows, heads, v_dim))
    rope = width - v_dim
    block_n = cfg["BLOCK_N"]
    _mla_decode_kernel[(b, triton.cdiv(heads, cfg["BLOCK_H"]), splits)](
        q, latents, tables, seq_lens, out, lse, part, scale, splits, q.stride(0), q.stride(1),
        latents.stride(0), latents.stride(2), tables.stride(0), out.stride(0), out.stride(1),
        HEADS=heads, BLOCK_H=cfg["BLOCK_H"], RANK=v_dim, RANK_POW2=triton.next_power_of_2(v_dim), ROPE=rope,
        ROPE_POW2=max(16, triton.next_power_of_2(rope)), PAGE=latents.shape[2], BLOCK_N=block_n,
        MIN_PER=MIN_SPLIT_TOKENS, DIRECT=direct, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl.launch())
    if not direct:
        triton_decode.merge_splits(out, lse, part, seq_lens, splits, block_n, MIN_SPLIT_TOKENS)
    return out
