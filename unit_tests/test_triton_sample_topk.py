"""The one-kernel sampler's split path (triton_sample._split_kernel: rows with 0 < top_k <= K_MAX, several
programs a row in one launch) on the CPU through Triton's interpreter, in a subprocess (float16 and float32:
the interpreter has no bfloat16; bf16 on the GPU, tests/test_sampling_gpu.py). Most cases shrink the path
(K_MAX 8, chunks of 32 to 64 logits) so that a row has many chunks and the interpreter stays quick; one runs
the shipped K_MAX at its boundary. The declared workspace and the host's choice of path need no kernel."""
from __future__ import annotations

import importlib.util

import pytest

from autoprofile.engine.sampling import FUSED_ROWS, SamplingParams, _split_mode, fused_bytes_per_row
from unit_tests.interpreter import run_script

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

COMMON = r'''
import sys
import torch
from autoprofile.kernels import triton_sample as ts
from autoprofile.engine.sampling import SamplingBatch, SamplingParams
P = SamplingParams

def small():
    """The split path shrunk: top_k <= 8, groups of 16, chunks of 64 logits in steps of 32, slots of 32."""
    ts.K_MAX, ts.SPAN, ts.STEP, ts.SLOT = 8, 64, 32, 32

def run(x, params, seeds=None, split="some", bounds=True):
    b = SamplingBatch.from_params(params, torch.device("cpu"))
    seeds = torch.arange(len(params)) * 7919 + 1 if seeds is None else seeds
    return ts.sample_batch(x, b.temperatures, b.top_ps, b.top_ks, seeds, bounds=bounds, split=split)

def order(row):
    """Token ids by descending logit, ties by ascending index (the split path's order)."""
    return sorted(range(len(row)), key=lambda i: (-float(row[i]), i))

def rule(row, p):
    """(kept count, smallest kept logit, kept ids) by the sampler's rule in fp64, ties kept lowest index
    first."""
    ids = order(row)
    k = p.top_k if 0 < p.top_k < len(row) else len(row)
    v = row.double()[ids[:k]]
    probs = (v / max(p.temperature, 1e-5)).softmax(-1)
    before = probs.cumsum(-1) - probs
    n = int((before <= p.top_p).sum()) if p.top_p < 1 else k
    return n, float(v[n - 1]), set(ids[:n])

def check(x, params, tok, got, split_rows):
    """Every split row against `rule`: its count, its boundary logit, its draw among the kept ids (the
    lowest-indexed of a tie group); one round. Other rows: the one-program kernel's (its own tests)."""
    for i, p in enumerate(params):
        if i not in split_rows:
            continue
        n, least, kept = rule(x[i].float(), p)
        assert int(got[i, 0]) == n and float(got[i, 1]) == least and got[i, 2] == 1, (i, p, got[i], n, least)
        assert int(tok[i]) in kept, (i, p, int(tok[i]), sorted(kept))
'''

KEPT = COMMON + r'''
# a mixed batch over rows of a wider buffer: greedy, top-p alone, temperature alone, small top-k (1, 2, 5,
# K_MAX) with and without top-p, k just above K_MAX and a large k (the one-program kernel's rows)
small()
params = [P(temperature=t, top_p=p, top_k=k) for t in (0.5, 1.0, 2.0) for p in (1.0, 0.917, 0.3)
          for k in (1, 2, 5, 8)]
params += [P(), P(temperature=1.0, top_p=0.9), P(temperature=0.7), P(temperature=1.0, top_k=9),
           P(temperature=1.0, top_k=9, top_p=0.8), P(temperature=1.0, top_k=200)]
vocab = 300  # 5 chunks, the last one partial
split_rows = {i for i, p in enumerate(params) if 0 < p.top_k <= ts.K_MAX and p.temperature > 0}
for dtype, scale in ((torch.float16, 3.0), (torch.float32, 1.0)):
    torch.manual_seed(0)
    wide = (torch.randn(len(params), vocab + 30) * scale).to(dtype)
    x = wide[:, 7:vocab + 7]  # rows of a wider buffer
    x[::2, 40:52] = x[::2].max(dim=1, keepdim=True).values - 0.5  # a tie group at the boundary, across chunks
    x[1::2, 100:160] = x[1::2].max(dim=1, keepdim=True).values  # ties at the max, over chunks
    x[::3, 200:290] = float("-inf")  # masked logits
    x[5, :] = float("-inf")  # a row of -inf (top_k 2 of it: the first two, each alike)
    x[7, 3:] = float("-inf")  # 3 finite logits, top_k 8: -inf ones kept, never drawn
    tok, got = run(x, params)
    check(x, params, tok, got, split_rows - {5})
    assert int(tok[5]) in (0, 1) and int(tok[7]) < 3, (tok[5], tok[7])
    # routing: the split rows as a batch of their own (split "all"), the others through the one-program kernel
    rows = sorted(split_rows)
    alone = run(x[rows], [params[i] for i in rows], (torch.arange(len(params)) * 7919 + 1)[rows], "all")[0]
    assert torch.equal(alone, tok[rows]), (alone, tok[rows])
    rest = [i for i in range(len(params)) if i not in split_rows]
    none = run(x[rest], [params[i] for i in rest], (torch.arange(len(params)) * 7919 + 1)[rest], "none")
    assert torch.equal(none[0], tok[rest]) and torch.equal(none[1], got[rest]), (none, tok[rest])
    assert int(tok[len(params) - 6]) == int(x[len(params) - 6].float().argmax())  # greedy: the first max
print("ok")
'''

