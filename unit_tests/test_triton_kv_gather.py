"""The prefill's K/V gather kernel (kernels.triton_kv_gather.gather) against torch's advanced indexing of the
paged cache (AttentionBackend.gather_kv's reference), on the CPU through Triton's interpreter: caches of fp32,
fp16 and one-byte cells, head widths that are and are not powers of two, caches that are views of the KV
buffer (a page stride past one page), slots across pages and in any order, a count that is not a multiple of
the kernel's block, none at all. On a GPU: tests/test_kernels.py (the chunked prefill through gather_kv)."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = r'''
import torch
from autoprofile.kernels import triton_kv_gather

torch.manual_seed(0)
for dtype, hkv, page, d, n in [(torch.float32, 2, 16, 8, 37), (torch.float16, 3, 16, 8, 16),
                               (torch.uint8, 1, 32, 4, 5), (torch.float32, 4, 16, 16, 1)]:
    pages = 9
    # [parts=2, pages, hkv, page, d] like KVCache's buffer: K and V views with a page stride of both parts
    buf = (torch.randn(pages, 2, hkv, page, d) * 50).to(dtype)
    kc, vc = buf[:, 0], buf[:, 1]
    slots = torch.randint(0, pages * page, (n,))
    slots[0] = pages * page - 1  # the last cell
    k, v = triton_kv_gather.gather(kc, vc, slots)
    p, o = slots // page, slots % page
    assert k.shape == (n, hkv, d) and k.dtype == dtype and k.is_contiguous()
    assert torch.equal(k, kc[p, :, o]), (dtype, hkv, d, n, "k")
    assert torch.equal(v, vc[p, :, o]), (dtype, hkv, d, n, "v")
k, v = triton_kv_gather.gather(kc, vc, torch.zeros(0, dtype=torch.int64))
assert k.shape == (0, 4, 16) and v.shape == (0, 4, 16)
try:
    triton_kv_gather.gather(kc, vc[:, :2], slots)
except ValueError as e:
    assert "K and V caches differ" in str(e)
else:
    raise AssertionError("mismatched caches accepted")
print("ok")
'''


def test_gather_matches_torch_indexing_of_the_paged_cache():
    run_script(CHECK)
