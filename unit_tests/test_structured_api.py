"""Structured output and tools through HTTP with the real `openai` client, the tiny model (random weights,
CPU, torch backend) on 127.0.0.1: response_format json_schema / json_object, vLLM's structured_outputs and
guided_* fields, invalid grammars as 400s naming the field, forced tool calls that parse (streamed too),
tool results, and langchain-openai's bind_tools / with_structured_output when it is installed."""
from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import pytest
from aiohttp.test_utils import TestClient, TestServer

from autoprofile import server
from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.serving.tokenizer import load_tokenizer
from unit_tests.cpu_server import booted_fixture
from unit_tests.test_openai_api import client, refused
from unit_tests.test_server import FLAGS

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

# the tools section of the prompt is a few hundred byte tokens: a longer request limit than test_server's
CFG = validate(ServerConfig(**{**FLAGS, "max_req_total_len": 1024, "batch_max_tokens": 256},
                            max_waiting_requests=8))
MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["x", "y", "zz"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima", "Pune"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a"], "additionalProperties": False}}}]


booted = booted_fixture(CFG)


@pytest.fixture(params=[True, False], ids=["overlap", "plain"])
def run(booted, request):
    engine = LLMEngine(booted[0], overlap=request.param)

    def go(body):
        async def main():
            app = server.make_app(CFG, engine, booted[1])
            async with TestClient(TestServer(app)) as c:
                async with client(c) as oa:
                    return await body(oa)
        return asyncio.run(main())
    yield go
    assert engine.stats.pages_used == 0 and not engine.has_unfinished()


def test_every_sampled_answer_satisfies_the_json_schema(run):
    async def body(oa):
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
        return await asyncio.gather(*[oa.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=80, temperature=1.0, seed=s, response_format=fmt)
            for s in range(4)])
    outs = run(body)
    for out in outs:
        assert out.choices[0].finish_reason == "stop", out
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
        assert list(json.loads(out.choices[0].message.content)) == ["ok", "n", "tag"]  # the schema's order
    assert len({o.choices[0].message.content for o in outs}) > 1


def test_json_object_parses_and_the_completions_endpoint_takes_it_too(run):
    async def body(oa):
        chat = await asyncio.gather(*[oa.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=200, temperature=0.7, seed=s,
            response_format={"type": "json_object"}) for s in range(3)])
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
        comp = await oa.completions.create(model="tiny", prompt="Hi", max_tokens=80, temperature=1.0, seed=3,
                                           extra_body={"response_format": fmt})
        return chat, comp
    chat, comp = run(body)
    for out in chat:
        assert out.choices[0].finish_reason == "stop", out
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    jsonschema.validate(json.loads(comp.choices[0].text), SCHEMA)


def test_structured_outputs_choice_regex_grammar_and_guided_fields_constrain(run):
    async def body(oa):
        kw = dict(model="tiny", max_tokens=40, temperature=1.0)
        choice = [await oa.completions.create(prompt="Pick", seed=s, **kw, extra_body={
            "structured_outputs": {"choice": ["alpha", "beta", "gamma delta"]}}) for s in range(4)]
        regex = [await oa.chat.completions.create(messages=MSG, seed=s, **kw, extra_body={
            "structured_outputs": {"regex": r"\d{3}-[A-Z]{2}"}}) for s in range(3)]
        ebnf = await oa.completions.create(prompt="G", seed=1, **kw, extra_body={
            "structured_outputs": {"grammar": 'root ::= "<" ("ab" | "c")+ ">"'}})
        guided = await oa.completions.create(prompt="G", seed=2, **kw,
                                             extra_body={"guided_choice": ["yes", "no"]})
        return choice, regex, ebnf, guided
    choice, regex, ebnf, guided = run(body)
    assert all(c.choices[0].text in ("alpha", "beta", "gamma delta") for c in choice)
    assert all(re.fullmatch(r"\d{3}-[A-Z]{2}", r.choices[0].message.content) for r in regex)
    text = ebnf.choices[0].text
    if ebnf.choices[0].finish_reason == "length":  # cut by max_tokens: a prefix of the grammar's language
        assert re.fullmatch(r"<(ab|c)*a?", text), text
    else:
        assert re.fullmatch(r"<(ab|c)+>", text), text
    assert guided.choices[0].text in ("yes", "no")


