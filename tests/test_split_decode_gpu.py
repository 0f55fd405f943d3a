"""GPU: our split-KV paged decode (kernels.triton_decode) at llama-3.1-8b's attention shapes (32/8 heads of
128, pages of 16), through AiterTritonBackend.decode as serving calls it (FP8 pages always; bf16 pages with
split_decode_rows past every row count), against the float64 reference over the dequantised pages; in a
CUDA graph whose scales change after capture; its scratch is what the budget says; one compile per variant."""
from __future__ import annotations

import pytest
import torch

from autoprofile import budget
from autoprofile.kernels import launch_rules
from autoprofile.engine.attention.aiter_triton import AiterTritonBackend
from autoprofile.kernels import triton_decode
from autoprofile.layers.attention import KVLayer, dequantize
from scripts.cuda_timing import capture
from tests.test_kernels import (BF16_TOL, HKV, HQ, D, compiled, fp8_pages, make, mixed_lens,
                                nan_empty, packed_qkv, paged, ref_decode_one)  # noqa: F401 (a fixture)
from unit_tests.test_attention_cpu import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = [  # (batch, longest seq_len, static max_seq_len, ragged)
    (1, 1024, 1024, False),      # 8 splits: the merge
    (256, 1024, 1024, False),    # one split: stage 1 writes the output
    (256, 1024, 4096, True),     # ragged, one split
    (8, 3000, 4096, True),       # ragged, 8 splits (short rows leave parts empty)
    (4, 131072, 131072, True),   # llama-3.1's full context: 16 splits of 8,192 tokens
]


def backend(cache: str) -> AiterTritonBackend:
    be = make("aiter_triton")
    be.split_decode_rows = 1 << 30  # bf16 pages through the split kernel at every row count
    return be


def layer_for(cache: str, kc: torch.Tensor, vc: torch.Tensor) -> KVLayer:
    """bf16 pages, or the pages quantised per tensor at scales far from 1 (K x 3, V x 0.05 first)."""
    return fp8_pages(kc * 3, vc * 0.05) if cache == "fp8" else KVLayer(kc, vc)


def dequantised(layer: KVLayer) -> tuple[torch.Tensor, torch.Tensor]:
    if layer.scales is None:
        return layer.k, layer.v
    return (dequantize(layer.k, layer.scales[0], torch.float32),
            dequantize(layer.v, layer.scales[1], torch.float32))


