"""The v2 decode's partition reduce (triton_reduce) and the whole v2 path (AITER's partition kernel + ours,
aiter_triton.decode_v2) on the CPU through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the flag
is read when a kernel module is imported), against float64 attention. The interpreter has no bfloat16: float16
and float32 here; bf16 on the GPU (tests/test_kernels.py)."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

COMMON = r'''
import math
import torch
from autoprofile.kernels import triton_reduce

def attention(q, k, v, keep=None):
    """float64 softmax(q k^T / sqrt(d)) v of one query head over its keys (keep: a mask of live keys)."""
    s = (k.double() @ q.double()) / math.sqrt(q.shape[-1])
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, 0) @ v.double()

def partials(q, k, v, lens, partition, max_parts, group, dtype, keep=None):
    """What a partition kernel writes: per (row, kv head, partition, query) the max logit, the exp-sum and the
    normalized partial output (dtype); partitions past a row's length are left as garbage (NaN, +huge)."""
    rows, hq, d = q.shape
    hkv = hq // group
    shape = (rows, hkv, max_parts, group)
    ml = torch.full(shape, 1e30)
    es = torch.full(shape, float("nan"))
    out = torch.full((*shape, d), float("nan"))
    for r, n in enumerate(lens):
        for h in range(hq):
            s = (k[r, :n, h // group].double() @ q[r, h].double()) / math.sqrt(d)
            if keep is not None:
                s = s.masked_fill(~keep[r, :n], float("-inf"))
            for p in range(-(-n // partition)):
                x = s[p * partition:(p + 1) * partition]
                m = x.max()
                e = torch.exp(x - m) if m > float("-inf") else torch.zeros_like(x)
                ml[r, h // group, p, h % group] = m
                es[r, h // group, p, h % group] = e.sum()
                vp = v[r, p * partition:p * partition + len(x), h // group].double()
                out[r, h // group, p, h % group] = (e @ vp) / e.sum()
    if group == 1:
        ml, es, out = ml[..., 0], es[..., 0], out[..., 0, :]
    return es.contiguous(), ml.contiguous(), out.to(dtype).contiguous()

def check(lens, partition, group, d, dtype, tol, keep=None, extra_parts=0, kscale=2.0):
    torch.manual_seed(sum(lens) + partition + group + d)
    rows, hkv = len(lens), 2
    hq = hkv * group
    longest = max(lens)
    q = torch.randn(rows, hq, d)
    k = torch.randn(rows, longest, hkv, d) * kscale
    v = torch.randn(rows, longest, hkv, d)
    max_parts = -(-longest // partition) + extra_parts
    es, ml, part = partials(q, k, v, lens, partition, max_parts, group, dtype, keep)
    out = torch.full((rows, hq, d), float("nan"), dtype=dtype)
    triton_reduce.reduce_partitions(out, es, ml, part, torch.tensor(lens, dtype=torch.int32), partition)
    for r, n in enumerate(lens):
        for h in range(hq):
            if n == 0:
                assert torch.equal(out[r, h].float(), torch.zeros(d)), (r, h, out[r, h])
                continue
            live = None if keep is None else keep[r, :n]
            want = attention(q[r, h], k[r, :n, h // group], v[r, :n, h // group], live)
            err = float((out[r, h].double() - want).abs().max() / want.abs().max())
            assert err < tol, (lens, partition, group, d, dtype, r, h, n, err)
'''

REDUCE = COMMON + r'''
P = 16
B = triton_reduce.BLOCK_P
cases = [  # (seq lens, group): one partition, odd counts, lengths off the partition size, past one BLOCK_P
    ([1, 16, 17, 5 * P + 3, 3 * P], 4),
    ([B * P, B * P + 1, 2 * B * P + 5 * P + 7], 4),  # one block exactly, one past it, three (odd count)
    ([1, 33, 7 * P, 40 * P + 1], 1),                       # MHA layout
    ([9, 2 * P + 1], 8),
]
for lens, group in cases:
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        check(lens, P, group, 64, dtype, tol)
check([3, 50, 100], 32, 4, 80, torch.float32, 1e-5)        # head_dim not a power of two
check([40, 130], 16, 4, 32, torch.float32, 1e-5, extra_parts=5)  # scratch wider than the longest row
check([0, 20, 0], 16, 4, 32, torch.float32, 1e-5)          # empty rows: 0, not NaN
check([40 * P + 3], P, 4, 64, torch.float32, 1e-5, kscale=80.0)  # maxima hundreds apart: no exp overflow
# a partition with no live key (max -inf, exp-sum 0, NaN partials) among live ones; a row with one live key
keep = torch.ones(3, 8 * P, dtype=torch.bool)
keep[0, P:2 * P] = False
keep[1, :] = False
keep[1, 3 * P + 2] = True
keep[2, :5 * P] = False
check([8 * P, 8 * P, 7 * P + 3], P, 4, 32, torch.float32, 1e-5, keep=keep)
print("ok")
'''

DEAD_ROW = COMMON + r'''
keep = torch.zeros(1, 40, dtype=torch.bool)
q, k, v = torch.randn(1, 4, 32), torch.randn(1, 40, 1, 32), torch.randn(1, 40, 1, 32)
es, ml, part = partials(q, k, v, [40], 16, 3, 4, torch.float32, keep)
out = torch.full((1, 4, 32), float("nan"))
triton_reduce.reduce_partitions(out, es, ml, part, torch.tensor([40], dtype=torch.int32), 16)
assert torch.equal(out, torch.zeros_like(out)), out
print("ok")
'''

DECODE_V2 = COMMON + r'''
import triton.language as tl
from autoprofile.kernels import aiter_loader
from autoprofile.engine.attention.aiter_triton import decode_v2

PAGE, D, HKV = 16, 32, 2
pa = aiter_loader.load_pa_kernels()
# 300 tokens: not whole partitions. GQA only: AITER's MHA partition kernel
# (_paged_attn_decode_v2_wo_dot_kernel) does not run in the interpreter
for group, lens, max_seq_len, partition in [(4, [1, 16, 100, 300], 300, 32), (2, [5, 64, 129], 160, 32),
                                           (4, [200, 17], 256, 128)]:
    torch.manual_seed(group * max_seq_len)
    hq, rows, cols = HKV * group, len(lens), -(-max_seq_len // PAGE)
    pages = torch.randperm(rows * cols + 1)[: rows * cols].view(rows, cols).to(torch.int32)
    kc = torch.randn(rows * cols + 1, HKV, PAGE, D, dtype=torch.float16)
    vc = torch.randn(rows * cols + 1, HKV, PAGE, D, dtype=torch.float16)
    q = torch.randn(rows, hq, D, dtype=torch.float16)
    out = torch.full_like(q, float("nan"))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    decode_v2(pa, out, q, kc, vc, pages, seq_lens, max_seq_len, tl.float16, HKV, 1 / math.sqrt(D), partition)
    for r, n in enumerate(lens):
        k = kc[pages[r].long()].permute(0, 2, 1, 3).reshape(-1, HKV, D)[:n]
        v = vc[pages[r].long()].permute(0, 2, 1, 3).reshape(-1, HKV, D)[:n]
        for h in range(hq):
            want = attention(q[r, h], k[:, h // group], v[:, h // group])
            err = float((out[r, h].double() - want).abs().max() / want.abs().max())
            assert err < 5e-3, (group, r, h, n, err)
print("ok")
'''


def _interpret(code: str) -> None:
    run_script(code)


def test_reduce_equals_attention_over_the_whole_row():
    """Partials of real attention split into partitions, merged: one partition, odd counts, lengths off the
    partition size, one and several BLOCK_P blocks, GQA and MHA layouts, float32/float16 partials, a head_dim
    that is not a power of two, scratch wider than the rows, empty rows (0), partitions without a live key;
    the garbage a partition kernel leaves past a row's length (NaN, +1e30) never reaches the output."""
    _interpret(REDUCE)


def test_a_row_without_a_live_key_is_zero():
    _interpret(DEAD_ROW)


@pytest.mark.skipif(importlib.util.find_spec("aiter") is None, reason="amd-aiter not installed")
def test_decode_v2_with_aiters_partition_kernel_equals_attention():
    """The v2 path as the backend runs it: AITER's GQA partition kernel then our reduce, on a shuffled page
    pool, in float16."""
    _interpret(DECODE_V2)


@pytest.mark.skipif(importlib.util.find_spec("aiter") is None, reason="amd-aiter not installed")
def test_partition_kernels_are_checked_against_the_pinned_signature(monkeypatch):
    """decode_v2 launches AITER's partition kernels positionally: another amd-aiter's signature is an error
    naming the pin and the torch backend, at load."""
    from autoprofile.kernels import aiter_loader

    assert aiter_loader.load_pa_kernels()._paged_attn_decode_v2_w_dot_kernel is not None
    moved = dict(aiter_loader.PARTITION_KERNEL_PARAMS)
    moved["_paged_attn_decode_v2_w_dot_kernel"] = moved["_paged_attn_decode_v2_w_dot_kernel"][1:]
    monkeypatch.setattr(aiter_loader, "PARTITION_KERNEL_PARAMS", moved)
    pin = f"amd-aiter=={aiter_loader.PINNED_AITER}"
    with pytest.raises(RuntimeError, match=f"{pin}.*--attention_backend torch"):
        aiter_loader.load_pa_kernels()
