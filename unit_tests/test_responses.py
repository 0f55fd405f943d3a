"""POST /v1/responses (OpenAI's Responses API over the chat path) with the real `openai` client's
responses.create, streamed and not, and openai-agents' Agent with a function tool, against the real server
and engine on a tiny model (CPU, torch backend, 127.0.0.1): input as text and items, instructions,
max_output_tokens, tools and function_call_output items, text.format json_schema, previous_response_id
within the server's lifetime (stored responses bounded, LRU, counted in /metrics), reasoning items."""
from __future__ import annotations

import json
from typing import Literal

import openai
import pytest

from autoprofile.engine.engine import LLMEngine
from autoprofile.serving.responses import ResponseStore
from unit_tests.cpu_server import boot_cpu
from unit_tests.test_reasoning import think_config, write_model
from unit_tests.test_server import metric_samples, post, serve

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"],
          "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "the forecast", "parameters": SCHEMA}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("responses_model")
    write_model(folder)
    runner, result = boot_cpu(think_config(folder))
    yield folder, runner, result
    runner.teardown()


@pytest.fixture
def run(model):
    """body(openai.AsyncOpenAI, aiohttp client, app) against a fresh server (reasoning_parser `parser`)."""
    folder, runner, result = model
    engines = []

    def go(body, parser=None):
        cfg = think_config(folder, reasoning_parser=parser)
        engines.append(LLMEngine.from_config(runner, cfg))

        async def main(c, app):
            async with openai.AsyncOpenAI(base_url=str(c.make_url("/v1")), api_key="unused",
                                          max_retries=0) as oa:
                return await body(oa, c, app)
        return serve(engines[-1], result, main, cfg)
    yield go
    assert all(e.stats.pages_used == 0 and not e.has_unfinished() for e in engines)


def test_text_input_with_instructions_whole_and_streamed(run):
    async def body(oa, c, app):
        whole = await oa.responses.create(model="tiny", input="hi", instructions="be brief",
                                          max_output_tokens=5, temperature=0)
        stream = await oa.responses.create(model="tiny", input="hi", instructions="be brief",
                                           max_output_tokens=5, temperature=0, stream=True)
        events = [e async for e in stream]
        return whole, events
    whole, events = run(body)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.instructions == "be brief"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 5 and whole.usage.input_tokens > 0
    assert [o.type for o in whole.output] == ["message"] and whole.output_text
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done", "response.output_item.done"} <= set(kinds)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == events[-1].response.output_text == whole.output_text  # greedy: the same


def test_message_items_and_text_format_json_schema(run):
    fmt = {"format": {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}}
    items = [{"role": "system", "content": "answer in JSON"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "where?"}]}]

    async def body(oa, c, app):
        return await oa.responses.create(model="tiny", input=items, text=fmt, temperature=0)
    out = run(body)
    assert out.status == "completed" and json.loads(out.output_text) in ({"city": "Oslo"}, {"city": "Lima"})


def test_a_forced_function_call_then_its_output_continues_the_conversation(run):
    async def body(oa, c, app):
        first = await oa.responses.create(model="tiny", input="weather in Oslo?", tools=[TOOL],
                                          tool_choice="required", temperature=0)
        call = first.output[0]
        items = ["weather in Oslo?", call.model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
        full = await post(c, "/tokenize", {"messages": [{"role": "user", "content": "x"}]})  # served alive
        second = await oa.responses.create(model="tiny", input=[
            {"role": "user", "content": items[0]}, items[1], items[2]], tools=[TOOL], max_output_tokens=3)
        chained = await oa.responses.create(model="tiny", previous_response_id=first.id, tools=[TOOL],
                                            max_output_tokens=3, input=[items[2]])
        stream = await oa.responses.create(model="tiny", input="weather?", tools=[TOOL],
                                           tool_choice={"type": "function", "name": "get_weather"},
                                           stream=True)
        events = [e async for e in stream]
        return first, full, second, chained, events
    first, full, second, chained, events = run(body)
    assert [o.type for o in first.output] == ["function_call"] and first.status == "completed"
    call = first.output[0]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Oslo", "Lima")
    assert call.call_id.startswith("call_") and full[0] == 200
    # the same conversation, sent whole or chained: the same prompt
    assert second.usage.input_tokens == chained.usage.input_tokens > first.usage.input_tokens
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    args = next(e for e in events if e.type == "response.function_call_arguments.done").arguments
    assert json.loads(args)["city"] in ("Oslo", "Lima")
    assert events[-1].response.output[0].arguments == args


def test_bad_requests_name_the_responses_field(run):
    async def body(oa, c, app):
        bad = [await post(c, "/v1/responses", b) for b in (
            {"input": "hi", "max_output_tokens": 0},
            {"input": [{"role": "user", "content": "hi"}, {"type": "message", "role": "robot", "content": "x"}]},
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            {"input": "hi", "tools": [{"type": "web_search"}]},
            {"input": "hi", "previous_response_id": "resp_nope"},
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}},
            {"input": "hi", "background": True},
            {"input": "hi", "max_tokens": 4},
            {"input": "hi", "max_output_tokens": 100000})]
        got = await c.get("/v1/responses/resp_nope")
        return bad, got.status
    bad, missing = run(body)
    assert [(s, e["error"]["param"]) for s, e in bad] == [
        (400, "max_output_tokens"), (400, "input[1].role"), (400, "input[0].content[0]"), (400, "tools[0].type"),
        (404, "previous_response_id"), (400, "text.format.schema"), (400, "background"),
        (400, "max_tokens"), (400, "max_output_tokens")], bad
    assert "'max_output_tokens'" in bad[0][1]["error"]["message"]
    assert "did you mean 'max_output_tokens'" in bad[7][1]["error"]["message"]
    assert missing == 404


