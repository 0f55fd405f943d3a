"""The prefix cache's host tier (--host_kv): its bookkeeping under random traffic, the copies' contents, the
tiny model's tokens served from host-tier pages, and its sizing (a host that cannot hold it: a clear error).

The content runner is test_scheduler's StepRunner with a KV pool whose every cell holds a value derived from
the request's tokens up to that position: each step first runs its saves through the real HostKVPool (as
ModelRunner.launch does), then checks that every position a row attends to holds its value (a page copied back
must hold exactly what was evicted, in its place), then writes its own positions. Its loads land later, as
the GPU's do beside the steps: a load lands (its copies run) only when the engine polls it and a coin says
so (loads_ready); until then no step may read or write its GPU pages, nor a save write its host pages.
"""
from __future__ import annotations

import pickle
import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from autoprofile.config import ConfigError, ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.envelope import EnvelopeError
from autoprofile.engine.host_kv import (GIB, PROCESS_MARGIN, HostKVError, HostKVPool, HostPages,
                                        host_kv_bytes, host_tier, page_runs)
from autoprofile.engine.scheduler import Step
from autoprofile.tp import broadcast
from autoprofile.engine.request import RequestStatus
from unit_tests.test_scheduler import (SHARED, STOPS, VOCAB, StepRunner, envelope, invariants, run_all,
                                       tiny_runner)

PS = 4


def cell(tokens: list[int]) -> float:
    """The K value at the last of `tokens`' positions: a hash of every token up to it (V: + 0.5)."""
    h = 7
    for t in tokens:
        h = (h * 131 + t + 1) % 1_000_003
    return float(h)


