"""A step that fails leaves no half-state (DESIGN.md: "A failed step must leave no half-state"): pages granted
to the step's rows that survive it go back, so the host's page lists and the device's page table agree again,
and no row writes K/V through a stale column into a page the prefix cache maps to another prompt."""
from __future__ import annotations

import asyncio
import time

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from autoprofile import server
from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.envelope import EnvelopeError
from autoprofile.engine.request import PENDING
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.weights import init_random
from autoprofile.serving import async_engine
from unit_tests.test_scheduler import SHARED, STOPS, VOCAB, StepRunner, envelope, invariants
from unit_tests.test_server import CFG as SERVER_CFG
from unit_tests.test_server import booted, greedy, serve  # noqa: F401 - booted: the server's runner fixture

TINY = dict(model="tiny", dtype="float32", attention_backend="torch", max_req_total_len=128,
            batch_max_tokens=64, graph_max_batch_size=4, running_max_req_size=4, report_dir=None)
C = [(29 * j) % 4000 + 5 for j in range(40)]  # 40 tokens: two full 16-token pages enter the prefix cache
D = C[:-1] + [C[-1] + 1]  # C's prompt with another last token: it takes C's two pages back
A, B = [(13 * j) % 4000 + 7 for j in range(10)], [(17 * j) % 4000 + 3 for j in range(20)]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    r = ModelRunner(validate(ServerConfig(**TINY)))
    init_random(r.model, seed=1, std=0.08)
    r.build(1024)
    return r


def fail_once(monkeypatch, owner, name: str, when, error: Exception) -> list:
    """owner.name raises `error` the first time it is called with a step for which when(step) holds."""
    real, fired = getattr(owner, name), []

    def method(arg, *a, **kw):
        if not fired and when(arg):
            fired.append(arg)
            raise error
        return real(arg, *a, **kw)
    monkeypatch.setattr(owner, name, method)
    return fired


def grows_a_decode_row(step) -> bool:
    """A mixed step in which a decode row gets a new page (a write past column 0 of its slot)."""
    grown = {slot for slot, first, _ in step.page_writes if first > 0}
    return bool(step.rows) and any(r.slot in grown for r in step.decode)


