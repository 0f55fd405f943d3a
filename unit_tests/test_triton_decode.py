"""Our split-KV paged decode (kernels.triton_decode) on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess: the flag is read when a kernel module is imported), against float64
attention over the dequantised pages gathered per row. The interpreter has no bfloat16 dot: float16 queries
here, over FP8 and float16 pages; bf16 on the GPU (tests/test_split_decode_gpu.py). Plus the split rule and
its scratch (pure)."""
from __future__ import annotations

import importlib.util

import pytest

from autoprofile import budget
from autoprofile.kernels import launch_rules
from unit_tests.interpreter import run_script

COMMON = r'''
import math
import torch
from autoprofile.kernels import triton_decode

FP8 = torch.float8_e4m3fn

def pool(lens, hkv, page, d, cache_dtype, gen):
    """A shuffled page pool (one spare page) with tables padded by page 0, and K/V in cache_dtype."""
    cols = max(-(-n // page) for n in lens) + 1
    used = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(used) + 1, generator=gen).to(torch.int32)
    tables = torch.zeros(len(lens), cols, dtype=torch.int32)
    at = 0
    for i, u in enumerate(used):
        tables[i, :u] = perm[at:at + u]
        at += u
    kc = torch.randn(sum(used) + 1, hkv, page, d, generator=gen) * 2
    vc = torch.randn(sum(used) + 1, hkv, page, d, generator=gen)
    return kc.to(cache_dtype), vc.to(cache_dtype), tables

def reference(q, kc, vc, tables, lens, scale, ks, vs):
    """float64 softmax attention per row over the dequantised pages (x.double() * scale)."""
    rows, hq, d = q.shape
    hkv, page = kc.shape[1], kc.shape[2]
    out = torch.empty(rows, hq, d, dtype=torch.float64)
    for r, n in enumerate(lens):
        pages = tables[r, :-(-n // page)].long()
        k = kc[pages].double().permute(0, 2, 1, 3).reshape(-1, hkv, d)[:n] * ks
        v = vc[pages].double().permute(0, 2, 1, 3).reshape(-1, hkv, d)[:n] * vs
        for h in range(hq):
            s = (k[:, h // (hq // hkv)] @ q[r, h].double()) * scale
            out[r, h] = torch.softmax(s, 0) @ v[:, h // (hq // hkv)]
    return out

def check(lens, hq, hkv, d, page, cache_dtype, splits, ks=1.0, vs=1.0, block_n=16, max_seq_len=None,
          strided=False, tol=5e-3, f16_dots=False, odd_v=False):
    gen = torch.Generator().manual_seed(sum(lens) + hq + d + splits)
    kc, vc, tables = pool(lens, hkv, page, d, cache_dtype, gen)
    if odd_v:  # V a view with odd strides (unit stride in D): no int16 pairs there
        vc = torch.cat([vc, vc[..., :1]], dim=-1)[..., :d]
    rows = len(lens)
    if strided:  # a view of a packed projection, like the model's
        q = torch.randn(rows, (hq + 2 * hkv) * d, generator=gen).half()[:, :hq * d].view(rows, hq, d)
    else:
        q = torch.randn(rows, hq, d, generator=gen).half()
    out = torch.full((rows, hq, d), float("nan"), dtype=torch.float16)
    scales = torch.tensor([ks, vs]) if cache_dtype == FP8 else None
    k_scale, v_scale = (scales[0], scales[1:2]) if scales is not None else (None, None)  # 0-d and [1]
    cfg = triton_decode.Config(block_n=block_n, splits=splits, f16_dots=f16_dots)
    scale = 1 / math.sqrt(d)
    triton_decode.decode(out, q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32),
                         max_seq_len or max(lens), scale, k_scale, v_scale, cfg)
    want = reference(q, kc, vc, tables, lens, scale, ks if scales is not None else 1.0,
                     vs if scales is not None else 1.0)
    assert not out.isnan().any(), out
    for r, n in enumerate(lens):
        err = float((out[r].double() - want[r]).abs().max() / want[r].abs().max())
        assert err < tol, (lens, cache_dtype, splits, r, n, err)
    return out, q, kc, vc, tables
'''

