"""The sampler on CUDA: one Triton kernel for a whole batch, greedy, temperature, top-k and top-p rows mixed,
no sort, no scratch, no host sync.

One program per row; the row is read a few times (it stays in L2 at decode batch sizes):
1. max, its first index, min and sum of exp((x - max) / T), online. A greedy row (T = 0) stops here: argmax.
2. top-k (0 < k < V): the k-th largest logit b_k, found by a WAYS-ary search over the logits' ordered bit
   patterns (`_key`: an int whose order is the float order, so a search ends on a logit present in the row),
   counting the logits above each of WAYS candidates per pass; then the mass above b_k and the top-k
   normaliser S_k = mass(> b_k) + (k - count(> b_k)) * exp((b_k - max) / T).
3. top-p (< 1): the smallest logit b_p >= b_k whose mass above is <= top_p * S_k, by the same search summing
   exp((x - max) / T) above each candidate. Every token above b_p is kept; of the g tokens equal to b_p,
   min(g, floor((top_p * S_k - mass(> b_p)) / exp((b_p - max) / T)) + 1) are (the sampler's rule: a token is
   kept while the mass before it is <= top_p; at b_k, g is the k - count(> b_k) tokens top-k kept).
4. the exponential race (Gumbel-max) over the kept tokens: argmax (x - max) / T - log E, E = -log U,
   U from Philox (tl.rand) with the row's seed and the token index. The b_p group races whole, its best
   score shifted by log(kept / g): the max of g i.i.d. Gumbels is one Gumbel + log g, so the group wins
   with probability kept * p(b_p) / S_kept and, when it does, each of its tokens alike: exactly the
   distribution of any `kept` of them (which tied tokens are kept is unspecified, as with a sort).
Passes: a search takes log_WAYS of the key range between the row's min and max (bf16: at most 16 bits,
6 passes at WAYS = 8; fp16 19 bits; fp32 32).
Semantics are the sampler's (autoprofile.engine.sampling; `top_k_top_p_probs` is the reference).
Imported by the sampler for CUDA tensors only (triton is imported here).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# BLOCK/WAYS/warps: fewer, longer loops win; extra passes cost little (docs/measurements.md, "Kernel choices")
BLOCK = 4096
WAYS = 8  # candidates per search pass
NUM_WARPS = 16
SHIFT = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}  # zero low bits of the fp32 pattern


@triton.jit
def _key(x, SHIFT: tl.constexpr):
    """fp32 -> int32 in the same order (negative floats: the low 31 bits flipped), >> SHIFT (exact for
    logits of a narrower float, whose low SHIFT bits are zero)."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> SHIFT


@triton.jit
def _load(base, offs, V, SHIFT: tl.constexpr):
    """(x fp32, key int64): padding lanes get -inf and a key below every logit's (-inf's included)."""
    valid = offs < V
    x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32)
    key = tl.where(valid, _key(x, SHIFT), -2147483648).to(tl.int64)
    return x, key