def run(engine: LLMEngine) -> dict[str, tuple[list[int], str]]:
    out: dict[str, tuple[list[int], str]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens, _ = out.get(o.request_id, ([], ""))
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
    return out


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("where", ["envelope", "page_write"])
def test_a_failed_mixed_step_leaves_no_stale_page_for_its_decode_rows(runner, monkeypatch, overlap, where):
    """C leaves its pages in slot 0's columns of the page table and in the prefix cache. A decodes in slot 0
    until it needs its second page inside a mixed step (beside B's prompt), and that step fails before the
    page table learns the page (the envelope check, or the table's write). B fails; A goes on and, like D
    (C's prompt with another last token, served from C's cached pages), gets the tokens it gets alone."""
    alone = {name: LLMEngine(runner).generate([p], max_tokens=n)[0]
             for name, p, n in (("A", A, 14), ("D", D, 8))}
    engine = LLMEngine(runner, overlap=overlap)
    c = engine.add_request(C, max_tokens=4)
    assert run(engine)[c][1] == "length" and engine.stats.pages_used == 0
    if where == "envelope":  # the runner refuses the step before it writes the page table
        fired = fail_once(monkeypatch, runner, "launch", grows_a_decode_row, EnvelopeError("injected"))
    else:
        fired = fail_once(monkeypatch, runner.req_table, "write",
                          lambda writes: any(first > 0 for _, first, _ in writes), RuntimeError("injected"))
    a = engine.add_request(A, max_tokens=14)
    req_a = engine.scheduler.waiting[0]
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    b = None
    while engine.has_unfinished():
        if b is None and req_a.num_computed == 16:  # its next decode row needs a second page
            assert req_a.slot == 0 and len(req_a.pages) == 1
            b = engine.add_request(B, max_tokens=4)
        for o in engine.step():
            out[o.request_id] = out.get(o.request_id, []) + o.new_token_ids
            reasons[o.request_id] = o.finish_reason
    assert fired, "the injected failure never ran"
    assert reasons[b] == "error" and engine.stats.failed_steps == 1
    assert (out[a], reasons[a]) == (alone["A"], "length")
    d = engine.add_request(D, max_tokens=8)
    got = run(engine)[d]
    assert engine.stats.prefix_hit_tokens == 32  # D took C's two pages back
    assert got == (alone["D"], "length")
    assert engine.stats.pages_used == 0


# ---------------------------------------------------------------- any step may fail (no model)
class FailingStepRunner(StepRunner):
    """StepRunner (the device's page table kept as a dict, every row's pages checked against it) whose
    chosen steps fail: "early" before the page table is written (an EnvelopeError), "late" after (the forward
    raising), "readback" once the step ran (its tokens' copy to the host raising: overlap reads them in the
    next step() call). A row whose pages the table does not hold is recorded in `stale`."""

    def __init__(self, env, kv_pages: int, fail: dict[int, str]):
        super().__init__(env, kv_pages)
        self.fail, self.launches, self.stale, self.failed_rows = fail, 0, [], []
        # the K/V each page slot holds: the token written there, None once a step that wrote it failed (its
        # forward raised or its read back did: what the device holds there is unknown)
        self.content: dict[tuple[int, int], int | None] = {}
        self.doomed: set[str] = set()  # requests of failed rows (overlap launches their next row before it knows)

    def _slots(self, row, start: int, end: int) -> list[tuple[int, int]]:
        ps = self.envelope.page_size
        return [(row.request.pages[i // ps], i % ps) for i in range(start, end)]

    def _check_reads(self, step) -> None:
        """Every row reads the K/V of its tokens before row.start from its pages (a prefix-cache hit's too)."""
        for row in step.all_rows:
            if row.request.request_id in self.doomed:
                continue  # it ends with "error" whatever it reads
            known = row.request.tokens(0, row.start)
            held = [self.content.get(at) for at in self._slots(row, 0, row.start)]
            if held != known:
                bad = next(i for i, (h, k) in enumerate(zip(held, known)) if h != k)
                raise AssertionError(f"a row reads position {bad} of its request from a page holding "
                                     f"{held[bad]}, not its token {known[bad]}")

    def _write(self, step, valid: bool) -> None:
        for row in step.all_rows:
            ids = [self.last_tokens.get(row.slot) if t == PENDING else t for t in row.ids]
            for at, t in zip(self._slots(row, row.start, row.start + len(row.ids)), ids):
                self.content[at] = t if valid else None

    def launch(self, step) -> SimpleNamespace:
        how = self.fail.get(self.launches)
        tokens = self._run(step)
        if how == "readback":
            self.failed_rows.append(step.all_rows)  # every row was counted as launched
            return SimpleNamespace(result=readback_failed)
        return SimpleNamespace(result=lambda: tokens)

    def execute(self, step) -> list[int]:
        tokens = self._run(step)
        if self.fail.get(self.launches - 1) == "readback":
            self.failed_rows.append(step.rows)
            readback_failed()
        return tokens

    def _run(self, step) -> list[int]:
        at, self.launches = self.launches, self.launches + 1
        how = self.fail.get(at)
        if how in ("early", "late"):
            self.failed_rows.append(step.rows)
            if how == "late":
                for slot, first, pages in step.page_writes:
                    for i, p in enumerate(pages):
                        self.page_table[slot, first + i] = p
                self._write(step, valid=False)
                self.doomed |= {row.request.request_id for row in step.rows}
                raise RuntimeError("injected: the forward failed")
            raise EnvelopeError("injected: refused before the page table learned the step's pages")
        try:
            self._check_reads(step)
            self._write(step, valid=True)
            tokens = super().execute(step)
        except AssertionError as e:
            self.stale.append(e)
            raise
        if how == "readback":
            self._write(step, valid=False)
            self.doomed |= {row.request.request_id for row in step.all_rows}
        return tokens


def readback_failed():
    raise RuntimeError("injected: the tokens' copy to the host failed")


def serve_trace(trace, fail: dict[int, str], kv_pages: int, batch: int, running: int, overlap: bool):
    """The trace's requests through the fake engine whose chosen steps fail: (outputs by trace index, the
    runner, the trace indices of the failed steps' failed rows)."""
    env = envelope(kv_pages=kv_pages, page_size=4, context=96, batch=batch, running=running)
    runner = FailingStepRunner(env, kv_pages, fail)
    engine = LLMEngine(runner, overlap=overlap)
    pending = sorted((wait, i) for i, (wait, *_) in enumerate(trace))
    ids, out, clock = {}, {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= clock:
            _, i = pending.pop(0)
            _, n, max_tokens, shared = trace[i]
            prompt = (SHARED[:shared] + [(i * 7 + j) % VOCAB for j in range(n)])[:n]
            ids[engine.add_request(prompt, max_tokens=max_tokens, stop_token_ids=STOPS)] = i
        for o in engine.step():
            tokens, _ = out.get(ids[o.request_id], ([], ""))
            out[ids[o.request_id]] = (tokens + o.new_token_ids, o.finish_reason)
        invariants(engine)
        clock += 1
        assert clock < 5000, "no progress"
    assert engine.stats.pages_used == 0 and len(engine.scheduler.free_slots) == running
    failed = {ids[r.request.request_id] for rows in runner.failed_rows for r in rows}
    return out, runner, failed


def check_failures(trace, fail, kv_pages, batch, running, overlap) -> None:
    want, _, _ = serve_trace(trace, {}, kv_pages, batch, running, overlap)
    got, runner, failed = serve_trace(trace, fail, kv_pages, batch, running, overlap)
    assert not runner.stale, runner.stale[0]
    errors = {i for i, (_, reason) in got.items() if reason == "error"}
    assert errors <= failed
    # a request that stopped on a token (overlap) may have had one more row in a failed step
    assert all(got[i] == want[i] and want[i][1] == "stop" for i in failed - errors)
    assert {i: v for i, v in got.items() if i not in failed} == {i: want[i] for i in got if i not in failed}


TRACE = st.lists(st.tuples(st.integers(0, 6),  # steps to wait before arriving
                           st.integers(1, 60),  # prompt length
                           st.integers(1, 30),  # max_tokens
                           st.integers(0, 40)),  # leading tokens shared with the other requests
                 min_size=1, max_size=12)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=TRACE,
       fail=st.dictionaries(st.integers(0, 60), st.sampled_from(["early", "late", "readback"]), max_size=6),
       kv_pages=st.integers(25, 60), batch=st.integers(2, 32), running=st.integers(2, 6),
       overlap=st.booleans())
def test_failed_steps_leave_every_surviving_row_on_the_pages_the_device_knows(
        trace, fail, kv_pages, batch, running, overlap):
    """Random arrivals (shared prefixes, preemption, mixed steps), random steps failing before or after the
    page-table write or on their read back: every row that runs finds its request's pages in the device's
    table and reads its tokens' K/V there (a prefix-cache hit's too); only requests of the failed steps'
    failed rows (prefill rows; every row of a decode step or of an overlapped read back) end with "error",
    every other request gets the tokens it gets when nothing fails; at the end every page and slot is free."""
    check_failures(trace, fail, kv_pages, batch, running, overlap)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 60), st.integers(1, 30),
                                st.integers(8, 40)),  # every prompt shares two pages or more
                      min_size=2, max_size=12),
       fail=st.dictionaries(st.integers(0, 60), st.just("readback"), min_size=2, max_size=10),
       kv_pages=st.integers(25, 32), batch=st.integers(2, 32), running=st.integers(2, 6))
