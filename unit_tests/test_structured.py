"""Structured output's requests and compiles (autoprofile.serving.structured), without a model: what each
field asks for, the bounds on a schema (size, depth, a compile deadline on threads that slow schemas cannot
hold), messages without xgrammar's internals, json_object as an object, forced tool calls over $defs."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from autoprofile.serving.errors import APIError
from autoprofile.serving.structured import (MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, Grammars, Spec, depth,
                                            parse_structured)
from autoprofile.serving.tokenizer import ByteTokenizer
from autoprofile.serving.tools import parse_tools

xgrammar = pytest.importorskip("xgrammar")

TOK = ByteTokenizer(4096, eos_token_ids=[2])


@pytest.fixture(scope="module")
def grammars():
    return Grammars(TOK, 4096)


def _refused(body: dict) -> APIError:
    with pytest.raises(APIError) as e:
        parse_structured(body)
    return e.value


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def accepts(grammars: Grammars, spec: Spec, text: str) -> bool:
    m = grammars.new_matcher(spec)
    return m.accept_string(text) and m.is_completed()


def test_a_json_schema_nested_past_the_parser_is_a_400_naming_the_field():
    deep = "[" * 50_000 + "]" * 50_000
    e = _refused({"structured_outputs": {"json": deep}})
    assert e.status == 400 and e.param == "structured_outputs.json" and e.code == "schema_too_deep"
    e = _refused({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": deep}}})
    assert e.param == "response_format.json_schema.schema"


def test_a_schema_past_the_size_or_depth_bound_is_a_400_naming_the_field():
    assert depth(_nested(3)) == 4 and depth(1) == 0 and depth({}) == 1
    ok = _nested(MAX_SCHEMA_DEPTH - 1)
    assert parse_structured({"guided_json": ok}).kind == "json"
    e = _refused({"guided_json": _nested(MAX_SCHEMA_DEPTH)})
    assert (e.param, e.code) == ("guided_json", "schema_too_deep") and str(MAX_SCHEMA_DEPTH) in e.message
    big = {"type": "object",
           "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_SCHEMA_BYTES // 20)}}
    e = _refused({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": big}}})
    assert (e.param, e.code) == ("response_format.json_schema.schema", "schema_too_large")
    e = _refused({"structured_outputs": {"regex": "a" * (MAX_SCHEMA_BYTES + 1)}})
    assert (e.param, e.code) == ("structured_outputs.regex", "schema_too_large")
    fn = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": _nested(MAX_SCHEMA_DEPTH)}}}}
    with pytest.raises(APIError) as e:
        parse_tools({"tools": [fn], "tool_choice": "required"}, TOK)
    assert e.value.param == "tools[0].function.parameters"
    assert parse_tools({"tools": [fn]}, TOK).forced is None  # auto: rendered, never compiled


def test_json_object_is_an_object_and_takes_instructor_s_schema(grammars):
    spec = parse_structured({"response_format": {"type": "json_object"}})
    assert accepts(grammars, spec, '{"a": [1, {"b": null}]}') and accepts(grammars, spec, "{}")
    for other in ("[1, 2]", '"text"', "3", "null"):
        assert not accepts(grammars, spec, other), other
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    spec = parse_structured({"response_format": {"type": "json_object", "schema": schema}})
    assert (spec.kind, spec.param) == ("json", "response_format.schema")
    assert accepts(grammars, spec, '{"n": 3}') and not accepts(grammars, spec, '{"m": 3}')
    e = _refused({"response_format": {"type": "json_object", "schema": {"type": "nope"}, "x": 1}})
    assert e.param == "response_format.x"
    e = _refused({"response_format": {"type": "text", "schema": schema}})
    assert e.param == "response_format.schema"


def test_a_refused_schema_s_message_holds_no_compiler_internals(grammars):
    with pytest.raises(APIError) as e:
        grammars.compiled(Spec("json", '{"type": "nope"}', "response_format.json_schema.schema"))
    msg = e.value.message
    assert e.value.param == "response_format.json_schema.schema" and 'Unsupported type "nope"' in msg
    assert ".cc" not in msg and "/" not in msg.split(":", 1)[1] and "[" not in msg, msg


def test_forced_tool_calls_resolve_each_tool_s_defs(grammars):
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    tools = [{"type": "function", "function": {"name": "draw", "parameters": {
                "$defs": {"Point": point}, "type": "object",
                "properties": {"at": {"$ref": "#/$defs/Point"}}, "required": ["at"]}}},
             {"type": "function", "function": {"name": "plot", "parameters": {  # same def name, other schema
                 "definitions": {"Point": {"type": "object", "properties": {"y": {"type": "string"}},
                                           "required": ["y"]}},
                 "type": "object", "properties": {"p": {"$ref": "#/definitions/Point"}}, "required": ["p"]}}},
             {"type": "function", "function": {"name": "grow", "parameters": tree}}]
    required = parse_tools({"tools": tools, "tool_choice": "required"}, TOK).forced
    named = parse_tools({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "plot"}}},
                        TOK).forced

    def call(name, args):
        return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
    assert accepts(grammars, required, call("draw", {"at": {"x": 3}}))
    assert not accepts(grammars, required, call("draw", {"at": {"y": "a"}}))
    assert accepts(grammars, required, call("plot", {"p": {"y": "a"}}))
    assert accepts(grammars, required, call("grow", {"kids": [{"kids": []}, {}]}))
    assert accepts(grammars, named, call("plot", {"p": {"y": "a"}}))
    assert not accepts(grammars, named, call("draw", {"at": {"x": 3}}))


def test_a_slow_compile_is_a_408_and_gives_its_slot_back():
    """One slot: a compile past the deadline answers 408, and a request after it compiles (the slow compile
    no longer holds the slot); the slow compile ends and is cached (counted), so the same request later gets
    its matcher. The slow compile is the real one, held at its start until the test lets it go."""
    grammars = Grammars(TOK, 4096, threads=1, deadline_s=1.0, max_overdue=1)
    slow = Spec("json", '{"type": "object", "properties": {"a": {"type": "integer"}}}', "guided_json")
    gate, real = threading.Event(), grammars._compile

    def compile_(spec):
        if spec == slow:
            gate.wait()
        return real(spec)
    grammars._compile = compile_

    async def main():
        with pytest.raises(APIError) as e:
            await grammars.matcher(slow)
        assert (e.value.status, e.value.param, e.value.code) == (408, "guided_json",
                                                                 "grammar_compile_timeout")
        assert (grammars.stats.running, grammars.stats.overdue) == (1, 1)
        assert await grammars.matcher(Spec("regex", "a+", "structured_outputs.regex")) is not None
        gate.set()
        while grammars.stats.running:
            await asyncio.sleep(0.01)
        assert await grammars.matcher(slow) is not None  # cached
    try:
        asyncio.run(main())
    finally:
        gate.set()  # a failed run must not leave the compile thread waiting (the process would not exit)
    s = grammars.stats
    assert (s.compiles, s.timeouts, s.hits, s.running, s.overdue) == (2, 1, 1, 0, 0)