SHIPPED = COMMON + r'''
# the shipped K_MAX at its boundary: k = 1, K_MAX - 1, K_MAX (split) and K_MAX + 1 (the one-program kernel),
# over chunks of 1,024 logits; ties at b_k for every k
torch.manual_seed(1)
K = ts.K_MAX
ts.SPAN = 1024
vocab = 2500
x = (torch.rand(8, vocab) * 2).half()
x[:, 1000:1200] = 3.0  # 200 ties above the rest: at b_k of every k in 2..K_MAX + 1
x[:, 100] = 4.0
x[1::2, 1990:2010] = 3.0
params = [P(temperature=1.0, top_k=k, top_p=p) for k in (1, K - 1, K, K + 1) for p in (1.0, 0.917)]
tok, got = run(x, params)
check(x, params, tok, got, {i for i, p in enumerate(params) if p.top_k <= K})
for i, p in enumerate(params):  # the one-program kernel's rows: the same count and boundary by its rule
    if p.top_k > K:
        assert int(got[i, 0]) == rule(x[i].float(), p)[0] and float(got[i, 1]) == 3.0, (p, got[i])
print("ok")
'''

ROUNDS = COMMON + r'''
# adversarial chunks: the top logits sit in two of a chunk's 16 groups, so more keys than a slot's
# SLOT - K_MAX are at or above the bound: compaction takes several rounds. The bound is mirrored here.
small()
ts.SPAN, ts.STEP = 256, 64
vocab = 700
torch.manual_seed(2)
idx = torch.arange(vocab)
x = torch.where(idx % 16 < 2, 10 + torch.rand(vocab), torch.rand(vocab)).repeat(4, 1).contiguous()
x[1] = x[1].flip(0)
x[2] = torch.where(idx % 16 == 15, x[2] + 20, x[2])
def candidates(row, lo):
    chunk = row[lo:lo + ts.SPAN]
    groups = [chunk[g::2 * ts.K_MAX] for g in range(2 * ts.K_MAX)]
    bound = sorted((float(g.max()) for g in groups if len(g)), reverse=True)[ts.K_MAX - 1]
    return int((chunk >= bound).sum())
assert candidates(x[0], 0) > ts.SLOT - ts.K_MAX, candidates(x[0], 0)
params = [P(temperature=1.0, top_k=k, top_p=p) for k, p in ((8, 1.0), (5, 0.917), (8, 0.5), (3, 1.0))]
for dtype in (torch.float32, torch.float16):
    y = x.to(dtype)
    tok, got = run(y, params)
    check(y, params, tok, got, set(range(4)))
print("ok")
'''