def test_stored_responses_are_retrieved_chained_bounded_and_counted(run):
    async def body(oa, c, app):
        first = await oa.responses.create(model="tiny", input="hi", max_output_tokens=2)
        again = await oa.responses.retrieve(first.id)
        unstored = await oa.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
        with pytest.raises(openai.NotFoundError) as e:
            await oa.responses.create(model="tiny", input="more", previous_response_id=unstored.id)
        metrics = metric_samples(await (await c.get("/metrics")).text())
        return first, again, e.value, metrics
    first, again, missing, metrics = run(body)
    assert again.id == first.id and again.output_text == first.output_text
    assert missing.code == "previous_response_not_found" and missing.param == "previous_response_id"
    assert metrics[("autoprofile_responses_stored", ())] == 1
    assert metrics[("autoprofile_responses_stored_bytes", ())] > 0


def test_the_store_drops_the_least_recently_used_past_its_bounds():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for rid in ("a", "b"):
        store.put({"id": rid}, [{"role": "user", "content": rid}])
    assert store.get("a") is not None  # a is now the most recently used
    store.put({"id": "c"}, [])
    assert sorted(store.items) == ["a", "c"] and store.evicted == 1
    store.put({"id": "big"}, [{"role": "user", "content": "x" * 20_000}])  # larger than the whole store
    assert "big" not in store.items and store.bytes == sum(s.size for s in store.items.values())
    store.put({"id": "d"}, [{"role": "user", "content": "y" * 9_000}])  # past 2 entries: a goes
    assert list(store.items) == ["c", "d"]
    store.put({"id": "e"}, [{"role": "user", "content": "z" * 2_000}])  # past the bytes: c and d go
    assert list(store.items) == ["e"] and store.bytes == store.items["e"].size <= 10_000


def test_reasoning_becomes_a_reasoning_item_and_counts_as_reasoning_tokens(run):
    async def body(oa, c, app):
        # greedy: the three tokens do not depend on what this worker's engine sampled before (a sampled one
        # could be the end of the thinking, in some test orders under pytest-xdist)
        whole = await oa.responses.create(model="tiny", input="hi", max_output_tokens=3, temperature=0)
        stream = await oa.responses.create(model="tiny", input="hi", max_output_tokens=3, stream=True,
                                           temperature=0)
        return whole, [e async for e in stream]
    whole, events = run(body, parser="deepseek_r1")  # cut while thinking: all of it is reasoning
    assert [o.type for o in whole.output] == ["reasoning"] and whole.output[0].content[0].text
    assert whole.usage.output_tokens == whole.usage.output_tokens_details.reasoning_tokens == 3
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert deltas and final.output[0].content[0].text == deltas
    assert final.usage.output_tokens_details.reasoning_tokens == 3


def test_chat_chunks_become_events_in_order():
    from autoprofile.serving.responses import ResponseEvents, ResponsesRequest
    req = ResponsesRequest({"input": "x"}, [], True)
    ev = ResponseEvents(req, "m", lambda ids, reasoning: ids.index(1) + 1 if reasoning else 0)
    chunks = [{"choices": [{"delta": {"reasoning_content": "hm"}, "token_ids": [1]}]},
              {"choices": [{"delta": {"content": "a"}, "token_ids": [2]}]},
              {"choices": [{"delta": {"content": "b"}, "token_ids": [3]}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                      "function": {"name": "f", "arguments": "{}"}}]}}]},
              {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}]
    events = ev.start() + [e for ch in chunks for e in ev.feed(ch)]
    assert [o["type"] for o in ev.response["output"]] == ["reasoning", "message", "function_call"]
    assert ev.response["output"][1]["content"][0]["text"] == "ab"
    assert ev.response["usage"]["output_tokens_details"]["reasoning_tokens"] == 1
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert done == [0, 1, 2] and events[-1]["type"] == "response.completed"


def test_openai_agents_runs_an_agent_with_a_function_tool(run):
    agents = pytest.importorskip("agents")
    from pydantic import BaseModel
    agents.set_tracing_disabled(True)  # NOTE: tracing would export to OpenAI's servers
    calls = []

    class Answer(BaseModel):
        city: Literal["Oslo", "Lima"]

    @agents.function_tool
    def get_weather(city: Literal["Oslo", "Lima"]) -> str:
        """The forecast of a city."""
        calls.append(city)
        return "sunny"

    async def body(oa, c, app):
        agent = agents.Agent(name="weather", instructions="use the tool", tools=[get_weather],
                             output_type=Answer, model=agents.OpenAIResponsesModel("tiny", oa),
                             model_settings=agents.ModelSettings(tool_choice="required"))
        return await agents.Runner.run(agent, "weather in Oslo?", max_turns=3)
    result = run(body)
    assert len(calls) == 1 and isinstance(result.final_output, Answer)


def test_the_features_check_mix_with_responses_and_reasoning_passes_on_cpu(run):
    import argparse
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "openai_features_check.py"
    spec = importlib.util.spec_from_file_location("openai_features_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    args = argparse.Namespace(seed=0, num_requests=len(check.kinds(True)), prompt_words=4, max_tokens=8,
                              request_timeout=300, reasoning=True)

    async def body(oa, c, app):
        return await check.mix(str(c.make_url("")).rstrip("/"), "tiny", args)
    out = run(body, parser="qwen3")
    assert set(out["by_kind"]) == set(check.KINDS) | {"reasoning"}
    assert out["by_kind"]["responses"] == out["by_kind"]["reasoning"] == {"ok": 1}, out
