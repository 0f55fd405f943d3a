"""Our varlen prefill kernel (kernels.triton_prefill) against the torch reference backend's varlen
attention, on the CPU through Triton's interpreter (in a subprocess: TRITON_INTERPRET is read at import). The
interpreter has no bfloat16: float16 here, bf16 on the GPU (tests/test_kernels.py)."""
from __future__ import annotations

import importlib.util

import pytest

from autoprofile.kernels import triton_prefill
from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = r'''
import sys
import torch
from autoprofile.kernels import triton_prefill
from autoprofile.engine.attention.torch_sdpa import TorchBackend
from autoprofile.layers.attention import AttentionMetadata

torch.manual_seed(0)
hq, hkv, d = 4, 2, 32
variant = sys.argv[1]
# (new tokens, keys) per request: a chunk over a prefix, one token over a prefix, tiles cut mid-way, a
# request whose keys end inside a tile, a first row that sees all but the last key of a tile
for q_lens, k_lens, block in [([5, 37, 1, 64], [5, 50, 70, 64], (16, 16)), ([33], [33], (32, 16)),
                              ([1, 17], [40, 17], (16, 32)), ([20], [34], (16, 16))]:
    cu_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    t, tk = sum(q_lens), sum(k_lens)
    packed = torch.randn(t, (hq + 2 * hkv) * d, dtype=torch.float16)  # q: a view of the packed projection
    q = packed[:, :hq * d].view(t, hq, d)
    kv = torch.randn(tk, 2 * hkv * d, dtype=torch.float16)
    kv[tk // 2:tk // 2 + 4, :hkv * d] *= 8  # keys whose scores jump mid-sequence: the max moves
    k, v = kv[:, :hkv * d].view(tk, hkv, d), kv[:, hkv * d:].view(tk, hkv, d)
    out = torch.full((t + 3, hq, d), 7.0, dtype=torch.float16)  # rows past the call's stay untouched
    config = {"BLOCK_M": block[0], "BLOCK_N": block[1], "num_warps": 4, "num_stages": 1,
              "TMA": variant == "tma"}
    got = triton_prefill.prefill(out[:t], q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), d ** -0.5, config)
    assert got.data_ptr() == out.data_ptr()
    same = t == tk and q_lens == k_lens
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.zeros(t, dtype=torch.int64), cu_seqlens=cu_q,
                             max_seqlen=max(q_lens), cu_seqlens_k=None if same else cu_k,
                             max_seqlen_k=max(k_lens))
    ref = TorchBackend(hq, hkv, d, 16, torch.float16, torch.device("cpu")).prefill(q, k, v, meta)
    torch.testing.assert_close(out[:t], ref, rtol=2e-3, atol=2e-3)
    assert (out[t:] == 7).all()
# heads at a stride other than head_dim (a slice of wider rows): a TMA config reads them with plain loads
wide = torch.randn(9, hkv, 2 * d, dtype=torch.float16)
k, v, q = wide[..., :d], wide[..., d:], torch.randn(9, hq, d, dtype=torch.float16)
cu = torch.tensor([0, 9], dtype=torch.int32)
config = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "TMA": variant == "tma"}
got = triton_prefill.prefill(torch.empty_like(q), q, k, v, cu, cu, 9, 9, d ** -0.5, config)
meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.zeros(9, dtype=torch.int64), cu_seqlens=cu,
                         max_seqlen=9)
ref = TorchBackend(hq, hkv, d, 16, torch.float16, torch.device("cpu")).prefill(q, k, v, meta)
torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)
print("ok")
'''


@pytest.mark.parametrize("variant", ["plain", "tma"])
def test_prefill_matches_the_torch_reference(variant):
    """Causal bottom-right over prefixes, GQA, the packed projection's strides, and only its own rows written:
    the plain kernel (every GPU) and the TMA one (Hopper's tensor descriptors)."""
    run_script(CHECK, variant)


def test_short_calls_take_the_short_config(monkeypatch):
    monkeypatch.setattr(triton_prefill, "CONFIGS", {"sm_90": {"BLOCK_M": 128}})
    monkeypatch.setattr(triton_prefill, "CONFIGS_SHORT", {"sm_90": {"BLOCK_M": 64}})

    def launch_config(max_keys, capability):
        return triton_prefill.pick_config(max_keys, *triton_prefill.configs(capability))

    assert launch_config(triton_prefill.SHORT_KEYS, "sm_90") == {"BLOCK_M": 64}
    assert launch_config(triton_prefill.SHORT_KEYS + 1, "sm_90") == {"BLOCK_M": 128}
    assert launch_config(16, "sm_80") == triton_prefill.CONFIG  # none tuned: the default
    assert launch_config(16, None) == triton_prefill.CONFIG


@pytest.mark.parametrize("head_dim, rocm, ours", [(64, False, True), (128, False, True), (256, False, False),
                                                  (96, False, False), (8, False, False), (128, True, False)])
def test_aiter_triton_prefill_takes_it_where_its_configs_fit(head_dim, rocm, ours):
    """Powers of two up to the 128-wide heads the configs are tuned for, on NVIDIA; the rest keep AITER's."""
    assert triton_prefill.serves(head_dim, rocm) is ours


def test_heads_it_cannot_run_are_refused_before_a_launch():
    import torch

    q = torch.zeros(4, 4, 24)
    with pytest.raises(ValueError, match="head_dim a power of two"):
        cu = torch.tensor([0, 4])
        triton_prefill.prefill(q, q, q[:, :2], q[:, :2], cu, cu, 4, 4, 1.0)
