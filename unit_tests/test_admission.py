"""The admission estimate (engine.admission, SGLang's new_token_ratio): its ratio decays to a floor, jumps
back up after a preemption and starts over when idle; and the real Scheduler (no model: test_scheduler's step
runner) under a hostile load (every request's output outgrows the cache beside the others') preempts far less
with it than with admission on free pages alone, every request whole and the tokens of a roomy cache."""
from __future__ import annotations

import pytest

from autoprofile.engine import admission
from autoprofile.engine.admission import NewTokenRatio, admits, future_tokens, ratio_after_retract
from autoprofile.engine.engine import LLMEngine
from unit_tests.test_scheduler import StepRunner, envelope, invariants, run_all


def test_the_ratio_decays_step_by_step_to_its_floor():
    r = NewTokenRatio()
    assert r.value == r.init == admission.INIT_NEW_TOKEN_RATIO
    assert r.floor == pytest.approx(0.7 * 0.14)
    r.step()
    assert r.value == pytest.approx(r.init - (r.init - r.floor) / admission.NEW_TOKEN_RATIO_DECAY_STEPS)
    for _ in range(admission.NEW_TOKEN_RATIO_DECAY_STEPS - 2):
        r.step()
    assert r.value > r.floor
    r.step()
    r.step()
    assert r.value == pytest.approx(r.floor)  # and it stays there
    r.step()
    assert r.value == pytest.approx(r.floor)


def test_a_preemption_puts_the_ratio_back_up_and_idle_starts_it_over():
    r = NewTokenRatio()
    for _ in range(1000):
        r.step()
    # two running requests wrote 300 of their 2 x 400 tokens: 300 + 20 each of room, over 800
    r.update(preempted=True, decoded=True, running=[_req(100, 400), _req(200, 400)])
    assert r.value == pytest.approx((300 + 2 * admission.RETRACT_DECODE_STEPS) / 800)
    young = r.value
    r.retracted(decoded=0, max_new=800, running=2)  # young requests say little: never below what let them in
    assert r.value == young
    assert ratio_after_retract(790, 800, 2) == 1.0 and ratio_after_retract(0, 0, 0) == 1.0
    r.update(preempted=False, decoded=False, running=[])  # a prefill-only step says nothing of the output
    assert r.value == young
    r.reset()
    assert r.value == r.init


def test_conservativeness_scales_the_estimate_and_zero_admits_on_free_pages_alone():
    assert NewTokenRatio(2.0).init == 1.0 and NewTokenRatio(0.5).init == pytest.approx(0.35)
    off = NewTokenRatio(0.0)
    off.retracted(decoded=10, max_new=20, running=1)
    off.step()
    assert off.value == 0.0
    with pytest.raises(ValueError, match="schedule_conservativeness"):
        NewTokenRatio(-1.0)


def test_the_estimate_counts_the_prompt_whole_and_the_output_times_the_ratio():
    assert future_tokens(200, 400, 0.5) == 400
    assert future_tokens(0, 10_000, 1.0) == admission.CLIP_MAX_NEW_TOKENS
    assert admits(free_tokens=1000, reserved=600, need=400) and not admits(1000, 600.5, 400)


def _req(decoded: int, max_tokens: int):
    from autoprofile.engine.request import Request
    from autoprofile.engine.sampling_params import SamplingParams
    r = Request("r", [1], SamplingParams(), max_tokens, frozenset(), 0)
    r.output_ids = [5] * decoded
    return r


# ---------------------------------------------------------------- the scheduler under hostile traffic
def _engine(overlap: bool, conservativeness: float, kv_pages: int, batch: int) -> LLMEngine:
    """The real engine and Scheduler on test_scheduler's step runner (no model): 16 slots, pages of 4."""
    env = envelope(kv_pages=kv_pages, page_size=4, context=64, batch=batch, running=16, graph=16)
    return LLMEngine(StepRunner(env, kv_pages), overlap=overlap, schedule_conservativeness=conservativeness)


HOSTILE = [[(7 * i + j) % 900 + 1 for j in range(20)] for i in range(48)]  # 48 x (20 in, 40 out)


