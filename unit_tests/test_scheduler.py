"""The envelope, the scheduler and the engine loop.

Scheduler-only tests drive the real Scheduler and LLMEngine with a step runner that has no model (it
checks every step against the envelope exactly as ModelRunner.execute does, checks the rows' pages
and token ids against the requests, and answers each sampled row with a token derived from the
request's whole history, so a recomputed request must rebuild the same history to get the same
answer). The model tests run the real tiny model on the torch backend.
"""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoprofile import budget
from autoprofile.config import ServerConfig, validate
from autoprofile.engine import stress
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.envelope import STEP_FIELDS, Envelope, EnvelopeError, StepShape
from autoprofile.engine.request import PENDING, RequestStatus
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.sampler import SampledTokens
from autoprofile.engine.sampling import SamplingParams
from autoprofile.engine.step_clock import StepClock
from autoprofile.engine.weights import init_random

VOCAB = 1000


def envelope(kv_pages=32, page_size=4, context=64, batch=16, running=4, graph=4, graphs=False) -> Envelope:
    return Envelope.build(kv_pages=kv_pages, page_size=page_size, context_len=context, batch_max_tokens=batch,
                          running_max_req_size=running, graph_max_batch_size=graph, use_graphs=graphs)


def history_token(req, end: int) -> int:
    """A deterministic 'model': the next token is a hash of every token before position `end`."""
    h = 17
    for t in req.tokens(0, end):
        h = (h * 31 + t) % 1_000_003
    return h % VOCAB


class StepRunner:
    """ModelRunner's step contract (engine.step_runner.StepRunner) without a model."""

    overlaps = True
    host_kv = None

    def __init__(self, env: Envelope, kv_pages: int):
        self.envelope, self.kv = env, SimpleNamespace(num_pages=kv_pages)
        self.model_config = SimpleNamespace(vocab_size=VOCAB, is_hybrid=False)
        self.shapes: list[StepShape] = []
        self.steps: list = []
        self.page_table: dict[tuple[int, int], int] = {}
        self.clock = StepClock(torch.device("cpu"))
        self.last_tokens: dict[int, int] = {}  # by request slot, as ReqTable.last_tokens
        self.pending_rows = 0  # decode rows launched with a PENDING id (overlap)
        self.unread: dict[int, set[int]] = {}  # launched steps not read back yet: the pages each writes
        self.launches = 0

    def launch(self, step) -> SimpleNamespace:
        """As ModelRunner.launch: the tokens are known at once here, read through result()."""
        n, self.launches = self.launches, self.launches + 1
        written = written_pages(step, self.envelope.page_size)
        tokens = self.execute(step)  # a step refused here wrote nothing
        self.unread[n] = written

        def result():
            del self.unread[n]
            return tokens
        return SimpleNamespace(result=result)

    def wait_load(self, load_id: int) -> None:
        """No host tier: no load is ever in flight."""

    def loads_ready(self, ids: list[int]) -> set[int]:
        return set(ids)

    def execute(self, step) -> SampledTokens:
        shape = step.shape(self.envelope.graph_rows)
        self.envelope.check(shape)
        self.clock.begin("prefill" if step.is_prefill else "decode", 0)
        self.clock.launched()
        self.clock.ended()
        self.shapes.append(shape)
        self.steps.append(step)
        for slot, first, pages in step.page_writes:
            for i, p in enumerate(pages):
                self.page_table[slot, first + i] = p
        ps = self.envelope.page_size
        assert len({r.slot for r in step.all_rows}) == len(step.all_rows), "a request is one row of a step"
        for row in step.all_rows:
            req, end = row.request, row.start + len(row.ids)
            assert row.ids == req.tokens(row.start, end) and row.start == req.num_computed
            assert len(req.pages) * ps >= end, "a row computes tokens its pages cannot hold"
            assert [self.page_table[row.slot, i] for i in range(len(req.pages))] == req.pages
        assert all(len(r.ids) == 1 and r.sample for r in step.decode)
        out = []
        for row in step.all_rows:
            known = row.request.tokens(0, row.start)
            assert PENDING not in known, "only a row's own input may still be in flight"
            if PENDING in row.ids:
                assert row.ids == [PENDING] and (row in step.decode or not step.is_prefill), "a decode row's"
                self.pending_rows += 1
            ids = [self.last_tokens[row.slot] if t == PENDING else t for t in row.ids]
            if row.sample:
                out.append(history_token(SimpleNamespace(tokens=lambda a, b, h=known + ids: h[a:b]),
                                         row.start + len(row.ids)))
                self.last_tokens[row.slot] = out[-1]
        return SampledTokens(out)


