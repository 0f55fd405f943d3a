"""The split sampler (triton_sample_split: several programs a row) on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess), against the one-program sampler (triton_sample) and the exact kept
distribution; its launch rule and scratch. Small vocabularies with small blocks, so that a row spans several
blocks; float16 and float32 (the interpreter has no bfloat16: tests/test_sampling_gpu.py on the GPU)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from autoprofile.engine.sampling import sampler_workspace_bytes
from autoprofile.kernels import launch_rules
from unit_tests.interpreter import run_script

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

COMMON = r'''
import torch
from autoprofile.kernels import triton_sample as ts
from autoprofile.kernels import triton_sample_split as tss
from autoprofile.engine.sampling import SamplingBatch, SamplingParams

def args(params, seeds=None):
    b = SamplingBatch.from_params(params, torch.device("cpu"))
    seeds = torch.arange(len(params)) * 7919 + 1 if seeds is None else seeds
    return b.temperatures, b.top_ps, b.top_ks, seeds

def both(x, params, chunk, seeds=None):
    """(one-program (tokens, bounds), split (tokens, bounds)) for the same seeds."""
    a = args(params, seeds)
    return ts.sample_batch(x, *a, bounds=True), tss.sample_batch_split(x, *a, bounds=True, chunk=chunk)

def logits(rows, vocab, scale, dtype, seed=0):
    wide = (torch.randn(rows, vocab + 40, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
    x = wide[:, 3:vocab + 3]  # rows of a wider buffer
    x[:, 10:30] = x[:, 9:10]  # a tie group at a top-k/top-p boundary of some rows
    x[::5, 100:130] = float("-inf")  # masked logits
    return x
'''

SAME = COMMON + r'''
tss.BLOCK = 64
params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7, top_k=7),
          SamplingParams(temperature=1.5, top_k=300, top_p=0.6), SamplingParams(),
          SamplingParams(temperature=1.0, top_k=20, top_p=0.95)]  # top-k inside the tie group at 10..29
for dtype in (torch.float16, torch.float32):
    x = logits(len(params), 1000, 3.0, dtype)  # 4 blocks of 256, the last one short
    x[3, [5, 700]] = x[3].max() + 1  # greedy row: the first index of a max tied across blocks
    (tok, kept), (tok_s, kept_s) = both(x, params, 256)
    assert torch.equal(tok, tok_s) and torch.equal(kept, kept_s), (dtype, tok, tok_s, kept, kept_s)
    assert int(tok[3]) == 5
    # a row alone gives its token in the batch
    a = args(params)
    for i in (0, 4):
        alone = tss.sample_batch_split(x[i:i + 1], *(t[i:i + 1] for t in a), chunk=256)
        assert int(alone) == int(tok_s[i]), (dtype, i)
    # another seed, another draw
    assert not torch.equal(tss.sample_batch_split(x, *args(params, torch.arange(5) + 99), chunk=256), tok_s)
print("ok")
'''

GRID = COMMON + r'''
tss.BLOCK = 64
params = [SamplingParams(temperature=t, top_p=p, top_k=k) for t in (0.5, 2.0)
          for p in (1.0, 0.95, 0.6, 0.1) for k in (0, 1, 7, 300)] + [SamplingParams()] * 2
for dtype, vocab, scale, chunk in [(torch.float32, 1000, 1.0, 256), (torch.float16, 700, 4.0, 128),
                                   (torch.float32, 300, 12.0, 64)]:
    x = logits(len(params), vocab, scale, dtype, seed=vocab)
    x[1, 200:206] = x[1].max()  # ties at the max of a sampled row
    (tok, kept), (tok_s, kept_s) = both(x, params, chunk)
    bad = [(i, params[i]) for i in range(len(params)) if tok[i] != tok_s[i] or (kept[i] != kept_s[i]).any()]
    assert not bad, (dtype, vocab, bad)
print("ok")
'''

DRAWS = COMMON + r'''
tss.BLOCK = 4  # three blocks a row
# 12 tokens: 3.0, 2.0, four at 1.0 (in every block), six at 0.0. top_k 3 keeps 3.0, 2.0 and one of the
# 1.0s; top_p 0.8 at T=1 keeps 3.0 and 2.0 (mass 0.66 before the 1.0s), then 1.0s while the mass before
# <= 0.8.
x = torch.tensor([0.0, 3.0, 1.0, 0.0, 2.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float16)
VALUES = (3.0, 2.0, 1.0, 0.0)
def expected(p):
    v = x.float().sort(descending=True).values
    k = p.top_k if p.top_k else len(v)
    probs = (v[:k] / p.temperature).softmax(-1)
    n = int(((probs.cumsum(-1) - probs) <= p.top_p).sum())
    return {value: float(probs[:n][v[:n] == value].sum() / probs[:n].sum()) for value in VALUES}
for p, rows in [(SamplingParams(temperature=1.0, top_k=3), 240),
                (SamplingParams(temperature=1.0, top_p=0.8), 160)]:
    tok = tss.sample_batch_split(x.expand(rows, -1).contiguous(), *args([p] * rows), chunk=4)
    drawn = x[tok].float()
    got, want = {v: float((drawn == v).float().mean()) for v in VALUES}, expected(p)
    for v in VALUES:  # 4.5 standard deviations; a class of probability 0 never drawn
        sd = (want[v] * (1 - want[v]) / rows) ** 0.5
        assert abs(got[v] - want[v]) <= 4.5 * sd, (p, got, want)
    ones = torch.bincount(tok, minlength=12)[x == 1.0].float()
    assert float(((ones - ones.mean()) ** 2 / ones.mean()).sum()) < 16.3, ones  # tied tokens alike
print("ok")
'''


@needs_triton
def test_split_gives_the_one_program_token_alone_and_in_a_batch():
    """Same seeds: the same tokens and kept sets (count, smallest kept logit) as triton_sample, fp16 and fp32,
    top-p, top-k inside a tie group, both, greedy with a max tied across blocks; a row alone gives its token
    in the batch; another seed another draw."""
    run_script(SAME)


@pytest.mark.slow  # minutes in the interpreter
@needs_triton
def test_split_matches_one_program_over_a_grid_of_parameters():
    """Temperatures x top-p x top-k, greedy rows, ties at the max, masked logits, three vocabularies and block
    sizes (the last block short): every row's token and kept set are the one-program sampler's."""
    run_script(GRID)


@pytest.mark.slow  # minutes in the interpreter
@needs_triton
def test_split_draws_follow_the_kept_distribution():
    """Draws against the exact kept distribution per logit value, a tie group spread over three blocks (its
    tokens alike)."""
    run_script(DRAWS)


def test_rule_keeps_the_one_program_kernel_by_default_and_splits_by_the_vocabulary_only():
    assert not any(launch_rules.sample_split(rows, 128256) for rows in (1, 8, 64, 256))
    assert launch_rules.sample_split(1, 128256, max_rows=8) and not launch_rules.sample_split(9, 128256, 8)
    assert not launch_rules.sample_split(1, 1000, max_rows=8)  # a short row: one program
    assert launch_rules.sample_split_blocks(128256) == 32 and launch_rules.sample_split_blocks(4096) == 1
    assert "SAMPLE_SPLIT_MAX_ROWS = 0" in launch_rules.sample_split_rule_line()


@needs_triton
@pytest.mark.parametrize("rows,vocab", [(1, 128256), (256, 128256), (7, 152064)])
def test_scratch_is_the_declared_bytes_and_inside_the_sampler_workspace(rows, vocab):
    from autoprofile.kernels import triton_sample_split as tss
    blocks = launch_rules.sample_split_blocks(vocab)
    scratch = tss.split_scratch(rows, blocks, launch_rules.SAMPLE_SPLIT_WAYS, torch.device("meta"))
    got = sum(t.numel() * t.element_size() for t in scratch.values())
    assert got == launch_rules.sample_split_scratch_bytes(rows, vocab)
    assert launch_rules.sample_split_scratch_bytes(rows, vocab) <= sampler_workspace_bytes(rows, vocab, 2)


@needs_triton
def test_passes_cover_the_widest_key_range():
    from autoprofile.kernels import triton_sample_split as tss
    assert [tss.split_passes(shift, 16) for shift in (16, 13, 0)] == [4, 5, 8]
    assert tss.split_passes(16, 8) == 6 and tss.split_passes(16, 64) == 3
