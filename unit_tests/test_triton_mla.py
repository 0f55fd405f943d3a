"""MLA's absorbed decode as the aiter_triton backend runs it (kernels.triton_mla: our kernel over the paged
latent cache, the splits merged by triton_decode's merge) on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess), against the torch reference's mla_decode over the same cache: shuffled
pages, rows ending mid-page and on a page boundary, one token, one split and many, rows sharing one cached
prefix, a latent width that is no power of two; and a row's output with a fixed split count the same alone
and in a batch. float32 and float16 (the interpreter's bf16 dot is not exact)."""
from __future__ import annotations

import importlib.util

import pytest

from autoprofile.kernels import launch_rules
from unit_tests.interpreter import run_script

DECODE = r'''
import torch
from autoprofile.kernels import triton_mla
from autoprofile.engine.attention.torch_sdpa import TorchBackend
from autoprofile.layers.attention import AttentionMetadata, KVLayer

torch.manual_seed(0)
H, PAGE, PAGES = 4, 16, 40


def check(q, latents, tables, lens, ctx, r, rows, tol, launch=None):
    ref = TorchBackend(H, H, latents.shape[-1], PAGE, q.dtype, torch.device("cpu"))
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(len(lens), dtype=torch.long),
                             block_tables=tables, seq_lens=lens, max_seq_len=ctx)
    got = triton_mla.mla_decode(q, latents, tables, lens, 0.2, r, rows, launch).float()
    want = ref.mla_decode(q, KVLayer(latents, latents), meta, 0.2, r).float()
    err = float((got - want).abs().max() / want.abs().max())
    assert got.shape == (len(lens), H, r) and err < tol, (q.dtype, len(lens), rows, launch, err)
    return got


for (r, p), dtype, tol in (((32, 16), torch.float32, 1e-5), ((32, 16), torch.float16, 3e-3),
                           ((24, 8), torch.float32, 1e-5)):
    latents = torch.randn(PAGES, 1, PAGE, r + p).to(dtype)
    for b, rows in ((1, 1), (3, 4), (6, 8), (6, 256)):  # 32, 32, 17 and 1 split(s)
        lens = torch.tensor([1, 37, 100, 16, 5, 128][:b], dtype=torch.int32)
        tables = torch.stack([torch.randperm(PAGES - 1)[:8] + 1 for _ in range(b)]).int()
        q = torch.randn(b, H, r + p).to(dtype)
        check(q, latents, tables, lens, 128, r, rows, tol)
        check(q, latents, tables, lens, 128, r, rows, tol, (3, triton_mla.CONFIG))
# --deterministic's fixed splits: a row's output alone equals (bitwise) its output in a batch
latents = torch.randn(PAGES, 1, PAGE, 48)
lens = torch.tensor([300, 37, 512, 16], dtype=torch.int32)
tables = torch.stack([torch.randperm(PAGES - 1)[:32] + 1 for _ in range(4)]).int()
q = torch.randn(4, H, 48)
launch = (triton_mla.INVARIANT_SPLITS, triton_mla.CONFIG)
crowd = check(q, latents, tables, lens, 512, 32, 4, 1e-5, launch)
for i in range(4):
    alone = check(q[i:i + 1], latents, tables[i:i + 1], lens[i:i + 1], 512, 32, 1, 1e-5, launch)
    assert torch.equal(alone[0], crowd[i]), i
# a call's scratch: at a padded count it holds the most any count of 1..rows takes (launch_rules), even at one
# split; a fixed launch (--deterministic) holds its own partials
from autoprofile.kernels import launch_rules
from autoprofile.kernels import triton_decode
held, carve = [], triton_decode.split_scratch
def spy(out, splits, reserve_bytes=0):
    got = carve(out, splits, reserve_bytes)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in got if t is not out}
    held.append(sum(storages.values()))
    return got
triton_decode.split_scratch = spy
q = torch.randn(6, H, 48)
lens = torch.tensor([300, 37, 512, 16, 5, 128], dtype=torch.int32)
tables = torch.stack([torch.randperm(PAGES - 1)[:32] + 1 for _ in range(6)]).int()
for rows in (8, 256):  # 17 splits; one split, the reserve only
    check(q, latents, tables, lens, 512, 32, rows, 1e-5)
    assert held[-1] == launch_rules.mla_decode_scratch_bytes(rows, H, 32) > 0, (rows, held)
check(q, latents, tables, lens, 512, 32, 256, 1e-5, launch)
assert held[-1] == launch_rules.mla_partials_bytes(6, H, 32, triton_mla.INVARIANT_SPLITS), held
triton_decode.split_scratch = carve
# rows sharing one cached prefix (4 pages)
shared = torch.arange(1, 5, dtype=torch.int32).repeat(6, 1)
lens = torch.full((6,), 4 * PAGE, dtype=torch.int32)
check(torch.randn(6, H, 48), torch.randn(5, 1, PAGE, 48), shared, lens, 4 * PAGE, 32, 8, 1e-5)
print("ok")
'''


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton needed")
def test_mla_decode_over_the_paged_latents_equals_the_reference():
    run_script(DECODE)


def test_decode_rows_run_at_compiled_counts():
    """The graph ladder's sizes while a graph holds the rows (each compiled at capture), the envelope's most
    rows above (the stress's corner): never a count no build compiled."""
    pytest.importorskip("triton")
    from autoprofile.kernels.triton_mla import padded_rows
    ladder = launch_rules.batch_ladder(64)
    assert [padded_rows(n, 64, 256) for n in (1, 3, 5, 9, 17, 63, 64)] == [1, 4, 8, 16, 24, 64, 64]
    assert all(padded_rows(n, 64, 256) in ladder for n in range(1, 65))
    assert [padded_rows(n, 64, 256) for n in (65, 200, 256)] == [256, 256, 256]
    assert padded_rows(7, 0, 32) == 32  # no graphs: every count at the most rows