def written_pages(step, page_size: int) -> set[int]:
    """The pages a step's rows write K/V into (rows of requests preempted while it was built write none)."""
    return {r.request.pages[pos // page_size] for r in step.all_rows
            if r.request.status is RequestStatus.RUNNING for pos in range(r.start, r.start + len(r.ids))}


def fake_engine(overlap: bool = False, **kw) -> tuple[LLMEngine, StepRunner]:
    kv_pages = kw.pop("kv_pages", 32)
    env = envelope(kv_pages=kv_pages, **kw)
    runner = StepRunner(env, kv_pages)
    runner.envelope = env
    return LLMEngine(runner, overlap=overlap), runner


def run_all(engine: LLMEngine, check=None) -> dict[str, tuple[list[int], str]]:
    out: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens, _ = out.get(o.request_id, ([], None))
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
        if check:
            check(engine)
    return out


def invariants(engine: LLMEngine) -> None:
    s = engine.scheduler
    loading = [r for load in s.cache.loads.values() for r in load.requests]  # the host tier's (host_kv)
    drained = [p for load in s.cache.loads.values() for p in load.drained]
    held = [p for r in s.running + loading for p in r.pages] + drained
    assert all(len(r.pages) == len(set(r.pages)) for r in s.running + loading), "a request holds a page once"
    assert len(set(held)) == s.pages_used, "every held page is counted (shared prefix pages once)"
    assert all(r.status is RequestStatus.LOADING for r in loading)
    assert all(not r.pages and r.slot is None for r in s.waiting), "waiting requests hold nothing"
    slots = [r.slot for r in s.running + loading]
    assert len(slots) == len(set(slots)) and len(slots) + len(s.free_slots) == s.env.running_reqs
    assert all(r.status is RequestStatus.RUNNING for r in s.running)
    cached_only_after_read_back(engine)


def cached_only_after_read_back(engine: LLMEngine) -> None:
    """A page is in the prefix cache only once every step that wrote it has been read back (a step still in
    flight may fail, and a cached page of unknown K/V would be served to the next prompt that shares it)."""
    unread = getattr(engine.runner, "unread", {})
    in_flight = set().union(*unread.values())
    cached = set(engine.scheduler.cache.registered().values())
    assert not in_flight & cached, f"pages {sorted(in_flight & cached)} cached while a step writing them runs"


# ---------------------------------------------------------------- the envelope and the stress corners
def test_every_envelope_limit_is_a_step_field():
    """A limit added to the envelope without a step field (so no stress corner could be checked against
    it) fails here. page_size and image_grid are shapes, not counts a step sums: the grid is checked per image
    at admission (LLMEngine._check_images) and the stress encodes it (test_images' sweep covers both);
    piecewise_tokens is where a step's path changes (its graphs), not a limit: the stress runs a corner at it
    (test_piecewise)."""
    fields = {f.name for f in dataclasses.fields(Envelope)} - {"page_size", "image_grid", "piecewise_tokens"}
    assert fields == set(STEP_FIELDS)


envelopes = st.builds(
    envelope, kv_pages=st.integers(2, 400), page_size=st.sampled_from([1, 4, 16]),
    context=st.integers(2, 300), batch=st.integers(1, 200), running=st.integers(1, 40),
    graph=st.integers(1, 40), graphs=st.booleans())


@settings(max_examples=300, deadline=None)
@given(envelopes)
def test_stress_corners_reach_every_limit_and_stay_inside(env):
    """Each field of the envelope is at its maximum in some corner step, and no corner step exceeds
    any limit (Envelope.check would refuse it in the runner)."""
    assert_corners_reach_every_limit(env)


def assert_corners_reach_every_limit(env: Envelope) -> None:
    """The steps the runner's stress executes: each inside the envelope, each limit reached by one of them."""
    pages = max(env.pages, 1)
    steps = stress.prefill_steps(env, pages, VOCAB, 0) + stress.decode_steps(env, pages, VOCAB, 0)
    shapes = [s.shape(env.graph_rows) for s in steps]
    for shape in shapes:
        env.check(shape)
    for name, limit in env.limits().items():
        assert max(getattr(s, name) for s in shapes) == limit, f"no stress corner reaches {name} = {limit}"


@settings(max_examples=200, deadline=None)
@given(envelopes, st.integers(0, 3))
def test_every_stress_row_is_sampled_and_each_worst_sampler_path_samples_the_most_rows(env, seed):
    """The sampler's memory grows with the rows it samples on its worst paths (STRESS_PARAMS): every row of
    every corner is sampled, and each path samples the most prefill rows and every decode row."""
    from autoprofile.engine.sampling import STRESS_PARAMS
    for is_prefill, corners in ((True, stress.prefill_corners(env)), (False, stress.decode_corners(env))):
        steps = [stress.corner_step(env, is_prefill, rows, max(env.pages, 1), VOCAB, seed + i)
                 for i, rows in enumerate(corners)]
        assert all(r.sample for s in steps for r in s.rows)
        most = max(len(s.rows) for s in steps)
        paths = {r.params for s in steps if len(s.rows) == most for r in s.rows}
        assert paths == set(STRESS_PARAMS), (is_prefill, most, paths)
        if not is_prefill:  # each decode row (slot) runs both paths
            for slot in range(most):
                assert {r.params for s in steps for r in s.rows if r.slot == slot} == set(STRESS_PARAMS)


@settings(max_examples=200, deadline=None)
@given(envelopes)
def test_a_stress_step_reports_the_slots_and_pages_it_really_holds(env):
    """running_reqs and pages of a corner step are counted from its rows and page writes (so the coverage
    test above can fail for them): each row its own slot, each page it writes once."""
    for is_prefill, corners in ((True, stress.prefill_corners(env)), (False, stress.decode_corners(env))):
        for i, rows in enumerate(corners):
            step = stress.corner_step(env, is_prefill, rows, max(env.pages, 1), VOCAB, i)
            slots = [r.slot for r in step.rows]
            pages = [p for _, _, ps in step.page_writes for p in ps]
            assert step.running == len(set(slots)) == len(rows)
            assert step.pages_used == len(set(pages)) == min(len(pages), max(env.pages, 1))


@settings(max_examples=100, deadline=None)
@given(envelopes, st.sampled_from([None, 8192, 131072]))
def test_every_decode_corner_runs_the_largest_max_seq_len_bucket(env, context):
    """The runner launches decode attention at the smallest bucket that holds the longest row; the
    decode kernels' scratch grows with that bucket, so each decode corner (eager and graph alike) must
    reach the largest one, which is --max_req_total_len."""
    if context is not None:
        env = dataclasses.replace(env, max_req_total_len=context, max_prefix_len=context - 2)
    buckets = budget.decode_buckets(env.max_req_total_len)
    last_steps = stress.decode_corners(env)[stress.DECODE_STEPS - 1::stress.DECODE_STEPS]
    assert last_steps
    for rows in last_steps:
        longest = max(start + n for start, n in rows)
        assert budget.decode_bucket(buckets, longest) == buckets[-1] == env.max_req_total_len
        step = stress.corner_step(env, False, rows, max(env.pages, 1), VOCAB, 0)
        env.check(step.shape(env.graph_rows))


def test_check_refuses_a_step_outside_and_names_the_limit():
    env = envelope(running=4)
    with pytest.raises(EnvelopeError, match="decode_rows 5 > 4"):
        env.check(StepShape(decode_rows=5, sampled_rows=4))
    with pytest.raises(EnvelopeError, match="prefill_tokens 17 > 16"):
        env.check(StepShape(prefill_tokens=17, prefill_rows=1))
    with pytest.raises(EnvelopeError,
                       match="a mixed step's tokens are its prefill tokens and one per decode row"):
        env.check(StepShape(decode_rows=1, prefill_rows=1, prefill_tokens=3, mixed_tokens=3))
    with pytest.raises(EnvelopeError, match="mixed_tokens 17 > 16"):
        env.check(StepShape(decode_rows=2, prefill_rows=1, prefill_tokens=15, mixed_tokens=17))
    with pytest.raises(EnvelopeError, match="a graph step replays every decode row, and only decode rows"):
        env.check(StepShape(decode_rows=1, graph_rows=1, prefill_rows=1, prefill_tokens=2, mixed_tokens=3))


def test_default_running_requests_are_the_graph_size_and_above_it_decode_is_eager_and_stressed():
    graphs = envelope(running=None, graph=8, graphs=True)
    assert graphs.running_reqs == graphs.decode_rows == graphs.graph_rows == 8
    wide = envelope(running=32, graph=8, graphs=True)
    assert (wide.decode_rows, wide.graph_rows) == (32, 8)
    sizes = {len(rows) for rows in stress.decode_corners(wide)}
    assert sizes == {32, 8}  # the eager corner and the largest graph


# ---------------------------------------------------------------- scheduling
def test_admission_fills_the_slots_in_arrival_order():
    engine, runner = fake_engine(running=2)
    ids = [engine.add_request([i + 1] * 3, max_tokens=2) for i in range(5)]
    first_tokens = {o.request_id: o.new_token_ids for o in engine.step()}
    first = runner.steps[0]
    assert first.is_prefill and [r.request.request_id for r in first.rows] == ids[:2]
    assert engine.stats.running == 2 and engine.stats.waiting == 3
    out = run_all(engine)
    assert sorted(first_tokens) == ids[:2]
    assert all(out[i][1] == "length" and len(first_tokens.get(i, []) + out[i][0]) == 2 for i in ids)


def test_a_prompt_of_max_req_total_len_minus_one_is_served_in_chunks():
    engine, runner = fake_engine(context=64, batch=16, kv_pages=40)
    rid = engine.add_request(list(range(1, 64)), max_tokens=1)
    out = run_all(engine)
    chunks = [(r.start, len(r.ids), r.sample) for s in runner.steps for r in s.rows]
    assert chunks == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 15, True)]
    assert out[rid] == ([history_token(SimpleNamespace(tokens=lambda a, b: list(range(1, 64))[a:b]), 63)],
                        "length")


