"""GPU: prefill and mixed steps through the captured piecewise graphs (engine.piecewise) equal the eager
forward, for every bucket (padded and exact), mixed steps with decode rows, chunks over a cached prefix, and
a smaller step after a larger one (its padded rows must write only the pad page); the pieces' pool is the
same in the probe and at the target. In bf16, with FP8 weights (tiny-fp8), an FP8 cache (fp8_e4m3), MoE
layers (tiny-moe, tiny-moe-fp8: the fused experts' sizes follow the bucket's tokens, the routing is a device
tensor), and hybrids (tiny-hybrid, tiny-hybrid-moe: the Gated DeltaNet layers' conv, gates, fla's rule and
gated norm run between the pieces from each row's state, which both ways must leave the same)."""
from __future__ import annotations

import pytest
import torch

from autoprofile import plan
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
# FP8 weights: the activations' per-token scales come from rows whose bf16 values already differ as above;
# an FP8 cache: a K/V value one e4m3 step off moves it by up to 1/8
FP8_REL_ERR = 5e-2
CASES = {"bf16": dict(model="tiny"), "fp8-weights": dict(model="tiny-fp8"),
         "fp8-cache": dict(model="tiny", kv_cache_dtype="fp8_e4m3"), "moe": dict(model="tiny-moe"),
         "moe-fp8": dict(model="tiny-moe-fp8"), "hybrid": dict(model="tiny-hybrid"),
         "hybrid-moe": dict(model="tiny-hybrid-moe")}


@pytest.fixture(scope="module", params=list(CASES))
def runner(request):
    require_backend("aiter_triton")
    r = ModelRunner(validate(ServerConfig(dtype="bfloat16", attention_backend="aiter_triton",
                                          max_req_total_len=2048, batch_max_tokens=2048,
                                          graph_max_batch_size=16, running_max_req_size=32,
                                          piecewise_cuda_graph_max_tokens=MAX_TOKENS, report_dir=None,
                                          **CASES[request.param])))
    r.case = request.param
    init_random(r.model, seed=3, std=0.08)
    r.build(32768)
    assert r.piecewise_ok, request.param
    yield r
    r.teardown()


def pages(r: ModelRunner, slots: int, tokens: int) -> None:
    per = -(-tokens // r.cfg.page_size)
    r.req_table.write([(s, 0, list(range(1 + s * per, 1 + (s + 1) * per))) for s in range(slots)])


def states(r: ModelRunner) -> list[torch.Tensor]:
    """A hybrid's conv windows and delta-rule states (none for the others)."""
    return [] if r.state is None else [r.state.conv, r.state.ssm]


@torch.no_grad()
def both(r: ModelRunner, rows, decode):
    """((logits, the real pages' K/V, a hybrid's states after) through the pieces, the same eagerly) of one
    step, each from the same states: eager first, so a padded row of the pieces that wrote a slot of an
    earlier step shows in the K/V."""
    out, replays = {}, []
    saved = r.pieces
    replay = saved.forward
    before = [t.clone() for t in states(r)]
    for pieces in (None, saved):
        for t, kept in zip(states(r), before):
            t.copy_(kept)
        r.pieces = pieces
        saved.forward = lambda *a: replays.append(a[0].shape[0]) or replay(*a)  # the pieces did run the step
        try:
            logits = r._prefill(rows, decode)[0].float().clone()
        finally:
            r.pieces, saved.forward = saved, replay
        torch.cuda.synchronize()
        out[pieces is None] = (logits, r.kv.buffer[:, :, PAD_PAGE + 1:].clone(),
                               [t.clone() for t in states(r)])
    assert replays == [sum(len(row.ids) for row in rows) + len(decode or ())], replays
    return out[False], out[True]


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_every_bucket_has_a_piece_per_layer_and_one_more_in_one_pool_the_probe_measures(runner):
    """Probe-size build, then target-size build (as the profiler does): the same pieces, the same pool. A
    build after the first warms up the first decode graph and the largest bucket alone (the steps of
    test_a_step_through_the_pieces... replay such a build's pieces)."""
    layers = runner.model_config.num_layers
    assert runner.envelope.piecewise_tokens == MAX_TOKENS  # the stress's corner at the largest bucket
    pools, eager, hidden = [], [], runner._hidden
    runner._hidden = lambda ids, *a: (None if torch.cuda.is_current_stream_capturing()
                                      else eager.append(ids.shape[0])) or hidden(ids, *a)
    runner.teardown()
    try:
        for tokens in (8192, 32768):
            eager.clear()
            runner.build(tokens)
            assert eager == [runner.graphs.keys[0][0], MAX_TOKENS], eager  # decode graph 1, the largest piece
            p = runner.pieces
            assert list(p.graphs) == [256, 224, 192, 160, 128, 96, 64, 32, 16]  # the largest first
            assert all(len(g) == layers + 1 and len(p.splits[b]) == layers for b, g in p.graphs.items())
            pools.append(p.pool_bytes())
            runner.teardown()
    finally:
        del runner._hidden
        runner.build(32768)
    estimate = plan.pieces_row(runner.cfg, runner.model_config, "aiter_triton", 2).bytes
    print(f"\npieces' pool {pools[0] / 2**20:.1f} MiB in the probe, {pools[1] / 2**20:.1f} MiB at the "
          f"target, plan's estimate {estimate / 2**20:.1f} MiB")
    assert pools[0] == pools[1] > 0
    assert pools[0] <= plan.ACTIVATION_FACTOR * estimate  # the pool's 2 MiB segments: the margin's room
    wide, out = plan.piece_widths(runner.model_config)  # the static buffers the plan charges beside the pool
    assert runner.pieces.outputs.numel() == MAX_TOKENS * out
    assert runner.pieces.inputs.numel() <= MAX_TOKENS * wide + 3 * 64


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
    (p_logits, p_kv, p_states), (e_logits, e_kv, e_states) = both(r, rows, decode)
    assert p_logits.shape == (1 + decoded, r.model_config.vocab_size) and not p_logits.isnan().any()
    err, kv_err = close(p_logits, e_logits), close(p_kv.float(), e_kv.float())
    agree = (p_logits.argmax(-1) == e_logits.argmax(-1)).float().mean().item()
    print(f"\n{r.case} {prompt - chunk}+{decoded} tokens: logits rel err {err:.2e}, K/V {kv_err:.2e}, "
          f"argmax {agree:.2f}")
    bound = BF16_REL_ERR if r.case == "bf16" else FP8_REL_ERR
    assert err < bound and kv_err < bound and agree >= 0.9
    for got, want in zip(p_states, e_states):  # the linear layers' rows went on from their states alike
        assert close(got.float(), want.float()) < bound
