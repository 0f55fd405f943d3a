"""The native AITER backend's call contract, against a mocked `aiter` module (no ROCm here).

Signatures follow amd-aiter 0.1.7: aiter/ops/attention.py paged_attention_ragged(out, workspace_buffer,
query, key_cache, value_cache, scale, kv_indptr, kv_page_indices, kv_last_page_lens, block_size,
max_num_partitions, alibi_slopes, kv_cache_dtype, kv_cache_layout, logits_soft_cap, k_scale, v_scale,
fp8_out_scale=None, partition_size=256); aiter/ops/mha.py flash_attn_varlen_func(q, k, v, cu_seqlens_q,
cu_seqlens_k, max_seqlen_q, max_seqlen_k, ..., softmax_scale=, causal=); aiter/ops/rmsnorm.py
rmsnorm2d_fwd(input, weight, epsilon).
"""
from __future__ import annotations

import math
import sys
import types
from unittest.mock import MagicMock

import pytest
import torch

from autoprofile import budget
from autoprofile.engine.attention import AttentionMetadata
from autoprofile.engine.attention.aiter_native import AiterNativeBackend, ragged_pages
from autoprofile.layers.attention import KVLayer

HQ, HKV, D, PAGE = 8, 2, 64, 16


@pytest.fixture
def fake_aiter(monkeypatch):
    mod = types.ModuleType("aiter")
    mod.paged_attention_ragged = MagicMock(name="paged_attention_ragged")
    mod.flash_attn_varlen_func = MagicMock(name="flash_attn_varlen_func",
                                           side_effect=lambda q, *a, **k: torch.zeros_like(q))
    mod.rmsnorm2d_fwd = MagicMock(name="rmsnorm2d_fwd", side_effect=lambda x, w, eps: x * 2)
    monkeypatch.setitem(sys.modules, "aiter", mod)
    return mod


def backend() -> AiterNativeBackend:
    return AiterNativeBackend(HQ, HKV, D, PAGE, torch.bfloat16, torch.device("cpu"))


def as_layer(q, kc, vc, meta):
    return q, KVLayer(kc, vc), meta


def decode_inputs(seq_lens: list[int], cols: int, max_seq_len: int):
    b = len(seq_lens)
    tables = torch.arange(b * cols, dtype=torch.int32).view(b, cols).flip(1).contiguous()  # non-trivial ids
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(b, dtype=torch.int64),
                             block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             max_seq_len=max_seq_len)
    q = torch.randn(b, HQ, D).bfloat16()
    kc = torch.randn(b * cols, HKV, PAGE, D).bfloat16()
    return q, kc, kc.clone(), meta


