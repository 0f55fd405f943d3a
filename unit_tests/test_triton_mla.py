"""MLA's absorbed decode as the aiter_triton backend runs it (kernels.triton_mla: our packed token slots,
AITER's Triton MLA decode) on the CPU through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess),
against the torch reference's mla_decode over the same paged latent cache: shuffled pages, rows ending
mid-page and on a page boundary, one token, and zero-length padding rows. float32 and float16 (the
interpreter has no bf16)."""
from __future__ import annotations

import importlib.util

import pytest

from autoprofile import budget
from unit_tests.interpreter import run_script

DECODE = r'''
import torch
from autoprofile.kernels import triton_mla
from autoprofile.engine.attention.torch_sdpa import TorchBackend
from autoprofile.layers.attention import AttentionMetadata, KVLayer

torch.manual_seed(0)
H, R, P, PAGE, PAGES = 4, 32, 16, 16, 40
ref = TorchBackend(H, H, R + P, PAGE, torch.float16, torch.device("cpu"))
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
    latents = torch.randn(PAGES, 1, PAGE, R + P).to(dtype)
    for b, rows in ((1, 1), (3, 4), (6, 8)):
        lens = torch.tensor([1, 37, 100, 16, 5, 128][:b], dtype=torch.int32)
        tables = torch.stack([torch.randperm(PAGES - 1)[:8] + 1 for _ in range(b)]).int()
        meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(b, dtype=torch.long),
                                 block_tables=tables, seq_lens=lens, max_seq_len=128)
        q = torch.randn(b, H, R + P).to(dtype)
        got = triton_mla.mla_decode(q, latents, tables, lens, 128, 0.2, R, rows).float()
        want = ref.mla_decode(q, KVLayer(latents, latents), meta, 0.2, R).float()
        err = float((got - want).abs().max() / want.abs().max())
        assert got.shape == (b, H, R) and err < tol, (dtype, b, rows, err)
    indptr, slots = triton_mla.kv_slots(tables, lens, PAGE, 128)
    for r, n in enumerate(lens.tolist()):
        want = [int(tables[r, t // PAGE]) * PAGE + t % PAGE for t in range(n)]
        assert slots[int(indptr[r]):int(indptr[r + 1])].tolist() == want
# rows sharing one cached prefix: their tokens together outnumber the cache's slots (4 pages here)
shared = torch.arange(1, 5, dtype=torch.int32).repeat(6, 1)
lens = torch.full((6,), 4 * PAGE, dtype=torch.int32)
indptr, slots = triton_mla.kv_slots(shared, lens, PAGE, 4 * PAGE)
assert int(indptr[-1]) == 6 * 4 * PAGE <= len(slots)
assert slots[int(indptr[5]):].tolist() == list(range(PAGE, 5 * PAGE))
q = torch.randn(6, H, R + P)
latents = torch.randn(5, 1, PAGE, R + P)
meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(6, dtype=torch.long), block_tables=shared,
                         seq_lens=lens, max_seq_len=4 * PAGE)
got = triton_mla.mla_decode(q, latents, shared, lens, 4 * PAGE, 0.2, R, 8)
want = ref.mla_decode(q, KVLayer(latents, latents), meta, 0.2, R)
assert float((got - want).abs().max() / want.abs().max()) < 1e-5
print("ok")
'''


@pytest.mark.slow  # minutes on 2 cores (the interpreter or a crowd); the slow run has it
@pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("aiter") is None,
                    reason="triton and amd-aiter needed")
def test_aiters_mla_decode_over_our_slots_equals_the_reference():
    run_script(DECODE)


def test_decode_rows_run_at_compiled_counts():
    """The graph ladder's sizes while a graph holds the rows (each compiled at capture), the envelope's most
    rows above (the stress's corner): never a count no build compiled."""
    pytest.importorskip("triton")
    from autoprofile.kernels.triton_mla import padded_rows
    ladder = budget.batch_ladder(64)
    assert [padded_rows(n, 64, 256) for n in (1, 3, 5, 9, 17, 63, 64)] == [1, 4, 8, 16, 24, 64, 64]
    assert all(padded_rows(n, 64, 256) in ladder for n in range(1, 65))
    assert [padded_rows(n, 64, 256) for n in (65, 200, 256)] == [256, 256, 256]
    assert padded_rows(7, 0, 32) == 32  # no graphs: every count at the most rows