def test_pages_are_allocated_as_requests_grow():
    engine, runner = fake_engine(page_size=4, kv_pages=40)
    engine.add_request([5] * 5, max_tokens=9)
    used = []
    while engine.has_unfinished():
        engine.step()
        s = engine.scheduler
        used.append(s.pages_used)
        if s.running:
            assert s.pages_used == math.ceil(s.running[0].num_computed / 4)
    # 5 prompt tokens: 2 pages; each decode adds one K/V, a page every 4 tokens; freed at the end
    assert used == [2, 2, 2, 2, 3, 3, 3, 3, 0]


@pytest.mark.parametrize("overlap", [False, True])
def test_chunks_ride_with_the_decodes_so_a_long_prompt_never_stalls_decoding(overlap):
    """Mixed steps: while a long prompt is chunked, every step also decodes the running request, and its
    decode row counts against the token budget."""
    engine, runner = fake_engine(overlap, context=64, batch=8, kv_pages=60)
    engine.add_request([1, 2], max_tokens=20)
    engine.step()  # its prefill
    engine.add_request(list(range(1, 60)), max_tokens=2)  # 59 tokens: chunks of 7 beside the decode row
    run_all(engine)
    chunk_steps = [s for s in runner.steps[1:] if s.is_prefill]
    assert len(chunk_steps) == 9 and all(len(s.decode) == 1 for s in chunk_steps)
    assert [sum(len(r.ids) for r in s.rows) for s in chunk_steps] == [7] * 8 + [3]
    assert all(shape.mixed_tokens <= 8 for shape in runner.shapes)
    assert not any(s.is_prefill for s in runner.steps[10:])  # then both decode: graph steps


