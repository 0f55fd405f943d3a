"""The page-transfer kernel (kernels.triton_kv_copy.copy_pages) against the host tier's per-run copies
(HostKVPool._copy, the CPU path and the fallback), on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess): saves to host pages and loads back into scattered GPU pages, pages of
fp32, fp16, fp64 and one-byte (FP8-sized) cells, runs and lone pages. On a GPU: tests/test_host_kv_gpu.py."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = r'''
import random
import torch
from autoprofile.engine.host_kv import HostKVPool, PageLists
from autoprofile.kernels.triton_kv_copy import copy_pages

random.seed(0)
torch.manual_seed(0)
for dtype, parts, cell in [(torch.float32, 2, (2, 4, 3)), (torch.float16, 2, (1, 4, 8)),
                           (torch.float64, 1, (2, 2, 1)), (torch.uint8, 2, (1, 3, 3))]:
    layers, gpu_pages, host_pages = 3, 12, 7
    gpu = (torch.randn(parts, layers, gpu_pages, *cell) * 50).to(dtype)
    ref = HostKVPool(host_pages, (parts, layers, *cell), dtype, pin=False)
    got = HostKVPool(host_pages, (parts, layers, *cell), dtype, pin=False)
    ref.buffer.zero_()
    got.buffer.zero_()
    saves = list(zip(random.sample(range(1, gpu_pages), 5), [0, 1, 2, 5, 6]))  # a run and lone pages
    loads = list(zip([6, 0, 1, 2], random.sample(range(1, gpu_pages), 4)))
    lists = PageLists(pin_memory=False)
    _, s, l = lists.stage(saves, loads)
    assert s.dtype == torch.int32 and s.tolist() == [list(p) for p in zip(*saves)]
    want_gpu, got_gpu = gpu.clone(), gpu.clone()
    ref._copy(want_gpu, saves, [])
    copy_pages(got_gpu, got.buffer, s)
    assert torch.equal(got.buffer, ref.buffer), ("saves", dtype)
    want_gpu[:, :, [d for _, d in loads]] = 0
    got_gpu[:, :, [d for _, d in loads]] = 0
    ref._copy(want_gpu, [], loads)
    copy_pages(got.buffer, got_gpu, l)
    assert torch.equal(got_gpu, want_gpu), ("loads", dtype)
    assert torch.equal(got_gpu[:, :, loads[0][1]], gpu[:, :, saves[4][0]])  # host page 6 came back
    copy_pages(got.buffer, got_gpu, torch.empty(2, 0, dtype=torch.int32))  # no pairs: nothing
try:
    copy_pages(torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4, 6), torch.zeros(2, 1, dtype=torch.int32))
except ValueError as e:
    assert "page layouts differ" in str(e)
else:
    raise AssertionError("mismatched layouts accepted")
print("ok")
'''


def test_page_transfer_kernel_matches_the_per_run_copies():
    run_script(CHECK)