@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("b,longest,max_seq_len,ragged", CASES)
def test_split_decode_equals_the_reference(cache, b, longest, max_seq_len, ragged, nan_empty, monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(b * longest + max_seq_len)
    be = backend(cache)
    lens = mixed_lens(b, longest, gen) if ragged else [longest] * b
    kc, vc, meta = paged(lens, max_seq_len, gen)
    layer = layer_for(cache, kc, vc)
    q = packed_qkv(b, gen)[0]  # strided, like the model's
    calls = []
    real = triton_decode.decode
    monkeypatch.setattr(triton_decode, "decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = be.decode(q, layer, meta)
    torch.cuda.synchronize()
    assert calls == [1], "the backend did not take the split decode"
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and not out.isnan().any()
    kd, vd = dequantised(layer)
    splits = launch_rules.split_decode_splits(b, HKV, max_seq_len)
    for i, n in enumerate(lens):
        err = rel_err(out[i], ref_decode_one(q[i], kd, vd, meta.block_tables[i], n))
        assert err < BF16_TOL, f"{cache} request {i} (len {n}, {splits} splits): rel err {err:.2e}"


@pytest.mark.parametrize("b,max_seq_len", [(1, 1024), (256, 1024), (4, 131072), (64, 2048), (32, 16384)])
def test_split_decode_graph_follows_the_scales_set_after_capture(b, max_seq_len):
    """Captured, replayed, the scales changed in place (as KVCache.set_scales writes) and replayed again: the
    replay equals an eager call bit for bit, differs from the first replay, and matches the reference at
    the new scales; new queries and lengths into the static buffers are followed too."""
    gen = torch.Generator(device="cuda").manual_seed(b + max_seq_len)
    be = backend("fp8")
    kc, vc, meta = paged([max_seq_len] * b, max_seq_len, gen)
    layer = fp8_pages(kc, vc)
    q = torch.randn(b, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    graph, out = capture(lambda: be.decode(q, layer, meta))
    graph.replay()
    first = out.clone()
    layer.scales.mul_(torch.tensor([0.5, 3.0], device="cuda"))
    graph.replay()
    eager = be.decode(q, layer, meta)
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and not torch.equal(out, first)
    kd, vd = dequantised(layer)
    for i in (0, b - 1):
        assert rel_err(out[i], ref_decode_one(q[i], kd, vd, meta.block_tables[i], max_seq_len)) < BF16_TOL
    q.copy_(torch.randn(q.shape, generator=gen, device="cuda", dtype=torch.bfloat16))
    meta.seq_lens.copy_(torch.randint(1, max_seq_len + 1, (b,), generator=gen, device="cuda"))
    graph.replay()
    eager = be.decode(q, layer, meta)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    i = int(meta.seq_lens.argmin())
    n = int(meta.seq_lens[i])
    assert rel_err(out[i], ref_decode_one(q[i], kd, vd, meta.block_tables[i], n)) < BF16_TOL


@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("b,max_seq_len", [(1, 1024), (4, 131072), (30, 4096), (256, 1024), (256, 4096)])
def test_split_decode_scratch_is_what_the_budget_says(cache, b, max_seq_len):
    """What one call allocates besides its output is triton_decode.scratch_bytes
    (launch_rules.split_decode_scratch_bytes at its splits; none at one split), up to the allocator's
    512-byte rounding, and never more than the plan's peak over 1..256 rows."""
    be = backend(cache)
    kc, vc, meta = paged([17] * b, max_seq_len, torch.Generator(device="cuda").manual_seed(b))
    layer = layer_for(cache, kc, vc)
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    be.decode(q, layer, meta)  # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    be.decode(q, layer, meta)
    torch.cuda.synchronize()
    scratch = torch.cuda.max_memory_allocated() - before - -(-q.numel() * 2 // 512) * 512
    expected = triton_decode.scratch_bytes(b, HQ, HKV, D, max_seq_len)
    assert (expected == 0) is (launch_rules.split_decode_splits(b, HKV, max_seq_len) == 1)
    assert expected <= scratch <= expected + 3 * 512, (scratch, expected)
    assert expected <= budget.split_decode_peak_scratch_bytes(256, HQ, HKV, D, max_seq_len)


def test_split_decode_compiles_once_per_variant():
    """Rows, max_seq_len (the tables' width) and the split count follow the step; once stage 1 ran with one
    split and with several, and stage 2 once, no new shape compiles either again."""
    be = backend("fp8")
    gen = torch.Generator(device="cuda").manual_seed(3)
    stage1, stage2 = triton_decode._split_decode_kernel, triton_decode._merge_splits_kernel
    for b, max_seq_len in ((1, 1024), (256, 1024)):  # warm both variants
        kc, vc, meta = paged([max_seq_len] * b, max_seq_len, gen)
        q = torch.randn(b, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
        be.decode(q, fp8_pages(kc, vc), meta)
    counts = (compiled(stage1), compiled(stage2))  # earlier tests of this process may have compiled more
    assert counts[0] >= 2 and counts[1] >= 1, counts
    for b, max_seq_len in ((1, 131072), (3, 100), (7, 5000), (64, 2048), (200, 33), (256, 8192)):
        kc, vc, meta = paged(mixed_lens(b, max_seq_len, gen), max_seq_len, gen)
        q = packed_qkv(b, gen)[0]
        layer = fp8_pages(kc, vc)
        out = be.decode(q, layer, meta)
        kd, vd = dequantised(layer)
        i = int(meta.seq_lens.argmax())
        want = ref_decode_one(q[i], kd, vd, meta.block_tables[i], int(meta.seq_lens[i]))
        assert rel_err(out[i], want) < BF16_TOL, (b, max_seq_len)
    assert (compiled(stage1), compiled(stage2)) == counts, "the split decode compiled again for a new shape"
