"""The torch reference backend on CPU against a plain float64 attention, plus backend selection and
the AITER Triton decode's pure rules (v1/v2 choice, per-call workspace)."""
from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autoprofile import budget
from autoprofile.kernels import launch_rules
from autoprofile.config import ConfigError
from autoprofile.engine import stress
from autoprofile.engine.envelope import Envelope
from autoprofile.engine.attention import (AttentionMetadata, BACKENDS, get_backend_class,
                                          resolve_backend_name)
from autoprofile.engine.attention import aiter_triton
from autoprofile.engine.attention.aiter_native import AiterNativeBackend
from autoprofile.engine.attention.aiter_triton import AiterTritonBackend
from autoprofile.kernels import aiter_loader, triton_prefill
from autoprofile.layers.attention import KVLayer
from autoprofile.engine.attention.torch_sdpa import TorchBackend


# ---------------------------------------------------------------- float64 reference (also used by tests/)
def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] -> [Lq, Hq, D] in float64; causal mask aligned bottom-right."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def ref_prefill(q, k, v, cu_seqlens) -> torch.Tensor:
    b = cu_seqlens.tolist()
    return torch.cat([ref_attention(q[s:e], k[s:e], v[s:e], True) for s, e in zip(b[:-1], b[1:])])


def ref_decode(q, k_cache, v_cache, block_tables, seq_lens, page_size) -> torch.Tensor:
    outs = []
    for i, n in enumerate(seq_lens.tolist()):
        pages = block_tables[i, : -(-n // page_size)].long()
        k = k_cache[pages].permute(0, 2, 1, 3).reshape(-1, *k_cache.shape[1:2], k_cache.shape[3])[:n]
        v = v_cache[pages].permute(0, 2, 1, 3).reshape(-1, *v_cache.shape[1:2], v_cache.shape[3])[:n]
        outs.append(ref_attention(q[i: i + 1], k, v, False))
    return torch.cat(outs)


def ref_rms_norm(x, w, eps) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def paged_case(seq_lens: list[int], hq: int, hkv: int, d: int, page: int, dtype, device="cpu", extra_cols=2,
               seed=0, max_seq_len: int | None = None):
    """A cache with random page placement; columns past each request's pages hold garbage (-1, huge)."""
    g = torch.Generator().manual_seed(seed)
    used = [-(-n // page) for n in seq_lens]
    cols = max(-(-(max_seq_len or max(seq_lens)) // page), max(used)) + extra_cols
    num_pages = sum(used) + 3
    perm = torch.randperm(num_pages, generator=g)
    tables = torch.full((len(seq_lens), cols), -1, dtype=torch.int32)
    tables[:, -1] = 10 ** 6
    at = 0
    for i, u in enumerate(used):
        tables[i, :u] = perm[at: at + u].to(torch.int32)
        at += u
    kc = torch.randn(num_pages, hkv, page, d, generator=g).to(dtype)
    vc = torch.randn(num_pages, hkv, page, d, generator=g).to(dtype)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),
                             block_tables=tables.to(device), seq_lens=sl.to(device),
                             max_seq_len=max_seq_len or max(seq_lens))
    return q.to(device), kc.to(device), vc.to(device), meta


def prefill_case(lens: list[int], hq: int, hkv: int, d: int, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype).to(device) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.zeros(t, dtype=torch.int64, device=device),
                             cu_seqlens=cu, max_seqlen=max(lens))
    return q, k, v, meta


def torch_backend(hq=8, hkv=2, d=16, page=16, dtype=torch.float32, **kw) -> TorchBackend:
    return TorchBackend(hq, hkv, d, page, dtype, torch.device("cpu"), **kw)


# ---------------------------------------------------------------- torch backend numerics
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)])
def test_prefill_varlen_causal_matches_float64(hq, hkv):
    q, k, v, meta = prefill_case([1, 5, 16, 33, 70], hq, hkv, 16, torch.float32)
    out = torch_backend(hq, hkv).prefill(q, k, v, meta)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, ref_prefill(q, k, v, meta.cu_seqlens)) < 1e-5


def test_prefill_is_per_request_not_across_requests():
    """Changing request 0's keys must not move request 1's outputs."""
    q, k, v, meta = prefill_case([9, 12], 4, 2, 16, torch.float32)
    be = torch_backend(4, 2)
    before = be.prefill(q, k, v, meta)
    k2 = k.clone()
    k2[:9] += 5.0
    after = be.prefill(q, k2, v, meta)
    assert torch.equal(before[9:], after[9:])
    assert not torch.allclose(before[:9], after[:9])