@triton.jit
def _search(base, V, lo, hi, xmax, inv, limit, MASS: tl.constexpr, SHIFT: tl.constexpr,
            BLOCK: tl.constexpr, WAYS: tl.constexpr):
    """The smallest key v in [lo, hi] with above(v) <= limit (MASS: the sum of exp((x - xmax) * inv) over
    keys > v; else their count, with limit = k - 1); `hi` must satisfy it. WAYS candidates per pass."""
    ways = tl.arange(0, WAYS).to(tl.int64)
    while lo < hi:
        step = (hi - lo + WAYS - 1) // WAYS
        cand = tl.minimum(lo + ways * step, hi)
        acc = tl.zeros([WAYS, BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            x, key = _load(base, start + tl.arange(0, BLOCK), V, SHIFT)
            if MASS:
                w = tl.exp((x - xmax) * inv)
            else:
                w = tl.full([BLOCK], 1.0, tl.float32)
            acc += tl.where(key[None, :] > cand[:, None], w[None, :], 0.0)
        ok = tl.sum(acc, axis=1) <= limit
        new_hi = tl.min(tl.where(ok, cand, hi), axis=0)
        lo = tl.max(tl.where(ok, lo, cand + 1), axis=0)
        hi = new_hi
    return lo


@triton.jit
def _above(base, V, b, xmax, inv, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """(count of keys > b, their mass, the logit whose key is b, count of keys == b)."""
    n = tl.zeros([BLOCK], tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    xb = tl.full([BLOCK], float("-inf"), tl.float32)
    g = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        x, key = _load(base, start + tl.arange(0, BLOCK), V, SHIFT)
        gt = key > b
        eq = key == b
        n += gt.to(tl.int32)
        mass += tl.where(gt, tl.exp((x - xmax) * inv), 0.0)
        xb = tl.maximum(xb, tl.where(eq, x, float("-inf")))
        g += eq.to(tl.int32)
    return tl.sum(n, axis=0), tl.sum(mass, axis=0), tl.max(xb, axis=0), tl.sum(g, axis=0)


@triton.jit
def _race(base, lo, hi, V, xmax, inv, seed, b, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """Step 4 over logits [lo, hi) of a row, per lane: the best race score and its index among keys > b and
    among keys == b (the group at b), the count and mass (exp((x - max) / T)) above b, the group's size and
    its logit."""
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    best_eq = tl.full([BLOCK], float("-inf"), tl.float32)
    best_eq_i = tl.zeros([BLOCK], tl.int32)
    n_gt = tl.zeros([BLOCK], tl.int32)
    mass_gt = tl.zeros([BLOCK], tl.float32)
    g = tl.zeros([BLOCK], tl.int32)
    xb = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, key = _load(base, offs, V, SHIFT)
        z = (x - xmax) * inv
        score = z - tl.log(-tl.log(tl.rand(seed, offs)))  # U = 0: -inf, never drawn
        gt = key > b
        eq = key == b
        win = gt & (score > best)
        best = tl.where(win, score, best)
        best_i = tl.where(win, offs, best_i)
        win_eq = eq & (score > best_eq)
        best_eq = tl.where(win_eq, score, best_eq)
        best_eq_i = tl.where(win_eq, offs, best_eq_i)
        n_gt += gt.to(tl.int32)
        mass_gt += tl.where(gt, tl.exp(z), 0.0)
        g += eq.to(tl.int32)
        xb = tl.maximum(xb, tl.where(eq, x, float("-inf")))
    return best, best_i, best_eq, best_eq_i, n_gt, mass_gt, g, xb


@triton.jit
def _sample_kernel(x_ptr, stride, V, t_ptr, p_ptr, k_ptr, seed_ptr, out_ptr, bound_ptr,
                   SHIFT: tl.constexpr, BLOCK: tl.constexpr, WAYS: tl.constexpr, BOUNDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    lanes = tl.arange(0, BLOCK)
    temp = tl.load(t_ptr + row)
    inv = 1.0 / tl.maximum(temp, 1e-5)
    # 1. max, its first index, min key, sum of exp((x - max) * inv)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    arg = tl.full([BLOCK], 2147483647, tl.int32)
    kmin = tl.full([BLOCK], 2**62, tl.int64)
    for start in range(0, V, BLOCK):
        offs = start + lanes
        x, key = _load(base, offs, V, SHIFT)
        arg = tl.where(x > m, offs, arg)
        m_new = tl.maximum(m, x)
        live = m_new > float("-inf")  # a lane that has seen nothing finite adds nothing (no -inf - -inf)
        s = tl.where(live, s * tl.exp((m - m_new) * inv) + tl.exp((x - m_new) * inv), 0.0)
        m = m_new
        kmin = tl.minimum(kmin, tl.where(offs < V, key, 2**62))
    xmax = tl.max(m, axis=0)
    first = tl.min(tl.where(m == xmax, arg, 2147483647), axis=0)
    if temp <= 0:  # greedy: the first index of the max, as torch.argmax
        tl.store(out_ptr + row, first.to(tl.int64))
        if BOUNDS:
            tl.store(bound_ptr + row * 2, 1.0)
            tl.store(bound_ptr + row * 2 + 1, xmax)
    else:
        total = tl.sum(tl.where(m > float("-inf"), s * tl.exp((m - xmax) * inv), 0.0), axis=0)
        kmax = _key(xmax, SHIFT).to(tl.int64)
        lo = tl.min(kmin, axis=0)
        top_k = tl.load(k_ptr + row)
        top_p = tl.load(p_ptr + row)
        # 2. top-k: b = the k-th largest key; `tied` of the tokens at b are in the top-k
        b = lo - 1  # no top-k: every key is above b
        tied = 0
        norm = total
        if (top_k > 0) & (top_k < V):
            b = _search(base, V, lo, kmax, xmax, inv, (top_k - 1).to(tl.float32), False, SHIFT, BLOCK, WAYS)
            n_gt, mass_gt, xb, _ = _above(base, V, b, xmax, inv, SHIFT, BLOCK)
            tied = (top_k - n_gt).to(tl.int32)
            norm = mass_gt + tied * tl.exp((xb - xmax) * inv)
            lo = b
        # 3. top-p: b = the smallest key >= b_k whose mass above is <= top_p * norm
        if top_p < 1:
            b_p = _search(base, V, lo, kmax, xmax, inv, top_p * norm, True, SHIFT, BLOCK, WAYS)
            if b_p != b:
                tied = 0  # b_p above b_k: its group is whole (counted in the race pass)
            b = b_p
        # 4. the race: keys > b, and the group at b apart (its best shifted by log(kept / g) below)
        seed = tl.load(seed_ptr + row)
        best, best_i, best_eq, best_eq_i, n_gt, mass_gt, g, xb = _race(
            base, 0, V, V, xmax, inv, seed, b, SHIFT, BLOCK)
        n_gt_all = tl.sum(n_gt, axis=0)
        g_all = tl.sum(g, axis=0)
        x_b = tl.max(xb, axis=0)
        group = g_all
        if tied > 0:
            group = tied  # the top-k group at b_k (top-p kept at most what top-k did)
        kept = group
        if top_p < 1:
            e_b = tl.exp((x_b - xmax) * inv)
            room = (top_p * norm - tl.sum(mass_gt, axis=0)) / e_b
            kept = tl.minimum(group, tl.maximum(tl.floor(room).to(tl.int32) + 1, 1))
        # the group's best, as the best of `kept` tokens (each of them alike); none kept: -inf
        eq_score = tl.max(best_eq, axis=0) + tl.log(kept.to(tl.float32) / tl.maximum(g_all, 1).to(tl.float32))
        gt_score = tl.max(best, axis=0)
        gt_i = tl.min(tl.where(best == gt_score, best_i, 2147483647), axis=0)
        eq_i = tl.min(tl.where(best_eq == tl.max(best_eq, axis=0), best_eq_i, 2147483647), axis=0)
        pick = tl.where((kept > 0) & (eq_score > gt_score), eq_i, gt_i)
        tl.store(out_ptr + row, pick.to(tl.int64))
        if BOUNDS:
            tl.store(bound_ptr + row * 2, (n_gt_all + kept).to(tl.float32))
            tl.store(bound_ptr + row * 2 + 1, x_b)


def sample_batch(x: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor,
                 seeds: torch.Tensor, bounds: bool = False):
    """Token ids [rows] int64 for logits x [rows, vocab] (unit stride in vocab; bf16, fp16 or fp32) with
    per-row temperature (0: greedy), top_p (>= 1: off), top_k int64 (<= 0 or >= vocab: off) and Philox seed
    (int64). bounds: also [rows, 2] fp32 (tokens kept, the smallest kept logit) for tests."""
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    kept = torch.empty(rows, 2, dtype=torch.float32, device=x.device) if bounds else out
    if rows:
        assert x.stride(-1) == 1 and x.dtype in SHIFT, (x.stride(), x.dtype)
        _sample_kernel[(rows,)](
            x, x.stride(0), vocab, temperatures.float().contiguous(), top_ps.float().contiguous(),
            top_ks.long().contiguous(), seeds.contiguous(), out, kept,
            SHIFT=SHIFT[x.dtype], BLOCK=BLOCK, WAYS=WAYS, BOUNDS=bounds, num_warps=NUM_WARPS)
    return (out, kept) if bounds else out
