"""The sampler on CUDA: one Triton kernel for a whole batch, greedy, temperature, top-k and top-p rows mixed,
no sort, no host sync; rows with a small top-k take a second, split-row kernel (5.).

One program per row; the row is read a few times (it stays in L2 at decode batch sizes);
e = exp((x - max) / T).
1. max, its first index, min, and per lane (the BLOCK lanes that walk the row, lane l holding tokens l,
   l + BLOCK, ...) the sum of e, online. A greedy row (T = 0) stops here: argmax.
2. top-k (0 < k < V): the k-th largest logit b_k, found by a WAYS-ary search over the logits' ordered bit
   patterns (`_key`: an int whose order is the float order, so a search ends on a logit present in the row),
   counting the logits above each of WAYS candidates per pass (no exp); then, in one pass, the mass above b_k
   per lane and the top-k normaliser S_k = mass(> b_k) + tied * e(b_k), where `tied` = k - count(> b_k) of
   the g tokens at b_k are in the top-k. Without top-k, S_k is the row's sum S from pass 1.
3. rejection sampling with inverse-CDF draws. The proposal is e over the tokens above a pivot xp, the tokens
   at xp weighted w_eq each (start: every token, or the top-k set: xp = b_k, w_eq = tied / g). A round draws
   ONE uniform u (Philox, tl.rand with the row's seed at offset V + 2 * round) and walks the proposal in a
   fixed order (lane-major: the lanes' sums are at hand, a cumulative sum over them finds the lane where the
   mass crosses u * total, then that lane's V / BLOCK tokens find the token t): no per-token random number.
   If the proposal is the kept set (top_p = 1; or a tie group cut, below) t is the draw. Else one pass
   measures mass(> x_t) and the g tokens equal to x_t; by the sampler's rule (a token is kept while the mass
   before it is <= top_p * S_k) min(g, floor((top_p * S_k - mass(> x_t)) / e(x_t)) + 1) of them are kept (0
   when mass(> x_t) > top_p * S_k; at b_k, g is `tied`). t is accepted with probability kept / g (a second
   Philox scalar at V + 2 * round + 1). Rejected, the kept set lies at or above x_t: the pivot rises to x_t
   with w_eq = kept / g, and the pass's per-lane mass is the next round's walk (no new pass). When kept > 0
   the new proposal IS the kept set (the group at x_t cut where the rule cuts it): the next draw is final.
   Exact: each round's proposal contains the kept set with the same weights, and a token is accepted with
   probability (its kept weight) / (its proposal weight), so whatever rounds came before, the draw follows
   the kept set's distribution, the boundary group's `kept` tokens weighted alike (which tied tokens are
   kept is unspecified, as with a sort). Passes: top-p 2 (pass 1, the acceptance pass) when the first draw is
   kept, +1 a rejection; rounds expected about 1 + ln(1 / top_p) (a rejected token is a uniform mass quantile
   of its proposal): 1.1 at top_p 0.9. Temperature only: 1 pass; top-k: 2 + the count search.
4. the fallback (ROUNDS rejections without a draw, or `bounds` asked for): the top-p threshold b_p by the
   same search summing e above each candidate, then the exponential race (Gumbel-max) over the kept tokens:
   argmax (x - max) / T - log E, E = -log U, U from Philox at the token's index (offsets < V: apart from the
   rounds'). The b_p group races whole, its best score shifted by log(kept / g): the max of g i.i.d. Gumbels
   is one Gumbel + log g, so the group wins with probability kept * p(b_p) / S_kept. The search takes
   log_WAYS of the key range between the row's min and max (bf16: at most 16 bits, 6 passes at WAYS = 8).
5. the split path, rows with 0 < top_k <= K_MAX (a second kernel, `_split_kernel`; `_sample_kernel` skips
   them): one program a row is compute-bound on one SM in step 2's search (issue 48: top-k 50 + top-p 0.9
   took 0.244 ms at 1 row, 0.529 at 256 on an H100). Here a row is SPAN-logit chunks, a program each, in one
   launch. A program keeps its chunk's K_MAX best keys (packed: value key, then the index, lower first on
   ties; `_chunk_top`: a bound from its group maxima, the few keys above it compacted into its workspace
   slot, tl.topk of the slot); the row's last program (an atomic count, as triton_argmax) merges the
   chunks' candidates by tl.topk into the row's top K_MAX, sorted, and draws over the first top_k alone:
   e = exp((x - max) / T), kept while the mass before a token (in that order) is <= top_p * their sum, one
   inverse-CDF draw (Philox at offset V). Exact; the tied tokens kept at a boundary are the lowest-indexed.
   Workspace: SLOT int64 keys a program, SPLIT_ROWS rows a launch at most, and an int32 count a row,
   zeros made by the call (no buffer outlives it: nothing for a teardown to give back).
Semantics are the sampler's (autoprofile.engine.sampling; `top_k_top_p_probs` is the reference). A row's
draw depends on its logits, parameters and seed only (fixed orders, whichever program finishes a row):
batch-invariant. Imported by the sampler for CUDA tensors only (triton is imported here).

Above the house's 500 lines on purpose: both kernels of the one sampler launch from `sample_batch`, share the
key and load helpers and the split-row test; a second module would import this one and be imported by it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# BLOCK/WAYS/warps: fewer, longer loops win; extra passes cost little (docs/measurements.md, "Kernel choices")
BLOCK = 4096
WAYS = 8  # candidates per search pass
NUM_WARPS = 16
CHUNK = 64  # tokens of one lane the draw's walk reads at a time (128,256 / 4096: 32 a lane)
ROUNDS = 32  # rejection rounds before the exact fallback (step 4); tests force 0 and 1
SHIFT = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}  # zero low bits of the fp32 pattern
# the split path (rows with 0 < top_k <= K_MAX): grid (rows, cdiv(vocab, SPAN)), one launch
K_MAX = 64  # the largest top_k it takes (a power of two: tl.topk's); its group count G is 2 * K_MAX
SPAN = 8192  # logits a program reads (a power of two >= 2 * K_MAX; keys in int32 up to 2 ** SHIFT)
SLOT = 256  # int64 keys a program's workspace slot holds (compaction rounds of SLOT - K_MAX candidates)
STEP = 1024  # tokens a program's passes take at a time
SPLIT_WARPS = 2  # with SPAN and STEP: bench_sampler --split_sweep's best, H100 (0.032 / 0.066 / 0.202 ms
# at 1 / 64 / 256 rows of top-k 50 + top-p 0.9; the same tokens under every config)
SPLIT_ROWS = 1024  # rows a split launch takes (more: launches over one workspace); sampling.FUSED_ROWS


@triton.jit
def _key(x, SHIFT: tl.constexpr):
    """fp32 -> int32 in the same order (negative floats: the low 31 bits flipped), >> SHIFT (exact for
    logits of a narrower float, whose low SHIFT bits are zero)."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> SHIFT


