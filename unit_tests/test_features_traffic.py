"""Issue 33's features mixed into random traffic on the tiny model (CPU, torch backend, a cache small enough to
preempt): logprobs and prompt logprobs, every logits processor, stop ids and grammars beside plain rows, on
both engines. Every step stays inside the envelope (the runner refuses any other: a failed step), every page and
request slot comes back, and every request ends with its own tokens and one logprob entry per token."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.envelope import EnvelopeError
from autoprofile.engine.sampling import SamplingParams
from autoprofile.serving.structured import Grammars, Spec
from autoprofile.serving.tokenizer import ByteTokenizer
from unit_tests.test_scheduler import invariants, tiny_runner

pytest.importorskip("xgrammar")

TOK = ByteTokenizer(4096, eos_token_ids=[2], specials=[1])
WORD = r"[a-e]{3,12}"


@pytest.fixture(scope="module")
def tight():
    return tiny_runner(320)  # 20 pages of 16: four requests of up to 128 tokens preempt each other


@pytest.fixture(scope="module")
def grammars():
    return Grammars(TOK, 4096)


features = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.7, 1.0]),
    "logprobs": st.sampled_from([None, 0, 3, 20]),
    "prompt_logprobs": st.sampled_from([None, None, 0, 5]),
    "presence": st.sampled_from([0.0, 0.0, 0.8, -1.0]),
    "frequency": st.sampled_from([0.0, 0.0, 0.5]),
    "repetition": st.sampled_from([1.0, 1.0, 1.3, 0.8]),
    "bias": st.sampled_from([(), ((7, 5.0),), ((2, -100.0), (9, 3.0))]),
    "min_p": st.sampled_from([0.0, 0.0, 0.1]),
    "min_tokens": st.integers(0, 6),
    "stop": st.sampled_from([(), (2,), (5, 6)]),
    "grammar": st.booleans(),
})
requests = st.lists(st.tuples(st.integers(1, 90), st.integers(1, 24), features), min_size=1, max_size=10)


def _params(f: dict, max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=f["temperature"], seed=seed, logprobs=f["logprobs"],
                          prompt_logprobs=f["prompt_logprobs"], presence_penalty=f["presence"],
                          frequency_penalty=f["frequency"], repetition_penalty=f["repetition"],
                          logit_bias=f["bias"], min_p=f["min_p"], min_tokens=min(f["min_tokens"], max_tokens))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=requests, overlap=st.booleans())
def test_mixed_features_stay_inside_the_envelope_and_give_every_page_back(tight, grammars, reqs, overlap):
    engine = LLMEngine(tight, overlap=overlap)
    asked = {}
    for i, (plen, max_tokens, f) in enumerate(reqs):
        prompt = [(31 * i + 7 * j) % 4000 + 3 for j in range(plen)]
        grammar = grammars.new_matcher(Spec("regex", WORD, "regex")) if f["grammar"] else None
        rid = engine.add_request(prompt, _params(f, max_tokens, i), max_tokens, stop_token_ids=f["stop"],
                                 grammar=grammar)
        asked[rid] = (plen, max_tokens, f)
    tokens: dict[str, list[int]] = {rid: [] for rid in asked}
    entries: dict[str, int] = dict.fromkeys(asked, 0)
    prompt_entries: dict[str, list] = {}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            entries[o.request_id] += len(o.logprobs or ())
            if o.prompt_logprobs is not None:
                prompt_entries[o.request_id] = o.prompt_logprobs
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        invariants(engine)
    stats = engine.stats
    assert stats.failed_steps == 0 and stats.ooms == 0  # a step outside the envelope would have failed
    assert stats.pages_used == 0 and stats.running == 0 and stats.waiting == 0
    assert len(engine.scheduler.free_slots) == engine.scheduler.env.running_reqs
    for rid, (plen, max_tokens, f) in asked.items():
        out, reason = tokens[rid], reasons[rid]
        assert reason in ("stop", "length") and 1 <= len(out) <= max_tokens, (rid, reason, out)
        assert reason == "stop" or len(out) == max_tokens
        if f["logprobs"] is not None:
            assert entries[rid] == len(out), (rid, entries[rid], len(out))
        if f["prompt_logprobs"] is not None:
            assert len(prompt_entries[rid]) == plen and prompt_entries[rid][0] is None
        stopped_by_id = reason == "stop" and out[-1] in f["stop"]
        if stopped_by_id:
            assert len(out) >= min(f["min_tokens"], max_tokens) + 1  # min_tokens masked the stop ids before
        if f["grammar"] and reason == "stop" and not stopped_by_id:
            assert len(out) >= 3  # a grammar's answer ends only where the regex may (at least 3 letters)


def readback_failed():
    raise RuntimeError("injected: the tokens' copy to the host failed")


class FailingLaunches:
    """The runner's launch failing at chosen launches: "early" (refused before anything runs: its prefill rows,
    or every row of a decode step, fail), "readback" (the step ran; its tokens' read back raises: every row may
    fail). `failed`: the requests of the rows that may end in error."""

    def __init__(self, runner, fail: dict[int, str]):
        self.real, self.fail, self.launches, self.failed = runner.launch, fail, 0, set()

    def __call__(self, step):
        how, self.launches = self.fail.get(self.launches), self.launches + 1
        if how == "early":
            self.failed |= {row.request.request_id for row in step.rows}
            raise EnvelopeError("injected: refused before anything ran")
        tokens = self.real(step)
        if how == "readback":
            self.failed |= {row.request.request_id for row in step.all_rows}
            return SimpleNamespace(result=readback_failed, logprobs=None)
        return tokens


def _serve(engine, grammars, reqs) -> tuple[dict[int, tuple[list[int], int, str]], dict[str, int]]:
    """Each request's (tokens, logprob entries, finish reason) by its index in reqs; the indices by id."""
    ids = {}
    for i, (plen, max_tokens, f) in enumerate(reqs):
        prompt = [(31 * i + 7 * j) % 4000 + 3 for j in range(plen)]
        grammar = grammars.new_matcher(Spec("regex", WORD, "regex")) if f["grammar"] else None
        ids[engine.add_request(prompt, _params(f, max_tokens, i), max_tokens, stop_token_ids=f["stop"],
                               grammar=grammar)] = i
    out, steps = {i: ([], 0, "") for i in ids.values()}, 0
    while engine.has_unfinished():
        steps += 1
        assert steps < 2000, "no progress"
        for o in engine.step():
            tokens, entries, _ = out[ids[o.request_id]]
            out[ids[o.request_id]] = (tokens + o.new_token_ids, entries + len(o.logprobs or ()),
                                      o.finish_reason or "")
        invariants(engine)
    assert engine.stats.pages_used == 0 and len(engine.scheduler.free_slots) == engine.scheduler.env.running_reqs
    return out, ids