def test_a_chunk_beside_decode_rows_waits_for_pages_instead_of_preempting_them():
    """In a mixed step the decode rows are scheduled first: a chunk that needs pages none can give waits,
    rather than preempt the youngest request, whose decode row may be in this very step."""
    engine, runner = fake_engine(kv_pages=7, batch=8, running=4)  # 6 usable pages of 4 tokens
    engine.add_request(list(range(1, 8)), max_tokens=10)
    engine.step()  # its prefill: 7 tokens, 2 pages
    engine.add_request(list(range(100, 120)), max_tokens=2)
    engine.step()  # mixed: the decode row + a 7-token chunk (2 pages); 2 pages free
    s = engine.scheduler
    s.running.reverse()  # the decoding request is the youngest (as after a preemption and re-admission)
    engine.step()  # its decode row takes a page; the chunk needs 2 more, 1 is free: it must wait
    last = runner.steps[-1]
    assert [len(r.ids) for r in last.all_rows] == [1] and s.num_preemptions == 0
    invariants(engine)
    out = run_all(engine, check=invariants)
    assert sorted(len(t) for t, _ in out.values()) == [2, 7]  # every request finishes (7 after the 3 above)


def test_abort_frees_every_page_and_slot_at_once_and_is_reported_once():
    engine, runner = fake_engine(running=2, kv_pages=32)
    a = engine.add_request([1] * 10, max_tokens=30)
    b = engine.add_request([2] * 10, max_tokens=30)
    c = engine.add_request([3] * 10, max_tokens=30)  # waits for a slot
    for _ in range(4):
        engine.step()
    assert engine.stats.pages_used > 0 and engine.stats.running == 2
    assert engine.abort(a) and engine.abort(c) and not engine.abort("nope")
    invariants(engine)
    assert engine.stats.waiting == 0 and engine.stats.running == 1
    assert engine.stats.pages_used == len(engine.scheduler.running[0].pages)
    assert engine.abort(b) and engine.stats.pages_used == 0 and engine.stats.running == 0
    reports = engine.step()
    assert sorted((o.request_id, o.finish_reason, o.finished) for o in reports) == [
        (a, "abort", True), (b, "abort", True), (c, "abort", True)]
    assert not engine.has_unfinished() and engine.step() == [] and not engine.abort(a)


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_token_ends_a_request_with_stop(overlap):
    engine, _ = fake_engine()
    probe = engine.add_request([4, 5, 6], max_tokens=5)
    first = run_all(engine)[probe][0]
    engine2, runner = fake_engine(overlap)
    rid = engine2.add_request([4, 5, 6], max_tokens=5, stop_token_ids={first[2]})
    assert run_all(engine2)[rid] == (first[:3], "stop")
    # overlap: the row after the stop token was launched before the token was read back (its token dropped)
    assert sum(len(s.all_rows) for s in runner.steps) == 3 + overlap
    assert engine2.stats.pages_used == 0 and not engine2.has_unfinished()


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_takes_the_youngest_and_recomputes_to_the_same_output(overlap):
    prompts = [[i + 1] * (6 + 3 * i) for i in range(6)]
    roomy, _ = fake_engine(kv_pages=200, running=6)
    want = [run_all_one for run_all_one in _serve(roomy, prompts)]
    # 13 usable pages for 6 requests of up to 10 pages
    tight, runner = fake_engine(overlap, kv_pages=14, running=6)
    got = _serve(tight, prompts, check=invariants)
    assert tight.stats.preemptions > 0
    assert got == want
    assert tight.stats.pages_used == 0 and len(tight.scheduler.free_slots) == 6