def _hostile(conservativeness: float, overlap: bool, kv_pages: int = 65):
    """48 requests of 20 + 40 tokens on 256 tokens of cache (pages of 4) and 16 slots: admitted on free pages,
    16 requests start and grow to 960 tokens together."""
    engine = _engine(overlap, conservativeness, kv_pages=kv_pages, batch=64)
    ids = [engine.add_request(p, max_tokens=40) for p in HOSTILE]
    out = run_all(engine, check=invariants)
    return [out[i] for i in ids], engine


@pytest.mark.parametrize("overlap", [False, True])
def test_a_hostile_load_preempts_far_less_and_every_request_completes_whole(overlap):
    want, roomy = _hostile(1.0, overlap, kv_pages=1024)
    assert roomy.stats.preemptions == 0
    before, thrash = _hostile(0.0, overlap)
    after, engine = _hostile(1.0, overlap)
    assert before == after == want  # every request whole, its tokens those of a roomy cache
    assert all(len(t) == 40 and r == "length" for t, r in after)
    s, t = engine.scheduler, thrash.scheduler
    assert t.num_preemptions >= 40  # on free pages alone the running set thrashes
    assert s.num_preemptions * 5 <= t.num_preemptions, (s.num_preemptions, t.num_preemptions)
    assert s.preempted_tokens * 5 <= t.preempted_tokens
    assert engine.stats.pages_used == 0 and len(s.free_slots) == 16 and not s.running


def test_light_traffic_is_admitted_at_once():
    """Room for every request's whole output: the estimate admits them all in the first step, as before."""
    engine = _engine(False, 1.0, kv_pages=1024, batch=320)
    for p in HOSTILE[:16]:
        engine.add_request(p, max_tokens=40)
    engine.step()
    assert len(engine.scheduler.running) == 16 and not engine.scheduler.waiting


# ---------------------------------------------------------------- when waiting requests join decode rows
def test_admit_now_is_tgi_s_rule():
    # nothing decodes, nothing waits, or pacing off: at once
    assert admission.admit_now(0, 5, 0, 8, 0.3) and admission.admit_now(100, 0, 0, 8, 0.3)
    assert admission.admit_now(100, 1, 0, 0, 0.3)
    # one waiting beside 100 decode rows: held until its 8th step
    assert not admission.admit_now(100, 1, 7, 8, 0.3) and admission.admit_now(100, 1, 8, 8, 0.3)
    # enough waiting against the decode rows: at once
    assert not admission.admit_now(100, 29, 0, 8, 0.3) and admission.admit_now(100, 30, 0, 8, 0.3)
    # a light load (fewer decode rows than min_rows, 64 by default): at once
    assert admission.admit_now(63, 1, 0, 8, 0.3) and not admission.admit_now(64, 1, 0, 8, 0.3)
    assert not admission.admit_now(8, 1, 0, 8, 0.3, min_rows=8) and admission.admit_now(7, 1, 0, 8, 0.3, 8)


def test_waiting_prompts_that_fill_the_steps_budget_join_at_once():
    """Held by TGI's rule (1 waiting beside 100 decode rows, none of its steps yet), admitted when what
    waits fills the step (a full prefill step); the scheduler counts the waiting prompts' tokens against
    the step's budget."""
    assert not admission.admit_now(100, 1, 0, 8, 0.3)
    engine = _paced(50, 0.3)
    s = engine.scheduler
    for p in HOSTILE[:3]:
        engine.add_request(p, max_tokens=4)
    need = sum(len(p) for p in HOSTILE[:3])
    assert s._waiting_fill(need) and not s._waiting_fill(need + 1)


def _paced(max_waiting_steps: int, ratio: float) -> LLMEngine:
    env = envelope(kv_pages=1024, page_size=4, context=256, batch=320, running=16, graph=16)
    engine = LLMEngine(StepRunner(env, 1024), max_waiting_steps=max_waiting_steps, waiting_served_ratio=ratio)
    engine.scheduler.hold_min_rows = 4  # 16 slots here: a "busy" batch of 8
    return engine


