"""GPU: prefill and mixed steps through the captured piecewise graphs (engine.piecewise) equal the eager
forward, for every bucket (padded and exact), mixed steps with decode rows, chunks over a cached prefix, and
a smaller step after a larger one (its padded rows must write only the pad page); the pieces' pool is the
same in the probe and at the target."""
from __future__ import annotations

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.kv_cache import PAD_PAGE
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.sampling import GREEDY
from autoprofile.engine.scheduler import StepRow
from autoprofile.engine.weights import init_random
from tests.conftest import require_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_TOKENS = 256
# bf16: a piece's GEMMs run at the bucket's rows, the eager step's at its own (cuBLAS picks its kernel by M),
# so the two round differently; a wrong piece (stale inputs, another layer's q, a missing attention) is O(1)
BF16_REL_ERR = 2e-2


@pytest.fixture(scope="module")
def runner():
    require_backend("aiter_triton")
    r = ModelRunner(validate(ServerConfig(model="tiny", dtype="bfloat16", attention_backend="aiter_triton",
                                          max_req_total_len=2048, batch_max_tokens=2048,
                                          graph_max_batch_size=16, running_max_req_size=32,
                                          piecewise_cuda_graph_max_tokens=MAX_TOKENS, report_dir=None)))
    init_random(r.model, seed=3, std=0.08)
    r.build(32768)
    yield r
    r.teardown()


def pages(r: ModelRunner, slots: int, tokens: int) -> None:
    per = -(-tokens // r.cfg.page_size)
    r.req_table.write([(s, 0, list(range(1 + s * per, 1 + (s + 1) * per))) for s in range(slots)])


@torch.no_grad()
def both(r: ModelRunner, rows, decode):
    """((logits, the real pages' K/V) through the pieces, the same eagerly) of one step: eager first, so a
    padded row of the pieces that wrote a slot of an earlier step shows in the K/V."""
    out = {}
    saved = r.pieces
    for pieces in (None, saved):
        r.pieces = pieces
        try:
            logits = r._prefill(rows, decode)[0].float().clone()
        finally:
            r.pieces = saved
        torch.cuda.synchronize()
        out[pieces is None] = (logits, r.kv.buffer[:, :, PAD_PAGE + 1:].clone())
    return out[False], out[True]


def pool_bytes(pool) -> int:
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s["segment_pool_id"]) == tuple(pool))


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_every_bucket_has_a_piece_per_layer_and_one_more_in_one_pool_the_probe_measures(runner):
    """Probe-size build, then target-size build (as the profiler does): the same pieces, the same pool."""
    layers = runner.model_config.num_layers
    assert runner.envelope.piecewise_tokens == MAX_TOKENS  # the stress's corner at the largest bucket
    pools = []
    runner.teardown()
    try:
        for tokens in (8192, 32768):
            runner.build(tokens)
            p = runner.pieces
            assert list(p.graphs) == [256, 224, 192, 160, 128, 96, 64, 32, 16]  # the largest first
            assert all(len(g) == layers + 1 and len(p.splits[b]) == layers for b, g in p.graphs.items())
            pools.append(pool_bytes(p.pool))
            runner.teardown()
    finally:
        runner.build(32768)
    print(f"\npieces' pool {pools[0] / 2**20:.1f} MiB in the probe, {pools[1] / 2**20:.1f} MiB at the target")
    assert pools[0] == pools[1] > 0


@pytest.mark.parametrize("prompt,chunk,decoded", [(16, 0, 0), (100, 0, 0), (200, 0, 12), (256, 0, 0),
                                                  (60, 40, 5), (30, 0, 1)])
def test_a_step_through_the_pieces_equals_the_eager_step(runner, prompt, chunk, decoded):
    """A prompt of `prompt` tokens (after a cached first `chunk` of them, the kv_slots path) beside
    `decoded` decode rows at 40 tokens of context."""
    r = runner
    assert r.pieces is not None and r.pieces.buckets[-1] == MAX_TOKENS
    g = torch.Generator().manual_seed(prompt + chunk + decoded)
    pages(r, 1 + decoded, 2048)
    ids = torch.randint(0, 4096, (prompt,), generator=g).tolist()
    if chunk:
        r._prefill([StepRow(0, 0, ids[:chunk], True, GREEDY)])
    rows = [StepRow(0, chunk, ids[chunk:], True, GREEDY)]
    decode = [StepRow(1 + i, 40, [int(t)], True, GREEDY)
              for i, t in enumerate(torch.randint(0, 4096, (decoded,), generator=g))]
    if decode:  # the decode rows' 40 tokens of context
        r._prefill([StepRow(1 + i, 0, torch.randint(0, 4096, (40,), generator=g).tolist(), True, GREEDY)
                    for i in range(decoded)])
    (p_logits, p_kv), (e_logits, e_kv) = both(r, rows, decode)
    assert p_logits.shape == (1 + decoded, r.model_config.vocab_size) and not p_logits.isnan().any()
    err, kv_err = close(p_logits, e_logits), close(p_kv.float(), e_kv.float())
    agree = (p_logits.argmax(-1) == e_logits.argmax(-1)).float().mean().item()
    print(f"\n{prompt - chunk}+{decoded} tokens: logits rel err {err:.2e}, K/V {kv_err:.2e}, "
          f"argmax {agree:.2f}")
    assert err < BF16_REL_ERR and kv_err < BF16_REL_ERR and agree >= 0.9