def _record_preemptions(engine) -> list[tuple[str, list[tuple[str, bool]], list[str]]]:
    """Each preemption as (victim, running before it as (id, still in chunked prefill), waiting after it)."""
    s, seen = engine.scheduler, []
    preempt = s._preempt

    def spy(req):
        running = [(r.request_id, r.num_tokens - r.num_computed > 1) for r in s.running]
        preempt(req)
        seen.append((req.request_id, running, [r.request_id for r in s.waiting]))
    s._preempt = spy
    return seen


def test_preemption_in_chunked_prefill_takes_the_youngest_and_puts_it_at_the_front_of_the_queue():
    prompts = [[1] * 6, [2] * 6, [3] * 30, [4] * 6, [5] * 6]  # the third is prefilled in chunks of 16
    def serve(engine, check=None):
        ids = [engine.add_request(p, max_tokens=4) for p in prompts]
        out = run_all(engine, check)
        return [out[i] for i in ids]
    want = serve(fake_engine(kv_pages=200, running=3, batch=16)[0])
    tight, _ = fake_engine(kv_pages=10, running=3, batch=16)  # 9 usable pages of 4 tokens
    seen = _record_preemptions(tight)
    assert serve(tight, check=invariants) == want
    victim, running, waiting = seen[0]
    # the youngest running request, still in its chunked prefill; the two older ones decode and stay
    assert running == [("req-0", False), ("req-1", False), ("req-2", True)] and victim == "req-2"
    assert waiting == ["req-2", "req-3", "req-4"]  # ahead of the requests that never ran
    assert all(v == r[-1][0] for v, r, _ in seen)  # every preemption takes the youngest running request


def _serve(engine, prompts, check=None):
    ids = [engine.add_request(p, max_tokens=20) for p in prompts]
    out = run_all(engine, check)
    return [out[i] for i in ids]


traces = st.lists(st.tuples(st.integers(0, 6),  # steps to wait before arriving
                            st.integers(1, 80),  # prompt length
                            st.integers(1, 40),  # max_tokens
                            st.one_of(st.none(), st.integers(0, 30)),  # abort after this many steps
                            st.integers(0, 60)),  # leading tokens shared with the other requests
                  min_size=1, max_size=25)
SHARED = [(5 * j + 1) % VOCAB for j in range(60)]
STOPS = frozenset(range(0, VOCAB, 11))  # about one token in 11 stops its request


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces, kv_pages=st.integers(25, 60), batch=st.integers(1, 48), running=st.integers(1, 8),
       caching=st.booleans())
