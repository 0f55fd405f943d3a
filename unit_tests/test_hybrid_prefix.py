"""Prefix caching for hybrid models (issue 45, item 4): a cached prefix resumes from a state checkpoint at its
end. The built-in tiny hybrids (dense and MoE, random weights) on the CPU: hits (a shared system prompt, a
multi-turn history) give the tokens and logprobs of a cold run with prefix caching off, and really hit;
preemption with the cache on gives the cold tokens; random traffic gives every state slot, checkpoint row and
page back and no row another's state; the checkpoint rows are inside the budget."""
from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoprofile import budget
from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.prefix_cache import PrefixCache
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.sampling import SamplingParams
from autoprofile.engine.scheduler import checkpoint_stops
from autoprofile.engine.state_cache import StateCache
from autoprofile.model_config import load_model_config

PAGE = 16
GREEDY_LP = SamplingParams(temperature=0.0, logprobs=1)
SYSTEM = [(7 * i + 3) % 250 + 1 for i in range(40)]  # 2.5 pages
USERS = [[11, 12, 13, 14, 15], [200, 201, 202, 203, 204, 205, 206, 207, 208], [90] * 21, [5, 6]]


def runner_for(model: str, **kw) -> ModelRunner:
    base = dict(model=model, dtype="float32", attention_backend="torch", max_req_total_len=256,
                batch_max_tokens=64, graph_max_batch_size=4, running_max_req_size=6, report_dir=None)
    return ModelRunner(validate(ServerConfig(**{**base, **kw})))


@pytest.fixture(scope="module", params=["tiny-hybrid", "tiny-hybrid-moe"])
def runner(request):
    r = runner_for(request.param)
    r.build(64 * PAGE)
    yield r
    r.teardown()


def engine_on(runner: ModelRunner, prefix_caching: bool = True, overlap: bool = False) -> LLMEngine:
    """A fresh engine (a fresh prefix cache) on the built runner; the state slots start at zero again."""
    runner.state.conv.zero_()
    runner.state.ssm.zero_()
    return LLMEngine(runner, prefix_caching=prefix_caching, overlap=overlap)


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 12, params=GREEDY_LP) -> list[tuple]:
    """Each prompt's (tokens, logprobs), one after the other in one engine (the cache warm from the ones
    before)."""
    out = []
    for p in prompts:
        rid = engine.add_request(p, params, max_tokens=max_tokens)
        tokens, lps = [], []
        while engine.has_unfinished():
            for o in engine.step():
                assert o.request_id == rid and o.finish_reason != "error"
                tokens += o.new_token_ids
                lps += [lp[1] for lp in o.logprobs or []]
        out.append((tokens, lps))
    return out


def cold(runner: ModelRunner, prompts: list[list[int]], max_tokens: int = 12) -> list[tuple]:
    return [run(engine_on(runner, prefix_caching=False), [p], max_tokens)[0] for p in prompts]


def assert_same(got: list[tuple], want: list[tuple]) -> None:
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), rtol=1e-4, atol=1e-4)


def assert_all_back(engine: LLMEngine) -> None:
    s = engine.scheduler
    assert sorted(s.free_slots) == list(range(engine.envelope.running_reqs))
    assert s.cache.num_free == s.cache.capacity
    c = s.cache
    assert c.num_free_checkpoints + c.num_held_checkpoints == c.checkpoints
    assert not s._saving and not s._stops


# ---------------------------------------------------------------- hits give the cold tokens
def test_a_shared_system_prompt_hits_from_the_third_request_and_gives_the_cold_tokens(runner):
    """The first request checkpoints the end of its full pages; the second finds the system prompt's pages
    as K/V without a checkpoint (where it parts from the first): it recomputes them, and checkpoints there;
    from the third on, the system prompt's two full pages resume from that checkpoint."""
    prompts = [SYSTEM + USERS[i] for i in (2, 1, 0, 3)]  # the first's last full page ends after the system's
    engine = engine_on(runner)
    hits = []
    got = []
    for p in prompts:
        got += run(engine, [p])
        hits.append(engine.stats.prefix_hit_tokens)
    assert_same(got, cold(runner, prompts))
    assert hits == [0, 0, 2 * PAGE, 4 * PAGE]
    assert_all_back(engine)