KERNEL = COMMON + r'''
P = 16
lens = [1, 2 * P, 5 * P + 3]  # one token, a whole number of pages, ragged
for cache_dtype in (FP8, torch.float16):
    for splits in (1, 3):  # 1: stage 1 writes the output; 3: parts, then the merge (empty parts past 1 token)
        check(lens, 8, 2, 64, P, cache_dtype, splits, ks=0.37, vs=2.5)
check(lens, 8, 2, 64, P, FP8, 2, ks=0.37, vs=2.5, block_n=32)  # tiles of two pages
check([7, 40], 8, 8, 32, P, FP8, 2, ks=3.0, vs=0.5)  # MHA: a group of 1 padded to 16 rows
check([50, 17], 8, 2, 48, P, FP8, 2, ks=1.5, vs=1.5)  # head_dim not a power of two
check([33, 70], 8, 2, 32, 32, torch.float16, 4, strided=True, max_seq_len=96)  # pages of 32, a strided q
for odd_v in (False, True):  # FP8 pages' fp16 dots (V as int16 pairs); odd V strides: the bf16-dot path
    check(lens, 8, 2, 64, P, FP8, 3, ks=0.37, vs=2.5, f16_dots=True, odd_v=odd_v)
check([50, 17], 8, 2, 48, P, FP8, 2, ks=1.5, vs=1.5, f16_dots=True)  # pairs masked past a head_dim of 48
print("ok")
'''

SCALES = COMMON + r'''
# the scales are read from their device tensors at each call: change them in place, the next call follows
gen = torch.Generator().manual_seed(5)
lens, hq, hkv, d, page = [20, 37], 8, 2, 32, 16
kc, vc, tables = pool(lens, hkv, page, d, FP8, gen)
q = torch.randn(2, hq, d, generator=gen).half()
scales = torch.tensor([0.5, 2.0])
seq = torch.tensor(lens, dtype=torch.int32)
for splits in (1, 2):
    cfg = triton_decode.Config(block_n=16, splits=splits)
    scales.copy_(torch.tensor([0.5, 2.0]))
    first = triton_decode.decode(torch.empty_like(q), q, kc, vc, tables, seq, 37, 0.2, scales[0], scales[1],
                                 cfg).clone()
    scales.mul_(torch.tensor([3.0, 0.25]))  # in place, as KVCache.set_scales writes
    second = triton_decode.decode(torch.empty_like(q), q, kc, vc, tables, seq, 37, 0.2, scales[0], scales[1],
                                  cfg)
    want = reference(q, kc, vc, tables, lens, 0.2, 1.5, 0.5)
    err = float((second.double() - want).abs().max() / want.abs().max())
    assert err < 5e-3 and not torch.allclose(first, second), (splits, err)
print("ok")
'''

BACKEND = COMMON + r'''
# AiterTritonBackend.decode: FP8 pages (KVLayer.scales [2]) through triton_decode, and float16 pages too
# at up to split_decode_rows rows; a float16 cache past them stays on AITER's
import types
from autoprofile.engine.attention import AttentionMetadata, aiter_triton
from autoprofile.kernels import launch_rules
from autoprofile.engine.attention.aiter_triton import AiterTritonBackend
from autoprofile.layers.attention import KVLayer
aiter_calls = []  # AITER's Triton modules need a GPU driver to import: a stand-in that records its v1 call
aiter_triton.load_aiter_triton = lambda: types.SimpleNamespace(
    seq_partition_size=aiter_triton.SEQ_PARTITION, paged_attn_decode_v1=lambda *a: aiter_calls.append(1))
calls = []
real = triton_decode.decode
triton_decode.decode = lambda *a, **k: calls.append(1) or real(*a, **k)
gen = torch.Generator().manual_seed(9)
lens, hq, hkv, d, page = [1, 40, 16], 8, 2, 32, 16
for cache_dtype, split_rows in ((FP8, 0), (torch.float16, 3), (torch.float16, 2)):
    be = AiterTritonBackend(hq, hkv, d, page, torch.float16, torch.device("cpu"))
    assert be.split_decode_rows == launch_rules.SPLIT_DECODE_ROWS
    be.split_decode_rows = split_rows
    kc, vc, tables = pool(lens, hkv, page, d, cache_dtype, gen)
    scales = torch.tensor([0.7, 1.9]) if cache_dtype == FP8 else None
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(3, dtype=torch.int64),
                             block_tables=tables, seq_lens=torch.tensor(lens, dtype=torch.int32),
                             max_seq_len=48)
    q = torch.randn(3, (hq + 2 * hkv) * d, generator=gen).half()[:, :hq * d].view(3, hq, d)
    before = len(calls)
    out = be.decode(q, KVLayer(kc, vc, scales), meta)
    ours = cache_dtype == FP8 or 3 <= split_rows
    assert (len(calls) - before, len(aiter_calls)) == ((1, 0) if ours else (0, 1)), (cache_dtype, split_rows)
    if not ours:
        continue
    want = reference(q, kc, vc, tables, lens, 1 / math.sqrt(d), *(scales.tolist() if scales is not None
                                                                  else (1.0, 1.0)))
    err = float((out.double() - want).abs().max() / want.abs().max())
    assert err < 5e-3, (cache_dtype, split_rows, err)
print("ok")
'''

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def test_split_decode_equals_attention_over_the_dequantised_pages():
    """FP8 and float16 pages, scales != 1 (a 0-d k_scale, a [1] v_scale), one split (direct) and several (the
    merge, with empty parts past a 1-token row), one-token / whole-page / ragged rows on shuffled tables,
    tiles of two pages, MHA, head_dim 48, pages of 32 and a strided q; FP8 pages' fp16 dots, V with odd
    strides among them."""
    run_script(KERNEL)


