"""Issue 48 item 1: structured output overlaps (LLMEngine(overlap=True)). A grammar step's forward is launched
before the step before is read back; its mask is filled from the matchers once that step's tokens advanced
them, then the sample runs (StepTokens.sample). Tiny model, CPU, torch backend, the real engine."""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from autoprofile import server
from autoprofile.config import ServerConfig, validate

from autoprofile.engine.engine import LLMEngine, has_grammar
from autoprofile.engine.grammar import TokenBitmask
from autoprofile.engine.request import PENDING
from autoprofile.engine.sampling import GREEDY, SamplingParams
from autoprofile.serving.structured import Grammars, Spec
from unit_tests.cpu_server import boot_cpu
from unit_tests.test_scheduler import run_all, tiny_runner
from unit_tests.test_server import FLAGS

pytest.importorskip("xgrammar")

from unit_tests.test_grammar import TOK, grammars, roomy  # noqa: E402,F401 - the module's fixtures
SCHEMA = {"type": "object", "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["x", "y", "zz"]}}}
# (grammar or None, sampling): long and short regexes (the short ones end by the grammar's end, EOS only,
# while the others go on), a JSON schema, a choice, plain rows; seeded and greedy; min_tokens past an end
CROWD = [(Spec("regex", r"[a-e]{12,20}", "regex"), SamplingParams(temperature=1.0, seed=1)),
         (None, SamplingParams(temperature=1.0, seed=2)),
         (Spec("regex", "ab|cd|efg", "regex"), SamplingParams(temperature=1.0, seed=3)),
         (Spec("json", json.dumps(SCHEMA), "s"), SamplingParams(temperature=1.0, seed=4)),
         (None, GREEDY),
         (Spec("choice", json.dumps(["red", "green", "blue"]), "c"), GREEDY),
         (Spec("regex", "ab|cd", "regex"), SamplingParams(temperature=1.0, seed=5, min_tokens=6)),
         (Spec("json", json.dumps(SCHEMA), "s"), GREEDY)]
PROMPTS = [[(5 * i + j) % 4000 + 3 for j in range(8 + 3 * i)] for i in range(len(CROWD))]


def crowd(engine: LLMEngine, grammars: Grammars, max_tokens: int = 40) -> dict[str, tuple[list[int], str]]:
    for (spec, params), prompt in zip(CROWD, PROMPTS):
        engine.add_request(prompt, params, max_tokens, stop_token_ids={2},
                           grammar=grammars.new_matcher(spec) if spec is not None else None)
    return run_all(engine)


def test_the_overlapped_engine_gives_the_synchronous_engine_s_tokens_with_grammar_rows(roomy, grammars):
    want = crowd(LLMEngine(roomy), grammars)
    by_id = {f"req-{i}": c for i, c in enumerate(CROWD)}
    assert all(reason == "stop" for rid, (_, reason) in want.items() if by_id[rid][0] is not None), want
    ended_early = [len(want[f"req-{i}"][0]) for i in (2, 5, 6)]
    assert max(ended_early) <= 6 < len(want["req-0"][0])  # ended by their grammar's end, others went on
    assert crowd(LLMEngine(roomy, overlap=True), grammars) == want
    tight = LLMEngine(tiny_runner(160), overlap=True)  # 9 pages: requests are preempted mid-answer
    assert crowd(tight, grammars) == want
    assert tight.stats.preemptions > 0 and tight.stats.pages_used == 0


def test_a_grammar_step_s_forward_launches_before_the_step_before_is_read_back(roomy, grammars):
    """The launch order: step N+1's forward, step N's read back (its tokens advance the matchers), then step
    N+1's mask and sample, and only then step N's reports (built while the GPU samples); at the fill every
    masked row's matcher holds all of its request's tokens but the one this step samples."""
    engine = LLMEngine(roomy, overlap=True)
    events: list[tuple[str, int]] = []
    launches = [0]  # steps launched so far (each step is tagged with its index: ids are reused)
    requests = {}  # id(matcher) -> request
    real_launch, real_resolve, real_fill = roomy.launch, engine.scheduler.resolve, TokenBitmask.fill

    def launch(step):
        n = step.launch_index = launches[0]
        launches[0] += 1
        tokens = real_launch(step)
        events.append(("forward", n))
        if has_grammar(step):
            deferred = tokens.sample

            def sample():
                if ("sample", n) not in events:  # result() calls it again: a no-op then
                    events.append(("sample", n))
                deferred()
            tokens.sample = sample
        return tokens

    def resolve(step, sampled):
        events.append(("read", step.launch_index))
        return real_resolve(step, sampled)

    real_report = engine._report

    def report(req):  # a report of the step read back last
        events.append(("report", max(n for kind, n in events if kind == "read")))
        return real_report(req)
    engine._report = report

    stale = []

    def fill(self, rows):
        stale.extend(requests[id(m)].output_ids.count(PENDING) for _, m in rows)
        return real_fill(self, rows)
    roomy.launch, engine.scheduler.resolve = launch, resolve
    TokenBitmask.fill = fill
    try:
        for (spec, params), prompt in zip(CROWD, PROMPTS):
            if spec is not None:
                m = grammars.new_matcher(spec)
                rid = engine.add_request(prompt, params, 30, stop_token_ids={2}, grammar=m)
                requests[id(m)] = engine._requests[rid]
            else:
                engine.add_request(prompt, params, 30, stop_token_ids={2})
        run_all(engine)
    finally:
        del roomy.launch
        TokenBitmask.fill = real_fill
    at = {e: i for i, e in enumerate(events)}
    sampled = sorted(n for kind, n in events if kind == "sample")
    overlapped = [n for n in sampled if ("read", n - 1) in at and at["forward", n] < at["read", n - 1]]
    assert len(overlapped) >= 10, events  # grammar steps launched while the one before was in flight
    first = {}
    for i, e in enumerate(events):
        first.setdefault(e, i)
    for n in overlapped:
        after = at.get(("forward", n + 1), len(events))
        assert at["forward", n] < at["read", n - 1] < at["sample", n] < first["report", n - 1] < after, events
    assert stale and set(stale) == {1}, stale  # only the row's own PENDING id: no matcher a token behind


def features_check():
    path = Path(__file__).resolve().parents[1] / "scripts" / "openai_features_check.py"
    spec = importlib.util.spec_from_file_location("openai_features_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    return check


def test_phase_2_checks_a_constrained_answer_whole_or_cut():
    pytest.importorskip("jsonschema")
    problem = features_check().schema_problem
    assert problem('{"text": "a \\"b\\" \\u00e9"}', "stop") is None
    assert problem('{ "text" : "a \\"b\\" \\u00', "length") is None  # cut inside an escape
    assert problem('{"text": "ab"', "length") is None and problem("", "length") is None
    assert problem('{"text": "ab"', "stop") and problem('{"text": 5}', "stop")
    assert problem('{"text": "ab"} x', "length") and problem('{"note": "', "length")


def test_phase_2_reports_the_schema_cost_length_matched_from_the_cpu_server():
    """Phase 2 of scripts/openai_features_check.py through HTTP (the overlapped engine, streamed requests):
    every constrained answer checked, none breaks the schema; the length-matched plain run gives exactly the
    schema answers' token counts, request by request; every run has a TPOT; the three ratios are there."""
    pytest.importorskip("jsonschema")
    check = features_check()
    cfg = validate(ServerConfig(**FLAGS))
    runner, result = boot_cpu(cfg)
    engine = LLMEngine(runner, overlap=True)
    args = argparse.Namespace(seed=0, prompt_words=4, throughput_max_tokens=24, max_concurrency=4,
                              throughput_prompts=8, request_timeout=300)
    runs = []
    real = check.throughput

    async def keep(*a, **kw):
        runs.append(await real(*a, **kw))
        return runs[-1]
    check.throughput = keep

    wanted = {i: 1 + 3 * i for i in range(8)}  # lengths a schema run might give: each request asks its own

    async def main():
        async with TestClient(TestServer(server.make_app(cfg, engine, result))) as c:
            url = str(c.make_url("")).rstrip("/")
            return await check.phase2(url, "tiny", args), await keep(url, "tiny", args, False, wanted)
    try:
        out, _ = asyncio.run(main())
    finally:
        runner.teardown()
    assert runs[-1]["lengths"] == wanted, runs[-1]  # ignore_eos, max_tokens: exactly the tokens asked
    constrained, matched = out["json_schema"], out["none_length_matched"]
    assert constrained["requests"] == constrained["schema_checked"] == 8 and constrained["failed"] == 0, out
    assert constrained["schema_invalid"] == 0 and constrained["output_tokens"] > 8, out
    assert runs[2]["lengths"] == runs[1]["lengths"] and len(runs[1]["lengths"]) == 8, runs
    assert matched["output_tokens"] == constrained["output_tokens"] and matched["failed"] == 0, out
    assert all(out[k]["tpot_ms"] > 0 for k in ("none", "json_schema", "none_length_matched", "none_again"))
    assert all(out[k] > 0 for k in ("ratio", "ratio_length_matched", "tpot_ratio")), out
    assert "lengths" not in json.dumps(out)
    # each run carries the server's step clock over it: the steps that served its tokens, the engine's seconds
    for k in ("none", "json_schema", "none_length_matched", "none_again"):
        e = out[k]["engine"]
        assert e["decode"]["steps"] + e["prefill"]["steps"] >= out[k]["output_tokens"] / 4, (k, e)
        assert e["host_s"]["execute"] > 0, (k, e)
    # each run its own prompts: none finds another's in the prefix cache, each prefills about as much
    prefilled = [out[k]["engine"]["prefill"]["tokens"] for k in ("none", "json_schema", "none_again")]
    assert min(prefilled) > 0.7 * max(prefilled), prefilled
    assert sum(line.startswith("json_schema: engine over") for line in check.schema_lines(out)) == 1


def test_phase_2_s_ratios_read_as_schema_speed_over_plain_speed():
    check = features_check()
    assert check.tpot(1.0, 1.5, 11) == pytest.approx(0.05) and check.tpot(1.0, 1.0, 1) is None
    run = {"failed": 0, "lengths": {0: 3}}
    cost = check.schema_cost({**run, "output_tok_s": 90.0, "tpot_ms": 10.0},
                             {**run, "output_tok_s": 45.0, "tpot_ms": 12.5},
                             {**run, "output_tok_s": 50.0, "tpot_ms": 11.0},
                             {**run, "output_tok_s": 110.0, "tpot_ms": 10.0})
    assert (cost["ratio"], cost["ratio_length_matched"], cost["tpot_ratio"]) == (0.45, 0.9, 0.8)
    assert cost["meets_target_ratio_length_matched"] and not cost["meets_target"]
    assert not cost["meets_target_tpot_ratio"] and "lengths" not in cost["none"]
    lines = check.schema_lines(cost)
    assert "length-matched" in lines[1] and lines[1].endswith("0.9") and "TPOT" in lines[2]


def test_a_grammar_step_whose_sample_raises_fails_its_rows_once_after_the_step_before_is_reported(roomy,
                                                                                                  grammars):
    """The deferred sample of a grammar step raises: the step before is reported first (the tokens its
    requests got), then that step's requests end with "error"; no request ends twice, nothing is lost and no
    page stays held."""
    engine = LLMEngine(roomy, overlap=True)
    real_launch, grammar_steps = roomy.launch, [0]

    def launch(step):
        tokens = real_launch(step)
        if has_grammar(step):
            grammar_steps[0] += 1
            if grammar_steps[0] == 4:
                def fail():
                    raise RuntimeError("the sample failed")
                tokens.sample = fail
        return tokens
    roomy.launch = launch
    outputs, requests = [], {}
    try:
        for (spec, params), prompt in zip(CROWD, PROMPTS):
            rid = engine.add_request(prompt, params, 30, stop_token_ids={2},
                                     grammar=grammars.new_matcher(spec) if spec is not None else None)
            requests[rid] = engine._requests[rid]
        while engine.has_unfinished():
            outputs += engine.step()
    finally:
        del roomy.launch
    ends = [o for o in outputs if o.finished]
    assert sorted(o.request_id for o in ends) == sorted(requests), ends  # each request ends once
    failed = {o.request_id for o in ends if o.finish_reason == "error"}
    assert failed and len(failed) < len(CROWD)  # the failing step's requests, not the ended ones
    for rid, req in requests.items():  # every token a request holds was reported, once
        reported = [t for o in outputs if o.request_id == rid for t in o.new_token_ids]
        assert reported == req.output_ids[:req.num_known], rid
    assert engine.stats.pages_used == 0
