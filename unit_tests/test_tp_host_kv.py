"""The prefix cache's host tier (--host_kv) under tensor parallelism on CPU (gloo ranks, the small Qwen
checkpoint, fp32, torch backend): each rank keeps its own shard of the tier (its KV heads), moved by the page
lists the step broadcast ships. A returning conversation's evicted pages come back from the host on every rank
and its greedy tokens are those of --tp 1 with the tier and of --tp 2 without it (recomputed)."""
from __future__ import annotations

import pytest
import torch

from autoprofile import launch
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.envelope import EnvelopeError
from autoprofile.engine.runner import ModelRunner
from autoprofile.tp import broadcast
from unit_tests.test_engine_cpu import QWEN_SMALL, small_cfg, write_checkpoint
from unit_tests.test_tp import TIMEOUT

KV_TOKENS = 176  # 11 pages of 16, one the pad page: a conversation's 5 pages, twice, evict the first's
HOST_KV = "0.002"  # GiB a rank: 131 pages at --tp 1, 262 at --tp 2 (a rank's page holds half the heads)
FLAGS = dict(max_req_total_len=128, batch_max_tokens=32, running_max_req_size=4, host_kv=HOST_KV)
NEW = 6


def conversations(engine: LLMEngine) -> list[list[int]]:
    """Three turns: A, then B and C (whose pages push A's cached pages to the host tier), then A again with
    its answer and more: its prefix comes back from the host tier."""
    a, b, c = ([(k * j + 7 * k) % 1000 + 1 for j in range(70)] for k in (29, 31, 37))
    out = [engine.generate([p], max_tokens=NEW)[0] for p in (a, b, c)]
    out.append(engine.generate([a + out[0] + [11, 12, 13]], max_tokens=NEW)[0])
    return out


def tier_view(engine: LLMEngine, pool) -> dict:
    """What the test checks of a tier: the engine's stats, and each cached key's page contents (by key: the
    page a key lands on is the scheduler's business), as numpy arrays (a rank's result pipe would pass
    tensors as shared memory, gone with the rank)."""
    s, host = engine.stats, engine.scheduler.cache.host
    return dict(hit_tokens=s.host.hit_tokens, saved=host.saved, loaded=host.loaded, pages_used=s.pages_used,
                held=host.num_held, loads=len(engine.scheduler.cache.loads), bytes_moved=pool.bytes_moved,
                page_bytes=pool.page_bytes, pages=pool.num_pages,
                page_of=host.keys(),
                cached={key: pool.buffer[:, :, page].numpy().copy() for key, page in host.keys().items()})


def _serve_with_tier(guard, model_dir: str):
    """Rank 0: the conversations with the tier off (the scheduler sees no pool), then on; every rank returns
    its own pool's view."""
    runner = ModelRunner(small_cfg(model=model_dir, tp=2, **FLAGS), rank=guard.rank, world_size=2,
                         group=guard.data)
    guarded = guard.bind(runner)
    guarded.build(KV_TOKENS)
    pool = runner.host_kv
    if guard.rank:
        broadcast.worker_loop(guarded)  # both engines' steps, until rank 0's stop
        return dict(bytes_moved=pool.bytes_moved, page_bytes=pool.page_bytes, pages=pool.num_pages,
                    shape=tuple(pool.buffer.shape), buffer=pool.buffer.numpy().copy(),
                    loads=len(runner._loads))
    broadcaster = broadcast.StepBroadcaster(guarded)
    runner.host_kv = None  # the tier off: recompute
    off = LLMEngine(broadcaster)
    off_tokens = conversations(off)
    runner.host_kv = pool
    on = LLMEngine(broadcaster)
    on_tokens = conversations(on)
    broadcaster.close()
    return dict(off=off_tokens, off_pages_used=off.stats.pages_used, off_host=off.stats.host,
                on=on_tokens, failed=on.stats.failed_steps + off.stats.failed_steps, tier=tier_view(on, pool),
                shape=tuple(pool.buffer.shape), loads=len(runner._loads))


@pytest.mark.slow
def test_tp2_ranks_each_keep_their_shard_of_the_host_tier_and_give_the_tp1_tokens(tmp_path):
    check_tp2_host_tier(tmp_path, "cpu")


