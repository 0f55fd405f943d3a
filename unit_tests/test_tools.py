"""The tool-call formats (autoprofile.serving.tools): hermes (Qwen2.5/Qwen3) and llama3_json (Llama 3.1)
replies parsed into OpenAI tool_calls, whole and streamed at every split point; tools' request fields."""
from __future__ import annotations

import json

import pytest

from autoprofile.serving.errors import APIError
from autoprofile.serving.tokenizer import ByteTokenizer, ChatTemplate
from autoprofile.serving.tools import (HERMES, LLAMA, Tools, ToolStream, parse_calls, parse_tools,
                                       reply_calls)

TOK = ByteTokenizer(4096, eos_token_ids=[2])
FN = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
HERMES_REPLY = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n'
                '</tool_call>')
LLAMA_REPLY = ('{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
               '{"name": "get_weather", "parameters": {}}')
LLAMA_SEMI = '{"name": "search", "parameters": {"q": "a;b"}};{"name": "sql", "parameters": {"s": "x; y;"}}'
# text around, between and after calls, a call that does not parse, an unclosed call at the end
HERMES_SPACED = (' Hi \n <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\n'
                 '<tool_call>{bad}</tool_call> \n<tool_call>{"name": "g"}</tool_call>\n'
                 ' tail  <tool_call>{"name"')


