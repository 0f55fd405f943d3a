"""The sampler on CUDA, split: several programs a row (a grid of rows x blocks, a block being `chunk` logits
of a row), for few rows of a long vocabulary, where triton_sample runs each row on one SM. Same semantics,
same searches and the same race as triton_sample (read its docstring): the same token for the same seed.

Launches (rows x blocks each, but the last):
1. stats: each block's max, the first index of it, sum of exp((x - max) / T) and smallest key.
2. top-k search, `passes` launches: each narrows the row's [lo, hi] from the previous launch's per-block
   counts at WAYS candidates, then counts its own block's keys above the new candidates.
3. above: the last narrowing (b_k); each block's count and mass above b_k and its logit at b_k.
4. top-p search, `passes` launches as 2., summing exp((x - max) / T) above each candidate.
5. race: the last narrowing (b_p); each block's race over its kept tokens.
6. final, one program a row: the blocks' results combined, the token.
A row whose search is done (lo == hi), or that has no top-k / top-p, passes through a launch without reading
its logits. `passes` covers the widest key range of the dtype (split_passes), so every search ends in time.
Reproducible: the blocks follow the vocabulary only (never the rows), and every sum over blocks is one fixed
reduction taken by whichever program needs it (each program combines the previous launch's partials itself:
no float atomics, no grid barrier, no host sync). Search state and partials alternate between two buffers by
launch parity: a launch reads one and writes the other.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from autoprofile.kernels.launch_rules import SAMPLE_SPLIT_CHUNK, SAMPLE_SPLIT_WAYS, sample_split_blocks
from autoprofile.kernels.triton_sample import SHIFT, _key, _load, _race

BLOCK = 1024  # logits a program reads per loop step
NUM_WARPS = 8
BIG = tl.constexpr(2147483647)


def split_passes(shift: int, ways: int) -> int:
    """Launches a search takes at most: the widest key range of a dtype (32 - shift bits), each pass leaving
    at most ceil(width / ways) - 1 of it."""
    width, passes = 2 ** (32 - shift) - 1, 0
    while width > 0:
        width, passes = -(-width // ways) - 1, passes + 1
    return passes


def split_scratch(rows: int, blocks: int, ways: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The split sampler's scratch (launch_rules.sample_split_scratch_bytes counts it)."""
    f32 = dict(dtype=torch.float32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    return {"st_f": torch.empty(rows, blocks, 2, **f32), "st_i": torch.empty(rows, blocks, 2, **i64),
            "part": torch.empty(2, rows, blocks, ways, **f32), "lohi": torch.empty(2, rows, 2, **i64),
            "rs": torch.empty(rows, 3, **i64), "abv_f": torch.empty(rows, blocks, 2, **f32),
            "abv_i": torch.empty(rows, blocks, **i64), "race_f": torch.empty(rows, blocks, 4, **f32),
            "race_i": torch.empty(rows, blocks, 4, **i64)}


@triton.jit
def _row_stats(st_f, st_i, row, NB, inv, NBP: tl.constexpr):
    """(max, its first index, sum of exp((x - max) * inv), smallest key) of a row from its blocks'."""
    blk = tl.arange(0, NBP)
    at = row * NB + blk
    valid = blk < NB
    m = tl.load(st_f + at * 2, mask=valid, other=float("-inf"))
    s = tl.load(st_f + at * 2 + 1, mask=valid, other=0.0)
    arg = tl.load(st_i + at * 2, mask=valid, other=BIG)
    kmin = tl.load(st_i + at * 2 + 1, mask=valid, other=2**62)
    xmax = tl.max(m, axis=0)
    first = tl.min(tl.where(m == xmax, arg, BIG), axis=0)
    total = tl.sum(tl.where(m > float("-inf"), s * tl.exp((m - xmax) * inv), 0.0), axis=0)
    return xmax, first, total, tl.min(kmin, axis=0)


@triton.jit
def _topk_norm(abv_f, abv_i, row, NB, top_k, xmax, inv, NBP: tl.constexpr):
    """(top-k normaliser, tokens at b_k in the top-k) from the blocks' counts and masses above b_k."""
    blk = tl.arange(0, NBP)
    at = row * NB + blk
    valid = blk < NB
    mass = tl.sum(tl.load(abv_f + at * 2, mask=valid, other=0.0), axis=0)
    xb = tl.max(tl.load(abv_f + at * 2 + 1, mask=valid, other=float("-inf")), axis=0)
    tied = top_k - tl.sum(tl.load(abv_i + at, mask=valid, other=0), axis=0)
    return mass + tied * tl.exp((xb - xmax) * inv), tied.to(tl.int32)


@triton.jit
def _cands(lo, hi, WAYS: tl.constexpr):
    step = (hi - lo + WAYS - 1) // WAYS
    return tl.minimum(lo + tl.arange(0, WAYS).to(tl.int64) * step, hi)


@triton.jit
def _narrow(part, lohi, row, rows, q, NB, limit, NBP: tl.constexpr, WAYS: tl.constexpr):
    """[lo, hi] after the pass that wrote parity q: its state, and its blocks' sums at its candidates."""
    lo = tl.load(lohi + (q * rows + row) * 2)
    hi = tl.load(lohi + (q * rows + row) * 2 + 1)
    if lo < hi:
        cand = _cands(lo, hi, WAYS)
        blk = tl.arange(0, NBP)
        at = (q * rows + row) * NB + blk
        sums = tl.load(part + at[:, None] * WAYS + tl.arange(0, WAYS)[None, :], mask=(blk < NB)[:, None],
                       other=0.0)
        ok = tl.sum(sums, axis=0) <= limit
        new_hi = tl.min(tl.where(ok, cand, hi), axis=0)
        lo = tl.max(tl.where(ok, lo, cand + 1), axis=0)
        hi = new_hi
    return lo, hi


@triton.jit
def _stats_kernel(x_ptr, stride, V, t_ptr, st_f, st_i, SHIFT: tl.constexpr, BLOCK: tl.constexpr,
                  CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    NB = tl.num_programs(1)
    base = x_ptr + row * stride
    inv = 1.0 / tl.maximum(tl.load(t_ptr + row), 1e-5)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    arg = tl.full([BLOCK], BIG, tl.int32)
    kmin = tl.full([BLOCK], 2**62, tl.int64)
    for start in range(blk * CHUNK, blk * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, key = _load(base, offs, V, SHIFT)
        arg = tl.where(x > m, offs, arg)
        m_new = tl.maximum(m, x)
        live = m_new > float("-inf")
        s = tl.where(live, s * tl.exp((m - m_new) * inv) + tl.exp((x - m_new) * inv), 0.0)
        m = m_new
        kmin = tl.minimum(kmin, tl.where(offs < V, key, 2**62))
    m_b = tl.max(m, axis=0)
    at = row * NB + blk
    tl.store(st_f + at * 2, m_b)
    tl.store(st_f + at * 2 + 1, tl.sum(tl.where(m > float("-inf"), s * tl.exp((m - m_b) * inv), 0.0), axis=0))
    tl.store(st_i + at * 2, tl.min(tl.where(m == m_b, arg, BIG), axis=0).to(tl.int64))
    tl.store(st_i + at * 2 + 1, tl.min(kmin, axis=0))


@triton.jit
def _pass_kernel(x_ptr, stride, V, rows, q, t_ptr, p_ptr, k_ptr, st_f, st_i, part, lohi, rs, abv_f, abv_i,
                 MASS: tl.constexpr, FIRST: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr,
                 CHUNK: tl.constexpr, NBP: tl.constexpr, WAYS: tl.constexpr):
    """One pass of a search (MASS: top-p, else top-k), writing parity q."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    NB = tl.num_programs(1)
    temp = tl.load(t_ptr + row)
    top_k = tl.load(k_ptr + row)
    top_p = tl.load(p_ptr + row)
    by_k = (top_k > 0) & (top_k < V)
    if MASS:
        active = (temp > 0) & (top_p < 1)
    else:
        active = (temp > 0) & by_k
    if active:
        inv = 1.0 / tl.maximum(temp, 1e-5)
        xmax, unused1, total, kmin = _row_stats(st_f, st_i, row, NB, inv, NBP)
        if FIRST:
            lo = kmin
            if MASS:
                if by_k:
                    lo = tl.load(rs + row * 3)  # b_k
            hi = _key(xmax, SHIFT).to(tl.int64)
        else:
            if MASS:
                norm = total
                if by_k:
                    norm, unused2 = _topk_norm(abv_f, abv_i, row, NB, top_k, xmax, inv, NBP)
                limit = top_p * norm
            else:
                limit = (top_k - 1).to(tl.float32)
            lo, hi = _narrow(part, lohi, row, rows, 1 - q, NB, limit, NBP, WAYS)
        if blk == 0:
            tl.store(lohi + (q * rows + row) * 2, lo)
            tl.store(lohi + (q * rows + row) * 2 + 1, hi)
        if lo < hi:
            cand = _cands(lo, hi, WAYS)
            acc = tl.zeros([WAYS, BLOCK], tl.float32)
            base = x_ptr + row * stride
            for start in range(blk * CHUNK, blk * CHUNK + CHUNK, BLOCK):
                x, key = _load(base, start + tl.arange(0, BLOCK), V, SHIFT)
                if MASS:
                    w = tl.exp((x - xmax) * inv)
                else:
                    w = tl.full([BLOCK], 1.0, tl.float32)
                acc += tl.where(key[None, :] > cand[:, None], w[None, :], 0.0)
            at = (q * rows + row) * NB + blk
            tl.store(part + at * WAYS + tl.arange(0, WAYS), tl.sum(acc, axis=1))


@triton.jit
def _above_kernel(x_ptr, stride, V, rows, q, t_ptr, k_ptr, st_f, st_i, part, lohi, rs, abv_f, abv_i,
                  SHIFT: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, NBP: tl.constexpr,
                  WAYS: tl.constexpr):
    """b_k, then each block's count and mass above it and its logit at b_k."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    NB = tl.num_programs(1)
    temp = tl.load(t_ptr + row)
    top_k = tl.load(k_ptr + row)
    if (temp > 0) & (top_k > 0) & (top_k < V):
        inv = 1.0 / tl.maximum(temp, 1e-5)
        xmax, unused3, unused4, unused5 = _row_stats(st_f, st_i, row, NB, inv, NBP)
        b, unused6 = _narrow(part, lohi, row, rows, 1 - q, NB, (top_k - 1).to(tl.float32), NBP, WAYS)
        if blk == 0:
            tl.store(rs + row * 3, b)
        n = tl.zeros([BLOCK], tl.int32)
        mass = tl.zeros([BLOCK], tl.float32)
        xb = tl.full([BLOCK], float("-inf"), tl.float32)
        base = x_ptr + row * stride
        for start in range(blk * CHUNK, blk * CHUNK + CHUNK, BLOCK):
            x, key = _load(base, start + tl.arange(0, BLOCK), V, SHIFT)
            gt = key > b
            n += gt.to(tl.int32)
            mass += tl.where(gt, tl.exp((x - xmax) * inv), 0.0)
            xb = tl.maximum(xb, tl.where(key == b, x, float("-inf")))
        at = row * NB + blk
        tl.store(abv_f + at * 2, tl.sum(mass, axis=0))
        tl.store(abv_f + at * 2 + 1, tl.max(xb, axis=0))
        tl.store(abv_i + at, tl.sum(n, axis=0).to(tl.int64))


@triton.jit
def _race_kernel(x_ptr, stride, V, rows, q, t_ptr, p_ptr, k_ptr, seed_ptr, st_f, st_i, part, lohi, rs, abv_f,
                 abv_i, race_f, race_i, SHIFT: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                 NBP: tl.constexpr, WAYS: tl.constexpr):
    """b (b_p, else b_k, else below every key) and the tied count, then each block's race."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    NB = tl.num_programs(1)
    temp = tl.load(t_ptr + row)
    if temp > 0:
        top_k = tl.load(k_ptr + row)
        top_p = tl.load(p_ptr + row)
        inv = 1.0 / tl.maximum(temp, 1e-5)
        xmax, unused7, total, kmin = _row_stats(st_f, st_i, row, NB, inv, NBP)
        b = kmin - 1
        tied = 0
        norm = total
        if (top_k > 0) & (top_k < V):
            b = tl.load(rs + row * 3)
            norm, tied = _topk_norm(abv_f, abv_i, row, NB, top_k, xmax, inv, NBP)
        if top_p < 1:
            b_p, unused8 = _narrow(part, lohi, row, rows, 1 - q, NB, top_p * norm, NBP, WAYS)
            if b_p != b:
                tied = 0
            b = b_p
        if blk == 0:
            tl.store(rs + row * 3 + 1, b)
            tl.store(rs + row * 3 + 2, tied.to(tl.int64))
        seed = tl.load(seed_ptr + row)
        base = x_ptr + row * stride
        best, best_i, best_eq, best_eq_i, n_gt, mass_gt, g, xb = _race(
            base, blk * CHUNK, blk * CHUNK + CHUNK, V, xmax, inv, seed, b, SHIFT, BLOCK)
        gt_score = tl.max(best, axis=0)
        eq_score = tl.max(best_eq, axis=0)
        at = row * NB + blk
        tl.store(race_f + at * 4, gt_score)
        tl.store(race_f + at * 4 + 1, eq_score)
        tl.store(race_f + at * 4 + 2, tl.sum(mass_gt, axis=0))
        tl.store(race_f + at * 4 + 3, tl.max(xb, axis=0))
        tl.store(race_i + at * 4, tl.min(tl.where(best == gt_score, best_i, BIG), axis=0).to(tl.int64))
        eq_i = tl.min(tl.where(best_eq == eq_score, best_eq_i, BIG), axis=0)
        tl.store(race_i + at * 4 + 1, eq_i.to(tl.int64))
        tl.store(race_i + at * 4 + 2, tl.sum(n_gt, axis=0).to(tl.int64))
        tl.store(race_i + at * 4 + 3, tl.sum(g, axis=0).to(tl.int64))


@triton.jit
def _final_kernel(V, NB, t_ptr, p_ptr, k_ptr, st_f, st_i, rs, abv_f, abv_i, race_f, race_i, out_ptr,
                  bound_ptr, NBP: tl.constexpr, BOUNDS: tl.constexpr):
    """One program a row: the blocks' races combined (the first index of the best score), the token."""
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(t_ptr + row)
    inv = 1.0 / tl.maximum(temp, 1e-5)
    xmax, first, total, unused9 = _row_stats(st_f, st_i, row, NB, inv, NBP)
    if temp <= 0:  # greedy: the first index of the max, as torch.argmax
        tl.store(out_ptr + row, first.to(tl.int64))
        if BOUNDS:
            tl.store(bound_ptr + row * 2, 1.0)
            tl.store(bound_ptr + row * 2 + 1, xmax)
    else:
        top_k = tl.load(k_ptr + row)
        top_p = tl.load(p_ptr + row)
        norm = total
        if (top_k > 0) & (top_k < V):
            norm, unused10 = _topk_norm(abv_f, abv_i, row, NB, top_k, xmax, inv, NBP)
        tied = tl.load(rs + row * 3 + 2).to(tl.int32)
        blk = tl.arange(0, NBP)
        at = row * NB + blk
        valid = blk < NB
        best = tl.load(race_f + at * 4, mask=valid, other=float("-inf"))
        best_eq = tl.load(race_f + at * 4 + 1, mask=valid, other=float("-inf"))
        mass_gt = tl.sum(tl.load(race_f + at * 4 + 2, mask=valid, other=0.0), axis=0)
        x_b = tl.max(tl.load(race_f + at * 4 + 3, mask=valid, other=float("-inf")), axis=0)
        best_i = tl.load(race_i + at * 4, mask=valid, other=BIG)
        best_eq_i = tl.load(race_i + at * 4 + 1, mask=valid, other=BIG)
        n_gt_all = tl.sum(tl.load(race_i + at * 4 + 2, mask=valid, other=0), axis=0).to(tl.int32)
        g_all = tl.sum(tl.load(race_i + at * 4 + 3, mask=valid, other=0), axis=0).to(tl.int32)
        group = g_all
        if tied > 0:
            group = tied
        kept = group
        if top_p < 1:
            e_b = tl.exp((x_b - xmax) * inv)
            room = (top_p * norm - mass_gt) / e_b
            kept = tl.minimum(group, tl.maximum(tl.floor(room).to(tl.int32) + 1, 1))
        eq_max = tl.max(best_eq, axis=0)
        eq_score = eq_max + tl.log(kept.to(tl.float32) / tl.maximum(g_all, 1).to(tl.float32))
        gt_score = tl.max(best, axis=0)
        gt_i = tl.min(tl.where(best == gt_score, best_i, BIG), axis=0)
        eq_i = tl.min(tl.where(best_eq == eq_max, best_eq_i, BIG), axis=0)
        pick = tl.where((kept > 0) & (eq_score > gt_score), eq_i, gt_i)
        tl.store(out_ptr + row, pick.to(tl.int64))
        if BOUNDS:
            tl.store(bound_ptr + row * 2, (n_gt_all + kept).to(tl.float32))
            tl.store(bound_ptr + row * 2 + 1, x_b)


def sample_batch_split(x: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor,
                       top_ks: torch.Tensor, seeds: torch.Tensor, bounds: bool = False,
                       chunk: int = SAMPLE_SPLIT_CHUNK, ways: int = SAMPLE_SPLIT_WAYS):
    """triton_sample.sample_batch's contract, several programs a row (`chunk` logits each, a multiple of
    BLOCK; the blocks of a row depend on its vocabulary only)."""
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    kept = torch.empty(rows, 2, dtype=torch.float32, device=x.device) if bounds else out
    if not rows:
        return (out, kept) if bounds else out
    assert x.stride(-1) == 1 and x.dtype in SHIFT, (x.stride(), x.dtype)
    assert chunk % BLOCK == 0 and ways & (ways - 1) == 0, (chunk, ways)
    blocks = sample_split_blocks(vocab, chunk)
    s = split_scratch(rows, blocks, ways, x.device)
    temps, top_ps = temperatures.float().contiguous(), top_ps.float().contiguous()
    top_ks, seeds = top_ks.long().contiguous(), seeds.contiguous()
    meta = dict(SHIFT=SHIFT[x.dtype], BLOCK=BLOCK, CHUNK=chunk, num_warps=NUM_WARPS)
    search = dict(NBP=triton.next_power_of_2(blocks), WAYS=ways, **meta)
    grid = (rows, blocks)
    _stats_kernel[grid](x, x.stride(0), vocab, temps, s["st_f"], s["st_i"], **meta)
    launch = 1  # parity of the launch: a search pass writes part/lohi[launch % 2], reads the other
    state = (s["st_f"], s["st_i"], s["part"], s["lohi"], s["rs"], s["abv_f"], s["abv_i"])
    for mass in (False, True):
        if mass:
            _above_kernel[grid](x, x.stride(0), vocab, rows, launch % 2, temps, top_ks, *state, **search)
            launch += 1
        for j in range(split_passes(SHIFT[x.dtype], ways)):
            _pass_kernel[grid](x, x.stride(0), vocab, rows, launch % 2, temps, top_ps, top_ks, *state,
                               MASS=mass, FIRST=j == 0, **search)
            launch += 1
    _race_kernel[grid](x, x.stride(0), vocab, rows, launch % 2, temps, top_ps, top_ks, seeds, *state,
                       s["race_f"], s["race_i"], **search)
    _final_kernel[(rows,)](vocab, blocks, temps, top_ps, top_ks, s["st_f"], s["st_i"], s["rs"], s["abv_f"],
                           s["abv_i"], s["race_f"], s["race_i"], out, kept, NBP=search["NBP"], BOUNDS=bounds,
                           num_warps=1)
    return (out, kept) if bounds else out