def test_overlap_serves_the_tokens_of_one_step_at_a_time(trace, kv_pages, batch, running, caching):
    """The overlapped engine (each step launched before the last is read back, its decode rows fed PENDING
    ids) gives every request the tokens and the finish reason the plain engine gives, under preemption, the
    prefix cache and stop tokens; a request stopped by a token runs one row more, one that ends on
    max_tokens runs none."""
    def serve(overlap):
        engine, runner = fake_engine(overlap, context=96, page_size=4, kv_pages=kv_pages, batch=batch,
                                     running=running)
        engine.scheduler.cache.enabled = caching
        ids = {}
        for i, (_, n, max_tokens, _, shared) in enumerate(trace):
            if n < 96:
                prompt = (SHARED[:shared] + [(i * 7 + j) % VOCAB for j in range(n)])[:n]
                ids[i] = engine.add_request(prompt, max_tokens=limit[i], stop_token_ids=STOPS)
        out = run_all(engine, check=invariants)
        rows = {}
        for step in runner.steps:
            for r in step.all_rows:
                if r.sample:
                    rows[r.request.request_id] = rows.get(r.request.request_id, 0) + 1
        assert engine.stats.pages_used == 0 and len(engine.scheduler.free_slots) == running
        assert not any(PENDING in r.request.output_ids for s in runner.steps for r in s.all_rows)
        return ({i: out[rid] for i, rid in ids.items()}, {i: rows[rid] for i, rid in ids.items()}, runner,
                engine.stats.preemptions)
    limit = {i: min(max_tokens, 96 - n) for i, (_, n, max_tokens, _, _) in enumerate(trace)}
    (want, want_rows, _, preempted), (got, got_rows, runner, preempted_too) = serve(False), serve(True)
    assert got == want
    if not preempted and not preempted_too:  # a recompute samples again
        assert got_rows == {i: want_rows[i] + (reason == "stop" and len(tokens) < limit[i])
                            for i, (tokens, reason) in want.items()}
    assert runner.pending_rows > 0 or all(len(t) == 1 for t, _ in want.values())


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces, kv_pages=st.integers(25, 120), batch=st.integers(1, 48), running=st.integers(1, 8),
       caching=st.booleans(), overlap=st.booleans())