def test_prefill_chunks_over_cached_prefixes_match_float64():
    """(prefix, new) rows read prefix + new K/V from the paged cache (gather_kv) and attend causally,
    aligned bottom-right: equal to the last rows of the whole sequence's causal attention."""
    chunks = [(0, 5), (13, 4), (40, 1), (7, 9)]
    kv_lens = [p + n for p, n in chunks]
    q_all, kc, vc, meta = paged_case(kv_lens, 8, 2, 16, 4, torch.float32, seed=3)
    be = TorchBackend(8, 2, 16, 4, torch.float32, torch.device("cpu"))
    tables = meta.block_tables.long()
    slots = torch.cat([tables[i, torch.arange(n) // 4] * 4 + torch.arange(n) % 4 for i,
                       n in enumerate(kv_lens)])
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(n for _, n in chunks), 8, 16, generator=g)
    cu_q = torch.tensor([0, *torch.tensor([n for _, n in chunks]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    pmeta = AttentionMetadata(is_prefill=True, slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64),
                              cu_seqlens=cu_q, max_seqlen=9, kv_slots=slots, cu_seqlens_k=cu_k,
                              max_seqlen_k=40)
    k, v = be.gather_kv(KVLayer(kc, vc), slots)
    out = be.prefill(q, k, v, pmeta)
    for i in range(len(chunks)):
        want = ref_attention(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]], True)
        assert rel_err(out[cu_q[i]:cu_q[i + 1]], want) < 1e-5
    # the gathered keys are the cache's tokens in order
    page, off = slots[cu_k[1] + 3] // 4, slots[cu_k[1] + 3] % 4
    assert torch.equal(k[cu_k[1] + 3], kc[page, :, off])


def test_prefill_bf16_within_bf16_tolerance():
    q, k, v, meta = prefill_case([3, 64, 100], 8, 2, 32, torch.bfloat16)
    out = torch_backend(8, 2, 32, dtype=torch.bfloat16).prefill(q, k, v, meta)
    assert rel_err(out, ref_prefill(q, k, v, meta.cu_seqlens)) < 2e-2


def test_prefill_rejects_cu_seqlens_not_covering_q():
    q, k, v, meta = prefill_case([4, 4], 4, 2, 16, torch.float32)
    bad = AttentionMetadata(is_prefill=True, slot_mapping=meta.slot_mapping,
                            cu_seqlens=torch.tensor([0, 4, 7], dtype=torch.int32), max_seqlen=4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        torch_backend(4, 2).prefill(q, k, v, bad)


@pytest.mark.parametrize("chunk_bytes", [None, 4096])  # one chunk / several chunks per decode
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)])
def test_paged_decode_matches_float64(hq, hkv, chunk_bytes):
    seq_lens = [1, 15, 16, 17, 100, 160, 33]
    q, kc, vc, meta = paged_case(seq_lens, hq, hkv, 16, 16, torch.float32)
    kw = {} if chunk_bytes is None else {"decode_chunk_bytes": chunk_bytes}
    be = torch_backend(hq, hkv, **kw)
    if chunk_bytes:
        assert be.decode_chunk_pages(len(seq_lens), meta.block_tables.shape[1]) < meta.block_tables.shape[1]
    out = be.decode(q, KVLayer(kc, vc), meta)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = ref_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 16)
    for i in range(len(seq_lens)):  # every request right, not only on average
        assert rel_err(out[i], ref[i]) < 1e-5, f"request {i} (len {seq_lens[i]})"


def test_paged_decode_page_size_one_and_bf16():
    q, kc, vc, meta = paged_case([1, 2, 37], 4, 2, 8, 1, torch.bfloat16)
    out = torch_backend(4, 2, 8, page=1, dtype=torch.bfloat16).decode(q, KVLayer(kc, vc), meta)
    assert rel_err(out, ref_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 1)) < 2e-2


