"""The one-kernel sampler (triton_sample._sample_kernel, one program a row: split "none", every top-k row
included) on the CPU through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the flag is read when
the kernel module is imported). The interpreter has no bfloat16: float16 and float32 here; bf16 on the GPU
(tests/test_sampling_gpu.py, which also runs it through sample()). Its split path (rows with top_k <= K_MAX
in sample()): test_triton_sample_topk.py."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

COMMON = r'''
import math
import torch
from autoprofile.kernels import triton_sample as ts
from autoprofile.engine.sampling import SamplingBatch, SamplingParams

def run(x, params, seeds=None, bounds=False):
    b = SamplingBatch.from_params(params, torch.device("cpu"))
    seeds = torch.arange(len(params)) * 7919 + 1 if seeds is None else seeds
    return ts.sample_batch(x, b.temperatures, b.top_ps, b.top_ks, seeds, bounds=bounds, split="none")

def rule(x, params):
    """(kept count, smallest kept logit) per row by the sampler's rule, through a full sort in fp64."""
    ns, least = [], []
    for row, p in zip(x.double(), params):
        v = row.sort(descending=True).values
        k = p.top_k if 0 < p.top_k < len(v) else len(v)
        probs = (v[:k] / max(p.temperature, 1e-5)).softmax(-1)
        before = probs.cumsum(-1) - probs
        n = int((before <= p.top_p).sum()) if p.top_p < 1 else k
        ns.append(n)
        least.append(float(v[n - 1]))
    return ns, least
'''

BOUNDS = COMMON + r'''
torch.manual_seed(0)
params = [SamplingParams(temperature=t, top_p=p, top_k=k) for t in (0.5, 1.0, 2.0)
          for p in (1.0, 0.95, 0.6, 0.1) for k in (0, 1, 7, 300)] + [SamplingParams()] * 3
for ts.BLOCK, dtype, vocab, scale in [(4096, torch.float32, 3000, 1.0), (4096, torch.float16, 2500, 4.0),
                                      (4096, torch.float32, 700, 12.0), (1024, torch.float32, 3000, 1.0)]:
    wide = (torch.randn(len(params), vocab + 40) * scale).to(dtype)
    x = wide[:, 3:vocab + 3]  # rows of a wider buffer
    x[:, 10:30] = x[:, 9:10]  # a tie group at the top-k/top-p boundary of some rows
    x[::5, 100:130] = float("-inf")  # masked logits
    x[1, 200:206] = x[1].max()  # ties at the max of a sampled row
    x[-3, [40, 41, vocab - 1]] = x[-3].max() + 1  # ties at the max of greedy rows, greedy takes the first:
    x[-2, [7, 600]] = x[-2].max() + 1  # across lanes (and blocks, above),
    x[-1, [i for i in (5, 5 + ts.BLOCK, 5 + 2 * ts.BLOCK) if i < vocab]] = x[-1].max() + 1  # in one lane
    firsts = {len(params) - 3: 40, len(params) - 2: 7, len(params) - 1: 5}
    tok, got = run(x, params, bounds=True)
    ns, least = rule(x.float(), params)
    for i, p in enumerate(params):
        if p.temperature == 0:
            assert tok[i] == x[i].float().argmax() == firsts[i] and got[i, 0] == 1, (i, tok[i])
            continue
        n = int(got[i, 0])
        assert n == ns[i], (dtype, i, p, n, ns[i])
        cut = n < vocab
        assert (float(got[i, 1]) == least[i]) if cut else got[i, 1] == float("-inf"), (i, p, got[i], least[i])
        assert x[i, tok[i]].float() >= least[i], (i, p)  # the draw is a kept token
print("ok")
'''

TOP_K = COMMON + r'''
# top-k's radix select: the kept count and the smallest kept logit against a full sort, at its corners
torch.manual_seed(1)
V = 600
rows = torch.randn(8, V) * 3
rows[0, :250] = 1.5  # many ties exactly at b_k, positive
rows[1, 100:400] = -2.25  # and negative
rows[2, 40:] = float("-inf")  # 40 finite logits: k beyond them keeps -inf ones (b_k = -inf)
rows[3] = -rows[3].abs() - 1  # all negative
rows[4] = rows[4].abs() + 1  # all positive
rows[5] = torch.where(torch.rand(V) < 0.5, -0.0, 0.0)  # -0.0 and 0.0: one tie group
rows[5, :5] = -1.0
rows[6, ::3] = -0.0
rows[6, 1::3] = 0.0
rows[7, 0] = float("-inf")  # one masked logit: k = V - 1 keeps every finite one
for ts.BLOCK, dtype in [(256, torch.float16), (256, torch.float32), (1024, torch.float32),
                        (128, torch.float16)]:
    x = rows.to(dtype)
    for k in (1, 2, 39, 40, 41, 249, 250, 251, 300, 500, V - 1):
        # top_p * k off the integers: no tie group cut exactly at a boundary (fp32 vs fp64 rounding)
        for top_p in (1.0, 0.917):
            params = [SamplingParams(temperature=1.0, top_p=top_p, top_k=k)] * len(x)
            tok, got = run(x, params, bounds=True)
            ns, least = rule(x.float(), params)
            assert got[:, 0].tolist() == ns, (dtype, ts.BLOCK, k, top_p, got[:, 0].tolist(), ns)
            assert got[:, 1].tolist() == least, (dtype, ts.BLOCK, k, top_p, got[:, 1].tolist(), least)
            assert (x.float().gather(1, tok[:, None])[:, 0] >= torch.tensor(least)).all(), (dtype, k, top_p)