def test_a_multi_turn_history_resumes_from_the_last_turns_checkpoint(runner):
    """Turn 2's prompt holds turn 1's prompt and answer: it resumes at turn 1's last full page, turn 3 at
    turn 2's, with the tokens and logprobs of cold runs."""
    engine = engine_on(runner)
    turn, prompts, got, hits = SYSTEM + USERS[0], [], [], []
    for user in USERS[1:]:
        prompts.append(turn)
        (tokens, lps), = run(engine, [turn])
        got.append((tokens, lps))
        hits.append(engine.stats.prefix_hit_tokens)
        turn = turn + tokens + user
    assert_same(got, cold(runner, prompts))
    assert hits[0] == 0 and hits[1] == (len(prompts[0]) - 1) // PAGE * PAGE
    assert hits[2] - hits[1] == (len(prompts[1]) - 1) // PAGE * PAGE
    assert_all_back(engine)


@pytest.mark.slow  # 2 minutes on 2 cores; the random traffic below covers crowds and overlap in the main run
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_crowd_with_shared_prefixes_in_one_engine_gives_the_cold_tokens(runner, overlap):
    """The same prompts twice, then in a crowd (chunks of several requests in one step, checkpoints saved
    and loaded in the same steps, the overlapped engine): each gets its cold tokens."""
    prompts = [SYSTEM + u for u in USERS] + [SYSTEM[:PAGE * 2 + 1], USERS[2] * 3]
    want = [t for t, _ in cold(runner, prompts)]
    engine = engine_on(runner, overlap=overlap)
    assert engine.generate(prompts, max_tokens=12) == want
    assert engine.generate(prompts + prompts, max_tokens=12) == want + want
    assert engine.stats.prefix_hit_tokens > 0
    assert_all_back(engine)


def test_preemption_with_prefix_caching_gives_the_cold_tokens(runner):
    """A cache of 12 pages for a crowd: requests are preempted and come back through their own checkpoints
    (or from zeros)."""
    small = runner_for(runner.model_config.name)
    small.build(12 * PAGE)
    prompts = [SYSTEM + u for u in USERS] + [USERS[2] * 3]
    want = [t for t, _ in cold(small, prompts, max_tokens=20)]
    engine = engine_on(small)
    assert engine.generate(prompts, max_tokens=20) == want
    assert engine.scheduler.num_preemptions > 0 and engine.stats.prefix_hit_tokens > 0
    assert_all_back(engine)
    small.teardown()


# ---------------------------------------------------------------- random traffic
POOL = [SYSTEM + USERS[0], SYSTEM + USERS[1], SYSTEM + USERS[1] + USERS[3] * 9, SYSTEM[:PAGE + 3],
        USERS[2] * 3, SYSTEM + USERS[2]]


@pytest.fixture(scope="module")
def pool_cold(runner) -> list[list[int]]:
    return [t for t, _ in cold(runner, POOL, max_tokens=10)]


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=st.lists(st.integers(0, 5), min_size=3, max_size=8), budget_tokens=st.sampled_from([16, 40, 64]),
       pages=st.sampled_from([12, 20, 64]), overlap=st.booleans())
def test_random_traffic_gives_the_cold_tokens_and_every_slot_checkpoint_and_page_back(
        runner, pool_cold, order, budget_tokens, pages, overlap):
    """Requests sharing prefixes in random order, chunk budgets and cache sizes (preemptions, checkpoint
    evictions): every request gets its cold tokens (no row reads another's state), and at the end every
    state slot, checkpoint row and page is back."""
    r = runner_for(runner.model_config.name, batch_max_tokens=budget_tokens)  # the same random weights
    r.build(pages * PAGE)
    engine = engine_on(r, overlap=overlap)
    assert engine.generate([POOL[i] for i in order], max_tokens=10) == [pool_cold[i] for i in order]
    assert_all_back(engine)
    r.teardown()


# ---------------------------------------------------------------- the pieces
def test_checkpoint_stops_are_the_prompts_last_full_page_and_where_the_cached_run_ends():
    assert checkpoint_stops(40, 16, 0, 0) == [32]
    assert checkpoint_stops(33, 16, 0, 0) == [32]
    assert checkpoint_stops(32, 16, 0, 0) == [16]  # the last token is computed to be sampled
    assert checkpoint_stops(45, 16, 0, 2) == [32]
    assert checkpoint_stops(60, 16, 16, 2) == [32, 48]
    assert checkpoint_stops(60, 16, 48, 2) == []
    assert checkpoint_stops(10, 16, 0, 0) == []