def _joins(engine: LLMEngine, prompt: list[int]) -> list[bool]:
    """Add one request beside the running ones; each next step: whether it carries the request's prompt."""
    rid = engine.add_request(prompt, max_tokens=4)
    joined = []
    while not joined or not joined[-1]:
        engine.step()
        req = engine._requests.get(rid)
        joined.append(req is None or req.num_computed > 0)
    return joined


def test_a_request_arriving_into_a_busy_batch_waits_at_most_max_waiting_steps():
    """8 requests decoding (long outputs), one arrives: decode-only steps hold it 3 steps, the 4th admits it
    (a prefill step); the rows decoding meanwhile are the 8 running ones. Pacing off: the next step."""
    for steps, want in ((3, [False, False, False, True]), (0, [True])):
        engine = _paced(steps, 0.3)
        for p in HOSTILE[:8]:
            engine.add_request(p, max_tokens=200)
        engine.step()  # nothing decoded yet: all 8 admitted at once
        assert len(engine.scheduler.running) == 8 and not engine.scheduler.waiting
        engine.step()  # decoding
        steps_before = len(engine.runner.steps)
        assert _joins(engine, HOSTILE[20]) == want
        held = engine.runner.steps[steps_before:steps_before + len(want) - 1]
        assert all(not s.is_prefill and len(s.rows) == 8 for s in held), held  # decode graphs replayed


def test_enough_waiting_requests_join_at_once_and_chunks_of_running_requests_never_wait():
    engine = _paced(8, 0.3)
    for p in HOSTILE[:8]:
        engine.add_request(p, max_tokens=200)
    engine.step()
    engine.step()
    ids = [engine.add_request(p, max_tokens=4) for p in HOSTILE[20:23]]  # 3 waiting >= 0.3 x 8
    engine.step()
    assert all(engine._requests[i].num_computed > 0 for i in ids)
    # a long prompt admitted beside decode rows goes on in chunks every step (held requests wait meanwhile)
    env = envelope(kv_pages=1024, page_size=4, context=256, batch=64, running=16, graph=16)
    engine = LLMEngine(StepRunner(env, 1024), max_waiting_steps=50, waiting_served_ratio=0.3)
    engine.scheduler.hold_min_rows = 4
    for p in HOSTILE[:8]:
        engine.add_request(p, max_tokens=200)
    s = engine.scheduler
    while any(r.num_tokens - r.num_computed > 1 for r in s.running) or s.waiting:
        engine.step()  # 160 prompt tokens at 64 a step
    short = engine.add_request(HOSTILE[30][:20], max_tokens=4)  # 1 waiting < 0.3 x 8, 20 tokens < 56: held
    for _ in range(5):
        engine.step()
    assert engine._requests[short].num_computed == 0
    rid = engine.add_request(list(range(1, 250)), max_tokens=4)  # now the waiting fill a step: at once
    engine.step()
    assert engine._requests[rid].num_computed > 0 and engine._requests[short].num_computed > 0
    long, done = engine._requests[rid], []
    while long.num_computed < 249:
        done.append(long.num_computed)
        engine.step()
    assert len(done) >= 4 and all(b > a for a, b in zip(done, done[1:])), done  # 56 tokens a step at most


def test_paced_traffic_completes_every_request_whole():
    """Requests arriving a few at a time into a busy batch, with pacing: the same tokens as without it, every
    page and slot back."""
    outs = []
    for steps in (0, 4):
        engine = _paced(steps, 0.3)
        ids, out = [], {}
        for i, p in enumerate(HOSTILE[:24]):
            ids.append(engine.add_request(p, max_tokens=10 + i % 7))
            for o in engine.step():
                tokens, _ = out.get(o.request_id, ([], None))
                out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
            invariants(engine)
        for rid, v in run_all(engine, check=invariants).items():
            tokens, _ = out.get(rid, ([], None))
            out[rid] = (tokens + v[0], v[1])
        outs.append([out[i] for i in ids])
        assert engine.stats.pages_used == 0 and len(engine.scheduler.free_slots) == 16
    assert outs[0] == outs[1]
