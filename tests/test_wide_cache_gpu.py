"""GPU: one layer's cache past 2^31 elements (budget.INDEX_LIMIT), which a small KV per token reaches on a
large card: qwen3.5-35b-a3b's full layers (2 KV heads x 256) were capped at 4,194,288 tokens on an H200, and
deepseek-v2-lite's latent (576) at 3,728,256, with memory left for more. On aiter_triton every kernel that
indexes the cache must offset it in 64 bits (budget.wide_offsets): AITER's v1/v2 decode offsets pages in 32,
so past the limit the backend decodes through our split kernel at every row count; the RoPE store, the K/V
gather and MLA's decode are ours. Each against the torch backend (torch's indexing) over pages past the
limit."""
from __future__ import annotations

import pytest
import torch

from autoprofile import budget
from autoprofile.layers.attention import AttentionMetadata, KVLayer
from tests.conftest import require_backend
from unit_tests.test_attention_cpu import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HQ, HKV, D, PAGE = 8, 1, 128, 16
PAGES = 1_100_000  # x 2,048 elements a page: 2.25e9, past 2^31 - 1
FIRST_WIDE = budget.INDEX_LIMIT // (HKV * PAGE * D) + 1  # the first page whose offset passes 32 bits


def backends(hq: int = HQ, hkv: int = HKV, head_dim: int = D):
    require_backend("aiter_triton")
    from autoprofile.engine.attention.aiter_triton import AiterTritonBackend
    from autoprofile.engine.attention.torch_sdpa import TorchBackend
    dev = torch.device("cuda")
    return (AiterTritonBackend(hq, hkv, head_dim, PAGE, torch.bfloat16, dev),
            TorchBackend(hq, hkv, head_dim, PAGE, torch.bfloat16, dev))


def top_pages(rows: int, per_row: int, pages: int, first: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, per_row] distinct int32 pages, all at or past `first` (past the 32-bit limit)."""
    assert first + rows * per_row <= pages
    pick = torch.randperm(pages - first, device="cuda", generator=gen)[:rows * per_row] + first
    return pick.view(rows, per_row).int()


@pytest.mark.parametrize("rows", [1, 64, 256])
def test_decode_reads_pages_past_the_32_bit_limit(rows):
    """1 row takes the split decode anyway; 64 and 256 rows took AITER's v1/v2 (past SPLIT_DECODE_ROWS), whose
    32-bit page offsets wrap past the limit."""
    ours, ref = backends()
    gen = torch.Generator(device="cuda").manual_seed(rows)
    kc, vc = (torch.empty(PAGES, HKV, PAGE, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    assert kc.numel() > budget.INDEX_LIMIT
    per_row, longest = 40, 40 * PAGE
    tables = top_pages(rows, per_row, PAGES, FIRST_WIDE, gen)
    used = tables.flatten().long()
    for c in (kc, vc):
        c[used] = torch.randn(used.numel(), HKV, PAGE, D, device="cuda", generator=gen).bfloat16()
    lens = torch.randint(1, longest + 1, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    slots = torch.zeros(rows, dtype=torch.int64, device="cuda")
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots, block_tables=tables, seq_lens=lens,
                             max_seq_len=longest)
    q = torch.randn(rows, HQ, D, device="cuda", generator=gen).bfloat16()
    got = ours.decode(q, KVLayer(kc, vc), meta)
    want = ref.decode(q, KVLayer(kc, vc), meta)
    assert rel_err(got, want) < 2e-2


def test_rope_store_and_gather_reach_slots_past_the_32_bit_limit():
    """Our RoPE store writes K and V at slots past the limit (the same cells torch's store writes into a small
    cache at slots 0..t-1), and our gather reads them back."""
    ours, ref = backends()
    gen = torch.Generator(device="cuda").manual_seed(7)
    t = 64
    kc, vc = (torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    slots = (top_pages(1, t, PAGES, FIRST_WIDE, gen)[0].long() * PAGE
             + torch.randint(0, PAGE, (t,), device="cuda", generator=gen))
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device="cuda", generator=gen).bfloat16()
    angles = torch.rand(t, 1, D // 2, device="cuda", generator=gen) * 6.28
    cos, sin = angles.cos(), angles.sin()
    q = ours.rope_store(qkv.clone(), cos, sin, KVLayer(kc, vc), slots)[0]
    small = [torch.zeros(-(-t // PAGE), HKV, PAGE, D, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    want_q = ref.rope_store(qkv.clone(), cos, sin, KVLayer(*small), torch.arange(t, device="cuda"))[0]
    assert rel_err(q, want_q) < 1e-2
    for big, little in zip((kc, vc), small, strict=True):
        stored = big[slots // PAGE, :, slots % PAGE]  # torch's (64-bit) indexing
        written = little.permute(0, 2, 1, 3).reshape(-1, HKV, D)[:t]  # slot s: page s // PAGE, cell s % PAGE
        assert stored.abs().sum() > 0 and rel_err(stored, written) < 1e-2
    from autoprofile.kernels import triton_kv_gather
    k, v = triton_kv_gather.gather(kc, vc, slots)
    cells = (slots // PAGE, slice(None), slots % PAGE)
    assert torch.equal(k, kc[cells]) and torch.equal(v, vc[cells])


@pytest.mark.parametrize("rows", [1, 64])
def test_mla_decode_reads_latents_past_the_32_bit_limit(rows):
    """MLA's latent cache [pages, 1, page, 576] (deepseek-v2-lite's widths) past the limit."""
    heads, rank, rope = 16, 512, 64
    ours, ref = backends(heads, heads, 128)
    ours.build(64, 4096, 16)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    width = rank + rope
    first = budget.INDEX_LIMIT // (PAGE * width) + 1  # the first page past the limit
    pages = first + 64 * 64
    latents = torch.empty(pages, 1, PAGE, width, dtype=torch.bfloat16, device="cuda")
    assert latents.numel() > budget.INDEX_LIMIT
    tables = top_pages(rows, 64, pages, first, gen)
    used = tables.flatten().long()
    latents[used] = torch.randn(used.numel(), 1, PAGE, width, device="cuda", generator=gen).bfloat16()
    lens = torch.randint(1, 64 * PAGE + 1, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    slots = torch.zeros(rows, dtype=torch.long, device="cuda")
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots, block_tables=tables, seq_lens=lens,
                             max_seq_len=64 * PAGE)
    q = torch.randn(rows, heads, width, device="cuda", generator=gen).bfloat16()
    kv = KVLayer(latents, latents)
    scale = (128 + rope) ** -0.5
    assert rel_err(ours.mla_decode(q, kv, meta, scale, rank), ref.mla_decode(q, kv, meta, scale, rank)) < 2e-2
