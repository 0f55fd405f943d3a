"""GPU: decode through the captured graphs equals eager decode, for full and padded batches, batches
larger than the biggest graph, long contexts (max_req_total_len 4096: AITER's partitioned v2 decode), and
every max_seq_len bucket; the graph pool is the same in the probe and at the target, and replaying any
(batch, bucket) graph allocates nothing.

The tiny model's context is 4096 tokens, so the first bucket is lowered to 256 here: buckets 256, 1024,
4096 (AITER: v1 with one partition, v1, v2 with four)."""
from __future__ import annotations

import pytest
import torch

from autoprofile import budget
from autoprofile.config import ServerConfig, validate
from autoprofile.engine import stress
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.sampling import GREEDY
from autoprofile.engine.scheduler import StepRow
from autoprofile.engine.weights import init_random
from tests.conftest import require_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GMBS, CONTEXT, STEPS = 16, 4096, 8
# bf16 graph vs eager: in the v2 buckets a graph splits the keys into finer partitions than eager decode
# (AttentionMetadata.captured), so the two round their partial outputs to bf16 differently; over STEPS
# teacher-forced steps of the tiny model that is 1.3-1.5% relative (H100), bf16's own noise (each path
# matches the fp64 reference in test_kernels). A wrong graph (stale buffers, another row's pages) is O(1).
BF16_REL_ERR = 3e-2
FIRST_BUCKET = 256
BUCKETS = [256, 1024, 4096]
CASES = [("torch", "float32"), ("aiter_triton", "bfloat16")]


def config(backend: str, dtype: str) -> ServerConfig:
    return validate(ServerConfig(model="tiny", dtype=dtype, attention_backend=backend,
                                 max_req_total_len=CONTEXT, batch_max_tokens=8192, graph_max_batch_size=GMBS,
                                 running_max_req_size=32, report_dir=None))


@pytest.fixture(scope="module", params=CASES, ids=[f"{b}-{d}" for b, d in CASES])
def case(request):
    require_backend(request.param[0])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(budget, "DECODE_FIRST_BUCKET", FIRST_BUCKET)
        assert budget.decode_buckets(CONTEXT) == BUCKETS
        yield request.param


@pytest.fixture(scope="module")
def runner(case):
    r = ModelRunner(config(*case))
    init_random(r.model, seed=3, std=0.08)
    r.build(65536)
    yield r
    r.teardown()


