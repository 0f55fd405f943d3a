"""MLA's absorption kernels (kernels.triton_mla_absorb: the query into the latent space with q_pe beside it,
the output out of it) against the einsums they replace, on the CPU through Triton's interpreter (float32 and
float16; bf16 on the GPU: tests/test_kernels.py), with the model's views of q and kv_b_proj's weight."""
from __future__ import annotations

import importlib.util

import pytest

from unit_tests.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = r'''
import torch
from autoprofile.kernels import triton_mla_absorb as k

torch.manual_seed(0)
H, NOPE, ROPE, RANK, V = 4, 16, 8, 128, 32
for dtype in (torch.float32, torch.float16):
    w = (torch.randn(H, NOPE + V, RANK) * 0.1).to(dtype)  # kv_b_proj's weight as [H, nope + v, rank]
    w_uk, w_uv = w.split([NOPE, V], dim=1)
    for t in range(1, k.MAX_ROWS + 1):
        q = torch.randn(t, H, NOPE + ROPE).to(dtype)
        q_nope, q_pe = q[..., :NOPE], q[..., NOPE:]
        assert k.absorb_serves(q_nope, q_pe, w_uk)
        got = k.absorb(q_nope, q_pe, w_uk)
        want = torch.cat([torch.einsum("thn,hnr->thr", q_nope.float(), w_uk.float()), q_pe.float()], dim=-1)
        tol = 1e-4 if dtype == torch.float32 else 2e-3
        assert got.shape == (t, H, RANK + ROPE) and got.dtype == dtype
        assert torch.allclose(got.float(), want, rtol=tol, atol=tol), (t, (got.float() - want).abs().max())
        assert torch.equal(got[..., RANK:], q_pe)
        o_lat = torch.randn(t, H, RANK).to(dtype)
        assert k.unabsorb_serves(o_lat, w_uv)
        got = k.unabsorb(o_lat, w_uv)
        want = torch.einsum("thr,hvr->thv", o_lat.float(), w_uv.float()).reshape(t, H * V)
        assert got.shape == (t, H * V) and got.dtype == dtype
        assert torch.allclose(got.float(), want, rtol=tol, atol=tol), (t, (got.float() - want).abs().max())
# more rows, or a weight whose heads' rows are not contiguous: the einsums take the step
q = torch.randn(k.MAX_ROWS + 1, H, NOPE + ROPE)
assert not k.absorb_serves(q[..., :NOPE], q[..., NOPE:], w_uk.float())
assert not k.unabsorb_serves(torch.randn(k.MAX_ROWS + 1, H, RANK), w_uv.float())
assert not k.unabsorb_serves(torch.randn(1, H, RANK), torch.randn(H, RANK, V).transpose(1, 2))
print("ok")
'''


def test_the_absorption_kernels_equal_the_einsums_at_every_row_count_they_take():
    run_script(CHECK)