def test_missing_aiter_names_the_other_backends(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", None)  # import aiter -> ImportError
    with pytest.raises(RuntimeError, match="aiter_triton or torch"):
        backend()


def test_workspace_is_the_declared_formula_and_build_allocates_exactly_it(fake_aiter):
    reqs, ctx = 6, 1000
    declared = AiterNativeBackend.workspace_bytes(reqs, ctx, HQ, D)
    parts = math.ceil(ctx / 256)
    assert declared == reqs * HQ * parts * (4 * D + 8) == budget.aiter_workspace_bytes(reqs, HQ, D, parts)
    # what SGLang allocates for the same kernel: fp32 partial outputs + 2 fp32 stats per partition
    assert declared == reqs * HQ * parts * D * 4 + 2 * reqs * HQ * parts * 4
    be = backend()
    assert be.workspace is None
    be.build(reqs, ctx)
    assert be.workspace.dtype == torch.uint8 and be.workspace.numel() == declared
    assert be.num_partitions == parts
    be.build(3, 256)  # a rebuild replaces, never stacks
    assert be.workspace.numel() == AiterNativeBackend.workspace_bytes(3, 256, HQ, D)
    be.teardown()
    assert be.workspace is None


def test_decode_calls_paged_attention_ragged_with_the_contract(fake_aiter):
    be = backend()
    be.build(max_decode_rows=4, max_context_len=1000)
    seq_lens = [1, 16, 17, 40]
    q, kc, vc, meta = decode_inputs(seq_lens, cols=5, max_seq_len=1000)
    out = be.decode(q, KVLayer(kc, vc), meta)
    assert out.shape == q.shape and out.dtype == torch.bfloat16

    (args, kwargs), = fake_aiter.paged_attention_ragged.call_args_list
    assert not kwargs and len(args) == 19
    (o, ws, query, key_cache, value_cache, scale, indptr, indices, last, block_size, parts, alibi, kv_dtype,
     layout, soft_cap, k_scale, v_scale, fp8_out_scale, partition) = args
    assert o is out
    assert ws is be.workspace
    assert query.data_ptr() == q.data_ptr() and query.shape == (4, HQ, D)
    assert key_cache is kc and value_cache is vc and key_cache.shape == (20, HKV, PAGE, D)
    assert scale == pytest.approx(D ** -0.5) and isinstance(scale, float)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert indptr.tolist() == [0, 1, 2, 4, 7]
    tables = meta.block_tables.tolist()
    assert indices[:7].tolist() == tables[0][:1] + tables[1][:1] + tables[2][:2] + tables[3][:3]
    assert last.tolist() == [1, 16, 1, 8]
    assert block_size == PAGE and parts == 4 and partition == 256
    assert alibi is None and fp8_out_scale is None
    assert kv_dtype == "auto" and layout == "HND" and soft_cap == 0.0
    assert k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.tolist() == v_scale.tolist() == [1.0]
    # the kernel's workspace need at this batch and partition count fits what build allocated
    assert budget.aiter_workspace_bytes(q.shape[0], HQ, D, parts) <= ws.numel()


def test_decode_refuses_what_the_workspace_cannot_hold(fake_aiter):
    be = backend()
    with pytest.raises(RuntimeError, match="build"):
        be.decode(*as_layer(*decode_inputs([3], 1, 16)))
    be.build(max_decode_rows=2, max_context_len=512)
    with pytest.raises(ValueError, match="batch 3"):
        be.decode(*as_layer(*decode_inputs([3, 3, 3], 1, 16)))
    with pytest.raises(ValueError, match="max_seq_len 513"):
        be.decode(*as_layer(*decode_inputs([3], 33, 513)))
    fake_aiter.paged_attention_ragged.assert_not_called()


def test_prefill_calls_flash_attn_varlen(fake_aiter):
    be = backend()
    t = 12
    q, k, v = (torch.randn(t, h, D).bfloat16() for h in (HQ, HKV, HKV))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(t), cu_seqlens=cu, max_seqlen=7)
    out = be.prefill(q, k, v, meta)
    assert out.shape == q.shape
    (args, kwargs), = fake_aiter.flash_attn_varlen_func.call_args_list
    assert args[0] is q and args[1] is k and args[2] is v
    assert args[3] is cu and args[4] is cu and args[5:7] == (7, 7)
    assert kwargs == {"softmax_scale": pytest.approx(D ** -0.5), "causal": True}


def test_rms_norm_calls_rmsnorm2d_fwd_on_2d_rows(fake_aiter):
    be = backend()
    x, w = torch.randn(3, 4, D), torch.randn(D)
    out = be.rms_norm(x, w, 1e-5)
    (args, _), = fake_aiter.rmsnorm2d_fwd.call_args_list
    assert args[0].shape == (12, D) and args[0].is_contiguous() and args[1] is w and args[2] == 1e-5
    assert out.shape == x.shape and torch.equal(out, x * 2)


@pytest.mark.parametrize("seq_lens,page", [([1, 16, 17, 40], 16), ([5, 5, 64], 32), ([1], 16),
                                           ([33, 1, 100], 1)])
def test_ragged_pages_matches_a_python_reference(seq_lens, page):
    cols = max(-(-n // page) for n in seq_lens) + 2
    g = torch.Generator().manual_seed(0)
    tables = torch.randint(0, 1000, (len(seq_lens), cols), generator=g, dtype=torch.int32)
    indptr, indices, last = ragged_pages(tables, torch.tensor(seq_lens, dtype=torch.int32), page)
    used = [-(-n // page) for n in seq_lens]
    assert indptr.tolist() == [0, *torch.tensor(used).cumsum(0).tolist()]
    assert indices.tolist()[: sum(used)] == [p for row, u in zip(tables.tolist(), used) for p in row[:u]]
    assert last.tolist() == [n - (u - 1) * page for n, u in zip(seq_lens, used)]
    assert all(1 <= x <= page for x in last.tolist())


def test_ragged_pages_has_static_shapes():
    """Graph-safe: runs on meta tensors (no data), shapes from the table alone."""
    tables = torch.empty(5, 7, dtype=torch.int32, device="meta")
    indptr, indices, last = ragged_pages(tables, torch.empty(5, dtype=torch.int32, device="meta"), 16)
    assert indptr.shape == (6,) and indices.shape == (36,) and last.shape == (5,)