@pytest.fixture(scope="module")
def tight_invariant():
    return tiny_runner(320, deterministic=True)  # a row's logits do not depend on its step's other rows


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=requests, overlap=st.booleans(),
       fail=st.dictionaries(st.integers(0, 40), st.sampled_from(["early", "readback"]), min_size=1, max_size=4))
def test_failed_steps_leave_every_other_requests_features_as_they_were(tight_invariant, grammars, reqs, overlap,
                                                                       fail):
    """The same traffic with steps failing (refused before they run, or their read back failing): every request
    outside the failed rows gets the tokens, logprob entries and finish reason it gets when nothing fails
    (penalties, grammars, seeded draws and logprobs untouched by another request's failure); the failed rows'
    requests end in "error" or as before; every page and slot comes back."""
    want, _ = _serve(LLMEngine(tight_invariant, overlap=overlap), grammars, reqs)
    failing = FailingLaunches(tight_invariant, fail)
    tight_invariant.launch = failing
    try:
        engine = LLMEngine(tight_invariant, overlap=overlap)
        got, ids = _serve(engine, grammars, reqs)
        failed = {ids[rid] for rid in failing.failed}
    finally:
        del tight_invariant.launch
    for i, (tokens, entries, reason) in got.items():
        if reason == "error":
            assert i in failed, (i, got[i], want[i])
        elif i not in failed:
            assert got[i] == want[i], (i, got[i], want[i])