def test_an_invalid_schema_regex_or_grammar_is_a_400_naming_the_field(run):
    async def body(oa):
        kw = dict(model="tiny", messages=MSG, max_tokens=8)
        return [await refused(oa.chat.completions.create(**kw, response_format={
                    "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}})),
                await refused(oa.chat.completions.create(**kw, extra_body={
                    "structured_outputs": {"regex": "a(("}})),
                await refused(oa.chat.completions.create(**kw, extra_body={
                    "structured_outputs": {"grammar": "root ::= "}})),
                await refused(oa.chat.completions.create(**kw, response_format={"type": "xml"})),
                await refused(oa.chat.completions.create(**kw, response_format={"type": "json_object"},
                                                         extra_body={"guided_regex": "a"})),
                await refused(oa.chat.completions.create(**kw, extra_body={
                    "structured_outputs": {"regx": "a"}}))]
    errs = run(body)
    assert [e.status_code for e in errs] == [400] * 6
    assert [e.param for e in errs] == ["response_format.json_schema.schema", "structured_outputs.regex",
                                       "structured_outputs.grammar", "response_format", "guided_regex",
                                       "structured_outputs.regx"]
    assert "nope" in errs[0].message and "JSON schema" in errs[0].message
    for e in errs[:3]:  # the compiler's own words, without its log prefix (time, source file and line)
        assert not re.search(r"\.cc\b|\[\d\d:\d\d", e.message), e.message


def test_client_schemas_past_the_bounds_are_400s_and_compiles_are_counted(run):
    async def body(oa):
        kw = dict(model="tiny", messages=MSG, max_tokens=8)
        deep = "[" * 30_000 + "]" * 30_000
        errs = [await refused(oa.chat.completions.create(**kw, extra_body={
                    "structured_outputs": {"json": deep}})),
                await refused(oa.chat.completions.create(**kw, response_format={
                    "type": "json_schema", "json_schema": {"name": "a", "schema": deep}}))]
        ok = await oa.chat.completions.create(**kw, extra_body={"structured_outputs": {"regex": "[a-c]{3}"}})
        metrics = await oa._client.get(str(oa.base_url).replace("/v1/", "/metrics"))
        return errs, ok, metrics.text
    errs, ok, metrics = run(body)
    assert [(e.status_code, e.param) for e in errs] == [(400, "structured_outputs.json"),
                                                        (400, "response_format.json_schema.schema")]
    assert re.fullmatch(r"[a-c]{3}", ok.choices[0].message.content)
    compiles = re.search(r"^autoprofile_grammar_compiles_total (\S+)$", metrics, re.M)
    assert compiles and float(compiles.group(1)) >= 1, metrics[:2000]
    assert "autoprofile_grammar_compile_timeouts_total" in metrics


def test_the_grammar_s_end_wins_over_min_tokens(run):
    async def body(oa):
        return await oa.completions.create(model="tiny", prompt="Hi", max_tokens=20, temperature=1.0, seed=4,
                                           extra_body={"structured_outputs": {"regex": "ab"},
                                                       "min_tokens": 10})
    out = run(body)
    assert out.choices[0].text == "ab" and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == 3  # a, b and EOS: no token the grammar forbids


def test_json_object_with_instructor_s_schema_follows_the_schema(run):
    async def body(oa):
        return await asyncio.gather(*[oa.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=80, temperature=1.0, seed=s,
            response_format={"type": "json_object", "schema": SCHEMA}) for s in range(2)])
    for out in run(body):
        assert out.choices[0].finish_reason == "stop", out
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def _args_ok(call) -> dict:
    args = json.loads(call.function.arguments)
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(args, schema)
    return args


def test_a_forced_tool_call_parses_into_tool_calls(run):
    async def body(oa):
        named = [await oa.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=120, temperature=1.0, seed=s, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}) for s in range(3)]
        required = [await oa.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=120, temperature=1.0, seed=s, tools=TOOLS,
            tool_choice="required") for s in range(3)]
        return named, required
    named, required = run(body)
    for out in named + required:
        ch = out.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
        (call,) = ch.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        _args_ok(call)
    assert {o.choices[0].message.tool_calls[0].function.name for o in named} == {"get_weather"}


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(run):
    kw = dict(model="tiny", messages=MSG, max_tokens=120, temperature=1.0, seed=7, tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})

    async def body(oa):
        whole = await oa.chat.completions.create(**kw)
        chunks = [c async for c in await oa.chat.completions.create(**kw, stream=True)]
        return whole, chunks
    whole, chunks = run(body)
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            got = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            got["name"] += d.function.name or ""
            got["arguments"] += d.function.arguments or ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    want = whole.choices[0].message.tool_calls[0]
    assert list(calls) == [0] and calls[0]["name"] == want.function.name == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(want.function.arguments)
    assert calls[0]["id"].startswith("call_")