def test_the_pool_evicts_the_least_recently_used_checkpoint_and_keeps_its_page_as_kv():
    c = PrefixCache(8, page_size=1, checkpoints=2)
    pages = c.alloc(3)
    rows = [c.new_checkpoint(), c.new_checkpoint()]
    assert c.new_checkpoint() is None  # both pending
    chain = c.insert(pages[0], 0, (1,), state=rows[0])
    chain = c.insert(pages[1], chain, (2,), state=rows[1])
    c.insert(pages[2], chain, (3,))
    assert c.match([(1,), (2,), (3,)], need_state=True).state == rows[1]
    c.match([(1,)], need_state=True)  # rows[0] used last
    row = c.new_checkpoint()
    assert row == rows[1] and c.entry(pages[1]).state is None
    m = c.match([(1,), (2,), (3,)], need_state=True)
    assert m.pages == pages[:1] and m.kv_pages == 3 and m.state == rows[0]
    c.drop_checkpoint(row)
    c.free(pages)
    c.alloc(7)  # every page evicted: its checkpoint with it
    assert c.num_free_checkpoints == 2 and c.num_held_checkpoints == 0


def test_state_cache_copies_checkpoints_to_and_from_slots():
    mc = load_model_config("tiny-hybrid")
    s = StateCache(mc, 3, 1, torch.float32, torch.device("cpu"), checkpoints=2)
    assert s.conv.shape[1] == 6 and s.pad == 3
    s.ssm[:, 1] = 5.0
    s.conv[:, 1] = 2.0
    s.save([(1, 0)])
    assert (s.ssm[:, 4] == 5.0).all() and (s.conv[:, 4] == 2.0).all() and not s.ssm[:, 5].any()
    s.load([(0, 2)])
    assert (s.ssm[:, 2] == 5.0).all() and not s.ssm[:, 0].any()
    with pytest.raises(ValueError, match="outside"):
        s.load([(2, 0)])


# ---------------------------------------------------------------- the budget
def test_the_checkpoint_rows_are_in_the_budget_and_the_log(caplog):
    """The runner's sizing declares the rows it builds (the probe builds them too, so the measurement holds
    them), the plan counts them, and the log says prefix caching is on with their count; without prefix
    caching there are none."""
    from autoprofile.plan import sizing_for

    r = runner_for("tiny-hybrid", running_max_req_size=20, graph_max_batch_size=4)
    sizing = r.sizing
    with caplog.at_level(logging.INFO):
        r.build(64 * PAGE)
        LLMEngine(r)
    assert r.state.checkpoints == budget.state_checkpoints(20) == 5
    assert sizing.state == (r.state.conv.nbytes, r.state.ssm.nbytes)
    assert r.state.conv.shape[1] == 20 + 1 + 5
    assert "5 state checkpoints" in caplog.text and "prefix caching on for" in caplog.text
    r.teardown()
    mc = load_model_config("qwen3.5-27b")
    cfg = validate(ServerConfig(model="qwen3.5-27b", running_max_req_size=64, graph_max_batch_size=64,
                                report_dir=None))
    with_rows = sizing_for(cfg, "triton").state
    assert budget.state_checkpoints(64) == 8  # a quarter of 64 slots is 16: the default's cap
    assert with_rows == budget.state_cache_bytes(mc, 64, 2, 1, checkpoints=8)
    off = sizing_for(cfg.replace(disable_prefix_caching=True), "triton").state
    assert sum(with_rows) - sum(off) == 8 * mc.state_bytes(1, 2)
    assert runner_for("tiny-hybrid", disable_prefix_caching=True).sizing.state == budget.state_cache_bytes(
        load_model_config("tiny-hybrid"), 6, 4)
    assert budget.state_checkpoints(1) == budget.MIN_CHECKPOINTS and budget.state_checkpoints(9, False) == 0


# ---------------------------------------------------------------- --state_checkpoints
def test_state_checkpoints_sets_the_pool_and_zero_turns_hybrid_hits_off():
    """--state_checkpoints N builds N rows (budget, runner, scheduler and plan agree); 0 keeps the K/V pages
    cached but no prefix of a hybrid resumes (no checkpoint): the same tokens, no hit."""
    assert budget.state_checkpoints(256) == budget.MAX_DEFAULT_CHECKPOINTS == 8
    assert budget.state_checkpoints(24) == 6 and budget.state_checkpoints(256, requested=64) == 64
    assert budget.state_checkpoints(256, prefix_caching=False, requested=8) == 0
    prompts = [SYSTEM + USERS[i] for i in (2, 1, 0)]
    hits = {}
    for n in (0, 2):
        r = runner_for("tiny-hybrid", state_checkpoints=n)
        r.build(64 * PAGE)
        try:
            assert r.state.ssm.shape[1] == r.envelope.running_reqs + 1 + n  # the slots, the pad, the pool
            engine = LLMEngine.from_config(r, r.cfg)  # the server's engine: the flag reaches the scheduler
            assert engine.scheduler.cache.checkpoints == n
            got = run(engine, prompts)
            hits[n] = engine.stats.prefix_hit_tokens
            assert_same(got, cold(r, prompts))
            assert_all_back(engine)
        finally:
            r.teardown()
    assert hits == {0: 0, 2: 2 * PAGE}