print("ok")
'''

DRAWS = COMMON + r'''
ts.BLOCK = 8  # two blocks per row (the interpreter takes ~40 ms a row: few draws here, many on the GPU)
# 12 tokens: 3.0, 2.0, four at 1.0, six at 0.0. top_k 3 keeps 3.0, 2.0 and one of the four 1.0s;
# top_p 0.8 at T=1 keeps 3.0 and 2.0 (mass 0.66 before the 1.0s), then 1.0s while the mass before <= 0.8.
logits = torch.tensor([0.0, 3.0, 1.0, 0.0, 2.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float16)
VALUES = (3.0, 2.0, 1.0, 0.0)
def expected(params):
    v, order = logits.float().sort(descending=True)
    k = params.top_k if params.top_k else len(v)
    probs = (v[:k] / params.temperature).softmax(-1)
    before = probs.cumsum(-1) - probs
    n = int((before <= params.top_p).sum())
    return {value: float(probs[:n][v[:n] == value].sum() / probs[:n].sum()) for value in VALUES}
for params, rows in [(SamplingParams(temperature=1.0, top_k=3), 400),
                     (SamplingParams(temperature=1.0, top_p=0.8), 150)]:
    tok = run(logits.expand(rows, -1).contiguous(), [params] * rows)
    drawn = logits[tok].float()
    # by logit value: which tied tokens are kept is unspecified, their total is not
    got, want = {v: float((drawn == v).float().mean()) for v in VALUES}, expected(params)
    for v in VALUES:  # 4.5 standard deviations; a class of probability 0 never drawn
        sd = (want[v] * (1 - want[v]) / rows) ** 0.5
        assert abs(got[v] - want[v]) <= 4.5 * sd, (params, got, want)
    ones = torch.bincount(tok, minlength=12)[logits == 1.0].float()
    # tied tokens alike (chi2, 3 degrees of freedom)
    assert float(((ones - ones.mean()) ** 2 / ones.mean()).sum()) < 16.3, ones
# keeping the whole tie group (top_k 6) would be the wrong distribution: 4.5 sd of either side apart
right = expected(SamplingParams(temperature=1.0, top_k=3))[1.0]
wrong = expected(SamplingParams(temperature=1.0, top_k=6))[1.0]
assert wrong - right > 4.5 * ((right * (1 - right) / 400) ** 0.5 + (wrong * (1 - wrong) / 400) ** 0.5)
ts.BLOCK = 1024
# seeds: the same seed, the same token, whatever else is in the batch
x = torch.randn(6, 500)
params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=k) for k in (0, 50, 3, 0, 0, 9)]
seeds = torch.tensor([5, 6, 7, 8, 9, 10])
batch = run(x, params, seeds)
assert all(int(run(x[i:i + 1], params[i:i + 1], seeds[i:i + 1])) == int(batch[i]) for i in range(6))
assert not torch.equal(run(x, params, seeds + 1000), batch)
print("ok")
'''

DIST = COMMON + r"""
import sys
from autoprofile.engine.sampling import top_k_top_p_probs
ts.BLOCK, ts.CHUNK = 8, 2  # 24 tokens: 8 lanes of 3, a lane's walk in two chunks
# 2.0 once, eight at 1.0 (a tie group that top-p and top-k cut), 0.5 twice, 0.0 thrice, -1.0 four times,
# six masked, scattered over the lanes
values = [2.0] + [1.0] * 8 + [0.5] * 2 + [0.0] * 3 + [-1.0] * 4 + [float("-inf")] * 6
logits = torch.tensor(values)[torch.randperm(24, generator=torch.Generator().manual_seed(3))].half()
F = float("inf")

def expected(p):
    # the reference's probabilities, each logit value's spread over its tokens (which ties are kept is
    # unspecified; the sampler draws the boundary group's tokens alike)
    probs, ids = top_k_top_p_probs(logits[None].float(), SamplingBatch.from_params([p], torch.device("cpu")))
    want = torch.zeros(24, dtype=torch.float64).scatter_(0, ids[0], probs[0].double())
    want /= want.sum()
    for v in logits.unique():
        at = logits == v
        want[at] = want[at].sum() / at.sum()
    return want

from unit_tests.draw_stats import chi2_ok

def check(cases, n, rounds_col=None):
    params = [p for p in cases for _ in range(n)]
    x = logits.expand(len(params), -1).contiguous()
    seeds = torch.arange(len(params)) * 104729 + 17
    tok, got = run(x, params, seeds, bounds=True) if rounds_col else (run(x, params, seeds), None)
    for i, p in enumerate(cases):
        counts = torch.bincount(tok[i * n:(i + 1) * n], minlength=24).double()
        assert chi2_ok(counts, expected(p), n), (p, counts.tolist(), (expected(p) * n).tolist())
    return got

P = SamplingParams
group = sys.argv[1]
if group == "sharp":  # the tie group at the boundary decides most of the mass
    check([P(temperature=1.0, top_p=0.3), P(temperature=1.0, top_k=2), P(temperature=2.0, top_k=7, top_p=0.6),
           P(temperature=1.0, top_p=0.6)], 300)
elif group == "grid":
    check([P(temperature=t, top_p=p, top_k=k) for t, p, k in [
        (0.5, 0.1, 0), (0.5, 0.95, 0), (0.5, 1.0, 7), (1.0, 1.0, 1), (1.0, 0.6, 7), (1.0, 1.0, 0),
        (1.0, 0.95, 0), (2.0, 0.95, 0), (2.0, 1.0, 7), (2.0, 0.1, 7), (2.0, 1.0, 0)]], 150)
elif group == "fallback":  # no rounds: every row takes step 4; one round: a mix of both
    cases = [P(temperature=1.0, top_p=0.3), P(temperature=1.0, top_k=2),
             P(temperature=2.0, top_k=7, top_p=0.6)]
    ts.ROUNDS = 0
    got = check(cases, 150, rounds_col=True)
    assert (got[:, 2] == 1).all()
    ts.ROUNDS = 1
    got = check(cases, 150, rounds_col=True)
    assert (got[:, 2] == 2).any() and (got[:, 2] == 1).any(), got[:, 2]
# a row's token: its logits, parameters and seed only, whatever else is in the batch
ts.ROUNDS = 32
mixed = [P(temperature=t, top_p=p, top_k=k) for t, p, k in [(1.0, 0.3, 0), (2.0, 0.6, 7), (0.5, 1.0, 0),
                                                            (0.0, 1.0, 0), (1.0, 0.95, 2)]]
rows = torch.stack([logits, logits.flip(0), logits.roll(5), logits, logits.roll(11)])
seeds = torch.tensor([11, 12, 13, 14, 15])
batch = run(rows, mixed, seeds)
for i in range(5):
    assert int(run(rows[i:i + 1], mixed[i:i + 1], seeds[i:i + 1])) == int(batch[i]), i
    same = run(rows[i:i + 1].expand(3, -1).contiguous(), mixed[i:i + 1] * 3, seeds[i:i + 1].repeat(3))
    assert int(same[2]) == int(batch[i]), i
print("ok")
"""


def _interpret(code: str, *args: str) -> None:
    run_script(code, *args)


@pytest.mark.slow  # minutes on 2 cores (the interpreter or a crowd); the slow run has it
def test_kept_count_and_boundary_follow_the_sampler_rule():
    """Against a full fp64 sort: top-k, top-p and both, ties at the boundary, masked logits, rows of a wider
    buffer, greedy rows (the first index of a tied max, across lanes, blocks and within a lane); every draw a
    kept token."""
    _interpret(BOUNDS)


@pytest.mark.slow  # minutes on 2 cores (the interpreter or a crowd); the slow run has it
def test_top_k_threshold_at_its_corners():
    """Top-k's radix select against a full sort: many ties at b_k (positive and negative), k beyond the
    finite logits (masked rows, b_k = -inf), k = 1 and V - 1, all-negative and all-positive rows, -0.0 and
    0.0 as one tie group; fp16 (3 digit passes) and fp32 (4), several BLOCKs; with and without top-p."""
    _interpret(TOP_K)


@pytest.mark.slow  # minutes on 2 cores (the interpreter or a crowd); the slow run has it
def test_draws_follow_the_distribution_and_seeds_fix_them():
    """Draws against the exact kept distribution, per logit value (tied tokens alike; keeping the whole
    tie group would fail it); a row's token depends on its logits, parameters and seed only."""
    _interpret(DRAWS)


@pytest.mark.slow  # minutes on 2 cores (the interpreter or a crowd); the slow run has it
@pytest.mark.parametrize("group", ["sharp", "grid", "fallback"])
def test_rejection_draws_match_the_reference_distribution(group):
    """Step 3 (rejection, inverse-CDF draws) against `top_k_top_p_probs` per token, by Pearson's chi-square
    over many seeds: "sharp": a tie group cut by top-p or top-k holds most of the mass (accepting it whole,
    or dropping it on a tie-rejection, fails); "grid": temperatures 0.5/1/2, top_p 0.1/0.6/0.95, top_k 1/7,
    masked logits never drawn; "fallback": ROUNDS 0 (step 4 alone) and 1 (both mixed). Every group also
    checks that a row's token is the same alone, repeated and in a mixed batch."""
    _interpret(DIST, group)
