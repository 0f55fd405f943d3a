"""The split-row argmax (triton_argmax) on the CPU through Triton's interpreter (TRITON_INTERPRET=1, in a
subprocess: the flag is read when the kernel module is imported), against torch.argmax: bf16, fp16 and fp32,
several programs a row (a small BLOCK and vocabulary, the split count forced), ties across the programs'
chunks, rows of -inf, NaN, the max at either end, a row stride wider than the row. Then sample() and the
Sampler route an all-greedy batch to it. The real vocabulary runs on a GPU (tests/test_argmax_gpu.py)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

KERNEL = r'''
import torch
from autoprofile.kernels import triton_argmax as ta

ta.BLOCK, ta.SCRATCH_ROWS = 64, 5  # 16 rows: launches of 5, 5, 5 and 1 rows on the kept scratch
V, R = 1000, 16  # 16 tiles of 64 a row, the last one partial


def cuts(row, splits):
    # the logits of `row` where a program's part begins (past 0), as argmax launches the grid
    lo = row // ta.SCRATCH_ROWS * ta.SCRATCH_ROWS
    rows, row, tiles = min(ta.SCRATCH_ROWS, R - lo), row - lo, -(-V // ta.BLOCK)
    if ta.GRID == "rows":
        n, chunk = ta.chunks(V, splits)
        return [s * chunk for s in range(1, n)]
    g = ta.programs_for(rows, V, 132, splits)
    starts = [p * rows * tiles // g for p in range(g)]
    return [(t - row * tiles) * ta.BLOCK for t in starts if row * tiles < t < (row + 1) * tiles]


torch.manual_seed(0)
cases = [(g, fast, dtype, splits) for g in ("flat", "rows") for fast in (True, False)
         for dtype in (torch.bfloat16, torch.float16, torch.float32) for splits in (1, 3, 40)
         if (fast or splits == 3) and (dtype == torch.bfloat16 or splits < 40)]  # (the compares: 3 alone)
for ta.GRID, ta.FAST, dtype, splits in cases:  # 3: parts of 5-6 tiles; 40: a tile each
    c = [(cuts(r, splits) + [384])[0] for r in range(R)]  # each row's second part's first logit (or 384)
    wide = torch.randn(R, V + 40).to(dtype)
    x = wide[:, 3:V + 3]  # a row stride of V + 40, rows starting off any alignment
    top = float(x.float().abs().max()) + 1
    x[0] = float("-inf")  # all -inf: index 0
    x[1, 0] = top  # the max at either end
    x[2, V - 1] = top
    x[3, [5, 5 + 64, c[3] + 7, V - 1]] = top  # ties within a lane, then in later programs: the first
    x[4, [V - 1, c[4] + 1, min(2 * c[4], V - 2)]] = top  # ties in later programs only
    x[5, [c[5], min(2 * c[5], V - 1)]] = top  # at programs' first logits
    x[6, :] = float("-inf")  # one finite logit, in the last tile
    x[6, V - 2] = -5.0
    x[7, :] = -1.0  # -0.0 ties with 0.0: the first of either
    x[7, [30, 500]] = -0.0
    x[7, [400, 900]] = 0.0
    x[8, [c[8] + 3, V - 1]] = float("nan")  # NaN above every number, +inf included: the first NaN
    x[8, 2] = float("inf")
    x[9, [700, 800]] = -float("nan")  # either sign
    x[10, :] = float("nan")
    x[11, [3, 600]] = float("inf")  # +inf ties
    x[12, :] = torch.arange(V, 0, -1).to(dtype)  # strictly falling: index 0
    x[13, [0, 999]] = float("-inf")  # a part's first or last logit below its others
    x[14, [63, 64, 127]] = top  # ties at a tile's end and the next one's start
    x[15, :] = 0.0
    x[15, [c[15] - 1, c[15]]] = -0.0  # -0.0 and 0.0 on either side of a cut
    want = x.argmax(dim=-1)
    for call in range(2):  # the kept scratch: the second call finds it as the first left it
        got = ta.argmax(x, splits)
        assert torch.equal(got, want), (ta.GRID, ta.FAST, dtype, splits, call, got.tolist(), want.tolist())
    assert got.dtype == torch.int64 and got[3] == 5 and got[4] == c[4] + 1 and got[8] == c[8] + 3
    assert (ta.scratch(x.device) == ta.INT64_MIN).all(), ta.scratch(x.device)  # every key and count reset
    assert splits == 1 or max(len(cuts(r, splits)) for r in range(R)) > 0  # some row is split
assert ta.argmax(torch.randn(0, V), 3).shape == (0,)
ta.SCRATCH = "fill"
x = torch.randn(R, V)
x[3, [100, 900]] = 9.0
assert torch.equal(ta.argmax(x, 3), x.argmax(dim=-1))
for ta.GRID in ("flat", "rows"):  # the split count chosen for an H100's 132 SMs
    one = torch.randn(1, V)
    assert int(ta.argmax(one)) == int(one.argmax())
print("ok")
'''

RESET = r'''
import torch
from autoprofile.kernels import triton_argmax as ta

ta.BLOCK = 64
torch.manual_seed(1)
for ta.GRID in ("flat", "rows"):
    high, low = torch.randn(6, 1000) + 10, torch.randn(6, 1000)  # low's maxima below high's
    for x in (high, low, high, low):  # keys or counts left over from a call would spoil the next
        assert torch.equal(ta.argmax(x, 3), x.argmax(dim=-1)), ta.GRID
    assert (ta.scratch(high.device) == ta.INT64_MIN).all(), ta.scratch(high.device)[:12]
print("ok")
'''

WIRED = r'''
import torch
from autoprofile.engine import sampling
from autoprofile.engine.sampler import Sampler, SamplingMetadata
from autoprofile.engine.sampling import GREEDY, SamplingBatch, SamplingParams
from autoprofile.kernels import triton_argmax as ta

calls = []
real = ta.argmax
ta.argmax = lambda x: calls.append(x.shape) or real(x, 4)
sampling._kernel_logits = lambda x: True  # the interpreter runs the kernels on CPU tensors
x = torch.randn(6, 3000)
x[2, [9, 2900]] = 9.0
want = x.argmax(dim=-1)
cpu = torch.device("cpu")
assert torch.equal(sampling.sample(x, SamplingBatch.from_params([GREEDY] * 6, cpu)), want)
assert torch.equal(Sampler._sample(None, x, SamplingMetadata((GREEDY,) * 6)), want)  # greedy: no state read
assert calls == [(6, 3000)] * 2, calls
mixed = SamplingBatch.from_params([GREEDY, SamplingParams(temperature=0.7)] * 3, cpu)
sampling._kernel_logits = lambda x: False  # a sampled row: the sampler's path, not the argmax
sampling.sample(x, mixed, torch.Generator().manual_seed(0))
assert len(calls) == 2
print("ok")
'''


def test_argmax_matches_torch_with_ties_inf_nan_and_several_programs_a_row():
    run_script(KERNEL)


def test_the_kept_scratch_is_clean_for_the_next_call():
    """Calls one after the other on the process-lived keys and counts: each split row's last program sets its
    two back, so every call gives torch.argmax (the GPU's graph replays: tests/test_argmax_gpu.py)."""
    run_script(RESET)


def test_all_greedy_batches_take_the_kernel():
    run_script(WIRED)


def test_split_covers_the_gpu_and_leaves_no_program_empty():
    from autoprofile.kernels import triton_argmax as ta
    vocab, aim = 128256, ta.PROGRAMS_PER_SM * 132
    tiles = -(-vocab // ta.BLOCK)
    for rows in (1, 2, 8, 64, 256, 1024, 4096):
        splits, chunk = ta.chunks(vocab, ta.splits_for(rows, vocab, 132))
        assert chunk % ta.BLOCK == 0 and (splits - 1) * chunk < vocab <= splits * chunk, (rows, splits, chunk)
        # whole tiles a program: at least half the programs aimed at (the tiles a row allowing)
        assert 2 * rows * splits >= min(aim, rows * tiles), (rows, splits)
    assert ta.chunks(vocab, 1) == (1, -(-vocab // ta.BLOCK) * ta.BLOCK)
    assert ta.chunks(100, 7) == (1, ta.BLOCK)  # more programs asked for than tiles: a tile each


def test_greedy_is_torch_argmax_on_the_cpu():
    from autoprofile.engine.sampling import greedy
    x = torch.randn(5, 300)
    x[1, [4, 200]] = 50.0
    assert torch.equal(greedy(x), x.argmax(dim=-1)) and int(greedy(x)[1]) == 4