@torch.no_grad()
def decode(runner: ModelRunner, prompts: list[list[int]], graphs: bool, forced: torch.Tensor | None = None):
    """(logits [STEPS, b, vocab] fp32, inputs [STEPS, b]) of greedy decode after one prefill; with
    `forced`, step i feeds forced[i] instead of the previous argmax (teacher forcing). Request i sits in
    slot i on pages of its own (the runner is otherwise idle)."""
    ps, nxt, writes = runner.cfg.page_size, 1, []
    for slot, p in enumerate(prompts):
        count = -(-(len(p) + STEPS) // ps)
        writes.append((slot, 0, list(range(nxt, nxt + count))))
        nxt += count
    runner.req_table.write(writes)
    tok = runner._prefill([StepRow(slot, 0, p, True, GREEDY) for slot, p in enumerate(prompts)])[0].argmax(-1)
    saved = runner.graphs
    runner.graphs = saved if graphs else None
    try:
        logits, inputs = [], []
        for i in range(STEPS):
            step_in = forced[i] if forced is not None else tok
            ids = step_in.tolist()
            rows = [StepRow(slot, len(p) + i, [ids[slot]], True, GREEDY) for slot, p in enumerate(prompts)]
            out = runner._decode(rows)[0].float().clone()
            logits.append(out)
            inputs.append(step_in)
            tok = out.argmax(-1)
        return torch.stack(logits), torch.stack(inputs)
    finally:
        runner.graphs = saved


def prompts_for(b: int, longest: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(b + longest)
    lens = torch.randint(1, longest, (b,), generator=g).tolist()
    if b == 3:
        lens[1] = CONTEXT - STEPS  # the longest request the table allows
    return [torch.randint(0, 4096, (n,), generator=g).tolist() for n in lens]


def test_one_capture_per_batch_and_bucket_sharing_one_pool(runner):
    assert list(runner.graphs.graphs) == budget.decode_graph_keys(GMBS, CONTEXT)  # capture order
    assert sorted(runner.graphs.graphs) == [(bs, b) for bs in (1, 2, 4, 8, 16) for b in BUCKETS]
    assert runner.graphs.pool is not None
    assert runner.graphs.logits.shape == (GMBS, 4096)  # one static output shared by every graph
    assert runner.graphs.block_tables.shape == (GMBS, CONTEXT // 16)
    assert runner.graphs.max_seq_len == CONTEXT and runner.buckets == BUCKETS


# 16 first: the padded batches that follow must not see its rows; 20 > GMBS runs eagerly; the longest
# row picks the bucket: 300 + 8 tokens -> 1024, 200 -> 256, b=3 holds a row of CONTEXT tokens -> 4096
@pytest.mark.parametrize("b,longest", [(16, 300), (13, 300), (1, 300), (3, 300), (8, 300), (20, 300),
                                       (16, 200), (5, 200), (6, 1000), (20, 200)])
def test_graph_replay_equals_eager_decode(runner, b, longest):
    prompts = prompts_for(b, longest)
    g_logits, g_inputs = decode(runner, prompts, graphs=True)
    if runner.cfg.dtype == "float32":
        e_logits, e_inputs = decode(runner, prompts, graphs=False)
        assert torch.equal(e_inputs, g_inputs)  # the same greedy tokens
        torch.testing.assert_close(e_logits, g_logits, rtol=1e-4, atol=1e-4)
    else:
        e_logits, _ = decode(runner, prompts, graphs=False, forced=g_inputs)
        err = ((e_logits - g_logits).norm() / g_logits.norm()).item()
        agree = (e_logits.argmax(-1) == g_logits.argmax(-1)).float().mean().item()
        print(f"\nb={b}: graph vs eager rel err {err:.2e}, argmax agreement {agree:.3f}")
        assert err < BF16_REL_ERR and agree >= 0.95
    assert g_logits.std() > 0.1 and not g_logits.isnan().any()


@pytest.mark.parametrize("bucket", BUCKETS)
def test_each_bucket_replays_its_own_graph_and_equals_eager(runner, bucket):
    """Prompts up to bucket - STEPS tokens, one of exactly that: every step's longest row lies in
    (previous bucket, bucket], so every step replays a graph of this bucket."""
    prompts = prompts_for(5, bucket - STEPS)
    prompts[2] = prompts[2][:1] * (bucket - STEPS)
    assert runner.graphs.pick(5, bucket - STEPS + 1) == (8, bucket)
    g_logits, g_inputs = decode(runner, prompts, graphs=True)
    e_logits, _ = decode(runner, prompts, graphs=False, forced=g_inputs)
    err = ((e_logits - g_logits).norm() / g_logits.norm()).item()
    assert err < (1e-4 if runner.cfg.dtype == "float32" else BF16_REL_ERR), err
    assert not g_logits.isnan().any()


def test_a_rebuild_warms_up_only_its_first_graph_and_still_replays_as_eager(runner):
    """The profiler's rebuild in the same process (DecodeGraphs.capture): one eager warm-up, the first
    graph's, then every graph captured cold (as the first build captured them); replay equals eager at a full,
    a padded and a long batch."""
    pool = pool_bytes(runner.graphs.pool)  # the warmed build's (the probe's, in a boot)
    eager_calls, step = [], runner._decode_logits
    runner.teardown()
    try:
        def counted(*args):
            if not torch.cuda.is_current_stream_capturing():
                eager_calls.append(args[0].shape[0])
            return step(*args)
        runner._decode_logits = counted
        runner.build(65536)
    finally:
        del runner._decode_logits  # the method again
        if runner.kv is None:
            runner.build(65536)
    assert eager_calls == [GMBS]  # the first graph's rows: its warm-up alone
    assert pool_bytes(runner.graphs.pool) == pool  # the pool the probe measured, without the warm-ups
    for b, longest in ((16, 300), (5, 300), (3, 300)):
        prompts = prompts_for(b, longest)
        g_logits, g_inputs = decode(runner, prompts, graphs=True)
        e_logits, _ = decode(runner, prompts, graphs=False, forced=g_inputs)
        err = ((e_logits - g_logits).norm() / g_logits.norm()).item()
        assert err < (1e-4 if runner.cfg.dtype == "float32" else BF16_REL_ERR), (b, err)


def pool_bytes(pool) -> int:
    """Bytes of the segments the caching allocator holds for this graph pool."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s["segment_pool_id"]) == tuple(pool))


@torch.no_grad()
def replay_every_graph(r: ModelRunner) -> None:
    """Each (batch, bucket) graph once, through the runner's decode path, its longest row at the bucket."""
    for i, (bs, bucket) in enumerate(r.graphs.keys):
        rows = [(bucket - 1, 1)] + [(s % 50, 1) for s in range(bs - 1)]
        step = stress.corner_step(r.envelope, False, rows, r.kv.num_pages - 1, r.model_config.vocab_size, i)
        r.req_table.write(step.page_writes)
        assert r.graphs.pick(bs, bucket) == (bs, bucket)
        r._decode(step.rows)
    torch.cuda.synchronize()


def test_the_serving_pool_is_the_measured_one_and_replay_allocates_nothing(case, runner):
    """Probe-size build, then target-size build (as the profiler does): the graph pool holds the same
    bytes, and replaying every (batch, bucket) graph changes neither the pool nor memory_reserved."""
    runner.teardown()
    try:
        pools = []
        for tokens in (16384, 65536):  # probe, then target
            runner.build(tokens)
            pool = pool_bytes(runner.graphs.pool)
            replay_every_graph(runner)  # warms the small non-graph tensors of a step too
            reserved = torch.cuda.memory_reserved()
            replay_every_graph(runner)
            assert torch.cuda.memory_reserved() == reserved
            assert pool_bytes(runner.graphs.pool) == pool > 0
            pools.append(pool)
            runner.teardown()
        print(f"\n{case}: graph pool {pools[0] / 2**20:.1f} MiB in the probe, {pools[1] / 2**20:.1f} MiB at "
              f"the target")
        assert pools[0] == pools[1]
    finally:
        if runner.kv is None:
            runner.build(65536)