@example(trace=[(1, 1, 1, 8), (2, 48, 3, 24), (0, 55, 13, 20), (1, 55, 3, 24), (0, 9, 13, 8)],  # found
         fail={17: "readback", 18: "readback"}, kv_pages=28, batch=11, running=4)
def test_failed_read_backs_leave_no_cached_page_of_unknown_kv(trace, fail, kv_pages, batch, running):
    """Overlapped read backs failing under preemption in a small cache, prompts sharing their first pages: a
    page that only a failed step wrote never enters the prefix cache, so no later prompt reads its unknown K/V
    (found: a preempted and readmitted request's old row cached, when read back, the pages its new rows were
    filling in a step that then failed)."""
    check_failures(trace, fail, kv_pages, batch, running, overlap=True)


# ---------------------------------------------------------------- a loop that can never step
@pytest.mark.parametrize("leak", ["pages", "slots"])
def test_a_loop_starved_by_a_leak_is_dead_and_health_says_why(booted, monkeypatch, leak):  # noqa: F811
    """Every KV page (or every request slot) leaked: the loop keeps iterating, so it is not wedged, but no
    step can ever run. After starved_after_s the server says so: /health 503 with the reason, the waiting
    request fails with 503 engine_dead."""
    runner, result = booted
    engine = LLMEngine.from_config(runner, SERVER_CFG)
    if leak == "pages":
        engine.scheduler.cache.alloc(engine.scheduler.cache.num_free)
    else:
        engine.scheduler.free_slots.clear()
    monkeypatch.setattr(async_engine, "STARVED_AFTER_S", 0.5)

    async def body(c, app):
        t0 = time.monotonic()
        r = await asyncio.wait_for(c.post("/v1/completions", json=greedy(n=4)), 5)
        waited = time.monotonic() - t0
        h = await c.get("/health")
        return r.status, await r.json(), waited, h.status, await h.json(), app[server.STATE].died.is_set()
    status, err, waited, h_status, health, died = serve(engine, result, body)
    assert status == 503 and err["error"]["code"] == "engine_dead"
    assert h_status == 503 and health["status"] == "dead" and died
    assert "ran no step for 0.5 s" in health["reason"] and "starved" in health["reason"]
    assert "0 running and 1 waiting" in health["reason"]
    assert 0.5 <= waited < 3.0