def test_paged_decode_reads_only_seq_len_tokens():
    """Tokens past seq_len (in the last page and in later pages) must not change the output."""
    q, kc, vc, meta = paged_case([20, 7], 4, 2, 16, 16, torch.float32)
    be = torch_backend(4, 2)
    before = be.decode(q, KVLayer(kc, vc), meta)
    kc2, vc2 = kc.clone(), vc.clone()
    p0, p1 = meta.block_tables[0, 1].item(), meta.block_tables[1, 0].item()
    kc2[p0, :, 4:] = 100.0
    vc2[p0, :, 4:] = -100.0
    kc2[p1, :, 7:] = 100.0
    assert torch.equal(be.decode(q, KVLayer(kc2, vc2), meta), before)
    # a cache is allocated uninitialized: cells past seq_len may hold NaN or inf bits, which a masked score's
    # zero weight must not carry into the output (0 * NaN is NaN; the unit test of piecewise steps saw a
    # decode row's logits turn NaN from its last page's unwritten tail)
    for bad in (float("nan"), float("inf")):
        kc3, vc3 = kc.clone(), vc.clone()
        kc3[p0, :, 4:], vc3[p0, :, 4:], vc3[p1, :, 7:] = bad, bad, bad
        assert torch.equal(be.decode(q, KVLayer(kc3, vc3), meta), before), bad


def test_decode_has_no_host_sync_or_data_dependent_shape(monkeypatch):
    """What a CUDA graph needs: run on meta tensors (no data at all) with .item()/.tolist() forbidden."""
    q, kc, vc, meta = paged_case([5, 40, 64], 8, 2, 16, 16, torch.float32)

    def forbidden(*_a, **_k):
        raise AssertionError("host sync in decode")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    m = AttentionMetadata(is_prefill=False, slot_mapping=meta.slot_mapping.to("meta"),
                          block_tables=meta.block_tables.to("meta"), seq_lens=meta.seq_lens.to("meta"),
                          max_seq_len=meta.max_seq_len)
    be = TorchBackend(8, 2, 16, 16, torch.float32, torch.device("meta"), decode_chunk_bytes=8192)
    out = be.decode(q.to("meta"), KVLayer(kc.to("meta"), vc.to("meta")), m)
    assert out.shape == q.shape and out.device.type == "meta"


def test_store_kv_round_trip():
    be = torch_backend(4, 2, 8, page=4)
    kc = torch.zeros(6, 2, 4, 8)
    vc = torch.zeros(6, 2, 4, 8)
    slots = torch.tensor([0, 5, 6, 23, 9], dtype=torch.int64)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    be.store_kv(k, v, KVLayer(kc, vc), slots)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(kc[s // 4, :, s % 4], k[i]) and torch.equal(vc[s // 4, :, s % 4], v[i])
    written = torch.zeros(6 * 4, dtype=torch.bool)
    written[slots] = True
    flat = kc.permute(0, 2, 1, 3).reshape(24, -1)
    assert flat[~written].abs().sum() == 0  # nothing else touched


def test_store_then_decode_sees_the_stored_tokens():
    """The runner's path: store K/V of a sequence at its slots, decode reads exactly them."""
    page, n = 4, 10
    be = torch_backend(4, 2, 8, page=page)
    kc, vc = torch.randn(8, 2, page, 8), torch.randn(8, 2, page, 8)
    pages = torch.tensor([6, 1, 3], dtype=torch.int32)
    slots = (pages.long()[:, None] * page + torch.arange(page)).reshape(-1)[:n]
    k, v, q = torch.randn(n, 2, 8), torch.randn(n, 2, 8), torch.randn(1, 4, 8)
    be.store_kv(k, v, KVLayer(kc, vc), slots)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots[-1:], block_tables=pages[None],
                             seq_lens=torch.tensor([n], dtype=torch.int32), max_seq_len=12)
    assert rel_err(be.decode(q, KVLayer(kc, vc), meta), ref_attention(q, k, v, False)) < 1e-5


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 32)])
def test_rms_norm_matches_float64(shape):
    x, w = torch.randn(*shape) * 3, torch.randn(shape[-1])
    out = torch_backend().rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, ref_rms_norm(x, w, 1e-6)) < 1e-6
    xb = x.bfloat16()
    wb = w.bfloat16()
    assert rel_err(torch_backend().rms_norm(xb, wb, 1e-6), ref_rms_norm(xb, wb, 1e-6)) < 1e-2


# ---------------------------------------------------------------- backend selection
def test_registry_names_match_the_flag_values():
    assert set(BACKENDS) == {"torch", "aiter_triton", "aiter"}
    assert BACKENDS["torch"] is TorchBackend and get_backend_class("torch") is TorchBackend


def test_auto_without_gpu_names_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("auto", "aiter_triton", "aiter"):
        with pytest.raises(ConfigError, match="--attention_backend torch"):
            get_backend_class(name)


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="attention_backend.*unknown"):
        get_backend_class("flashinfer")


@pytest.mark.parametrize("rocm,expected", [(False, AiterTritonBackend), (True, AiterNativeBackend)])
def test_auto_picks_by_platform(monkeypatch, rocm, expected):
    import autoprofile.engine.attention as attn

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attn, "is_rocm", lambda: rocm)
    monkeypatch.setattr(attn, "aiter_installed", lambda: True)
    assert get_backend_class("auto") is expected