DRAWS = COMMON + r'''
# 24 tokens, one chunk: 2.0 once, eight at 1.0 (a tie group that top-k and top-p cut), 0.5 twice, 0.0 thrice,
# -1.0 four times, six masked, shuffled. Per token (the kept ties: the lowest-indexed) against the rule's
# probabilities, Pearson's chi-square; dropping the temperature or the top-p cut, or keeping the other ties,
# fails it.
small()
ts.SPAN, ts.STEP = 32, 32
values = [2.0] + [1.0] * 8 + [0.5] * 2 + [0.0] * 3 + [-1.0] * 4 + [float("-inf")] * 6
logits = torch.tensor(values)[torch.randperm(24, generator=torch.Generator().manual_seed(3))].half()

def expected(p):
    ids = order(logits.float())
    n = rule(logits.float(), p)[0]
    want = torch.zeros(24, dtype=torch.float64)
    z = logits.double()[ids[:n]] / p.temperature
    want[ids[:n]] = z.softmax(-1)
    return want

from unit_tests.draw_stats import chi2_ok

cases = [P(temperature=0.25, top_k=7), P(temperature=1.0, top_k=7, top_p=0.6),
         P(temperature=2.0, top_k=8, top_p=0.9)]
n = 200
params = [p for p in cases for _ in range(n)]
seeds = torch.arange(len(params)) * 104729 + 17
tok = run(logits.expand(len(params), -1).contiguous(), params, seeds, "all", bounds=False)
for i, p in enumerate(cases):
    counts = torch.bincount(tok[i * n:(i + 1) * n], minlength=24).double()
    assert chi2_ok(counts, expected(p), n), (p, counts.tolist(), (expected(p) * n).tolist())
# the checks can fail: T = 1 in place of 0.25, top-p dropped (the highest-indexed ties: outside the support)
assert not chi2_ok(torch.bincount(tok[:n], minlength=24).double(), expected(P(temperature=1.0, top_k=7)), n)
counts = torch.bincount(tok[n:2 * n], minlength=24).double()
assert not chi2_ok(counts, expected(P(temperature=1.0, top_k=7)), n)
# a row's token: its logits, parameters and seed only (alone, repeated, in a mixed batch, a wider vocabulary
# of more chunks), and the same again on the same counters and a fresh workspace
mixed = [P(temperature=1.0, top_k=7, top_p=0.6), P(), P(temperature=0.8, top_p=0.9),
         P(temperature=2.0, top_k=3), P(temperature=1.0, top_k=100)]
rows = torch.stack([logits, logits.flip(0), logits.roll(5), logits.roll(11), logits])
rows = torch.cat([rows, torch.full((5, 200), float("-inf"), dtype=rows.dtype)], dim=1)  # 7 chunks a row
some = run(rows, mixed, torch.tensor([11, 12, 13, 14, 15]), bounds=False)
for i in (0, 3):
    assert int(run(rows[i:i + 1], mixed[i:i + 1], torch.tensor([11 + i]), "all", False)) == int(some[i]), i
    same = run(rows[i:i + 1].expand(3, -1).contiguous(), mixed[i:i + 1] * 3, torch.tensor([11 + i] * 3),
               "all", False)
    assert (same == some[i]).all(), (i, same, some[i])
assert torch.equal(run(rows, mixed, torch.tensor([11, 12, 13, 14, 15]), bounds=False), some)
# rows past a launch's SPLIT_ROWS: a launch a row over one workspace and one set of counts (rows 0 and 3
# share count 0: each row's last program sets it back, or row 3 finishes early on row 0's candidates)
ts.SPLIT_ROWS = 1
assert torch.equal(run(rows, mixed, torch.tensor([11, 12, 13, 14, 15]), bounds=False), some)
print("ok")
'''


FAST = COMMON + r'''
# every CI run: six split rows of 300 fp32 logits (5 chunks), a tie group across chunks at b_k, top-p, T
small()
torch.manual_seed(2)
x = torch.randn(4, 300)
x[:, 40:52] = x.max(dim=1, keepdim=True).values - 0.5
params = [P(temperature=1.0, top_k=1), P(temperature=0.5, top_k=5, top_p=0.6), P(temperature=2.0, top_k=8),
          P(temperature=1.0, top_k=8, top_p=0.917), P(temperature=0.25, top_k=8, top_p=0.5),
          P(temperature=0.1, top_k=8, top_p=0.5)]
x = torch.cat([x, x[:2]])
tok, got = run(x, params, split="all")
check(x, params, tok, got, set(range(len(params))))
# the temperature decides the last two rows' counts: a kernel that dropped it would be caught
assert rule(x[4], params[4])[0] != rule(x[4], P(temperature=1.0, top_k=8, top_p=0.5))[0]
assert rule(x[5], params[5])[0] != rule(x[5], P(temperature=1.0, top_k=8, top_p=0.5))[0]
# each row's last program sets its count back to zero (a call's later launches reuse the counts)
b = SamplingBatch.from_params(params, torch.device("cpu"))
out, kept = torch.empty(len(params), dtype=torch.int64), torch.empty(len(params), 3)
counters = ts.row_counters(len(params), x.device)
ws = torch.empty(ts.workspace_bytes(len(params), x.shape[1]) // 8, dtype=torch.int64)
ts._launch_split(x, (b.temperatures.float(), b.top_ps.float(), b.top_ks, torch.arange(6), out, kept), ws,
                 counters, True)
assert not counters.any() and torch.equal(kept[:, 0], got[:, 0]), counters
# "reserve" (the stress: larger top-k rows only) launches the split kernel, every row returning at once
large = [P(temperature=1.0, top_k=100, top_p=0.9), P(temperature=0.7, top_k=9)]
reserve, none = run(x[:2], large, split="reserve"), run(x[:2], large, split="none")
assert all(torch.equal(a, b) for a, b in zip(reserve, none))
print("ok")
'''