class ContentRunner(StepRunner):
    def __init__(self, env, kv_pages: int, host_pages: int, land: float = 1.0, seed: int = 0):
        """land: the chance that a load in flight lands at a poll."""
        super().__init__(env, kv_pages)
        self.in_flight: dict[int, list[tuple[int, int]]] = {}  # load id -> (host page, gpu page), not landed
        self.land, self.rng = land, random.Random(seed)
        self.loads_seen = 0
        self.buffer = torch.full((2, 1, kv_pages, 1, PS, 1), -1.0, dtype=torch.float64)
        self.host_kv = (HostKVPool(host_pages, (2, 1, 1, PS, 1), torch.float64, pin=False) if host_pages
                        else None)
        self.checked = 0
        self.waited: list[int] = []
        self.doomed: set[str] = set()  # requests of failed rows (FailingContentRunner)
        self.wait_lands = True  # False: a wait returns with the load still in flight (a test's stuck copy)

    def wait_load(self, load_id: int) -> None:
        """As ModelRunner.wait_load: the load lands (its event synchronized)."""
        self.waited.append(load_id)
        if self.wait_lands:
            self.host_kv.transfer(self.buffer, [], self.in_flight.pop(load_id, []))

    def loads_ready(self, ids: list[int]) -> set[int]:
        done = set()
        for i in ids:
            if i in self.in_flight and self.rng.random() >= self.land:
                continue
            pairs = self.in_flight.pop(i, [])
            self.host_kv.transfer(self.buffer, [], pairs)
            done.add(i)
        return done

    def execute(self, step):
        gpu_loading = {g for pairs in self.in_flight.values() for _, g in pairs}
        host_loading = {h for pairs in self.in_flight.values() for h, _ in pairs}
        assert not gpu_loading & {g for g, _ in step.kv_saves}, "a save reads a page still loading"
        assert not host_loading & {h for _, h in step.kv_saves}, "a save writes a host page still being read"
        for row in step.all_rows:
            pages = row.request.pages[:-(-(row.start + len(row.ids)) // PS)]
            assert not gpu_loading & set(pages), "a row reads or writes a page before its load landed"
        if step.kv_saves:
            self.host_kv.transfer(self.buffer, step.kv_saves, [])
        if step.kv_loads:
            assert step.kv_load_id and step.kv_load_id not in self.in_flight
            self.in_flight[step.kv_load_id] = list(step.kv_loads)
            self.loads_seen += 1
        for slot, first, pages in step.page_writes:
            for i, p in enumerate(pages):
                self.page_table[slot, first + i] = p
        for row in step.all_rows:
            if row.request.request_id in self.doomed:
                continue  # a failed step's request: it ends with "error" whatever it reads
            history = row.request.tokens(0, row.start)
            for pos in range(row.start):  # what the row attends to: cached (GPU or host tier) or computed
                k, v = self._cell(row.slot, pos)
                assert (k, v) == (cell(history[:pos + 1]), cell(history[:pos + 1]) + 0.5), \
                    f"position {pos} of {row.request.request_id} holds the wrong K/V"
                self.checked += 1
        for row in step.all_rows:  # the row's own K/V (a PENDING decode input: the slot's last token)
            ids = [self.last_tokens[row.slot] if t < 0 else t for t in row.ids]
            history = row.request.tokens(0, row.start) + ids
            for pos in range(row.start, row.start + len(ids)):
                page = self.page_table[row.slot, pos // PS]
                value = cell(history[:pos + 1])
                self.buffer[0, 0, page, 0, pos % PS, 0] = value
                self.buffer[1, 0, page, 0, pos % PS, 0] = value + 0.5
        return super().execute(step)

    def _cell(self, slot: int, pos: int) -> tuple[float, float]:
        page = self.page_table[slot, pos // PS]
        return float(self.buffer[0, 0, page, 0, pos % PS, 0]), float(self.buffer[1, 0, page, 0, pos % PS, 0])


def content_engine(kv_pages: int, host_pages: int, overlap: bool = False, land: float = 1.0, seed: int = 0,
                   **kw) -> tuple[LLMEngine, ContentRunner]:
    env = envelope(kv_pages=kv_pages, page_size=PS, **kw)
    runner = ContentRunner(env, kv_pages, host_pages, land, seed)
    return LLMEngine(runner, overlap=overlap), runner


def tier_invariants(engine: LLMEngine) -> None:
    """Every GPU page free or held, every host page free or cached (none held between steps), no key on both
    tiers, and every key the host tier took is cached there still or left it one way."""
    invariants(engine)
    s = engine.scheduler
    a, host = s.cache, s.cache.host
    assert a.num_free + s.pages_used == a.capacity
    if host is None:
        return
    held = [h for load in s.cache.loads.values() for h in load.host_pages]
    assert host.num_held == len(held) == len(set(held)), "host pages held past their loads, or not by one"
    assert host.num_free + host.num_cached + host.num_held == host.num_pages
    gpu = [g for load in s.cache.loads.values() for g in load.gpu_pages]
    assert all(not a.pages.is_free(g) for g in gpu), "a page still loading is free (alloc could hand it out)"
    assert not set(a.registered()) & set(host.keys()), "a key on both tiers"
    assert host.saved == host.num_cached + host.loaded + host.dropped + host.discarded, "a host page lost"
    assert len(set(host.keys().values())) == host.num_cached


class FailingContentRunner(ContentRunner):
    """ContentRunner whose chosen launches fail (as test_failed_step's FailingStepRunner): "early" before
    anything (an EnvelopeError: no copy, no page-table write), "late" after the copies and the page-table
    writes (the forward raising), "readback" once the step ran (its tokens' copy to the host raising). A step
    that failed "late" or on its read back leaves its rows' positions unknown (NaN). A row reading the wrong
    K/V is recorded in `stale` (the engine turns the assertion into a failed step)."""

    def __init__(self, env, kv_pages: int, host_pages: int, land: float, seed: int, fail: dict[int, str]):
        super().__init__(env, kv_pages, host_pages, land, seed)
        self.fail, self.launches, self.stale, self.failed_rows = fail, 0, [], []

    def launch(self, step):
        how = self.fail.get(self.launches)
        tokens = self._run(step)
        if how == "readback":
            return SimpleNamespace(result=readback_failed)
        return SimpleNamespace(result=lambda: tokens)

    def execute(self, step):
        tokens = self._run(step)
        if self.fail.get(self.launches - 1) == "readback":
            readback_failed()
        return tokens

    def _run(self, step):
        at, self.launches = self.launches, self.launches + 1
        how = self.fail.get(at)
        if how == "early":
            self.failed_rows.append(step.rows)
            self.doomed |= {row.request.request_id for row in step.rows}
            raise EnvelopeError("injected: refused before anything ran")
        last = dict(self.last_tokens)
        try:
            tokens = super().execute(step)
        except AssertionError as e:
            self.stale.append(e)
            raise
        if how in ("late", "readback"):
            rows = step.rows if how == "late" else step.all_rows
            self.failed_rows.append(rows)
            self.doomed |= {row.request.request_id for row in rows}
            for row in step.all_rows:  # what the failed forward left in the step's positions is unknown
                for pos in range(row.start, row.start + len(row.ids)):
                    self.buffer[:, 0, self.page_table[row.slot, pos // PS], 0, pos % PS, 0] = float("nan")
            if how == "late":
                self.last_tokens = last  # the step's tokens never existed
                raise RuntimeError("injected: the forward failed")
        return tokens


def readback_failed():
    raise RuntimeError("injected: the tokens' copy to the host failed")


# ---------------------------------------------------------------- the bookkeeping under random traffic
traces = st.lists(st.tuples(st.integers(0, 6),  # steps to wait before arriving
                            st.integers(1, 70),  # prompt length
                            st.integers(1, 24),  # max_tokens
                            st.one_of(st.none(), st.integers(0, 30)),  # abort after this many steps
                            st.integers(0, 60),  # leading tokens shared with the other requests
                            st.booleans()),  # returns: again later with its first prompt and more
                  min_size=1, max_size=20)


def serve_traffic(engine: LLMEngine, trace, kv_pages: int) -> tuple[dict[str, list[int]], dict[str, str]]:
    """The trace's requests (and its returning conversations' second turns, their first prompt and more) at
    their steps, its aborts at theirs, the tier's invariants after every step: (prompt, finish reason) by id."""
    arrivals = sorted([(wait, i, 0) for i, (wait, *_) in enumerate(trace)]
                      + [(wait + 12, i, 1) for i, (wait, *_, again) in enumerate(trace) if again])
    pending, prompts, reasons, aborts, clock = list(arrivals), {}, {}, {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= clock:
            _, i, turn = pending.pop(0)
            _, n, max_tokens, abort_after, shared, _ = trace[i]
            prompt = (SHARED[:shared] + [(i * 7 + j) % VOCAB for j in range(n)])[:n]
            prompt += [(i * 13 + j) % VOCAB for j in range(5)] if turn else []
            max_tokens = min(max_tokens, min(96, (kv_pages - 1) * PS) - len(prompt))
            if max_tokens < 1:
                continue
            rid = engine.add_request(prompt, max_tokens=max_tokens, stop_token_ids=STOPS)
            prompts[rid] = prompt
            if abort_after is not None and not turn:
                aborts.setdefault(clock + abort_after, []).append(rid)
        for rid in aborts.pop(clock, []):
            engine.abort(rid)
        for o in engine.step():
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        tier_invariants(engine)
        clock += 1
        assert clock < 5000, "no progress"
    return prompts, reasons


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces, kv_pages=st.integers(22, 50), host_pages=st.integers(0, 40), batch=st.integers(4, 40),
       running=st.integers(1, 6), overlap=st.booleans(), land=st.sampled_from([1.0, 0.5, 0.2]),
       seed=st.integers(0, 99))
def test_random_traffic_keeps_every_page_on_one_tier_and_restores_what_was_evicted(
        trace, kv_pages, host_pages, batch, running, overlap, land, seed):
    """Random arrivals, returning conversations, aborts (some while loading), preemptions, loads that land
    late: after every step each page is on one tier or free, nothing is lost, and every position a row
    reads holds its K/V (ContentRunner)."""
    engine, runner = content_engine(kv_pages, host_pages, overlap, land, seed, context=96, batch=batch,
                                    running=running)
    prompts, reasons = serve_traffic(engine, trace, kv_pages)
    assert set(reasons) == set(prompts)
    s = engine.stats
    assert s.failed_steps == 0, "a step failed (ContentRunner's checks raise inside the engine's step)"
    assert s.pages_used == 0 and len(engine.scheduler.free_slots) == running
    assert not runner.in_flight and not engine.scheduler.cache.loads
    if host_pages:
        assert s.host.hit_tokens == engine.scheduler.cache.host.loaded * PS
        assert s.host.bytes_moved == (s.host.saved + s.host.loaded) * runner.host_kv.page_bytes
    else:
        assert s.host is None


# found: the host pages of a failed step's saves (which never ran) kept their keys, and a later hit read them
SAVES_NEVER_RAN = [(0, 1, 1, None, 0, False)] * 3 + [(0, 41, 1, None, 4, False), (0, 41, 1, None, 0, False),
                                                     (0, 5, 1, None, 4, False)]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces, kv_pages=st.integers(22, 40), host_pages=st.integers(4, 40), batch=st.integers(4, 40),
       running=st.integers(1, 6), overlap=st.booleans(), land=st.sampled_from([1.0, 0.5, 0.2]),
       seed=st.integers(0, 99),
       fail=st.dictionaries(st.integers(0, 80), st.sampled_from(["early", "late", "readback"]), max_size=8))
@example(trace=SAVES_NEVER_RAN, kv_pages=22, host_pages=4, batch=14, running=1, overlap=False, land=1.0, seed=0,
         fail={0: "early", 1: "early", 8: "early"})
def test_failed_steps_beside_the_host_tier_leave_no_row_reading_unknown_kv(
        trace, kv_pages, host_pages, batch, running, overlap, land, seed, fail):
    """Random traffic through the tier (returning conversations, aborts, preemption, late loads) with random
    steps failing before anything, after the copies and page-table writes, or on their read back: no row of
    a request that survives reads a position whose K/V is not its own (a failed step's unknown K/V never
    reaches the prefix cache or the host tier), only the failed rows' requests end with "error", and at the
    end every page and slot is back and no load is in flight."""
    env = envelope(kv_pages=kv_pages, page_size=PS, context=96, batch=batch, running=running)
    runner = FailingContentRunner(env, kv_pages, host_pages, land, seed, fail)
    engine = LLMEngine(runner, overlap=overlap)
    prompts, reasons = serve_traffic(engine, trace, kv_pages)
    assert not runner.stale, runner.stale[0]
    failed = {r.request.request_id for rows in runner.failed_rows for r in rows}
    assert {rid for rid, why in reasons.items() if why == "error"} <= failed
    assert set(reasons) == set(prompts)
    assert engine.stats.pages_used == 0 and len(engine.scheduler.free_slots) == running
    assert not runner.in_flight and not engine.scheduler.cache.loads


def test_a_returning_conversation_is_served_from_the_host_tier_with_its_own_contents():
    """A prompt whose pages the GPU evicted comes back: they come from the host tier (no recompute of them),
    each into a GPU page that holds exactly what was evicted (ContentRunner checks every position)."""
    engine, runner = content_engine(kv_pages=24, host_pages=64, context=96, batch=16, running=2)
    first = [(3 * j + 1) % VOCAB for j in range(41)]
    _serve(engine, [first], max_tokens=4)
    others = [[(5 * j + 7 * k + 2) % VOCAB for j in range(60)] for k in range(3)]
    _serve(engine, others, max_tokens=4)  # 15 pages each: the first prompt's 10 cached pages go to the host
    host = engine.scheduler.cache.host
    assert host.saved >= 10 and host.loaded == 0
    runner.checked = 0
    rid = engine.add_request(first + [9, 9, 9], max_tokens=4)
    while engine.has_unfinished():
        engine.step()
    first_row = next(r for s in runner.steps for r in s.rows if r.request.request_id == rid)
    assert first_row.start == 40  # 10 pages back from the host tier: its first chunk starts after them
    assert host.loaded == 10 and engine.stats.host.hit_tokens == 40
    assert engine.stats.failed_steps == 0, "a step failed (ContentRunner's checks raise inside the step)"
    assert runner.checked >= 40
    tier_invariants(engine)


def _evicted_conversation(engine):
    """A prompt of 41 tokens served, then three others whose pages push its 10 cached pages to the host."""
    first = [(3 * j + 1) % VOCAB for j in range(41)]
    _serve(engine, [first], max_tokens=4)
    _serve(engine, [[(5 * j + 7 * k + 2) % VOCAB for j in range(60)] for k in range(3)], max_tokens=4)
    assert engine.scheduler.cache.host.saved >= 10
    return first


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_loading_from_the_host_tier_waits_while_others_run_and_an_abort_gives_its_pages_back(
        overlap):
    """Its loads do not land: it has no row while another request runs to its end; aborted, its pages stay
    held until the loads land (the copies may still write them), then every page is back."""
    engine, runner = content_engine(kv_pages=24, host_pages=64, overlap=overlap, context=96, batch=16,
                                    running=3)
    first = _evicted_conversation(engine)
    runner.land, runner.wait_lands = 0.0, False
    rid = engine.add_request(first + [9, 9, 9], max_tokens=4)
    other = engine.add_request([(11 * j) % VOCAB for j in range(9)], max_tokens=6)
    done = set()
    for _ in range(12):
        done |= {o.request_id for o in engine.step() if o.finished}
        tier_invariants(engine)
    s = engine.scheduler
    loading = [r for load in s.cache.loads.values() for r in load.requests]
    assert [r.request_id for r in loading] == [rid] and loading[0].status is RequestStatus.LOADING
    assert other in done, "the other request ran beside the loads"
    assert not any(r.request.request_id == rid for st_ in runner.steps for r in st_.all_rows)
    held = s.pages_used
    assert held == 10 and runner.in_flight
    assert engine.abort(rid)
    assert s.pages_used == held and len(s.free_slots) == 3, "pages wait for the copies, the slot does not"
    tier_invariants(engine)
    runner.land, runner.wait_lands = 1.0, True
    while engine.has_unfinished():
        engine.step()
    assert s.pages_used == 0 and not s.cache.loads and not runner.in_flight
    assert engine.stats.failed_steps == 0
    tier_invariants(engine)


class FailingLoads(ContentRunner):
    """Its first step that carries loads raises before any copy."""

    failed = False

    def execute(self, step):
        if step.kv_loads and not self.failed:
            self.failed = True
            raise RuntimeError("injected: the step carrying the loads failed")
        return super().execute(step)


def test_a_failed_step_sends_its_loading_requests_back_to_wait_and_they_recompute():
    env = envelope(kv_pages=24, page_size=PS, context=96, batch=16, running=2)
    runner = FailingLoads(env, 24, 64)
    engine = LLMEngine(runner)
    first = _evicted_conversation(engine)
    rid = engine.add_request(first + [9, 9, 9], max_tokens=4)
    reasons = {}
    while engine.has_unfinished():
        reasons |= {o.request_id: o.finish_reason for o in engine.step() if o.finished}
        tier_invariants(engine)
    assert runner.failed and engine.stats.failed_steps == 1
    assert reasons[rid] == "length", "the loading request was not a row of the failed step: it runs again"
    rows = [r for st_ in runner.steps for r in st_.all_rows if r.request.request_id == rid]
    assert rows[0].start == 0, "its pages' contents were unknown: recomputed from the start"
    assert engine.stats.pages_used == 0 and not engine.scheduler.cache.loads
    tier_invariants(engine)


class FailingReady(ContentRunner):
    """Its first step that names loads done (kv_ready) is refused before anything ran."""

    failed: list[int] = []

    def execute(self, step):
        if step.kv_ready and not self.failed:
            self.failed = list(step.kv_ready)
            raise EnvelopeError("injected: refused before anything ran")
        return super().execute(step)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_that_never_ran_gives_its_ready_loads_to_the_next_step(overlap):
    """The step that names a landed load (Step.kv_ready: under --tp every rank's forward waits for its own
    copies of it) fails before it runs: the next step names the load instead (it was lost, and the loaded
    request's later rows ran in steps that never named it)."""
    env = envelope(kv_pages=24, page_size=PS, context=96, batch=16, running=2)
    runner = FailingReady(env, 24, 64)
    engine = LLMEngine(runner, overlap=overlap)
    first = _evicted_conversation(engine)
    engine.add_request([(11 * j) % VOCAB for j in range(9)], max_tokens=12)  # decodes beside the loads
    engine.step()
    engine.add_request(first + [9, 9, 9], max_tokens=4)
    while engine.has_unfinished():
        engine.step()
        tier_invariants(engine)
    assert runner.failed and engine.stats.failed_steps == 1
    after = [st_ for st_ in runner.steps if st_.kv_ready]
    assert after and after[0].kv_ready[:len(runner.failed)] == runner.failed
    assert engine.stats.pages_used == 0 and not engine.scheduler.cache.loads


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_alone_with_its_loads_in_flight_waits_for_them_instead_of_polling(overlap):
    """Nothing else to run: the engine waits for the load's event (runner.wait_load) instead of returning at
    once to poll it again (a busy loop); the loads never land by a poll here, so only that wait serves it."""
    engine, runner = content_engine(kv_pages=24, host_pages=64, overlap=overlap, context=96, batch=16,
                                    running=3)
    first = _evicted_conversation(engine)
    runner.land = 0.0
    rid = engine.add_request(first + [9, 9, 9], max_tokens=4)
    finished, calls = {}, 0
    while engine.has_unfinished() and calls < 20:
        finished.update({o.request_id: o.finish_reason for o in engine.step() if o.finished})
        calls += 1
    assert finished == {rid: "length"} and len(runner.waited) == 1
    assert engine.stats.host.hit_tokens > 0 and engine.stats.pages_used == 0
    tier_invariants(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_preempted_requests_full_pages_go_to_the_host_tier_and_come_back_from_it(overlap):
    """Two requests outgrow 11 pages: the younger is preempted; its full pages enter the prefix cache, the
    older one's growth saves them to the host, and the younger comes back through the host hit (ContentRunner
    checks every position it reads). The tokens are those of a cache that never preempts."""
    prompts = [[(7 * j + 3 * k) % VOCAB for j in range(18)] for k in range(2)]
    engine, runner = content_engine(kv_pages=12, host_pages=64, overlap=overlap, context=48, batch=32,
                                    running=2)
    for p in prompts:
        engine.add_request(p, max_tokens=22)
    got = run_all(engine, check=tier_invariants)
    roomy, _ = content_engine(kv_pages=40, host_pages=0, overlap=overlap, context=48, batch=32, running=2)
    for p in prompts:
        roomy.add_request(p, max_tokens=22)
    assert got == run_all(roomy)
    s = engine.stats
    assert s.preemptions > 0 and roomy.stats.preemptions == 0
    assert s.host.loaded > 0 and s.host.hit_tokens > 0, "the preempted pages came back from the host"
    assert s.failed_steps == 0 and s.pages_used == 0
    tier_invariants(engine)


def _serve(engine, prompts, max_tokens):
    for p in prompts:
        engine.add_request(p, max_tokens=max_tokens)
        while engine.has_unfinished():
            engine.step()


def test_page_runs_group_consecutive_pages_on_both_sides():
    assert page_runs([(5, 0), (6, 1), (7, 2), (9, 3), (10, 5)]) == [(5, 0, 3), (9, 3, 1), (10, 5, 1)]
    assert page_runs([]) == []


def test_host_pages_drop_the_least_recently_used_and_hold_loaded_pages_until_the_step_is_built():
    h = HostPages(2)
    a, b = h.put((0, (1,)), 5), h.put((5, (2,)), 6)
    assert h.lookup(0, (1,)) == (a, 5) and h.lookup(5, (2,)) == (b, 6)
    h.take(a)
    assert h.num_free == 0 and h.num_held == 1 and h.lookup(0, (1,)) is None
    c = h.put((0, (3,)), 7)  # the held page is not given out: the LRU's b goes
    assert c == b and h.dropped == 1 and h.lookup(5, (2,)) is None
    h.release([a])
    assert h.num_free == 1
    assert h.discard((0, (3,))) == 7 and h.num_free == 2 and h.discarded == 1


def test_a_step_ships_its_host_tier_copies_to_every_rank():
    step = Step(is_prefill=False, rows=[], kv_saves=[(3, 0), (4, 1)], kv_loads=[(7, 9)], kv_load_id=5,
                kv_ready=[2, 4])
    back = broadcast.decode(pickle.loads(pickle.dumps(broadcast.encode(step))))
    assert back.kv_saves == [(3, 0), (4, 1)] and back.kv_loads == [(7, 9)]
    assert back.kv_load_id == 5 and back.kv_ready == [2, 4]


# ---------------------------------------------------------------- the tiny model
def _conversations(engine, max_tokens=6):
    """Three turns: A, then B and C (whose pages evict A's), then A again with more."""
    a = [(29 * j) % 4000 + 5 for j in range(70)]
    b = [(31 * j) % 4000 + 7 for j in range(70)]
    c = [(37 * j) % 4000 + 9 for j in range(70)]
    out = [engine.generate([p], max_tokens=max_tokens)[0] for p in (a, b, c)]
    out.append(engine.generate([a + out[0] + [11, 12, 13]], max_tokens=max_tokens)[0])
    return out


@pytest.mark.parametrize("deterministic", [False, True])
def test_model_host_tier_hits_give_the_recompute_tokens(deterministic):
    """The tiny model on the CPU engine, a GPU KV of 10 pages: the returning conversation's prefix comes back
    from the host tier and its tokens are those of the tier off (recomputed) and of no prefix cache."""
    fresh = _conversations(LLMEngine(tiny_runner(2048, deterministic=deterministic), prefix_caching=False))
    off = _conversations(LLMEngine(tiny_runner(176, deterministic=deterministic)))
    tier = LLMEngine(tiny_runner(176, deterministic=deterministic, host_kv="0.002"))
    got = _conversations(tier)
    assert got == off == fresh
    assert tier.stats.host.hit_tokens >= 64 and tier.stats.host.loaded >= 4
    assert tier.stats.pages_used == 0
    tier_invariants(tier)


# ---------------------------------------------------------------- sizing
def test_auto_takes_a_share_of_available_memory_less_a_margin_split_over_the_hosts_gpus():
    assert host_kv_bytes("off", 100 * GIB, 1, 1) == 0
    assert host_kv_bytes("auto", 100 * GIB, 1, 1) == 50 * GIB - PROCESS_MARGIN
    assert host_kv_bytes("auto", 100 * GIB, 2, 8) == (50 * GIB - PROCESS_MARGIN) // 8
    assert host_kv_bytes("auto", 100 * GIB, 4, 2) == (50 * GIB - PROCESS_MARGIN) // 4
    assert host_kv_bytes("auto", 10 * GIB, 1, 1) == 0
    assert host_kv_bytes("1.5", 100 * GIB, 1, 1) == int(1.5 * GIB)


def test_a_size_the_host_cannot_hold_names_the_flag_and_a_size_that_fits():
    with pytest.raises(HostKVError, match=r"try --host_kv 21 "):
        host_kv_bytes("64", 50 * GIB, 2, 2)  # 2 ranks x 64 > 50 - 8: 21 GiB each fits
    cfg = validate(ServerConfig(model="tiny", dtype="float32", attention_backend="torch", host_kv="64",
                                report_dir=None))
    with pytest.raises(ConfigError, match=r"^--host_kv: 64 GiB of pinned host memory does not fit.*try "
                                          r"--host_kv 2 "):
        host_tier(cfg, 1, 2, 32, torch.float32, pin=False, available=10 * GIB)
    with pytest.raises(ConfigError, match="--host_kv: .*try --host_kv off"):
        host_tier(cfg, 1, 2, 32, torch.float32, pin=False, available=4 * GIB)


def test_the_runner_refuses_a_size_the_host_cannot_hold_before_it_builds_the_model():
    with pytest.raises(ConfigError, match="--host_kv: 100000 GiB .* does not fit"):
        tiny_runner(176, host_kv="100000")


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works here")
def test_a_host_that_refuses_to_pin_gets_a_clear_error():
    cfg = validate(ServerConfig(model="tiny", dtype="float32", attention_backend="torch", host_kv="0.5",
                                report_dir=None))
    with pytest.raises(ConfigError, match=r"--host_kv: the host refused to pin 0.5 GiB .*try --host_kv"):
        host_tier(cfg, 1, 2, 32, torch.float32, pin=True, available=64 * GIB)


@pytest.mark.parametrize("text", ["-1", "0", "lots", "inf", "nan"])
def test_a_bad_host_kv_value_names_the_flag(text):
    with pytest.raises(ConfigError, match="--host_kv: must be auto, off or a number of GiB"):
        validate(ServerConfig(model="tiny", host_kv=text, report_dir=None))


def test_the_host_tier_needs_the_prefix_cache():
    with pytest.raises(ConfigError, match="--host_kv: .*needs the prefix cache"):
        validate(ServerConfig(model="tiny", host_kv="auto", disable_prefix_caching=True, report_dir=None))


# ---------------------------------------------------------------- the report, /metrics, the benchmark
def test_the_budget_report_shows_the_tier():
    from autoprofile.profiler import ProfileResult
    from autoprofile.report import format_report, to_dict
    cfg = validate(ServerConfig(model="tiny", host_kv="2", report_dir=None))
    r = ProfileResult(cfg, 4096, 1024, True, 1, 4096, None, None, {}, [], [], [], host_kv_pages=4096,
                      host_kv_bytes=2 * GIB)
    assert "host KV tier (--host_kv 2): 4096 pages (65536 tokens, 2.00 GiB" in format_report(r)
    assert to_dict(r)["host_kv_pages"] == 4096 and to_dict(r)["host_kv_gib"] == 2.0


def test_a_multi_turn_benchmark_against_a_server_with_the_tier():
    """bench_serving --multi-turn against the CPU server (the tiny model, 20 GPU pages, a host tier): the
    conversations' later turns come back from the host tier; /metrics counts the tier; every page is free
    at the end, nothing failed."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from autoprofile import server
    from unit_tests.cpu_server import boot_cpu
    from unit_tests.test_bench_serving import bench_serving
    from unit_tests.test_server import FLAGS
    cfg = validate(ServerConfig(**FLAGS, host_kv="0.01"))
    runner, result = boot_cpu(cfg, kv_tokens=336)
    engine = LLMEngine.from_config(runner, cfg)
    args = bench_serving.parse_args(["--multi-turn", "4", "--num-turns", "3", "--random-input-len", "40",
                                     "--random-output-len", "8", "--seed", "3"])

    async def go():
        async with TestClient(TestServer(server.make_app(cfg, engine, result))) as c:
            url = str(c.make_url("")).rstrip("/")
            health = await bench_serving.wait_ready(url, 10, None)
            summary = await bench_serving.bench(args, url, health)
            return summary, await (await c.get("/metrics")).text()
    s, metrics = asyncio.run(go())
    assert s["completed"] == 12 and s["failed"] == 0
    assert set(s["ttft_by_turn_ms"]) == {"turn0", "turn1", "turn2"}
    assert s["total_input_tokens"] == 4 * (40 + 88 + 136)
    tier = s["server"]["host_kv"]
    assert tier["hit_tokens"] > 0 and tier["loaded_pages"] > 0 and tier["moved_gib"] > 0
    assert s["server"]["kv_pages_used_after"] == 0 and s["server"]["oom_while_serving"] == 0
    assert "autoprofile_host_kv_loaded_pages_total" in metrics
    assert engine.stats.pages_used == 0
    tier_invariants(engine)
    lines = bench_serving.comparison_lines(s, s, ("on", "off"))
    assert lines[1].startswith("on") and "hit tokens" in lines[1] and "1.00x" in lines[-1]


def test_teardown_waits_for_the_loads_still_writing_kv_pages_and_forgets_them():
    """A load in flight writes KV pages on the copy stream, which the allocator does not know of: teardown
    (which frees the KV) waits for it first, and a rebuilt runner starts with no load in flight."""
    class Load:
        waited = False

        def synchronize(self):
            self.waited = True
    runner = tiny_runner(176, host_kv="0.002")
    load = Load()
    runner._loads[7] = load
    runner.teardown()
    assert load.waited and not runner._loads
    runner.build(176)
    assert runner.loads_ready([7]) == {7}  # an id this runner does not hold is done
    runner.teardown()


def _hits_by_turn(engine: LLMEngine, convs: int, turns: int, new: int, out: int) -> list[float]:
    """convs conversations of `turns` turns, one request at a time in turn (every conversation's turn 0, then
    every turn 1, ...): a turn's prompt is the conversation so far (prompts and answers) and `new` fresh
    tokens. Returns, by turn, the share of its prompt tokens whose K/V was cached (on the GPU or the host)."""
    history: list[list[int]] = [[] for _ in range(convs)]
    shares = []
    for t in range(turns):
        before, prompt_tokens = engine.scheduler.prefix_hit_tokens, 0
        for c in range(convs):
            prompt = history[c] + [(c * 31 + t * 7 + j) % VOCAB for j in range(new)]
            rid = engine.add_request(prompt, max_tokens=out)
            answer = []
            while engine.has_unfinished():
                answer += [tok for o in engine.step() if o.request_id == rid for tok in o.new_token_ids]
            history[c], prompt_tokens = prompt + answer, prompt_tokens + len(prompt)
        shares.append((engine.scheduler.prefix_hit_tokens - before) / prompt_tokens)
    tier_invariants(engine)
    return shares


@pytest.mark.parametrize("host_pages", [0, 100])
def test_conversations_a_little_over_the_cache_still_find_most_of_their_history(host_pages):
    """8 conversations returning in turn whose histories outgrow the GPU and host pages by about 10% by the
    last turn: each turn still finds most of its history cached (each conversation loses the tail of its
    history, not its head: a head evicted first strands every page after it, and a cyclic working set over
    the cache then hits nothing, as the first 64 x 10 run of the multi-turn benchmark found at its last
    turn). Fails if the allocator frees a request's pages head first, or the host tier keeps pages stranded
    after a dropped one."""
    kv_pages = 176 - host_pages
    engine, runner = content_engine(kv_pages=kv_pages, host_pages=host_pages, context=128, batch=32,
                                    running=1)
    # turn 5's histories: 8 x (5 x 16 + 12 + 4) tokens = 8 x 24 pages, against kv_pages + host_pages
    shares = _hits_by_turn(engine, convs=8, turns=6, new=12, out=4)
    assert 8 * 24 > kv_pages + host_pages > 8 * 20
    assert engine.stats.failed_steps == 0, "a step failed (ContentRunner's checks raise inside the step)"
    # a turn's share can reach at most about (its history - 4) / its prompt: 0.79 at turn 4, 0.83 at turn 5
    # (measured: 0.70 on the GPU alone and 0.64 with the tier; freed head first: 0.41 and 0.31)
    assert shares[4] > 0.75 and shares[5] > 0.55, shares


def test_a_dropped_host_page_takes_the_pages_cached_after_it():
    """The host tier's LRU drops a prefix's page: every page whose key follows its chain id goes too (no
    lookup can reach them: a recomputed page gets a new id) and is free for the next save."""
    host = HostPages(4)
    a = host.put((0, (1,)), chain=1)
    host.put((1, (2,)), chain=2)
    host.put((2, (3,)), chain=3)
    other = host.put((0, (9,)), chain=4)
    assert host.num_free == 0
    page = host.put((0, (5,)), chain=5)  # drops the least recently used (chain 1) and the two after it
    assert page == a and host.num_free == 2 and host.dropped == 3
    assert host.lookup(1, (2,)) is None and host.lookup(2, (3,)) is None
    assert host.lookup(0, (9,)) == (other, 4) and host.lookup(0, (5,)) == (page, 5)
    assert host.saved == host.num_cached + host.loaded + host.dropped + host.discarded


def test_the_host_tier_splits_a_hosts_memory_over_that_hosts_ranks_only(mocker):
    """--tp 2 over --nnodes 2: each host runs one rank, which takes the whole auto share of its host (the
    tier's memory is the host's, not the world's)."""
    from autoprofile.engine import runner as runner_module
    seen = mocker.patch.object(runner_module, "host_tier", return_value=None)
    for nnodes in (1, 2):
        cfg = validate(ServerConfig(model="tiny", attention_backend="torch", dtype="float32", report_dir=None,
                                    host_kv="auto", tp=2, nnodes=nnodes, node_rank=0,
                                    dist_init_addr="127.0.0.1:29999" if nnodes > 1 else None))
        runner_module.ModelRunner(cfg, rank=0, world_size=2)
    assert [c.args[1] for c in seen.call_args_list] == [2, 1]