def test_native_aiter_on_cuda_and_missing_aiter_are_config_errors(monkeypatch):
    import autoprofile.engine.attention as attn

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attn, "is_rocm", lambda: False)
    monkeypatch.setattr(attn, "aiter_installed", lambda: True)
    with pytest.raises(ConfigError, match="aiter_triton"):
        resolve_backend_name("aiter")
    monkeypatch.setattr(attn, "aiter_installed", lambda: False)
    with pytest.raises(ConfigError, match="amd-aiter.*--attention_backend torch"):
        resolve_backend_name("auto")


def test_loader_without_aiter_names_the_torch_backend(monkeypatch):
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    aiter_loader.load_aiter_triton.cache_clear()
    aiter_loader.triton_ops_package.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="--attention_backend torch"):
            aiter_loader.load_aiter_triton()
    finally:
        aiter_loader.load_aiter_triton.cache_clear()
        aiter_loader.triton_ops_package.cache_clear()


def test_is_rocm_follows_torch_version_hip(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert aiter_loader.is_rocm()
    monkeypatch.setattr(torch.version, "hip", None)
    assert not aiter_loader.is_rocm()


# ---------------------------------------------------------------- AITER Triton decode rules
@pytest.mark.parametrize("num_seqs,max_seq_len,v1", [
    (1, 1024, True),      # one partition
    (1, 1025, False),     # two partitions, 32 rows
    (16, 4096, False),    # 512 rows: not > 512
    (17, 4096, True),     # 544 rows
    (256, 8192, True),
    (256, 8193, False),   # past 8192 always v2
    (1, 131072, False),
])
def test_v1_v2_rule(num_seqs, max_seq_len, v1):
    assert aiter_triton.use_v1(num_seqs, 32, max_seq_len) is v1


def test_per_call_workspace_is_the_v2_scratch():
    # v2 GQA allocates exp_sums + max_logits fp32 [B, Hkv, P, G] and tmp_out [B, Hkv, P, G, D] (out dtype)
    b, hq, d, L = 4, 32, 128, 16384
    # eager, captured
    for partition in (launch_rules.TRITON_PARTITION, launch_rules.triton_decode_partition(b, hq, L)):
        parts = L // partition  # 16 eager; 64 in a graph (4 rows: partitions of 256 tokens)
        expected = 2 * (b * hq * parts * 4) + b * hq * parts * d * 2
        assert AiterTritonBackend.per_call_workspace_bytes(b, hq, d, L, 2, partition) == expected
        assert expected == budget.triton_decode_workspace_bytes(b, hq, d, L, 2, partition)
    assert AiterTritonBackend.per_call_workspace_bytes(b, hq, d, L,
                                                       2) == 2 * (b * hq * 16 * 4) + b * hq * 16 * d * 2
    assert AiterTritonBackend.per_call_workspace_bytes(256, hq, d, 2048, 2) == 0  # v1: no scratch


def test_aiter_triton_rejects_what_its_kernels_cannot_run():
    with pytest.raises(ValueError, match="torch"):
        AiterTritonBackend(8, 2, 16, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=">= 16"):
        AiterTritonBackend(8, 2, 16, 8, torch.bfloat16, torch.device("cpu"))


@pytest.mark.skipif(importlib.util.find_spec("aiter") is None and "aiter" not in sys.modules,
                    reason="amd-aiter not installed")
def test_v1_v2_rule_is_the_wrappers(monkeypatch):
    """Our choice equals what AITER's own paged_attention_decode picks (its v1/v2 mocked; CPU-only)."""
    pa = aiter_loader.load_pa_decode()
    assert pa._SEQ_PARTITION_SIZE == aiter_triton.SEQ_PARTITION
    picked = []
    monkeypatch.setattr(pa, "paged_attn_decode_v1", lambda *a, **k: picked.append(True))
    monkeypatch.setattr(pa, "paged_attn_decode_v2", lambda *a, **k: picked.append(False))
    one = torch.ones(1)
    for num_seqs in (1, 3, 16, 17, 64, 256):
        for max_seq_len in (16, 1024, 1025, 4096, 8192, 8193, 32768):
            q = torch.empty(num_seqs, 32, 8)
            kc = torch.empty(1, 8, 16, 8)
            pa.paged_attention_decode(q, q, kc, kc, None, None, 1.0, max_seq_len, None, one, one)
            assert picked.pop() is aiter_triton.use_v1(num_seqs, 32, max_seq_len), (num_seqs, max_seq_len)


def test_prefill_config_per_compute_capability(monkeypatch):
    """NVIDIA GPUs take their tuned entry (scripts/tune_prefill.py), others PREFILL_CONFIG; never the
    AMD-only `waves_per_eu`; a copy, so a launcher that consumes it cannot change the table."""
    monkeypatch.setattr(aiter_triton, "PREFILL_CONFIGS", {"sm_90": {"BLOCK_M": 64}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    got = aiter_triton.prefill_config()
    assert got == {"BLOCK_M": 64} and got is not aiter_triton.PREFILL_CONFIGS["sm_90"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert aiter_triton.prefill_config() == aiter_triton.PREFILL_CONFIG
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.2")  # gfx90a reports (9, 0) too
    assert aiter_triton.prefill_config() == aiter_triton.PREFILL_CONFIG
    assert "waves_per_eu" not in aiter_triton.PREFILL_CONFIG


@settings(max_examples=200, deadline=None)
@given(context=st.integers(2, 140_000), batch=st.integers(1, 20_000), running=st.integers(1, 300),
       page=st.sampled_from([16, 32, 64]))
def test_the_stress_runs_both_prefill_configs(context, batch, running, page):
    """Every envelope's prefill stress has a call whose requests read at most SHORT_PREFILL_KEYS keys (the
    short config) and, where a request can read more, one that does (the long config)."""
    env = Envelope.build(kv_pages=context * running // page + 64, page_size=page, context_len=context,
                         batch_max_tokens=batch, running_max_req_size=running,
                         graph_max_batch_size=min(running, 256), use_graphs=True)
    keys = [max(r.start + len(r.ids) for r in s.rows) for s in stress.prefill_steps(env, env.pages, 100, 0)]
    assert min(keys) <= aiter_triton.SHORT_PREFILL_KEYS
    assert max(keys) > aiter_triton.SHORT_PREFILL_KEYS or context - 1 <= aiter_triton.SHORT_PREFILL_KEYS


def test_short_prefill_calls_take_the_short_config_where_one_is_tuned(monkeypatch):
    """At most SHORT_PREFILL_KEYS keys a request: the short entry (a copy); longer, or none tuned: the long
    one."""
    monkeypatch.setattr(aiter_triton, "PREFILL_CONFIGS_SHORT", {"sm_90": {"BLOCK_M": 64}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    short, long = aiter_triton.prefill_config(short=True), {"BLOCK_M": 128}
    assert short == {"BLOCK_M": 64} and short is not aiter_triton.PREFILL_CONFIGS_SHORT["sm_90"]
    n = aiter_triton.SHORT_PREFILL_KEYS
    assert triton_prefill.pick_config(n, long, short) == short
    assert triton_prefill.pick_config(n + 1, long, short) == long
    picked = triton_prefill.pick_config(1, long, None)
    assert picked == long and picked is not long
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert aiter_triton.prefill_config(short=True) is None


@pytest.mark.parametrize("hq", [8, 16, 32, 64])
@pytest.mark.parametrize("page", [16, 32, 64])
def test_decode_partitions_shrink_for_few_rows_within_the_default_scratch(hq, page):
    """Fewer rows, smaller partitions (more programs for a batch of 1); the scratch never exceeds what
    AITER's fixed 1024 allocates at its largest v2 batch, partitions divide into pages, and a row never
    has more than TRITON_MAX_PARTITIONS of them."""
    largest_v2 = launch_rules.TRITON_V1_MIN_ROWS // hq
    for L in (4096, 16384, 65536, 131072):
        worst = budget.triton_decode_workspace_bytes(largest_v2, hq, 128, L, 2, launch_rules.TRITON_PARTITION)
        parts = [launch_rules.triton_decode_partition(n, hq, L, page) for n in range(1, largest_v2 + 1)]
        assert parts == sorted(parts) and parts[-1] == launch_rules.TRITON_PARTITION
        for n, p in enumerate(parts, 1):
            assert p % page == 0 and -(-L // p) <= launch_rules.TRITON_MAX_PARTITIONS
            assert budget.triton_decode_scratch_bytes(n, hq, 128, L, 2, p) <= worst
    assert launch_rules.triton_decode_partition(1, 32, 4096) == launch_rules.TRITON_MIN_PARTITION
    # 48 divides no power of 2
    assert launch_rules.triton_decode_partition(1, 32, 4096, page_size=48) == launch_rules.TRITON_PARTITION