def test_random_arrival_traces_never_leave_the_envelope_and_lose_nothing(trace, kv_pages, batch, running,
                                                                         caching, overlap):
    """Every step passes Envelope.check (StepRunner raises otherwise), every request ends (length,
    stop or abort), and at the end every page and slot is free; with prefix caching on or off, with the
    overlapped engine or not."""
    engine, runner = fake_engine(overlap, context=96, page_size=4, kv_pages=kv_pages, batch=batch,
                                 running=running)
    engine.scheduler.cache.enabled = caching
    arrivals = sorted((wait, i) for i, (wait, *_) in enumerate(trace))
    pending, added, ended, aborts, clock = list(arrivals), {}, {}, {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= clock:
            _, i = pending.pop(0)
            _, n, max_tokens, abort_after, shared = trace[i]
            max_tokens = min(max_tokens, 96 - n) if n < 96 else None
            if max_tokens is None or max_tokens < 1:
                continue
            prompt = (SHARED[:shared] + [(i * 7 + j) % VOCAB for j in range(n)])[:n]
            added[i] = engine.add_request(prompt, max_tokens=max_tokens, stop_token_ids=STOPS)
            if abort_after is not None:
                aborts[clock + abort_after] = aborts.get(clock + abort_after, []) + [added[i]]
        for rid in aborts.pop(clock, []):
            engine.abort(rid)
        for o in engine.step():
            assert o.request_id not in ended, "reported after it finished"
            if o.finished:
                ended[o.request_id] = o.finish_reason
        invariants(engine)
        clock += 1
        assert clock < 5000, "no progress"
    assert set(ended) == set(added.values())
    assert set(ended.values()) <= {"length", "abort", "stop"}
    assert caching or engine.stats.prefix_hit_tokens == 0
    assert engine.stats.pages_used == 0 and len(engine.scheduler.free_slots) == running


# ---------------------------------------------------------------- the real tiny model
TINY = dict(model="tiny", dtype="float32", attention_backend="torch", max_req_total_len=128,
            batch_max_tokens=32, graph_max_batch_size=4, running_max_req_size=4, report_dir=None)


def tiny_runner(tokens: int, **kw) -> ModelRunner:
    r = ModelRunner(validate(ServerConfig(**{**TINY, **kw})))
    init_random(r.model, seed=1, std=0.08)
    r.build(tokens)
    return r


@pytest.fixture(scope="module")
def roomy():
    return tiny_runner(2048)


def test_model_preempted_then_resumed_gives_the_same_greedy_tokens(roomy):
    prompts = [[(11 * i + j) % 4000 + 1 for j in range(15 + 4 * i)] for i in range(4)]
    want = LLMEngine(roomy).generate(prompts, max_tokens=40)
    tight = LLMEngine(tiny_runner(160))  # 9 pages besides the pad page; the four need up to 4 each
    got = tight.generate(prompts, max_tokens=40)
    assert tight.stats.preemptions > 0
    assert got == want
    assert tight.stats.pages_used == 0


def test_model_chunked_prefill_equals_one_chunk(roomy):
    prompt = [(7 * j) % 4000 + 3 for j in range(100)]
    want = LLMEngine(tiny_runner(2048, batch_max_tokens=128)).generate([prompt], max_tokens=8)
    chunked = LLMEngine(roomy)  # 32-token chunks over cached prefixes
    log = roomy.step_log = []
    try:
        assert chunked.generate([prompt], max_tokens=8) == want
    finally:
        roomy.step_log = None
    assert [s.prefill_tokens for s in log[:4]] == [32, 32, 32, 4] and log[3].max_prefix_len == 96


def test_model_serves_many_short_beside_one_of_max_req_total_len(roomy):
    engine = LLMEngine(roomy)
    log = roomy.step_log = []
    try:
        long_id = engine.add_request([9] * 126, max_tokens=2)
        short = [engine.add_request([i + 1, i + 2], SamplingParams(temperature=0.9, top_p=0.8), max_tokens=5)
                 for i in range(10)]
        out = run_all(engine)
    finally:
        roomy.step_log = None
    assert len(out[long_id][0]) == 2 and all(len(out[s][0]) == 5 for s in short)
    assert max(s.max_req_total_len for s in log) == 128
    env = roomy.envelope
    for s in log:
        env.check(s)
    assert torch.equal(roomy.kv.buffer.isnan().any(), torch.tensor(False))


def test_model_seeded_requests_are_batch_and_preemption_invariant(roomy):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = LLMEngine(roomy).generate([[5, 6, 7]], seeded, max_tokens=12)[0]
    others = [SamplingParams(temperature=0.9, top_k=40)] * 3
    prompts = [[5, 6, 7]] + [[(13 * i + j) % 4000 + 1 for j in range(30)] for i in range(3)]
    crowded = LLMEngine(roomy).generate(prompts, [seeded] + others, max_tokens=12)[0]
    tight = LLMEngine(tiny_runner(160))
    preempted = tight.generate([[(3 * i + j) % 4000 + 1 for j in range(40)] for i in range(3)] + [[5, 6, 7]],
                               others + [seeded], max_tokens=60)[3][:12]
    assert tight.stats.preemptions > 0
    assert alone == crowded == preempted
    assert LLMEngine(roomy).generate([[5, 6, 7]], SamplingParams(temperature=1.0, top_p=0.95, seed=1235),
                                     max_tokens=12)[0] != alone


# ---------------------------------------------------------------- prefix caching
def test_the_prefix_cache_keeps_freed_pages_cached_until_alloc_needs_them():
    from autoprofile.engine.prefix_cache import PrefixCache
    c = PrefixCache(5, page_size=2)  # pages 1..4
    p1, p2 = c.alloc(2)
    c1 = c.insert(p1, 0, (1, 2))
    c2 = c.insert(p2, c1, (3, 4))
    assert c.match([(1, 2), (3, 4)]).pages == [p1, p2] and c.match([(1, 2), (3, 4)]).chain == c2
    assert c.match([(3, 4)]).pages == []  # the same tokens after another prefix are another key
    q = c.alloc(1)[0]
    assert c.insert(q, 0, (1, 2)) == c1 and c.registered()[0, (1, 2)] == p1  # the first copy stays
    c.free([p1, p2, q])
    assert c.num_free == 4 and c.match([(1, 2)]).pages == [p1]  # freed, still cached
    c.pages.share(p1)
    assert c.num_free == 3 and not c.pages.is_free(p1)
    c.free([p1])
    # least recently freed first, a freed run's tail before its head: the untouched page 4, then q, then p2
    evicted = c.alloc(3)
    assert evicted == [4, q, p2] and c.registered() == {(0, (1, 2)): p1}
    with pytest.raises(ValueError, match="double free"):
        c.free([p1])


def test_a_page_refilled_after_a_preemption_is_cached_only_when_its_own_step_is_read_back():
    """Overlap, 5 pages: B's chunk of 8 tokens (two pages, not sampled) is in flight when A's decode row needs
    a page: B is preempted and admitted again in the same step, its first chunk in one of those pages. The
    chunk before is read back then: its pages are no longer B's, and the page B holds now was written by the
    step still in flight, so resolve must not cache it (it did, before Scheduler.resolve compared the
    request's preemptions with the row's)."""
    engine, runner = fake_engine(True, kv_pages=6, page_size=4, context=64, batch=8, running=2)
    engine.add_request([1], max_tokens=8)
    engine.step()
    engine.step()
    engine.add_request([(5 * j + 2) % VOCAB for j in range(15)], max_tokens=4)
    seen = []
    while engine.has_unfinished():
        engine.step()
        seen.append(engine.stats.preemptions)
        invariants(engine)  # cached_only_after_read_back
    assert seen[-1] > 0 and runner.launches > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_shared_prefix_is_computed_once_and_gives_the_same_tokens(overlap):
    system = [(3 * j + 2) % VOCAB for j in range(40)]
    prompts = [system + [7, 8, 9], system + [4, 5], system]
    plain, _ = fake_engine(kv_pages=60)
    plain.scheduler.cache.enabled = False
    want = _serve_each(plain, prompts)
    cached, runner = fake_engine(overlap, kv_pages=60)
    got = _serve_each(cached, prompts)
    assert got == want and plain.stats.prefix_hit_tokens == 0
    # 40 shared tokens = 10 full pages of 4; the prompt that is the system prompt alone keeps its last
    # token to compute (9 pages)
    assert cached.stats.prefix_hit_tokens == 40 + 36
    first_start: dict[str, int] = {}
    for step in runner.steps:
        for r in step.rows:
            first_start.setdefault(r.request.request_id, r.start)
    assert list(first_start.values()) == [0, 40, 36]  # each later request's first chunk starts after the hit
    assert cached.stats.pages_used == 0


def _serve_each(engine, prompts):
    """One after the other, so each finds what the earlier ones left in the cache."""
    out = []
    for p in prompts:
        rid = engine.add_request(p, max_tokens=6)
        out.append(run_all(engine)[rid])
    return out


def test_model_prefix_cache_gives_the_same_greedy_tokens(roomy):
    system = [(29 * j) % 4000 + 5 for j in range(70)]
    prompts = [system + [11, 12, 13], system + [14], system + [15, 16, 17, 18, 19]]
    want = LLMEngine(roomy, prefix_caching=False).generate(prompts, max_tokens=8)
    cached = LLMEngine(roomy)
    first = cached.generate(prompts[:1], max_tokens=8)
    rest = cached.generate(prompts[1:], max_tokens=8)
    assert first + rest == want
    assert cached.stats.prefix_hit_tokens >= 2 * 64  # four full 16-token pages of the system prompt, twice


def test_model_overlap_gives_the_tokens_of_one_step_at_a_time(roomy):
    """The real runner's launch: decode rows (eager and riding in mixed steps) fed PENDING ids from the
    request table on the device give the plain engine's greedy and seeded tokens, under preemption and with
    stop tokens (the row after a stop is computed and dropped)."""
    prompts = [[(11 * i + j) % 4000 + 1 for j in range(15 + 9 * i)] for i in range(4)]
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, seed=7)] * 2
    want = LLMEngine(roomy).generate(prompts, params, max_tokens=40)
    assert LLMEngine(roomy, overlap=True).generate(prompts, params, max_tokens=40) == want
    tight = LLMEngine(tiny_runner(160), overlap=True)
    log = tight.runner.step_log = []
    assert tight.generate(prompts, params, max_tokens=40) == want
    assert tight.stats.preemptions > 0 and tight.stats.pages_used == 0
    assert any(s.prefill_tokens and s.decode_rows for s in log), "no mixed step ran"
    stop = want[0][5]
    plain, overlapped = LLMEngine(roomy), LLMEngine(roomy, overlap=True)
    for engine in (plain, overlapped):
        for p, sp in zip(prompts, params):
            engine.add_request(p, sp, max_tokens=40, stop_token_ids={stop})
    assert run_all(overlapped) == run_all(plain)
    assert run_all(plain) == {} and overlapped.stats.pages_used == 0


def test_overlap_needs_a_runner_that_launches():
    engine, runner = fake_engine()

    class Broadcaster(StepRunner):  # as tp.broadcast.StepBroadcaster: it does not overlap
        overlaps = False
    with pytest.raises(ValueError, match="overlap needs a runner"):
        LLMEngine(Broadcaster(runner.envelope, runner.kv.num_pages), overlap=True)