def check_tp2_host_tier(tmp_path, device: str) -> None:
    """The checks, on gloo ranks (cpu) or on 2 GPUs (cuda: tests/test_tp_host_kv_gpu.py, the pinned pools'
    page-transfer kernel on its streams, each worker's forward waiting for its own loads)."""
    write_checkpoint(tmp_path / "qwen", QWEN_SMALL, seed=6)
    one = ModelRunner(small_cfg(model=str(tmp_path / "qwen"), **FLAGS))
    one.build(KV_TOKENS)
    ref = LLMEngine(one)
    want = conversations(ref)
    ref_tier = tier_view(ref, one.host_kv)
    assert ref_tier["hit_tokens"] >= 64, "the --tp 1 reference did not use the tier: the test proves nothing"
    assert len({t for out in want for t in out}) > 3, "degenerate greedy text"

    out = launch.launch(_serve_with_tier, 2, (str(tmp_path / "qwen"),), device=device, timeout_s=TIMEOUT)
    assert all(o.ok for o in out), out
    r0, r1 = out[0].value, out[1].value
    assert r0["failed"] == 0
    # the tokens: --tp 2 with the tier == --tp 2 recomputing == --tp 1 with the tier
    assert r0["off_host"] is None and r0["off_pages_used"] == 0
    assert r0["off"] == want, "--tp 2 without the tier differs from --tp 1"
    assert r0["on"] == want, "--tp 2 with the host tier differs from --tp 1 (and from --tp 2 recomputing)"

    tier = r0["tier"]
    assert tier["hit_tokens"] >= 64 and tier["loaded"] >= 4, "the returning conversation missed the host tier"
    # each rank holds its own shard: [parts, layers, pages, heads, page, width] with half the KV heads
    heads = QWEN_SMALL["num_key_value_heads"]
    full = one.host_kv.buffer.shape
    assert full[3] == heads
    for shape in (r0["shape"], r1["shape"]):
        assert shape[3] == heads // 2 and shape[:2] == full[:2] and shape[4:] == full[4:]
    assert tier["page_bytes"] == one.host_kv.page_bytes // 2 == r1["page_bytes"]
    assert tier["pages"] == r1["pages"] == 2 * one.host_kv.num_pages
    # every rank moved every page the scheduler saved and loaded, in its own pool
    moved = (tier["saved"] + tier["loaded"]) * tier["page_bytes"]
    assert tier["bytes_moved"] == moved > 0 and r1["bytes_moved"] == moved
    # a cached host page on rank r holds rank r's heads of that key's K/V (--tp 1's pool holds them all)
    assert set(tier["cached"]) == set(ref_tier["cached"]) and tier["cached"]
    for key, whole in ref_tier["cached"].items():  # whole: [parts, layers, heads, page, width]
        whole = torch.from_numpy(whole)
        shard0 = torch.from_numpy(tier["cached"][key])
        shard1 = torch.from_numpy(r1["buffer"][:, :, tier["page_of"][key]])  # placed by rank 0's scheduler
        torch.testing.assert_close(shard0, whole[:, :, :1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(shard1, whole[:, :, 1:], rtol=1e-4, atol=1e-4)
    # at the end every page is back: none used, none held by a load, no load in flight on any rank
    assert tier["pages_used"] == 0 and tier["held"] == 0 and tier["loads"] == 0
    assert r0["loads"] == r1["loads"] == 0


# ---------------------------------------------------------------- one page count on every rank (boot)
CASES = [([7, 5], 5), ([7, 0], None), ([0, 5], None), ([4, 4], 4)]  # each rank's pages as host_tier left them


def _agree(guard):
    """Each case's tiers (0: None, as for --host_kv auto near the threshold) agreed as boot does, each
    followed by a vote as the profiler's first collective: what each rank ends with."""
    from types import SimpleNamespace

    from autoprofile import memory
    from autoprofile.engine.host_kv import HostKVPool
    from autoprofile.profiler import agree_host_tier
    out = []
    for pages, _ in CASES:
        n = pages[guard.rank]
        pool = HostKVPool(n, (2, 1, 1, 4, 1), torch.float32, pin=False) if n else None
        runner = SimpleNamespace(cfg=SimpleNamespace(host_kv="auto"), host_kv=pool)
        agree_host_tier(runner, 2, guard.control)
        ok = memory.all_ok(True, guard.control)  # a rank that skipped the agreement pairs it with this
        out.append((None if runner.host_kv is None else runner.host_kv.num_pages, ok))
    return out


@pytest.mark.slow
def test_ranks_agree_on_one_host_tier_page_count_or_none_when_a_rank_has_none():
    """Rank 0 schedules the pages every rank copies: a rank with fewer would be written past its buffer, a
    rank without a tier would fail its first copy (or, skipping the agreement, pair the others' reduction with
    its next collective)."""
    out = launch.launch(_agree, 2, (), device="cpu", timeout_s=60)
    assert all(o.ok for o in out), out
    want = [(pages, True) for _, pages in CASES]
    assert out[0].value == out[1].value == want


# ---------------------------------------------------------------- a failed step with ready loads (issue 46.4)
class _FailFirstReady:
    """Rank 0's step broadcast whose first step naming landed host-tier loads (Step.kv_ready) raises before it
    is shipped: the step never runs on any rank, and its ready loads must reach the next step."""

    def __init__(self, broadcaster):
        self.inner, self.failed_ready = broadcaster, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, step):
        if step.kv_ready and not self.failed_ready:
            self.failed_ready = list(step.kv_ready)
            raise EnvelopeError("injected: a step with ready host-tier loads fails before it is shipped")
        return self.inner.execute(step)


def _resend_after_failure(engine: LLMEngine) -> dict:
    """The conversations with the tier on, turn by turn; a turn that ended with "error" is sent again."""
    a, b, c = ([(k * j + 7 * k) % 1000 + 1 for j in range(70)] for k in (29, 31, 37))
    out, errors = [], 0
    for make in (lambda: a, lambda: b, lambda: c, lambda: a + out[0] + [11, 12, 13]):
        while True:
            rid = engine.add_request(make(), max_tokens=NEW)
            tokens, reason = [], None
            while rid in engine._requests:
                for o in engine.step():
                    if o.request_id == rid:
                        tokens += o.new_token_ids
                        reason = o.finish_reason or reason
            if reason != "error":
                out.append(tokens)
                break
            errors += 1
    return dict(out=out, errors=errors)


def _serve_failing(guard, model_dir: str):
    runner = ModelRunner(small_cfg(model=model_dir, tp=2, **FLAGS), rank=guard.rank, world_size=2,
                         group=guard.data)
    guarded = guard.bind(runner)
    guarded.build(KV_TOKENS)
    if guard.rank:
        broadcast.worker_loop(guarded)
        return dict(loads=len(runner._loads))
    failing = _FailFirstReady(broadcast.StepBroadcaster(guarded))
    engine = LLMEngine(failing)
    got = _resend_after_failure(engine)
    failing.inner.close()
    return dict(**got, failed_ready=failing.failed_ready, failed=engine.stats.failed_steps,
                tier=tier_view(engine, runner.host_kv), loads=len(runner._loads))


def check_tp2_host_tier_with_a_failed_step(tmp_path, device: str) -> None:
    """--tp 2 --host_kv where the step carrying landed loads fails before it runs: the turn it held ends
    "error" and, sent again, gives the tokens of a clean --tp 1 run, as does every other turn; on 2 GPUs
    (tests/test_tp_host_kv_gpu.py) a worker whose forward did not wait for its own copies would read stale
    K/V there. Every page and load comes back on both ranks."""
    write_checkpoint(tmp_path / "qwen", QWEN_SMALL, seed=6)
    one = ModelRunner(small_cfg(model=str(tmp_path / "qwen"), **FLAGS))
    one.build(KV_TOKENS)
    want = conversations(LLMEngine(one))
    out = launch.launch(_serve_failing, 2, (str(tmp_path / "qwen"),), device=device, timeout_s=TIMEOUT)
    assert all(o.ok for o in out), out
    r0, r1 = out[0].value, out[1].value
    assert r0["failed_ready"], "no step named ready loads: the failure was never injected"
    assert r0["failed"] == 1 and r0["errors"] == 1
    assert r0["out"] == want, "a turn after the failed step differs from the clean --tp 1 run"
    assert r0["tier"]["hit_tokens"] >= 64, "the re-sent turn missed the host tier"
    assert r0["tier"]["pages_used"] == 0 and r0["tier"]["held"] == 0 and r0["tier"]["loads"] == 0
    assert r0["loads"] == r1["loads"] == 0


@pytest.mark.slow
def test_tp2_host_tier_with_a_step_that_fails_holding_ready_loads_gives_the_clean_tokens(tmp_path):
    check_tp2_host_tier_with_a_failed_step(tmp_path, "cpu")