def _shape(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_and_llama_replies_parse_into_tool_calls():
    content, calls = parse_calls(HERMES_REPLY, HERMES)
    assert content == "Let me look." and _shape(calls) == [("get_weather", {"city": "Oslo"}),
                                                           ("get_weather", {"city": "Lima"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    content, calls = parse_calls(LLAMA_REPLY, LLAMA)
    assert content is None and _shape(calls) == [("get_weather", {"city": "Oslo"}), ("get_weather", {})]
    assert _shape(parse_calls('<|python_tag|>{"name": "f", "arguments": {"a": 1}}', LLAMA)[1]) == [
        ("f", {"a": 1})]
    # text that is no call stays text
    assert parse_calls("<tool_call>\n{not json}\n</tool_call>", HERMES) == (
        "<tool_call>\n{not json}\n</tool_call>", [])
    assert parse_calls("The answer is {x}", LLAMA) == ("The answer is {x}", [])
    assert parse_calls("plain", HERMES) == ("plain", [])


@pytest.mark.parametrize("fmt, reply", [(HERMES, HERMES_REPLY), (LLAMA, LLAMA_REPLY), (LLAMA, LLAMA_SEMI),
                                        (HERMES, "no call <tool_ at all"), (LLAMA, "  plain words"),
                                        (HERMES, HERMES_SPACED)])
def test_a_streamed_reply_gives_the_same_content_and_calls_at_every_split(fmt, reply):
    tools = Tools((FN["function"],), "auto", None, True, fmt, None)
    want_content, want_calls = parse_calls(reply, fmt)
    for cut in range(len(reply) + 1):
        for pieces in ([reply[:cut], reply[cut:]], list(reply) if cut == 0 else None):
            if pieces is None:
                continue
            s = ToolStream(tools)
            content, calls = "", []
            for p in pieces:
                c, new = s.push(p)
                content, calls = content + c, calls + new
            c, new = s.finish()
            content, calls = content + c, calls + new
            assert _shape(calls) == _shape(want_calls), (cut, pieces)
            assert (content or None) == want_content, (cut, content)


@pytest.mark.parametrize("fmt, reply", [
    (HERMES, 'Sure.\n<tool_call>\n{"name": "note", "arguments": {"text": "line one\nline\ttwo\r"}}\n'
             '</tool_call>'),
    (LLAMA, '{"name": "note", "parameters": {"text": "line one\nline\ttwo\r"}}')])
def test_a_raw_newline_inside_a_string_argument_still_makes_a_call_of_valid_json(fmt, reply):
    """A model's free reply (no grammar) may write a raw newline or tab inside a JSON string, which strict
    json.loads refuses: the call is still made, its arguments valid JSON holding the same text, whole and
    streamed."""
    tools = Tools((FN["function"],), "auto", None, True, fmt, None)
    content, calls = reply_calls(reply, tools)
    s = ToolStream(tools)
    streamed = [c for piece in reply for c in s.push(piece)[1]] + s.finish()[1]
    for got in (calls, streamed):
        assert len(got) == 1 and got[0]["function"]["name"] == "note", (reply, got)
        args = got[0]["function"]["arguments"]
        assert "\n" not in args and json.loads(args) == {"text": "line one\nline\ttwo\r"}
    assert content == ("Sure." if fmt == HERMES else None)


def test_a_semicolon_inside_a_llama3_json_argument_is_text():
    content, calls = parse_calls(LLAMA_SEMI, LLAMA)
    assert content is None and _shape(calls) == [("search", {"q": "a;b"}), ("sql", {"s": "x; y;"})]
    assert _shape(parse_calls('<|python_tag|>{"name": "q", "parameters": {"s": "select 1;"}}', LLAMA)[1]) == [
        ("q", {"s": "select 1;"})]
    for text in ('{"name": "a", "parameters": {}} {"name": "b", "parameters": {}}',  # no `;` between
                 '{"name": "a", "parameters": {}}; trailing words'):
        assert parse_calls(text, LLAMA) == (text, []), text
    assert _shape(parse_calls('{"name": "a", "parameters": {}};', LLAMA)[1]) == [("a", {})]


def test_text_between_calls_keeps_its_words_and_drops_the_calls_whitespace():
    content, calls = parse_calls(HERMES_SPACED, HERMES)
    assert _shape(calls) == [("f", {}), ("g", {})]
    assert content == ' Hi<tool_call>{bad}</tool_call>tail  <tool_call>{"name"'


@pytest.mark.parametrize("fmt, template", [(HERMES, "<tool_call>\n{}\n</tool_call>"), (LLAMA, "{}")])
def test_a_call_nested_past_the_json_parser_stays_text(fmt, template):
    deep = '{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}"
    text = template.format(deep) if fmt == HERMES else deep
    assert parse_calls(text, fmt) == (text, [])
    s = ToolStream(Tools((FN["function"],), "auto", None, True, fmt, None))
    pushed = s.push(text)
    assert "".join([pushed[0], s.finish()[0]]) == text and s.calls == []


def test_non_streamed_parallel_false_keeps_the_first_call_and_a_forced_call_s_markup_is_never_content():
    whole = Tools((FN["function"],), "auto", None, False, HERMES, None)
    content, calls = reply_calls(HERMES_REPLY, whole)
    assert content == "Let me look." and _shape(calls) == [("get_weather", {"city": "Oslo"})]
    assert len(reply_calls(HERMES_REPLY, Tools((FN["function"],), "auto", None, True, HERMES, None))[1]) == 2
    forced = parse_tools({"tools": [FN], "tool_choice": "required"}, TOK)
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert reply_calls(cut, forced) == (None, [])
    s = ToolStream(forced)
    assert s.push(cut) == ("", []) and s.finish() == ("", [])
    auto = Tools((FN["function"],), "auto", None, True, HERMES, None)
    assert reply_calls(cut, auto) == (cut, [])  # a call the model chose to write stays its text


def test_parallel_tool_calls_false_keeps_the_first_call():
    s = ToolStream(Tools((FN["function"],), "auto", None, False, HERMES, None))
    _, calls = s.push(HERMES_REPLY)
    assert _shape(calls) == [("get_weather", {"city": "Oslo"})] and s.finish() == ("", [])


def test_tools_fields_are_checked_and_a_forced_choice_is_a_grammar():
    body = {"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    tools = parse_tools(body, TOK)
    assert tools.format == HERMES and tools.forced.kind == "tool_hermes" and tools.choice == "function"
    schema = json.loads(tools.forced.source)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert parse_tools({"tools": [FN]}, TOK).forced is None
    assert parse_tools({"tools": [FN], "tool_choice": "required"}, TOK).forced is not None
    for bad_body, param in [({"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                             "tool_choice"),
                            ({"tools": [FN], "tool_choice": "sometimes"}, "tool_choice"),
                            ({"tool_choice": "required"}, "tool_choice"),
                            ({"tools": [FN, FN]}, "tools"),
                            ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
                             "tools[0].function.name"),
                            ({"tools": [FN], "parallel_tool_calls": "yes"}, "parallel_tool_calls")]:
        with pytest.raises(APIError) as e:
            parse_tools(bad_body, TOK)
        assert e.value.status == 400 and e.value.param == param, (bad_body, e.value.message)
    plain = ByteTokenizer(4096)
    plain.chat = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(APIError) as e:
        parse_tools({"tools": [FN]}, plain)
    assert e.value.param == "tools" and "does not render tools" in e.value.message


def test_forced_call_grammars_accept_exactly_a_call_of_the_named_tools():
    pytest.importorskip("xgrammar")
    from autoprofile.serving.structured import Grammars, parse_structured
    other = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    llama_tok = ByteTokenizer(4096, eos_token_ids=[2])
    llama_tok.chat = ChatTemplate('{% if tools %}{"name": ..., "parameters": ...}{% endif %}'
                                  "{% for m in messages %}{{ m.content }}{% endfor %}")
    grammars = Grammars(TOK, 4096)

    def accepts(spec, text):
        m = grammars.new_matcher(spec)
        return m.accept_string(text) and m.is_completed()
    required = parse_tools({"tools": [FN, other], "tool_choice": "required"}, TOK).forced
    assert accepts(required, '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>')
    assert accepts(required,
                   '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x"}}\n</tool_call>')
    assert not accepts(required, '<tool_call>\n{"name": "add", "arguments": {"a": "3"}}\n</tool_call>')
    assert not accepts(required, '<tool_call>\n{"name": "sub", "arguments": {"a": 3}}\n</tool_call>')
    choice = {"type": "function", "function": {"name": "add"}}
    named = parse_tools({"tools": [FN, other], "tool_choice": choice}, llama_tok).forced
    assert named.kind == "tool_llama"
    assert accepts(named, '{"name": "add", "parameters": {"a": 3}}')
    assert not accepts(named, '{"name": "get_weather", "parameters": {"city": "x"}}')
    # a string holds no raw control character (json.loads would refuse it): escaped, it is accepted
    assert accepts(required, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a\\nb"}}\n'
                   '</tool_call>')
    for raw in "\n\t\x01":
        assert not accepts(required, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a%sb"}}\n'
                           '</tool_call>' % raw)
    schema = parse_structured({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "properties": {"s": {"type": "string"}}}}}})
    assert accepts(schema, '{"s": "a\\nb"}') and not accepts(schema, '{"s": "a\nb"}')


def test_grammars_compile_off_the_event_loop_once_per_text():
    pytest.importorskip("xgrammar")
    import asyncio
    import threading
    from autoprofile.serving.structured import Grammars, Spec
    grammars = Grammars(TOK, 4096, cache_size=2)
    threads = []
    real = grammars._compile

    def compile_(spec):
        threads.append(threading.current_thread())
        return real(spec)
    grammars._compile = compile_

    async def main():
        return [await grammars.matcher(Spec("regex", r, "regex"))
                for r in ("a+", "a+", "b+", "a+", "c+", "b+")]
    matchers = asyncio.run(main())
    assert threading.main_thread() not in threads
    assert grammars.compiles == 4  # a+, b+ (a+ again: cached), c+ evicts b+ (least recent): b+ again
    assert len({id(m) for m in matchers}) == 6  # a fresh matcher per request