def _regex(text: str) -> str:
    return "".join("\\" + ch if ch in "{}[]()*+?.|^$\\" else ch for ch in text)


TWO_CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>')


def test_two_calls_parallel_or_not_streamed_indices_and_every_choice_s_usage(run):
    """A regex makes the model write two calls (tool_choice auto): parallel_tool_calls false keeps the first,
    whole and streamed; streamed calls are indexed 0 and 1; include_usage with n=2 counts both choices."""
    kw = dict(model="tiny", messages=MSG, max_tokens=200, temperature=1.0, tools=TOOLS,
              extra_body={"structured_outputs": {"regex": _regex(TWO_CALLS)}})

    async def body(oa):
        both = await oa.chat.completions.create(**kw)
        first = await oa.chat.completions.create(**kw, parallel_tool_calls=False)
        streamed = [c async for c in await oa.chat.completions.create(
            **kw, stream=True, n=2, stream_options={"include_usage": True})]
        one = [c async for c in await oa.chat.completions.create(**kw, stream=True,
                                                                  parallel_tool_calls=False)]
        return both, first, streamed, one
    both, first, streamed, one = run(body)
    calls = both.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments) for c in calls] == [{"a": 1}, {"a": 2}]
    assert both.choices[0].finish_reason == "tool_calls" and both.choices[0].message.content is None
    assert [json.loads(c.function.arguments) for c in first.choices[0].message.tool_calls] == [{"a": 1}]
    tokens = len(TWO_CALLS.encode()) + 1  # the tiny model's byte tokens and EOS
    assert both.usage.completion_tokens == tokens
    for i in range(2):
        deltas = [d for c in streamed for ch in c.choices if ch.index == i for d in ch.delta.tool_calls or []]
        assert [(d.index, json.loads(d.function.arguments)) for d in deltas] == [(0, {"a": 1}), (1, {"a": 2})]
    assert streamed[-1].usage.completion_tokens == 2 * tokens
    deltas = [d for c in one for ch in c.choices for d in ch.delta.tool_calls or []]
    assert [(d.index, json.loads(d.function.arguments)) for d in deltas] == [(0, {"a": 1})]


def test_a_forced_call_cut_by_max_tokens_gives_no_markup_as_content(run):
    kw = dict(model="tiny", messages=MSG, max_tokens=12, temperature=1.0, seed=3, tools=TOOLS,
              tool_choice="required")

    async def body(oa):
        return (await oa.chat.completions.create(**kw),
                [c async for c in await oa.chat.completions.create(**kw, stream=True)])
    whole, chunks = run(body)
    ch = whole.choices[0]
    assert ch.finish_reason == "length" and ch.message.content is None and ch.message.tool_calls is None
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_forced_calls_with_defs_parse(run):
    """instructor's TOOLS mode: a nested pydantic model's parameters hold $defs and $ref."""
    city = {"type": "object", "properties": {"name": {"enum": ["Oslo", "Lima"]}}, "required": ["name"],
            "additionalProperties": False}
    params = {"$defs": {"City": city}, "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "Trip", "parameters": params}}, TOOLS[1]]

    async def body(oa):
        return [await oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=120, temperature=1.0,
                                                 seed=s, tools=tools, tool_choice=choice)
                for s, choice in enumerate(["required", {"type": "function", "function": {"name": "Trip"}}])]
    required, named = run(body)
    for out in (required, named):
        assert out.choices[0].finish_reason == "tool_calls", out
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "Trip"
    jsonschema.validate(json.loads(call.function.arguments), params)