@triton.jit
def _unkey(key, SHIFT: tl.constexpr):
    """The logit whose key is `key` (the inverse of `_key` on keys of logits in the row: their low SHIFT bits
    are zero, also after a negative key's low bits are flipped back)."""
    bits = (key << SHIFT).to(tl.int32)
    return ((bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> SHIFT << SHIFT).to(tl.float32, bitcast=True)


@triton.jit
def _logits(base, offs, V):
    """fp32 logits, padding lanes -inf; + 0.0 turns -0.0 into 0.0 (float ties and key ties then agree)."""
    return tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) + 0.0


@triton.jit
def _load(base, offs, V, SHIFT: tl.constexpr):
    """(x fp32, key int64): padding lanes get -inf and a key below every logit's (-inf's included)."""
    x = _logits(base, offs, V)
    key = tl.where(offs < V, _key(x, SHIFT), -2147483648).to(tl.int64)
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
def _above(base, V, xb, xmax, inv, BLOCK: tl.constexpr):
    """Per lane: the count of logits > xb, their mass (exp((x - xmax) * inv)), the count of logits == xb."""
    n = tl.zeros([BLOCK], tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    g = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        x = _logits(base, start + tl.arange(0, BLOCK), V)
        gt = x > xb
        n += gt.to(tl.int32)
        mass += tl.where(gt, tl.exp((x - xmax) * inv), 0.0)
        g += (x == xb).to(tl.int32)
    return n, mass, g


@triton.jit
def _draw(base, V, lane_mass, xp, w_eq, xmax, inv, u, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Step 3's inverse-CDF draw: the token where the proposal's mass, walked lane-major, crosses u * total.
    lane_mass: the proposal's mass per lane (tokens > xp weighted e, == xp weighted e * w_eq). A token of
    weight 0 is never drawn (rounding: the last positive token of the lane if the walk falls short)."""
    lanes = tl.arange(0, BLOCK)
    c = tl.cumsum(lane_mass, axis=0)
    target = u * tl.max(c, axis=0)
    lane = tl.min(tl.where((c > target) & (lane_mass > 0), lanes, BLOCK), axis=0)
    lane = tl.where(lane < BLOCK, lane, tl.max(tl.where(lane_mass > 0, lanes, 0), axis=0))
    rest = target - tl.sum(tl.where(lanes == lane, c - lane_mass, 0.0), axis=0)
    pick = tl.full([], 2147483647, tl.int32)
    last = lane
    run = tl.zeros([], tl.float32)
    for j in range(0, tl.cdiv(V, BLOCK), CHUNK):
        offs = lane + (j + tl.arange(0, CHUNK)) * BLOCK
        x = _logits(base, offs, V)
        e = tl.exp((x - xmax) * inv)
        w = tl.where(x > xp, e, tl.where(x == xp, e * w_eq, 0.0))
        cross = ((tl.cumsum(w, axis=0) + run) > rest) & (w > 0)
        pick = tl.minimum(pick, tl.min(tl.where(cross, offs, 2147483647), axis=0))
        last = tl.maximum(last, tl.max(tl.where(w > 0, offs, -1), axis=0))
        run += tl.sum(w, axis=0)
    return tl.where(pick < 2147483647, pick, last)


@triton.jit
def _race(base, lo, hi, V, xmax, inv, seed, b, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """Step 4's race over logits [lo, hi) of a row, per lane: the best race score and its index among keys > b
    and among keys == b (the group at b), the count and mass (exp((x - max) / T)) above b, the group's size
    and its logit."""
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
def _exact(base, V, lo, kmax, b, tied, norm, top_p, xmax, inv, seed, SHIFT: tl.constexpr,
           BLOCK: tl.constexpr, WAYS: tl.constexpr):
    """Step 4, the fallback: (token, tokens kept, the smallest kept logit). b: b_k (no top-k: below every
    key, lo: the row's min key), `tied` of the tokens at b_k in the top-k, norm: S_k."""
    # top-p: b = the smallest key >= b_k whose mass above is <= top_p * norm
    if top_p < 1:
        b_p = _search(base, V, lo, kmax, xmax, inv, top_p * norm, True, SHIFT, BLOCK, WAYS)
        if b_p != b:
            tied = 0  # b_p above b_k: its group is whole (counted in the race pass)
        b = b_p
    # the race: keys > b, and the group at b apart (its best shifted by log(kept / g) below)
    best, best_i, best_eq, best_eq_i, n_gt, mass_gt, g, xb = _race(
        base, 0, V, V, xmax, inv, seed, b, SHIFT, BLOCK)
    g_all = tl.sum(g, axis=0)
    x_b = tl.max(xb, axis=0)
    group = g_all
    if tied > 0:
        group = tied  # the top-k group at b_k (top-p kept at most what top-k did)
    kept = group
    if top_p < 1:
        room = (top_p * norm - tl.sum(mass_gt, axis=0)) / tl.exp((x_b - xmax) * inv)
        kept = tl.minimum(group, tl.maximum(tl.floor(room).to(tl.int32) + 1, 1))
    # the group's best, as the best of `kept` tokens (each of them alike); none kept: -inf
    eq_score = tl.max(best_eq, axis=0) + tl.log(kept.to(tl.float32) / tl.maximum(g_all, 1).to(tl.float32))
    gt_score = tl.max(best, axis=0)
    gt_i = tl.min(tl.where(best == gt_score, best_i, 2147483647), axis=0)
    eq_i = tl.min(tl.where(best_eq == tl.max(best_eq, axis=0), best_eq_i, 2147483647), axis=0)
    pick = tl.where((kept > 0) & (eq_score > gt_score), eq_i, gt_i)
    return pick, tl.sum(n_gt, axis=0) + kept, x_b


@triton.jit
def _sample_kernel(x_ptr, stride, V, t_ptr, p_ptr, k_ptr, seed_ptr, out_ptr, bound_ptr,
                   SHIFT: tl.constexpr, BLOCK: tl.constexpr, WAYS: tl.constexpr, CHUNK: tl.constexpr,
                   ROUNDS: tl.constexpr, BOUNDS: tl.constexpr, SKIP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(t_ptr + row)
    if SKIP > 0:  # the split path's rows (top_k <= SKIP) are _split_kernel's
        mine = ~_split_row(temp, tl.load(k_ptr + row), V, SKIP)
    else:
        mine = True
    if mine:
        _sample_row(x_ptr + row * stride, row, V, temp, p_ptr, k_ptr, seed_ptr, out_ptr, bound_ptr, SHIFT,
                    BLOCK, WAYS, CHUNK, ROUNDS, BOUNDS)


@triton.jit
def _sample_row(base, row, V, temp, p_ptr, k_ptr, seed_ptr, out_ptr, bound_ptr, SHIFT: tl.constexpr,
                BLOCK: tl.constexpr, WAYS: tl.constexpr, CHUNK: tl.constexpr, ROUNDS: tl.constexpr,
                BOUNDS: tl.constexpr):
    """Steps 1 to 4 for one row."""
    lanes = tl.arange(0, BLOCK)
    inv = 1.0 / tl.maximum(temp, 1e-5)
    # 1. max, its first index, min, sum of exp((x - max) * inv) per lane
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    arg = tl.full([BLOCK], 2147483647, tl.int32)
    xmin = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + lanes
        x = _logits(base, offs, V)
        # one exp a logit: e^-|x - m| / T is the old sum's factor (x > m: a new max) or the new term (else)
        up = x > m
        arg = tl.where(up, offs, arg)
        d = tl.exp(-tl.abs(x - m) * inv)
        m_new = tl.maximum(m, x)  # a lane that has seen nothing finite adds nothing (no -inf - -inf):
        s = tl.where(m_new > float("-inf"), tl.where(up, s * d + 1.0, s + d), 0.0)
        m = m_new
        xmin = tl.minimum(xmin, tl.where(offs < V, x, float("inf")))
    xmax = tl.max(m, axis=0)
    first = tl.min(tl.where(m == xmax, arg, 2147483647), axis=0)
    if temp <= 0:  # greedy: the first index of the max, as torch.argmax
        tl.store(out_ptr + row, first.to(tl.int64))
        if BOUNDS:
            tl.store(bound_ptr + row * 3, 1.0)
            tl.store(bound_ptr + row * 3 + 1, xmax)
            tl.store(bound_ptr + row * 3 + 2, 0.0)
    else:
        lane_mass = tl.where(m > float("-inf"), s * tl.exp((m - xmax) * inv), 0.0)
        norm = tl.sum(lane_mass, axis=0)
        kmax = _key(xmax, SHIFT).to(tl.int64)
        lo = _key(tl.min(xmin, axis=0), SHIFT).to(tl.int64)
        top_k = tl.load(k_ptr + row)
        top_p = tl.load(p_ptr + row)
        seed = tl.load(seed_ptr + row)
        # 2. top-k: b = the k-th largest key; `tied` of the tokens at b are in the top-k
        b = lo - 1  # no top-k: every key is above b
        tied = tl.zeros([], tl.int32)
        # the proposal: the logits > xp, and those == xp weighted w_eq each
        xp = tl.full([], float("-inf"), tl.float32)
        w_eq = tl.zeros([], tl.float32)
        if (top_k > 0) & (top_k < V):
            b = _search(base, V, lo, kmax, xmax, inv, (top_k - 1).to(tl.float32), False, SHIFT, BLOCK, WAYS)
            xp = _unkey(b, SHIFT)
            n_l, mass_l, g_l = _above(base, V, xp, xmax, inv, BLOCK)
            tied = (top_k - tl.sum(n_l, axis=0)).to(tl.int32)
            e_b = tl.exp((xp - xmax) * inv)
            norm = tl.sum(mass_l, axis=0) + tied * e_b
            w_eq = tied / tl.sum(g_l, axis=0).to(tl.float32)
            lane_mass = mass_l + (w_eq * e_b) * g_l.to(tl.float32)
            lo = b
        # 3. rejection: the proposal (xp, w_eq, lane_mass) always holds the kept set
        limit = top_p * norm
        exact = top_p >= 1  # the proposal is the kept set
        n_eq = tied  # tokens at xp in the proposal
        done = tl.full([], 0, tl.int1)
        rounds = tl.zeros([], tl.int32)
        tok = first
        if ROUNDS > 0:  # NOTE: Triton 3.6 fails to compile a while loop whose bound is the constant 0 (sm_90)
            while (rounds < ROUNDS) & ~done:
                u = tl.rand(seed, V + 2 * rounds)
                tok = _draw(base, V, lane_mass, xp, w_eq, xmax, inv, u, BLOCK, CHUNK)
                if exact:
                    done = exact
                else:
                    x_t = tl.load(base + tok).to(tl.float32) + 0.0
                    _, mass_l, g_l = _above(base, V, x_t, xmax, inv, BLOCK)
                    above = tl.sum(mass_l, axis=0)
                    g = tl.sum(g_l, axis=0)
                    e_t = tl.exp((x_t - xmax) * inv)
                    group = tl.where(x_t == xp, n_eq, g)
                    kept = tl.minimum(group, tl.floor((limit - above) / e_t).to(tl.int32) + 1)
                    kept = tl.where(above <= limit, kept, 0)
                    done = tl.rand(seed, V + 2 * rounds + 1) * group.to(tl.float32) < kept.to(tl.float32)
                    # rejected: the kept set lies at or above x_t, its group there cut at `kept` (0: none)
                    xp = x_t
                    n_eq = kept
                    w_eq = kept / g.to(tl.float32)
                    lane_mass = mass_l + (w_eq * e_t) * g_l.to(tl.float32)
                    exact = kept > 0
                rounds += 1
        if BOUNDS:
            pick, n_kept, x_b = _exact(base, V, lo, kmax, b, tied, norm, top_p, xmax, inv, seed, SHIFT, BLOCK,
                                       WAYS)
            tl.store(bound_ptr + row * 3, n_kept.to(tl.float32))
            tl.store(bound_ptr + row * 3 + 1, x_b)
            tl.store(bound_ptr + row * 3 + 2, (rounds + (~done).to(tl.int32)).to(tl.float32))
            tok = tl.where(done, tok, pick)
        else:
            if ~done:
                tok, _, _ = _exact(base, V, lo, kmax, b, tied, norm, top_p, xmax, inv, seed, SHIFT, BLOCK,
                                   WAYS)
        tl.store(out_ptr + row, tok.to(tl.int64))


# ---------------------------------------------------------------- the split path: 0 < top_k <= K_MAX
@triton.jit
def _split_row(temp, top_k, V, K: tl.constexpr):
    """Whether a row takes the split path: sampled (T > 0) with 0 < top_k <= K (and top_k < V: a top-k)."""
    return (temp > 0) & (top_k > 0) & (top_k <= K) & (top_k < V)


@triton.jit
def _pack(key, local, LB: tl.constexpr, SPAN: tl.constexpr, WIDE: tl.constexpr):
    """A chunk's keys made distinct: the value's key, then LB bits of SPAN - 1 - (index in the chunk), so that
    ties order the lower index first. int32 where the key leaves LB bits free (bf16, fp16), else int64."""
    if WIDE:
        packed = (key.to(tl.int64) << LB) | (SPAN - 1 - local).to(tl.int64)
    else:
        packed = (key << LB) | (SPAN - 1 - local)
    return packed


@triton.jit
def _packed(base, lo, start, local, V, SHIFT: tl.constexpr, LB: tl.constexpr, SPAN: tl.constexpr,
            WIDE: tl.constexpr):
    """The packed keys of the chunk's tokens start + local (any shape; padding past V: below -inf)."""
    offs = lo + start + local
    key = tl.where(offs < V, _key(_logits(base, offs, V), SHIFT), -(1 << (31 - SHIFT)))
    return _pack(key, start + local, LB, SPAN, WIDE)


@triton.jit
def _compact(base, ws, lo, V, bound, r, SHIFT: tl.constexpr, K: tl.constexpr, SPAN: tl.constexpr,
             SLOT: tl.constexpr, STEP: tl.constexpr, LB: tl.constexpr, WIDE: tl.constexpr):
    """The chunk's keys >= bound, numbered in index order: those numbered [r, r + SLOT - K) stored into the
    slot after its first K; their count."""
    lanes = tl.arange(0, STEP)
    count = tl.zeros([], tl.int32)
    for start in range(0, SPAN, STEP):
        packed = _packed(base, lo, start, lanes, V, SHIFT, LB, SPAN, WIDE)
        cand = packed >= bound
        pos = count + tl.cumsum(cand.to(tl.int32), axis=0) - 1
        tl.store(ws + K + pos - r, packed.to(tl.int64), mask=cand & (pos >= r) & (pos < r + SLOT - K))
        count += tl.sum(cand.to(tl.int32), axis=0)
    return count


@triton.jit
def _chunk_top(base, ws, lo, V, SHIFT: tl.constexpr, K: tl.constexpr, G: tl.constexpr, SPAN: tl.constexpr,
               SLOT: tl.constexpr, STEP: tl.constexpr, LB: tl.constexpr, WIDE: tl.constexpr,
               PMIN: tl.constexpr):
    """The K largest packed keys of the logits [lo, lo + SPAN) (padding past V: below -inf), descending.
    Groups: token i of the chunk is in group i % G. The K-th largest of the G group maxima, `bound`, has K
    distinct keys at or above it, so the chunk's top K lie at or above it too, and few others do (iid
    logits: about G ln 2). Two passes over the chunk, STEP tokens at a time (the second from L1/L2): the
    group maxima, then the keys >= bound compacted into the program's workspace slot (SLOT int64 keys)
    beside the K best so far, SLOT - K at a time (one round but for adversarial rows), tl.topk keeping the K
    best of the slot."""
    if WIDE:
        groups = tl.full([G], PMIN, tl.int64)
    else:
        groups = tl.full([G], PMIN, tl.int32)
    tile = tl.arange(0, STEP // G)[:, None] * G + tl.arange(0, G)[None, :]
    for start in range(0, SPAN, STEP):
        groups = tl.maximum(groups, tl.max(_packed(base, lo, start, tile, V, SHIFT, LB, SPAN, WIDE), axis=0))
    bound = tl.min(tl.topk(groups, K), axis=0)
    top = tl.full([K], PMIN, groups.dtype)
    slots = tl.arange(0, SLOT)
    r = tl.zeros([], tl.int32)
    count = tl.full([], 1, tl.int32)
    while r < count:
        tl.store(ws + tl.arange(0, K), top.to(tl.int64))
        count = _compact(base, ws, lo, V, bound, r, SHIFT, K, SPAN, SLOT, STEP, LB, WIDE)
        tl.debug_barrier()  # the slot written by every thread before any reads it
        buf = tl.load(ws + slots, mask=slots < K + count - r, other=PMIN).to(groups.dtype)
        top = tl.topk(buf, K)
        tl.debug_barrier()  # read by every thread before the next round writes it
        r += SLOT - K
    return top


@triton.jit
def _finish(base, ws, splits, V, temp, top_k, top_p, seed, K: tl.constexpr, SLOT: tl.constexpr,
            PARTS: tl.constexpr):
    """The row's last program: (token, tokens kept, the smallest kept logit). The splits' candidates (K
    int64 keys each: value key << 32 | 0xFFFFFFFF - index) merged by tl.topk into the row's top K, descending
    (ties: the lower index first); e = exp((x - max) / T) over the first top_k; kept while the mass before a
    token is <= top_p * (their sum) (the sampler's rule, in this order); one inverse-CDF draw over the kept
    tokens (Philox, the row's seed at offset V)."""
    part = tl.arange(0, PARTS)
    rank = tl.arange(0, K)
    cands = tl.load(ws + part[:, None] * SLOT + rank[None, :], mask=(part < splits)[:, None],
                    other=-9223372036854775808, cache_modifier=".cg")  # L2: other SMs wrote them
    top = tl.topk(tl.reshape(cands, [PARTS * K]), K)
    idx = (0xFFFFFFFF - (top & 0xFFFFFFFF)).to(tl.int32)
    in_k = rank < top_k
    x = tl.load(base + idx, mask=in_k, other=float("-inf")).to(tl.float32) + 0.0
    xmax = tl.max(x, axis=0)
    inv = 1.0 / tl.maximum(temp, 1e-5)
    # x == max: e = 1 (also a row of -inf: no -inf - -inf)
    e = tl.where(in_k, tl.exp(tl.where(x == xmax, 0.0, (x - xmax) * inv)), 0.0)
    before = tl.cumsum(e, axis=0) - e
    kept = in_k & (before <= tl.where(top_p < 1, top_p * tl.sum(e, axis=0), float("inf")))
    w = tl.where(kept, e, 0.0)
    target = tl.rand(seed, V) * tl.sum(w, axis=0)
    pick = tl.min(tl.where((tl.cumsum(w, axis=0) > target) & (w > 0), rank, K), axis=0)
    pick = tl.where(pick < K, pick, tl.max(tl.where(w > 0, rank, 0), axis=0))  # rounding: the last kept
    tok = tl.sum(tl.where(rank == pick, idx, 0), axis=0)
    return tok, tl.sum(kept.to(tl.int32), axis=0), tl.min(tl.where(kept, x, float("inf")), axis=0)


@triton.jit
def _split_kernel(x_ptr, stride, V, t_ptr, p_ptr, k_ptr, seed_ptr, out_ptr, bound_ptr, ws_ptr, count_ptr,
                  splits, SHIFT: tl.constexpr, K: tl.constexpr, G: tl.constexpr, SPAN: tl.constexpr,
                  SLOT: tl.constexpr, STEP: tl.constexpr, LB: tl.constexpr, WIDE: tl.constexpr,
                  PMIN: tl.constexpr, PARTS: tl.constexpr, BOUNDS: tl.constexpr):
    """Grid (rows, splits): program (row, part) takes the row's logits [part * SPAN, (part + 1) * SPAN) to
    its K best keys (`_chunk_top`) in its workspace slot; the row's last program (an atomic count, as
    triton_argmax; it sets the count back to zero) merges and draws (`_finish`). Rows off the split path
    return at once."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    temp = tl.load(t_ptr + row)
    top_k = tl.load(k_ptr + row)
    if _split_row(temp, top_k, V, K):
        base = x_ptr + row * stride
        lo = part * SPAN
        ws = ws_ptr + (row * splits + part) * SLOT
        top = _chunk_top(base, ws, lo, V, SHIFT, K, G, SPAN, SLOT, STEP, LB, WIDE, PMIN)
        index = lo + (SPAN - 1) - (top & (SPAN - 1)).to(tl.int32)
        tl.store(ws + tl.arange(0, K), ((top >> LB).to(tl.int64) << 32) | (0xFFFFFFFF - index.to(tl.int64)))
        tl.debug_barrier()  # every thread's candidates stored before the count's release
        done = tl.atomic_add(count_ptr + row, 1)  # NOTE: acq_rel, Triton's default
        if done == splits - 1:
            tl.store(count_ptr + row, 0)  # for the call's next launch (rows past SPLIT_ROWS)
            tok, n_kept, least = _finish(base, ws_ptr + row * splits * SLOT, splits, V, temp, top_k,
                                         tl.load(p_ptr + row), tl.load(seed_ptr + row), K, SLOT, PARTS)
            tl.store(out_ptr + row, tok.to(tl.int64))
            if BOUNDS:
                tl.store(bound_ptr + row * 3, n_kept.to(tl.float32))
                tl.store(bound_ptr + row * 3 + 1, least)
                tl.store(bound_ptr + row * 3 + 2, 1.0)  # one draw, no rejection


def splits_for(vocab: int) -> int:
    """Programs a row of the split path: chunks of SPAN logits."""
    return triton.cdiv(vocab, SPAN)


def workspace_bytes(rows: int, vocab: int) -> int:
    """The split path's workspace for `rows` rows: a slot of SLOT int64 keys per program, SPLIT_ROWS rows at a
    time (the arrival counts beside it: `row_counters`, 4 bytes a row)."""
    return 8 * min(rows, SPLIT_ROWS) * splits_for(vocab) * SLOT


def row_counters(rows: int, device: torch.device) -> torch.Tensor:
    """The split path's per-row arrival counts for one call: int32 zeros, SPLIT_ROWS at most (each row's last
    program sets its count back to zero, so the call's launches share them). Made by the call, like its
    workspace: a captured graph makes them in its pool, and no buffer outlives the call."""
    return torch.zeros(min(rows, SPLIT_ROWS), dtype=torch.int32, device=device)


def _launch_split(x, params, ws, counters, bounds: bool) -> None:
    """_split_kernel over x's rows, SPLIT_ROWS at a time (one workspace: the launches follow in the stream).
    params: temperatures, top_ps, top_ks, seeds, out, bounds (rows first)."""
    rows, vocab = x.shape
    splits = splits_for(vocab)
    lb = SPAN.bit_length() - 1
    wide = lb > SHIFT[x.dtype]
    for lo in range(0, rows, SPLIT_ROWS):
        hi = min(lo + SPLIT_ROWS, rows)
        _split_kernel[(hi - lo, splits)](
            x[lo:hi], x.stride(0), vocab, *(t[lo:hi] for t in params), ws, counters, splits,
            SHIFT=SHIFT[x.dtype], K=K_MAX, G=2 * K_MAX, SPAN=SPAN, SLOT=SLOT, STEP=min(STEP, SPAN), LB=lb,
            WIDE=wide, PMIN=-2**63 if wide else -2**31, PARTS=triton.next_power_of_2(splits), BOUNDS=bounds,
            num_warps=SPLIT_WARPS)


def sample_batch(x: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor,
                 seeds: torch.Tensor, bounds: bool = False, split: str = "some"):
    """Token ids [rows] int64 for logits x [rows, vocab] (unit stride in vocab; bf16, fp16 or fp32) with
    per-row temperature (0: greedy), top_p (>= 1: off), top_k int64 (<= 0 or >= vocab: off) and Philox seed
    (int64). bounds: also [rows, 3] fp32 (tokens kept, the smallest kept logit, by step 4's search; the
    rejection rounds taken, ROUNDS + 1 where the fallback drew; the split path: its own, 1 round) for tests
    and the benchmark. split, as the host knows the batch (engine.sampling decides it from the parameters):
    "some" (rows with 0 < top_k <= K_MAX may be there: _split_kernel takes them, _sample_kernel the others),
    "all" (every row is one: _split_kernel alone), "none" (none is: _sample_kernel alone), "reserve" (none
    is, but a row has a larger top-k: as "none", and the split path's workspace allocated and its kernel
    launched, every row returning at once, so that the profiler's stress, whose rows have top_k
    PREFILTER + 1, measures the workspace and compiles the kernel before a request needs it)."""
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    kept = torch.empty(rows, 3, dtype=torch.float32, device=x.device) if bounds else out
    if rows:
        assert x.stride(-1) == 1 and x.dtype in SHIFT, (x.stride(), x.dtype)
        assert split in ("some", "all", "none", "reserve"), split
        params = (temperatures.float().contiguous(), top_ps.float().contiguous(), top_ks.long().contiguous(),
                  seeds.contiguous(), out, kept)
        if split != "none":
            ws = torch.empty(workspace_bytes(rows, vocab) // 8, dtype=torch.int64, device=x.device)
            _launch_split(x, params, ws, row_counters(rows, x.device), bounds)  # "reserve": rows return
        if split != "all":
            _sample_kernel[(rows,)](
                x, x.stride(0), vocab, *params, SHIFT=SHIFT[x.dtype], BLOCK=BLOCK, WAYS=WAYS, CHUNK=CHUNK,
                ROUNDS=ROUNDS, BOUNDS=bounds, SKIP=K_MAX if split == "some" else 0, num_warps=NUM_WARPS)
    return (out, kept) if bounds else out