@needs_triton
def test_split_rows_keep_the_rule_fast():
    """The split path's kept counts, boundary logits and draws against a full sort on a few small rows (the
    slow tests below cover the rest), fast enough for every CI run."""
    run_script(FAST)


@needs_triton
@pytest.mark.slow  # a minute on 2 cores (the interpreter)
def test_split_rows_keep_the_rule_in_a_mixed_batch():
    """fp16 and fp32 rows of a wider buffer, 5 chunks each: ties at the top-k and top-p boundaries and at
    the max, masked logits, a row of -inf, fewer finite logits than top_k; each split row's kept count and
    boundary logit against a full sort, its draw a kept token (ties: the lowest-indexed); the batch's
    greedy, top-p, temperature and top_k > K_MAX rows through the one-program kernel as they would be
    alone."""
    run_script(KEPT)


@needs_triton
@pytest.mark.slow  # a minute on 2 cores (the interpreter)
def test_split_path_at_the_shipped_k_max():
    """The shipped K_MAX: k = 1, K_MAX - 1 and K_MAX on the split path, K_MAX + 1 not, with and without top-p,
    200 ties at b_k spread over chunks."""
    run_script(SHIPPED)


@needs_triton
@pytest.mark.slow  # half a minute on 2 cores (the interpreter)
def test_split_path_compacts_adversarial_chunks_in_rounds():
    """Chunks whose top logits crowd two groups: more candidates than a slot holds (mirrored here), so the
    compaction takes rounds; the kept set still follows the rule (fp32: int64 keys; fp16: int32)."""
    run_script(ROUNDS)


@needs_triton
@pytest.mark.slow  # a minute on 2 cores (the interpreter)
def test_split_draws_follow_the_rule_and_seeds_fix_them():
    """600 draws against the rule's per-token probabilities (temperature 0.25; top-p cutting a tie group; T 2)
    by chi-square, and the same statistic rejecting T = 1 and a dropped top-p; a row's token is the same
    alone, repeated, in a mixed batch, called again, and over several launches."""
    run_script(DRAWS)


def test_the_host_picks_the_split_mode_from_the_parameters():
    k_max, vocab = 64, 1000
    g, small, large = SamplingParams(), SamplingParams(temperature=1.0, top_k=50), SamplingParams(
        temperature=1.0, top_k=65)
    top_p = SamplingParams(temperature=1.0, top_p=0.9)
    assert _split_mode(None, vocab, k_max) == "some"
    assert _split_mode((small, small), vocab, k_max) == "all"
    assert _split_mode((small, g), vocab, k_max) == _split_mode((small, large), vocab, k_max) == "some"
    assert _split_mode((large, top_p), vocab, k_max, stress=True) == "reserve"  # the workspace measured
    assert _split_mode((large, top_p), vocab, k_max) == "none"  # serving: no launch for rows that skip it
    assert _split_mode((g, top_p), vocab, k_max) == "none"
    assert _split_mode((SamplingParams(top_k=5),), vocab, k_max) == "none"  # greedy with a top_k
    assert _split_mode((SamplingParams(temperature=1.0, top_k=30),), 30, k_max) == "none"  # top_k >= vocab
    assert _split_mode((SamplingParams(temperature=1.0, top_k=29),), 30, k_max) == "all"


@needs_triton
def test_the_declared_bytes_bound_the_split_workspace():
    from autoprofile.kernels import triton_sample as ts
    assert ts.SPLIT_ROWS == FUSED_ROWS
    for vocab in (24, 8191, 8192, 8193, 32000, 128256, 151936, 262144):
        for rows in (1, 7, 256, FUSED_ROWS, 4096):
            assert ts.workspace_bytes(rows, vocab) <= min(rows, FUSED_ROWS) * fused_bytes_per_row(vocab), (
                vocab, rows)