def test_a_tool_result_round_trips_through_the_template(run):
    tok = load_tokenizer(CFG)
    history = [MSG[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]

    async def body(oa):
        return await oa.chat.completions.create(model="tiny", messages=history, max_tokens=4, temperature=0,
                                                tools=TOOLS, tool_choice="none")
    out = run(body)
    parsed = [history[0], {**history[1], "content": "", "tool_calls": [
        {**history[1]["tool_calls"][0], "function": {"name": "get_weather",
                                                     "arguments": {"city": "Oslo", "days": 2}}}]}, history[2]]
    prompt = tok.apply_chat_template(parsed, [{"type": "function", "function": t["function"]} for t in TOOLS])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt and '"name": "add"' in prompt
    assert out.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")


def test_langchain_bind_tools_and_structured_output(booted):
    lc = pytest.importorskip("langchain_openai")
    pydantic = pytest.importorskip("pydantic")

    class Answer(pydantic.BaseModel):
        ok: bool
        tag: str = pydantic.Field(max_length=4)

    def get_weather(city: Literal["Oslo", "Lima"], days: int) -> str:  # random weights: bounded strings
        """the forecast of a city"""
        return "sunny"

    engine = LLMEngine(booted[0], overlap=True)

    async def main():
        app = server.make_app(CFG, engine, booted[1])
        async with TestClient(TestServer(app)) as c:
            url = str(c.make_url("/v1"))
            assert url.startswith("http://127.0.0.1:")
            llm = lc.ChatOpenAI(base_url=url, api_key="unused", model="tiny", max_tokens=200, temperature=1.0,
                                seed=3, max_retries=0)
            msg = await llm.bind_tools([get_weather], tool_choice="get_weather").ainvoke("weather?")
            answer = await llm.with_structured_output(Answer, method="json_schema").ainvoke("answer")
            return msg, answer
    msg, answer = asyncio.run(main())
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Oslo", "Lima")
    assert isinstance(call["args"]["days"], int)
    assert isinstance(answer, Answer) and len(answer.tag) <= 4
    assert engine.stats.pages_used == 0


def test_ready_before_the_grammars_a_schema_request_waits_for_them(booted, monkeypatch):
    """`serve` activates with grammars_later: /health is 200 and plain requests are served while xgrammar's
    vocabulary is still being built (held here until released); a json_schema request sent meanwhile waits,
    then gets an answer that satisfies its schema (not a 400)."""
    import threading
    release = threading.Event()
    real = server.grammars_for

    def held(tokenizer, vocab_size):
        assert release.wait(60)
        return real(tokenizer, vocab_size)
    monkeypatch.setattr(server, "grammars_for", held)
    engine = LLMEngine(booted[0])
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}

    async def main():
        app = server.make_app(CFG)
        async with TestClient(TestServer(app)) as c:
            server.activate(app, engine, booted[1], grammars_later=True)
            async with client(c) as oa:
                health = await c.get("/health")
                schema = asyncio.ensure_future(oa.chat.completions.create(
                    model="tiny", messages=MSG, max_tokens=80, temperature=1.0, seed=1, response_format=fmt))
                plain = await oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=4)
                await asyncio.sleep(0.2)
                waited = not schema.done() and app[server.STATE].grammars is None
                release.set()
                return health.status, plain, waited, await schema
    status, plain, waited, out = asyncio.run(main())
    assert status == 200 and plain.usage.completion_tokens == 4 and waited
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    assert engine.stats.pages_used == 0 and not engine.has_unfinished()


def test_a_server_stopped_before_its_grammars_are_built_does_not_wait_for_them(booted, monkeypatch):
    """The grammars' build runs on a daemon thread: a server stopped while xgrammar still loads (here held)
    ends its event loop without joining the build, which ends on its own later (its result dropped: the loop
    is closed). In the loop's default executor, asyncio.run waited for it."""
    import threading
    import time
    release, builders = threading.Event(), []

    def held(tokenizer, vocab_size):
        builders.append(threading.current_thread())
        release.wait(20)
        return None, "held on purpose"
    monkeypatch.setattr(server, "grammars_for", held)
    engine = LLMEngine(booted[0])

    async def main():
        app = server.make_app(CFG)
        async with TestClient(TestServer(app)) as c:
            server.activate(app, engine, booted[1], grammars_later=True)
            return (await c.get("/health")).status
    assert asyncio.run(main()) == 200
    deadline = time.monotonic() + 10
    while not builders and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(builders) == 1 and builders[0].is_alive()  # the loop ended, the build had not
    release.set()
    builders[0].join(20)
    assert not builders[0].is_alive()