@pytest.mark.parametrize("kw, words", [(dict(state_checkpoints=-1), "must be >= 0"),
                                       (dict(state_checkpoints=4, disable_prefix_caching=True),
                                        "--disable_prefix_caching")])
def test_bad_state_checkpoints_are_refused_naming_the_flag(kw, words):
    from autoprofile.config import ConfigError
    with pytest.raises(ConfigError) as e:
        validate(ServerConfig(model="tiny-hybrid", **kw))
    assert "state_checkpoints" in str(e.value) and words in str(e.value)


def test_two_conversations_alternating_on_two_checkpoints_both_resume_every_turn():
    """A first resume makes a checkpoint the next to evict (PrefixCache.resumed): two multi-turn conversations
    taking turns on a pool of 2 rows each resume from their last turn's checkpoint. Under least recently used
    alone, A's resumed (dead) checkpoint outlives B's live one and B misses every turn."""
    r = runner_for("tiny-hybrid", state_checkpoints=2)
    r.build(64 * PAGE)
    try:
        engine = LLMEngine(r, state_checkpoints=2)
        history = {"A": [(3 * i) % 250 + 1 for i in range(40)], "B": [(5 * i) % 250 + 2 for i in range(40)]}
        hits, prompts, got = [], [], []
        for turn in range(3):
            for name in ("A", "B"):
                if turn:  # the last turn's prompt, a reply and new tokens (as bench_serving --multi-turn)
                    new = [(11 * i + turn) % 250 + 1 for i in range(20)]
                    history[name] = history[name] + [7 + turn] * 5 + new
                before = engine.stats.prefix_hit_tokens
                got += run(engine, [history[name]], max_tokens=4)
                prompts.append(history[name])
                hits.append(engine.stats.prefix_hit_tokens - before)
        assert hits[:2] == [0, 0] and all(h >= 2 * PAGE for h in hits[2:]), hits
        assert_same(got, cold(r, prompts, max_tokens=4))
        assert_all_back(engine)
    finally:
        r.teardown()


@pytest.mark.parametrize("model", ["tiny-hybrid", "tiny-hybrid-moe"])
def test_teardown_drops_the_state_slots_and_checkpoints(model):
    """The state cache (every request slot's conv + delta-rule state, and the checkpoint rows beside them)
    has one owner, the runner: teardown leaves no reference to its tensors, and a rebuild makes new ones."""
    import gc
    import weakref
    r = runner_for(model, state_checkpoints=3)
    for _ in range(2):
        r.build(64 * PAGE)
        assert r.state is not None and r.state.checkpoints == 3
        held = [weakref.ref(r.state.conv), weakref.ref(r.state.ssm)]
        LLMEngine(r).generate([SYSTEM + USERS[0]], max_tokens=4)
        r.teardown()
        gc.collect()
        assert r.state is None and all(ref() is None for ref in held), model


def test_a_prefill_forward_hands_the_linear_layers_fla_s_chunk_indices(runner, monkeypatch):
    """The runner's prefill metadata carries fla's chunk indices, made on the host and uploaded with the
    step's other inputs (gdn_chunk_indices): what the aiter_triton backend hands fla's rule in every linear
    layer, so no layer derives them with a host sync; those of the device's cu_seqlens, two rows in one step
    included."""
    seen = []
    real = type(runner.backend).gdn_prefill

    def spy(self, *args, **kwargs):
        seen.append(args[-1])  # the step's AttentionMetadata
        return real(self, *args, **kwargs)
    monkeypatch.setattr(type(runner.backend), "gdn_prefill", spy)
    engine = engine_on(runner, prefix_caching=False)
    for p in (SYSTEM + USERS[1], USERS[2]):
        engine.add_request(p, GREEDY_LP, max_tokens=2)
    while engine.has_unfinished():
        engine.step()
    assert seen, "no prefill reached a linear layer"
    for meta in seen:
        assert meta.gdn_chunk_indices is not None and meta.gdn_chunk_indices.dtype == torch.int64
        assert meta.gdn_chunk_indices.tolist() == [
            [i, j] for i, n in enumerate(meta.cu_seqlens.diff().tolist()) for j in range(-(-n // 64))]
    assert any(len(m.cu_seqlens) > 2 for m in seen), "two rows never shared a prefill step"
