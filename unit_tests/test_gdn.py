"""The gated delta rule's torch reference (layers.gdn): its chunked form, 64 tokens at a time, against the rule
applied one token at a time, across several chunks and from a non-zero state; prefill rows of several lengths
in one call, each from and back to its own slot, and decode rows after them, as one row run whole."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from autoprofile.layers import gdn


def _inputs(t: int, hk: int, hv: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, hk, d, generator=g), torch.randn(t, hk, d, generator=g)
    v = torch.randn(t, hv, d, generator=g)
    return q, k, v, -torch.rand(t, hv, generator=g), torch.rand(t, hv, generator=g)


def test_the_chunked_form_equals_the_rule_token_by_token_across_chunks():
    q, k, v, g, beta = _inputs(150, 2, 4, 16, 0)  # 3 chunks of 64, the last one short
    state = torch.randn(4, 16, 16) * 0.1
    want, want_state = gdn.recurrent_reference(q, k, v, g, beta, state)
    got, got_state = gdn.chunked_delta_rule(*gdn._expand(q, k, 4), v, g, beta, state)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)


def test_prefill_rows_and_decode_rows_go_on_from_their_own_slots():
    lens, slots = [1, 70, 130], torch.tensor([4, 0, 2])
    q, k, v, g, beta = _inputs(sum(lens) + 3, 2, 4, 8, 1)
    ssm = torch.randn(5, 4, 8, 8) * 0.1
    start = ssm.clone()
    cu = torch.tensor([0, 1, 71, 201])
    n = sum(lens)
    out = gdn.delta_rule_prefill(q[:n], k[:n], v[:n], g[:n], beta[:n], ssm, slots, cu)
    dec = gdn.delta_rule_decode(q[n:], k[n:], v[n:], g[n:], beta[n:], ssm, slots)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        rows = list(range(a, b)) + [n + i]  # the row's prefill tokens, then its decode token
        want, state = gdn.recurrent_reference(q[rows], k[rows], v[rows], g[rows], beta[rows], start[slots[i]])
        torch.testing.assert_close(torch.cat([out[a:b], dec[i:i + 1]]), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ssm[slots[i]], state, rtol=1e-5, atol=1e-5)
    assert torch.equal(ssm[[1, 3]], start[[1, 3]])  # no row touched another slot


@pytest.mark.parametrize("lens", [[1], [64], [65, 0, 3], [130, 64, 1, 200, 0], [0]])
def test_fla_chunk_indices_from_the_hosts_cu_seqlens(lens):
    """The (row, chunk) pairs the backend uploads once a forward for fla's varlen kernels: every 64 tokens of
    each row, rows in order, none for an empty row; as fla's own prepare_chunk_indices where fla is there."""
    cu = np.concatenate([[0], np.cumsum(lens)])
    got = gdn.chunk_indices(cu)
    assert got.dtype == np.int64 and got.shape == (sum(-(-n // 64) for n in lens), 2)
    assert got.tolist() == [[i, j] for i, n in enumerate(lens) for j in range(-(-n // 64))]
    try:
        from fla.ops.utils.index import prepare_chunk_indices
    except ImportError:
        return
    assert prepare_chunk_indices(torch.from_numpy(cu), 64).tolist() == got.tolist()


def test_fla_that_does_not_import_is_an_error_naming_the_install_not_a_slower_prefill(monkeypatch):
    """A GPU's prefill rows run fla's rule (delta_rule_prefill takes no other path on CUDA): an fla that is
    missing or broken raises naming the pip line, where the torch reference once ran them 64 tokens at a time
    (10.7x slower a step on an H200)."""
    from autoprofile.config import FLA_REQUIREMENT
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")] + ["fla"]:
        monkeypatch.setitem(sys.modules, name, None)  # imported by an earlier test or not: blocked
    gdn.fla_ops.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=f"pip install {FLA_REQUIREMENT}"):
            gdn.fla_ops()
    finally:
        gdn.fla_ops.cache_clear()