def test_split_decode_reads_the_scales_from_their_tensors():
    run_script(SCALES)


def test_splits_fill_the_gpu_within_bounds():
    """Few rows split more (up to SPLIT_DECODE_MAX_SPLITS, each part >= SPLIT_DECODE_MIN_TOKENS of
    max_seq_len); many rows run one part (no scratch)."""
    s = launch_rules.split_decode_splits
    assert s(256, 8, 1024) == s(64, 8, 1024) == s(256, 8, 131072) == 1
    assert s(1, 8, 1024) == 1024 // launch_rules.SPLIT_DECODE_MIN_TOKENS
    assert s(1, 8, 131072) == launch_rules.SPLIT_DECODE_MAX_SPLITS
    assert s(1, 8, 100) == 1
    for rows in range(1, 600):
        for L in (1, 200, 1024, 4096, 131072):
            n = s(rows, 8, L)
            assert 1 <= n <= launch_rules.SPLIT_DECODE_MAX_SPLITS
            assert n == 1 or -(-L // n) >= launch_rules.SPLIT_DECODE_MIN_TOKENS // 2
            assert n == 1 or rows * 8 * (n - 1) < launch_rules.SPLIT_DECODE_PROGRAMS


@pytest.mark.parametrize("L", [1024, 4096, 131072])
def test_split_decode_peak_scratch_bounds_every_row_count(L):
    """The plan declares the peak over 1..max rows: no row count allocates more, and it is reached."""
    hq, hkv, d = 32, 8, 128
    for top in (1, 7, 64, 256, 1024):
        each = [launch_rules.split_decode_scratch_bytes(n, hq, d, launch_rules.split_decode_splits(n, hkv, L))
                for n in range(1, top + 1)]
        assert budget.split_decode_peak_scratch_bytes(top, hq, hkv, d, L) == max(each)
    assert launch_rules.split_decode_scratch_bytes(3, hq, d, 4) == 3 * hq * 4 * (4 * d + 4)
    assert launch_rules.split_decode_scratch_bytes(300, hq, d, 1) == 0


def test_backend_decodes_fp8_pages_through_the_split_kernel():
    """AiterTritonBackend.decode: FP8 pages (scales from KVLayer.scales) and, at up to split_decode_rows rows,
    float16 pages go through triton_decode, against float64 attention from a strided q; a float16 cache past
    them stays on AITER's v1 kernel (a stand-in here: AITER's modules need a GPU driver to import)."""
    run_script(BACKEND)


def test_fp8_pages_take_their_own_config_at_every_row_count_and_an_override_wins():
    from autoprofile.kernels import triton_decode as td

    for rows in (1, 2, 64, 128, 256):
        assert td.config(rows, 8, 4096, fp8=True)[1] == td.FP8, rows
        assert td.config(rows, 8, 4096, fp8=False)[1] == td.DEFAULT, rows
    assert td.FP8.f16_dots and not td.DEFAULT.f16_dots
    assert td.config(64, 8, 4096, td.SWEEP[0], fp8=True)[1] == td.SWEEP[0]
