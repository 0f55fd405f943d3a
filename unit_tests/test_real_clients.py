"""Real clients through HTTP (issue 47's Show list) against the real server and engine on the tiny model
(random weights, CPU, torch backend) on 127.0.0.1: instructor's TOOLS, JSON, JSON_SCHEMA and MD_JSON modes
with a nested pydantic model, and litellm (a plain chat, streaming, a tool call). Skipped where a client is
not installed (pyproject's test extra names them).

The random model follows no prompt: JSON and MD_JSON (which only ask in words) get the schema as a grammar
through extra_body, so those tests check the client's request and parsing, not the model's obedience."""
from __future__ import annotations

import asyncio
import json
import os
from typing import Literal

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel, Field

from autoprofile import server
from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from unit_tests.cpu_server import booted_fixture
from unit_tests.test_openai_api import client
from unit_tests.test_server import FLAGS

pytest.importorskip("xgrammar")
# litellm fetches its price table from the network at import unless told to read its bundled copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

# instructor writes the schema into the prompt (JSON, MD_JSON): about a thousand byte tokens
CFG = validate(ServerConfig(**{**FLAGS, "max_req_total_len": 2048, "batch_max_tokens": 512},
                            max_waiting_requests=8))
MSG = [{"role": "user", "content": "Plan a trip"}]


class City(BaseModel):
    name: Literal["Oslo", "Lima", "Pune"]
    rainy: bool


class Trip(BaseModel):
    """A trip to one city."""
    city: City
    days: int = Field(ge=1, le=9)


booted = booted_fixture(CFG)


@pytest.fixture
def run(booted):
    """body(base_url) against a server over a fresh engine; every test leaves no page held."""
    engine = LLMEngine(booted[0], overlap=True)

    def go(body):
        async def main():
            app = server.make_app(CFG, engine, booted[1])
            async with TestClient(TestServer(app)) as c:
                url = str(c.make_url("/v1"))
                assert url.startswith("http://127.0.0.1:")
                return await body(c, url)
        return asyncio.run(main())
    yield go
    assert engine.stats.pages_used == 0 and not engine.has_unfinished()


# ---------------------------------------------------------------- instructor
def _schema_body() -> dict:
    return {"structured_outputs": {"json": Trip.model_json_schema()}}


@pytest.mark.parametrize("mode,extra", [
    ("TOOLS", {}),  # a forced tool call whose parameters hold $defs / $ref
    ("JSON_SCHEMA", {}),  # response_format json_object with a "schema" beside it (vLLM honours it)
    ("JSON", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "Trip", "schema": Trip.model_json_schema()}}}),
    ("MD_JSON", _schema_body()),
])
def test_instructor_modes_give_a_nested_model(run, mode, extra):
    instructor = pytest.importorskip("instructor")

    async def body(c, url):
        async with client(c) as oa:
            ic = instructor.from_openai(oa, mode=getattr(instructor.Mode, mode))
            return [await ic.chat.completions.create(
                model="tiny", messages=MSG, response_model=Trip, max_tokens=200, temperature=1.0, seed=s,
                max_retries=0, **({"extra_body": extra} if extra else {})) for s in range(2)]
    trips = run(body)
    assert all(isinstance(t, Trip) and isinstance(t.city, City) and 1 <= t.days <= 9 for t in trips), trips


# ---------------------------------------------------------------- litellm
def _litellm():
    litellm = pytest.importorskip("litellm")
    litellm.telemetry = False
    return litellm


def test_litellm_chat_stream_and_tool_call(run):
    litellm = _litellm()
    tool = {"type": "function", "function": {"name": "Trip", "description": Trip.__doc__,
                                             "parameters": Trip.model_json_schema()}}

    async def body(c, url):
        kw = dict(model="openai/tiny", api_base=url, api_key="unused", messages=MSG, temperature=0,
                  seed=0, num_retries=0)
        plain = await litellm.acompletion(**kw, max_tokens=8)
        stream = await litellm.acompletion(**kw, max_tokens=8, stream=True)
        chunks = [ch async for ch in stream]
        call = await litellm.acompletion(**kw, max_tokens=200, tools=[tool],
                                         tool_choice={"type": "function", "function": {"name": "Trip"}})
        return plain, chunks, call
    plain, chunks, call = run(body)
    text = plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 8 and text
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text  # greedy: same
    (tc,) = call.choices[0].message.tool_calls
    assert call.choices[0].finish_reason == "tool_calls" and tc.function.name == "Trip"
    Trip.model_validate(json.loads(tc.function.arguments))
