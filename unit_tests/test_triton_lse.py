"""The sampler's one-pass log-sum-exp Triton kernel against torch, on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess: the flag is read when the kernel module is imported). The
interpreter has no bfloat16: float16 and float32 here; bf16 on the GPU (tests/test_sampling_gpu.py)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = r'''
import torch
from autoprofile.engine import triton_lse

torch.manual_seed(0)
for dtype, rows, vocab, scale in [(torch.float32, 3, 5000, 5.0), (torch.float16, 4, 2048, 1.0),
                                   (torch.float32, 2, 7, 30.0), (torch.float32, 1, 4097, 80.0)]:
    x = (torch.randn(rows, vocab) * scale).to(dtype)
    temps = torch.rand(rows) * 2 + 0.05
    want = torch.logsumexp(x.float() / temps[:, None], dim=-1)
    got = triton_lse.scaled_logsumexp(x, 1 / temps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
# a row of a wider buffer (row stride > vocab), and masked logits (-inf) among finite ones
big = torch.randn(3, 6000)
x = big[:, :5000]
x[1, ::2] = float("-inf")
inv = torch.tensor([1.0, 0.5, 4.0])
torch.testing.assert_close(triton_lse.scaled_logsumexp(x, inv), torch.logsumexp(x * inv[:, None], dim=-1),
                           rtol=1e-5, atol=1e-4)
print("ok")
'''


def test_one_pass_scaled_logsumexp_matches_torch():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