def test_slow_steps_and_a_busy_loop_are_not_starved(booted, monkeypatch):  # noqa: F811
    """Steps that each take longer than starved_after_s (the loop is inside them: the wedge watchdog's
    business), and a loop that steps all along for longer than it: served, healthy."""
    runner, result = booted
    engine = LLMEngine.from_config(runner, SERVER_CFG)
    monkeypatch.setattr(async_engine, "STARVED_AFTER_S", 0.3)
    real_launch, slow = runner.launch, [0.8, 0.8]

    def launch(step):
        if slow:
            time.sleep(slow.pop())
        return real_launch(step)
    monkeypatch.setattr(runner, "launch", launch)

    async def body(c, app):
        t0 = time.monotonic()
        first = await c.post("/v1/completions", json=greedy(n=2))
        slow_s = time.monotonic() - t0
        t0 = time.monotonic()
        rest = [await c.post("/v1/completions", json=greedy(f"p{i}", n=40, ignore_eos=True))
                for i in range(8)]
        busy_s = time.monotonic() - t0
        h = await c.get("/health")
        return first.status, slow_s, [r.status for r in rest], busy_s, h.status
    first, slow_s, rest, busy_s, h_status = serve(engine, result, body)
    assert first == 200 and slow_s >= 1.6 and rest == [200] * 8 and h_status == 200
    assert busy_s > 0.3, "the busy loop never outlasted starved_after_s: nothing tested"
    assert engine.stats.pages_used == 0
