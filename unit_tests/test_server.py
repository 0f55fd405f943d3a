"""The HTTP server against the real engine: the tiny model with random weights on the CPU (torch backend).

Every endpoint, SSE streams, stop strings and EOS, 4xx error objects, 429 past the queue bound, a
disconnect that frees its pages, an OOM in a step, SIGTERM draining a subprocess server, the `openai`
client end to end."""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import openai
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from autoprofile import server
from autoprofile.config import ConfigError, ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.request import RequestOutput
from autoprofile.engine.sampling import SamplingParams
from autoprofile.serving.async_engine import EngineFailure, RequestHandle
from autoprofile.serving.protocol import generate_body_bytes, max_body_bytes
from autoprofile.serving.tokenizer import ByteTokenizer
from unit_tests.cpu_server import boot_cpu, booted_fixture, bound_url

ROOT = Path(__file__).resolve().parents[1]
FLAGS = dict(model="tiny", dtype="float32", attention_backend="torch", max_req_total_len=256,
             batch_max_tokens=64,
             graph_max_batch_size=4, running_max_req_size=8, report_dir=None,
             engine_process=False)  # the boots here are closures, run by the engine thread of this process
CFG = validate(ServerConfig(**FLAGS, max_waiting_requests=2))
RUNNING = 8  # running_max_req_size: the engine's running-request limit


booted = booted_fixture(CFG)


@pytest.fixture
def engine(booted):
    """A fresh engine over the module's runner, as the server builds it (overlapped on one device); every test
    must leave no page held."""
    eng = LLMEngine.from_config(booted[0], CFG)
    assert eng.overlap
    yield eng
    assert eng.stats.pages_used == 0 and not eng.has_unfinished()


def serve(engine, result, body, cfg=CFG, tokenizer=None):
    """body(client, app) against a server over `engine`, in a fresh event loop."""
    async def go():
        app = server.make_app(cfg, engine, result, tokenizer)
        async with TestClient(TestServer(app)) as client:
            return await body(client, app)
    return asyncio.run(go())


@pytest.fixture
def run(engine, booted):
    return lambda body, **kw: serve(engine, booted[1], body, **kw)


async def post(c, path: str, body) -> tuple[int, dict]:
    r = await c.post(path, json=body)
    return r.status, await r.json()


async def sse(c, path: str, body) -> list:
    """The data: payloads of a stream (json-decoded; the final "[DONE]" as a string)."""
    r = await c.post(path, json=body)
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in (await r.text()).split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def metric_samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def greedy(prompt="Hello", n=32, **kw) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, **kw}


async def idle(app, timeout=5.0) -> None:
    """Until the engine loop holds no request and has published it."""
    eng = app[server.STATE].engine
    deadline = time.monotonic() + timeout
    while eng.outstanding or eng.snapshot.pages_used or eng.snapshot.running:
        assert time.monotonic() < deadline, eng.snapshot
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- endpoints
def test_health_models_and_metrics(run):
    async def body(c, app):
        h, m = await c.get("/health"), await c.get("/v1/models")
        await post(c, "/v1/completions", greedy(n=4))
        await idle(app)
        return h.status, await h.json(), await m.json(), await (await c.get("/metrics")).text()
    status, health, models, text = run(body)
    assert status == 200 and health["status"] == "ok"
    assert health["max_running_requests"] == RUNNING and health["max_waiting_requests"] == 2
    assert health["max_req_total_len"] == 256 and health["kv_tokens"] > 0
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
    s = metric_samples(text)
    assert s[("autoprofile_time_to_first_token_seconds_count", ())] == 1
    assert s[("autoprofile_time_per_output_token_seconds_count", ())] == 1
    assert s[("autoprofile_e2e_request_latency_seconds_count", ())] == 1
    assert s[("autoprofile_serving_oom_total", ())] == 0
    assert s[("autoprofile_kv_pages_used", ())] == 0 and s[("autoprofile_kv_pages_total", ())] > 0
    for name in ("autoprofile_num_requests_running", "autoprofile_num_requests_waiting",
                 "autoprofile_num_preemptions_total", "autoprofile_kv_cache_tokens"):
        assert (name, ()) in s, name
    assert ("autoprofile_profile_phase_seconds", (("phase", "load_weights"),)) in s
    assert s[("autoprofile_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 1


def test_step_metrics_count_every_step_of_a_request_by_kind(run):
    """/metrics says where the engine's steps went: a prompt of 3 chunks and 5 tokens is 3 prefill steps
    of its prompt tokens and 4 decode steps of one row, each scheduled, executed and applied on the host;
    on a CPU no GPU second is counted."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 3  # 135 bytes: 3 chunks of --batch_max_tokens 64

    async def body(c, app):
        before = metric_samples(await (await c.get("/metrics")).text())
        status, out = await post(c, "/v1/completions", greedy(prompt, n=5, ignore_eos=True))
        await idle(app)
        return status, out, before, metric_samples(await (await c.get("/metrics")).text())
    status, out, before, after = run(body)
    assert status == 200 and out["usage"]["completion_tokens"] == 5

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)
    prompt_tokens = out["usage"]["prompt_tokens"]
    assert prompt_tokens > 128
    assert grew("autoprofile_engine_step_kind_steps_total", kind="prefill") == 3
    assert grew("autoprofile_engine_step_kind_tokens_total", kind="prefill") == prompt_tokens
    assert grew("autoprofile_engine_step_kind_steps_total", kind="decode") == 4
    assert grew("autoprofile_engine_step_kind_tokens_total", kind="decode") == 4
    assert grew("autoprofile_engine_steps_total") == 7
    for part in ("schedule", "execute", "wait", "update", "post"):  # the fixture's engine is overlapped
        assert grew("autoprofile_engine_host_seconds_total", part=part) > 0, part
    assert grew("autoprofile_engine_gpu_seconds_total", kind="", part="idle") == 0
    assert grew("autoprofile_engine_gpu_seconds_total", kind="decode", part="forward") == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_steps_outputs_reach_the_event_loop_while_the_next_step_runs(run, booted, engine, monkeypatch,
                                                                       overlap):
    """The engine thread posts a step's outputs once the next step's work is enqueued (the event loop writes
    them while the GPU runs), or when no step follows; nothing is lost or reordered. Plain engine: during
    the next launch; overlapped: as soon as the step returns them, the next step in flight already."""
    engine.overlap = overlap
    clock = booted[0].clock
    state = {"launching": False}
    ended = clock.ended

    def marked_ended():
        state["launching"] = True
        try:
            ended()
        finally:
            state["launching"] = False
    monkeypatch.setattr(clock, "ended", marked_ended)
    posts = []

    async def body(c, app):
        eng = app[server.STATE].engine
        post_ = eng._post

        def recorded(fn, *args):
            if getattr(fn, "__name__", "") == "_dispatch":
                running = state["launching"] if not overlap else eng.engine._inflight is not None
                posts.append((running, eng.engine.stats.steps))
            post_(fn, *args)
        eng._post = recorded
        outs = await asyncio.gather(*(post(c, "/v1/completions", greedy(p, n=6, ignore_eos=True))
                                      for p in ("one", "two two", "three three three")))
        await idle(app)
        return outs
    outs = run(body)
    assert all(status == 200 and o["usage"]["completion_tokens"] == 6 for status, o in outs)
    assert len(posts) >= 6
    during = [steps for launching, steps in posts if launching]
    assert len(during) >= len(posts) - 2, posts  # only a stretch's last step waits for no launch
    assert during == sorted(during)
    if overlap:  # each step's outputs go as it is read back, not with the next step's
        assert len({steps for _, steps in posts}) == len(posts), posts


def test_a_repeated_prompt_hits_the_prefix_cache_and_answers_the_same(run):
    prompt = "You are a helpful assistant. Answer briefly and precisely, in plain words. " * 2  # > 8 pages

    async def body(c, app):
        first = await post(c, "/v1/completions", greedy(prompt, n=6))
        await idle(app)
        second = await post(c, "/v1/completions", greedy(prompt, n=6))
        await idle(app)
        return first, second, await (await c.get("/metrics")).text()
    (s1, a), (s2, b), text = run(body)
    assert s1 == s2 == 200 and a["choices"][0]["text"] == b["choices"][0]["text"]
    hits = metric_samples(text)[("autoprofile_prefix_cache_hit_tokens_total", ())]
    assert hits >= 16 * (a["usage"]["prompt_tokens"] // 16 - 1) > 0  # every full page but the last


def test_health_is_503_until_the_profile_is_validated():
    async def go():
        app = server.make_app(CFG)  # no engine yet: the profile is running
        async with TestClient(TestServer(app)) as c:
            h = await c.get("/health")
            status, err = await post(c, "/v1/completions", greedy())
            return h.status, await h.json(), status, err, h.headers
    status, health, gen_status, err, _ = asyncio.run(go())
    assert status == 503 and health == {"status": "starting"}
    assert gen_status == 503 and err["error"]["code"] == "starting"


def test_completion_matches_generate_and_chat_uses_the_template(run):
    tok = ByteTokenizer(4096, {2}, {1})

    async def body(c, app):
        s1, comp = await post(c, "/v1/completions", greedy())
        s2, gen = await post(c, "/generate",
                             {"input_ids": [tok.encode("Hello"), [5, 6]], "max_new_tokens": 32})
        s3, ids = await post(c, "/v1/completions", greedy(tok.encode("Hello")))
        msgs = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
        s4, chat = await post(c, "/v1/chat/completions",
                              {"messages": msgs, "max_tokens": 8, "temperature": 0})
        s5, plain = await post(c, "/v1/completions", greedy(tok.apply_chat_template(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]), 8))
        return (s1, s2, s3, s4, s5), comp, gen, ids, chat, plain
    statuses, comp, gen, ids, chat, plain = run(body)
    assert statuses == (200,) * 5
    choice = comp["choices"][0]
    assert comp["object"] == "text_completion" and choice["finish_reason"] == "length"
    assert comp["usage"] == {"prompt_tokens": 5, "completion_tokens": 32, "total_tokens": 37}
    assert len(gen["output_ids"]) == 2 and all(len(o) == 32 for o in gen["output_ids"])
    assert choice["text"] == tok.decode(gen["output_ids"][0]) == ids["choices"][0]["text"]
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def test_streams_are_sse_chunks_ending_in_done(run):
    async def body(c, app):
        _, whole = await post(c, "/v1/completions", greedy())
        comp = await sse(c, "/v1/completions", greedy(stream=True, stream_options={"include_usage": True}))
        chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0}
        _, chat_whole = await post(c, "/v1/chat/completions", chat_body)
        chat = await sse(c, "/v1/chat/completions", {**chat_body, "stream": True})
        return whole, comp, chat_whole, chat
    whole, comp, chat_whole, chat = run(body)
    assert comp[-1] == "[DONE]" and chat[-1] == "[DONE]"
    assert comp[-2]["choices"] == [] and comp[-2]["usage"]["completion_tokens"] == 32
    assert comp[-3]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in comp[:-2])
    assert len(comp) > 5  # token by token, not one blob
    assert "".join(c["choices"][0]["text"] for c in comp[:-2]) == whole["choices"][0]["text"]
    assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat[-2]["choices"][0]["finish_reason"] == "length" and chat[-2]["choices"][0]["delta"] == {}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chat[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chat[1:-1])
    assert text == chat_whole["choices"][0]["message"]["content"]


def _stop_for(text: str, size: int = 3) -> str:
    """A substring of `text` whose first occurrence is not at its start (spans `size` tokens)."""
    for i in range(1, len(text) - size):
        s = text[i:i + size]
        if text.find(s) == i and "\ufffd" not in s:
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_end_the_text_streamed_or_not(run, engine):
    async def body(c, app):
        _, ref = await post(c, "/v1/completions", greedy(n=48))
        text = ref["choices"][0]["text"]
        stop = _stop_for(text)
        _, whole = await post(c, "/v1/completions", greedy(n=48, stop=["never-appears", stop]))
        chunks = await sse(c, "/v1/completions", greedy(n=48, stop=stop, stream=True,
                                                        stream_options={"include_usage": True}))
        await idle(app)
        return text, stop, whole, chunks
    text, stop, whole, chunks = run(body)
    expected = text[:text.index(stop)]
    assert whole["choices"][0]["text"] == expected and whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] < 48  # the engine request was aborted, not run to the end
    streamed = "".join(c["choices"][0]["text"] for c in chunks[:-2])
    assert streamed == expected and chunks[-3]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-2]["usage"]["completion_tokens"] < 48


def test_eos_ends_a_request_unless_ignore_eos(booted, engine):
    runner, result = booted
    first = engine.generate([ByteTokenizer(4096).encode("Hello")], max_tokens=8)[0]
    eos = first[4]  # the model's 5th greedy token serves as this tokenizer's EOS
    tok = ByteTokenizer(4096, {eos}, {1})

    async def body(c, app):
        _, stopped = await post(c, "/v1/completions", greedy(n=8))
        _, ignored = await post(c, "/v1/completions", greedy(n=8, ignore_eos=True))
        return stopped, ignored
    stopped, ignored = serve(engine, result, body, tokenizer=tok)
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == first.index(eos) + 1
    assert stopped["choices"][0]["text"] == tok.decode(first[:first.index(eos)])
    assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 8


def test_seed_is_honoured_and_sampling_fields_are_accepted(run):
    async def body(c, app):
        seeded = greedy(n=12, temperature=1.0, top_p=0.95, top_k=-1)
        return [await post(c, "/v1/completions", {**seeded, "seed": s}) for s in (7, 7, 8)]
    (s1, a), (s2, b), (s3, other) = run(body)
    assert s1 == s2 == s3 == 200 and a["usage"]["completion_tokens"] == 12
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # same seed, same text
    assert other["choices"][0]["text"] != a["choices"][0]["text"]


# ---------------------------------------------------------------- client mistakes: 4xx, never 500
MSG = [{"role": "user", "content": "hi"}]
BAD = [  # (path, body, status, param)
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2.5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 300}, 400, "max_tokens"),  # > --max_req_total_len
    ("/v1/completions", {"prompt": "x" * 300}, 400, "prompt"),  # the prompt alone is too long
    ("/v1/completions", {"prompt": [1, 4096]}, 400, "prompt"),  # outside tiny's vocabulary
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", 5]}, 400, "prompt"),  # neither a list of prompts nor of ids
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3, "stream": True}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": MSG, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "model": 3}, 400, "model"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "seed": "abc"}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 1 << 70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": 2}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),  # in [-2, 2]
    ("/v1/completions", ["prompt", "hi"], 400, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema"),
    ("/generate", {"input_ids": [[1, 2]], "max_new_tokens": 0}, 400, "max_new_tokens"),
    ("/generate", {"input_ids": [[1] * 200], "max_new_tokens": 100}, 400, "max_new_tokens"),
    ("/generate", {"input_ids": [[4096]]}, 400, "input_ids"),
    ("/generate", {"input_ids": [1, 2]}, 400, "input_ids"),
    ("/generate", {"input_ids": [[1]], "top_k": True}, 400, "top_k"),
    ("/v1/completions", {"prompt": [[[1, 2]]]}, 400, "prompt"),  # nested one level too deep
    ("/v1/completions", {"prompt": "ab\ud800"}, 400, "prompt"),  # a lone surrogate
    ("/v1/completions", {"prompt": "hi", "stop": ["\udc00"]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions",
     {"messages": [MSG[0], {"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     400, "messages[1].content"),
    ("/generate", {"input_ids": [[1]] * (RUNNING + 2 + 1)}, 400, "input_ids"),  # more than running + waiting
]
DEEP = 100_000  # levels of nesting: past the JSON parser's recursion limit
JSON = {"Content-Type": "application/json"}


def test_at_least_15_distinct_4xx_cases():
    assert len({(p, json.dumps(b, sort_keys=True)) for p, b, _, _ in BAD}) >= 15


def test_client_mistakes_are_4xx_error_objects_naming_the_field(run):
    async def body(c, app):
        out = [(await c.post(path, json=b), path) for path, b, _, _ in BAD]
        out += [(await c.post("/v1/completions", data=b"{not json", headers=JSON), "json"),
                (await c.post("/v1/chat/completions", data=b"\xff\xfe", headers=JSON), "bytes"),
                (await c.post("/v1/completions", data=b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}",
                              headers=JSON), "deep"),
                (await c.post("/generate", data=b"[" * DEEP + b"]" * DEEP, headers=JSON), "deep body"),
                (await c.get("/v1/nothing"), "unknown path"),
                (await c.get("/v1/completions"), "wrong method")]
        return [(r.status, await r.json()) for r, _ in out], await (await c.get("/metrics")).text()
    results, metrics = run(body)
    expected = [(s, p) for _, _, s, p in BAD] + [(400, None), (400, None), (400, "prompt"), (400, None),
                                                 (404, None),
                                                 (405, None)]
    assert len(results) == len(expected)
    for (status, data), (want_status, param), case in zip(results, expected, BAD + [None] * 6):
        assert status == want_status, (case, data)
        err = data["error"]
        assert set(err) == {"message", "type", "param", "code"}, data
        assert err["param"] == param, (case, data)
        assert err["message"] and "Traceback" not in err["message"]
        if case and isinstance(case[1], dict) and case[1].get("prompt") == [[[1, 2]]]:
            assert "list of token ids" in err["message"] and "got 1" not in err["message"], err
    assert 'status="500"' not in metrics


@pytest.mark.parametrize("context_len,vocab",
                         [(256, 4096), (8192, 128256), (131072, 128256), (32768, 151936)])
def test_the_body_bound_holds_the_longest_valid_token_list_pretty_printed(context_len, vocab):
    longest = {"model": "m", "prompt": [vocab - 1] * (context_len - 1), "max_tokens": 1,
               "stop": ["x" * 60] * 16}
    assert len(json.dumps(longest, indent=2).encode()) <= max_body_bytes(context_len, vocab)
    assert max_body_bytes(context_len, vocab) < 8 * context_len * 32 + (2 << 20)  # a bound, not a formality


def test_a_body_past_the_bound_is_413_and_the_longest_valid_one_is_not(run):
    async def body(c, app):
        limit = app[server.STATE].bounds["openai"].limit
        longest = json.dumps(greedy([4095] * 255, n=1), indent=4) + " " * 1000
        ok = await c.post("/v1/completions", data=longest, headers={"Content-Type": "application/json"})
        over = await c.post("/v1/completions", data=b'{"prompt": [1]}' + b" " * limit, headers=JSON)
        return limit, ok.status, over.status, await over.json()
    limit, ok, status, data = run(body)
    assert limit == max_body_bytes(256, 4096)
    assert ok == 200
    assert status == 413 and data["error"]["code"] == "request_entity_too_large" and str(limit) in \
        data["error"]["message"] and "one prompt of 256 token ids" in data["error"]["message"]


def test_generate_takes_a_full_queue_of_longest_prompts_and_413s_past_that(booted, engine):
    """/generate's bound holds the most prompts it admits at once (running + waiting), each of the longest
    prompt at the widest spelling, pretty-printed: 900 prompts of 250 ids (1.35 MB) were a 413 against a
    1.05 MB bound. One byte past its bound is still a 413, and the message says what the bound holds."""
    cfg = validate(ServerConfig(**FLAGS, max_waiting_requests=1000))
    prompts = [[4095] * 249 + [7]] * 900  # one prompt: prefix-cached after the first

    async def body(c, app):
        st = app[server.STATE]
        bound = st.bounds["generate"].limit
        full = json.dumps({"input_ids": [[4095] * 255] * st.engine.capacity, "max_new_tokens": 1}, indent=4)
        ok = await c.post("/generate", data=json.dumps({"input_ids": prompts, "max_new_tokens": 1}),
                          headers=JSON)
        over = await c.post("/generate", data=b'{"input_ids": [[1]]}' + b" " * bound, headers=JSON)
        sizes = st.engine.capacity, bound, len(full)
        return *sizes, ok.status, await ok.json(), over.status, await over.json()
    capacity, bound, full, ok, out, status, data = serve(engine, booted[1], body, cfg)
    assert capacity == RUNNING + 1000 and bound == generate_body_bytes(256, 4096, capacity)
    assert len(json.dumps({"input_ids": prompts}).encode()) > max_body_bytes(256, 4096)  # the old bound
    assert full <= bound < 2 * full  # the pretty-printed full queue fits; a bound, not a formality
    assert ok == 200 and len(out["output_ids"]) == 900 and all(len(o) == 1 for o in out["output_ids"]), out
    assert status == 413, data
    msg = data["error"]["message"]
    assert str(bound) in msg and f"{capacity} prompts" in msg and "255 token ids" in msg, msg


# ---------------------------------------------------------------- backpressure, disconnects, failures
def test_past_the_waiting_bound_requests_get_429_with_retry_after(run):
    async def body(c, app):
        rs = await asyncio.gather(*[c.post("/v1/completions",
                                           json=greedy(n=64)) for _ in range(RUNNING + 2 + 3)])
        statuses = [r.status for r in rs]
        rejected = [r for r in rs if r.status == 429]
        after, _ = await post(c, "/v1/completions", greedy(n=2))
        return statuses, rejected[0].headers.get("Retry-After"), await rejected[0].json(), after
    statuses, retry_after, err, after = run(body)
    assert statuses.count(200) == RUNNING + 2 and statuses.count(429) == 3
    assert retry_after == "1" and err["error"]["code"] == "queue_full"
    assert after == 200


# per engine step: 200 tokens take >= 5 s, so a request cannot end by itself in a test's wait
STEP_DELAY_S = 0.025
ABORTED_WITHIN_S = 1.0


@pytest.fixture
def slow_steps(engine):
    real_launch = engine.runner.launch

    def launch(step):
        time.sleep(STEP_DELAY_S)
        return real_launch(step)
    engine.runner.launch = launch
    yield
    del engine.runner.launch


async def _freed(app) -> float:
    """Seconds until the engine holds no request and no page (an assertion past ABORTED_WITHIN_S)."""
    t0 = time.monotonic()
    await idle(app, timeout=ABORTED_WITHIN_S)
    return time.monotonic() - t0


def test_stopping_the_server_mid_stream_leaves_no_step_in_flight_and_no_page_held(run, engine):
    """The app's cleanup stops the engine loop while a stream runs: the overlapped engine has launched a step
    ahead; stop aborts the request and collects that step, so the runner can be torn down or reused (the
    `engine` fixture checks: no page held, nothing unfinished)."""
    async def body(c, app):
        stream = await c.post("/v1/completions", json=greedy(n=200, ignore_eos=True, stream=True))
        await stream.content.readline()
        return app[server.STATE].engine.snapshot.running
    assert run(body) == 1
    assert engine.stats.launched == engine.stats.steps


def test_a_client_that_disconnects_is_aborted_at_once(run, engine, slow_steps):
    async def body(c, app):
        eng = app[server.STATE].engine
        r = await c.post("/v1/completions", json=greedy(n=200, stream=True, ignore_eos=True))
        await r.content.readline()  # the first chunk: the request is running and holds pages
        held, steps = eng.snapshot.pages_used, eng.snapshot.steps
        r.close()  # hang up mid-stream
        streamed = await _freed(app)
        task = asyncio.ensure_future(c.post("/v1/completions", json=greedy(n=200, ignore_eos=True)))
        while not eng.snapshot.running:
            await asyncio.sleep(0.01)
        task.cancel()  # a non-streaming client that gives up
        whole = await _freed(app)
        return held, eng.snapshot.steps - steps, streamed, whole
    held, steps, streamed, whole = run(body)
    assert held > 0 and engine.stats.pages_used == 0 and not engine.has_unfinished()
    assert streamed < ABORTED_WITHIN_S and whole < ABORTED_WITHIN_S
    assert steps < 100  # both requests together ran far fewer steps than either one alone needs (199)


def test_an_oom_in_a_step_fails_its_requests_counts_and_serving_goes_on(run, engine):
    real_launch = engine.runner.launch
    calls = {"n": 0}

    def launch_once_oom(step):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 752.00 MiB")
        return real_launch(step)

    engine.runner.launch = launch_once_oom
    try:
        async def body(c, app):
            failed = await post(c, "/v1/completions", greedy(n=16))
            ok = await post(c, "/v1/completions", greedy(n=4))
            return failed, ok, await (await c.get("/metrics")).text()
        (status, err), (ok_status, _), metrics = run(body)
    finally:
        del engine.runner.launch
    assert status == 500 and err["error"]["code"] == "engine_oom" and "752" not in err["error"]["message"]
    assert ok_status == 200
    assert metric_samples(metrics)[("autoprofile_serving_oom_total", ())] == 1


def test_two_apps_keep_their_own_metrics():
    a, b = server.make_app(CFG), server.make_app(CFG)
    assert a[server.STATE].metrics.registry is not b[server.STATE].metrics.registry


def test_a_failed_profile_exits_1_with_its_diagnostic(capsys):
    from autoprofile.profiler import ProfileError

    def boot(cfg):
        raise ProfileError("no size survived: lower --graph_max_batch_size")
    assert asyncio.run(server.serve(CFG.replace(port=0), boot)) == 1
    assert "no size survived" in capsys.readouterr().err


# ---------------------------------------------------------------- the openai client, end to end
def test_the_openai_client_end_to_end(run):
    async def body(c, app):
        url = str(c.make_url("/v1"))
        assert url.startswith("http://127.0.0.1:")
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            models = await client.models.list()
            comp = await client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
            chat = await client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6,
                                                        temperature=0,
                                                        seed=3)
            parts, reasons = [], []
            stream = await client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6,
                                                          temperature=0,
                                                          stream=True)
            async for ch in stream:
                parts.append(ch.choices[0].delta.content or "")
                reasons.append(ch.choices[0].finish_reason)
            with pytest.raises(openai.BadRequestError) as bad:
                await client.completions.create(model="tiny", prompt="Hello", max_tokens=8, top_p=2.0)
            with pytest.raises(openai.NotFoundError) as missing:
                await client.completions.create(model="nope", prompt="Hello")
        return models, comp, chat, parts, reasons, bad.value, missing.value
    models, comp, chat, parts, reasons, bad, missing = run(body)
    assert [m.id for m in models.data] == ["tiny"]
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 8
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 6
    assert "".join(parts) == chat.choices[0].message.content and reasons[-1] == "length"
    assert bad.param == "top_p" and bad.code == "invalid_value"
    assert missing.code == "model_not_found"


# ---------------------------------------------------------------- SIGTERM: drain, lose nothing, exit 0
def _cli_flags(**extra) -> list[str]:
    flags = {**FLAGS, "report_dir": "", "port": 0, **extra}
    flags.pop("engine_process")  # a switch without a value; cpu_server serves on its engine thread unasked
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))]


@pytest.mark.slow  # a server process: its imports and boot
def test_sigterm_drains_every_accepted_request_then_exits_0():
    N = 4
    proc = subprocess.Popen([sys.executable, "-m", "unit_tests.cpu_server", *_cli_flags()], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        url = bound_url(proc.stdout)
        assert url, "the server never bound"

        async def go():
            async with aiohttp.ClientSession() as s:
                while True:
                    async with s.get(f"{url}/health") as h:
                        if h.status == 200:
                            break
                        assert h.status == 503
                    await asyncio.sleep(0.05)

                async def one(i: int):
                    async with s.post(f"{url}/v1/completions",
                                      json=greedy(f"p{i}", 200, stream=i % 2 == 0)) as r:
                        return r.status, await r.text()
                tasks = [asyncio.ensure_future(one(i)) for i in range(N)]
                while True:  # every request is in the engine
                    async with s.get(f"{url}/health") as h:
                        if (await h.json())["outstanding_requests"] == N:
                            break
                    await asyncio.sleep(0.01)
                proc.send_signal(signal.SIGTERM)
                while True:  # until the signal is handled; the requests run on
                    async with s.get(f"{url}/health") as h:
                        draining = h.status, await h.json()
                    if h.status == 503:
                        break
                    await asyncio.sleep(0.01)
                async with s.post(f"{url}/v1/completions", json=greedy()) as r:
                    refused = r.status, await r.json()
                return draining, refused, await asyncio.gather(*tasks)
        draining, refused, done = asyncio.run(go())
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert draining == (503, {"status": "draining"})
    assert refused[0] == 503 and refused[1]["error"]["code"] == "draining"
    for i, (status, text) in enumerate(done):
        assert status == 200, text
        if i % 2 == 0:
            assert text.endswith("data: [DONE]\n\n") and '"finish_reason": "length"' in text
        else:
            assert json.loads(text)["usage"]["completion_tokens"] == 200
    assert code == 0


@pytest.mark.slow  # a server process: its imports and boot
def test_sigterm_during_the_profile_exits_0_at_once():
    proc = subprocess.Popen([sys.executable, "-m", "unit_tests.cpu_server", *_cli_flags()], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        for line in proc.stdout:
            if "serving on" in line:  # bound; the boot (the profile) runs now
                proc.send_signal(signal.SIGTERM)
                break
        rest = proc.stdout.read()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "stopped during startup" in rest


def test_auto_context_that_does_not_fit_the_cache_is_cut_and_reported():
    """--max_req_total_len unset (auto): tiny's 4096-token context needs a cache of 4112 tokens; a cache of
    1024 serves requests of at most 1008 (one such request plus the pad page)."""
    flags = {k: v for k, v in FLAGS.items() if k != "max_req_total_len"}
    cfg = validate(ServerConfig(**flags, max_total_token_num=1024))
    assert cfg.context_len == 4096
    runner, result = boot_cpu(cfg, kv_tokens=1024)
    try:
        engine = LLMEngine.from_config(runner, cfg)
        assert engine.envelope.max_req_total_len == 1008 == result.cfg.context_len

        async def body(c, app):
            h, m = await c.get("/health"), await c.get("/v1/models")
            long = await post(c, "/v1/completions", greedy(n=1008))  # with the prompt: past 1008
            fits = await post(c, "/v1/completions", greedy(n=8))
            await idle(app)
            return await h.json(), await m.json(), long, fits
        health, models, long, fits = serve(engine, result, body, cfg=cfg)
    finally:
        runner.teardown()
    assert health["max_req_total_len"] == 1008 and models["data"][0]["max_model_len"] == 1008
    assert long[0] == 400 and "max_tokens" in json.dumps(long[1]) and "1008" in json.dumps(long[1])
    assert fits[0] == 200


def test_an_explicit_context_that_does_not_fit_a_pinned_cache_is_refused():
    with pytest.raises(ConfigError, match="--max_total_token_num: 1024 tokens is below the smallest usable "
                                          "cache, 4112 tokens"):
        validate(ServerConfig(**{**FLAGS, "max_req_total_len": 4096}, max_total_token_num=1024))


def test_serve_loads_the_tokenizer_beside_the_boot_and_xgrammar_after_it(monkeypatch):
    """`serve` loads the tokenizer on a thread while the boot runs, and builds xgrammar's vocabulary only
    after the boot (its import, 5.7-7 s of host time on the GPU hosts, slowed the boot's host-bound steps): a
    boot that sees the tokenizer loaded and no grammar built, then fails its profile; serve ends with exit 1
    and xgrammar's vocabulary was never built."""
    from autoprofile.profiler import ProfileError
    loaded, grammars = threading.Event(), []
    real = server.load_tokenizer

    def tokenizer(cfg):
        out = real(cfg)
        loaded.set()
        return out

    def boot(cfg):
        if not loaded.wait(60):
            raise RuntimeError("the tokenizer was not loaded while the boot ran")
        time.sleep(0.2)
        assert not grammars, "xgrammar's vocabulary was built beside the boot"
        raise ProfileError("the boot's end, on purpose")

    monkeypatch.setattr(server, "load_tokenizer", tokenizer)
    monkeypatch.setattr(server, "grammars_for", lambda *a: grammars.append(a))
    cfg = CFG.replace(host="127.0.0.1", port=0)
    assert asyncio.run(server.serve(cfg, boot)) == server.EXIT_FAILED
    assert loaded.is_set() and grammars == []


# ---------------------------------------------------------------- a reader behind the steps
def test_a_reader_behind_the_steps_reads_the_outputs_it_missed_as_one(run):
    """RequestHandle merges the outputs not yet read (vLLM's RequestOutputCollector): a reader that comes back
    once the request has ended reads one output, with the same tokens, logprobs and counts as a reader that
    took each step's output as it came (one SSE chunk for them instead of one a step)."""
    async def body(c, app):
        eng = app[server.STATE].engine
        params = SamplingParams(temperature=0.0, logprobs=2)

        async def read(behind: bool) -> list:
            handle = await eng.submit([5, 6, 7, 8, 9], params, 12)
            if behind:
                await idle(app)  # every step has run and been dispatched, none read
            return [out async for out in handle]
        return await read(False), await read(True)
    eager, behind = run(body)
    assert len(eager) >= 6 and len(behind) == 1, (len(eager), len(behind))
    merged = behind[0]
    assert merged.new_token_ids == [t for o in eager for t in o.new_token_ids]
    assert len(merged.new_token_ids) == merged.completion_tokens == eager[-1].completion_tokens == 12
    assert [e[:2] for e in merged.logprobs] == [e[:2] for o in eager for e in o.logprobs]  # (token, logprob)
    assert merged.finished and merged.finish_reason == eager[-1].finish_reason == "length"


def test_a_failure_is_read_after_the_outputs_before_it():
    """A handle merges outputs but never across a failure: the reader gets what came before, then the
    error."""
    out = [RequestOutput("r", [i], False, None, 3, i + 1) for i in range(3)]

    async def go():
        handle = RequestHandle(None, "r", 3)
        for o in out:
            handle.put(o)
        handle.put(EngineFailure("oom"))
        handle.put(RequestOutput("r", [9], True, "length", 3, 4))  # never read: the failure ends the handle
        got = []
        with pytest.raises(EngineFailure) as e:
            async for o in handle:
                got.append(o)
        return got, e.value.code
    got, code = asyncio.run(go())
    assert [o.new_token_ids for o in got] == [[0, 1, 2]] and got[0].completion_tokens == 3
    assert code == "oom"


def test_a_stream_interval_wakes_the_reader_at_its_first_token_every_n_tokens_and_at_the_end():
    """--stream_interval 4: the reader takes the first token at once, then the outputs of 4 tokens merged
    (the steps' outputs of 1 and 2 tokens in between never wake it), then whatever is left at the end; a
    failure wakes it at once. At 1 every output wakes it."""
    def outputs(sizes, end=True):
        done, out = 0, []
        for i, n in enumerate(sizes):
            done += n
            last = end and i == len(sizes) - 1
            out.append(RequestOutput("r", list(range(done - n, done)), last, "length" if last else None, 3,
                                     done))
        return out

    async def read(interval, items):
        handle, got = RequestHandle(None, "r", 3, stream_interval=interval), []

        async def reader():
            try:
                async for o in handle:
                    got.append(len(o.new_token_ids))
            except EngineFailure as e:
                got.append(e.code)
        task = asyncio.ensure_future(reader())
        woken, turns = [], 0
        for item in items:
            await asyncio.sleep(0)
            waiting = handle._waiter  # the blocked reader's future
            handle.put(item)
            turns += waiting is not None and waiting.done()  # a turn on the event loop for the reader
            for _ in range(3):  # the reader's turn, if it was woken
                await asyncio.sleep(0)
            woken.append(len(got))
        await task
        assert turns <= len(got)  # woken only for what it reads: no turn for an output merged
        return got, woken
    got, woken = asyncio.run(read(4, outputs([1, 1, 2, 1, 1, 1, 1, 1, 2, 1])))
    assert got == [1, 4, 4, 3] and woken == [1, 1, 1, 2, 2, 2, 2, 3, 3, 4]
    got, _ = asyncio.run(read(4, [*outputs([1, 2], end=False), EngineFailure("oom")]))
    assert got == [1, 2, "oom"]
    got, woken = asyncio.run(read(1, outputs([1, 1, 2, 1])))
    assert got == [1, 1, 2, 1] and woken == [1, 2, 3, 4]
    got, woken = asyncio.run(read(math.inf, outputs([1, 1, 2, 1, 3])))  # final_only: first token, end
    assert got == [1, 7] and woken == [1, 1, 1, 1, 2]


def test_a_whole_answer_without_stop_strings_reads_its_first_token_and_its_end(run, monkeypatch):
    """A non-streamed completion (vLLM's FINAL_ONLY): its handler reads two outputs, the first token and the
    rest at the end, with the text a stream of the same request carries; with a stop string it reads the
    outputs as they come, to end the request at the string."""
    reads: list[int] = []
    real = RequestHandle.__anext__

    async def counted(self):
        out = await real(self)
        reads.append(len(out.new_token_ids))
        return out
    monkeypatch.setattr(RequestHandle, "__anext__", counted)

    async def body(c, app):
        whole = await post(c, "/v1/completions", greedy(n=16, ignore_eos=True))
        first = list(reads)
        reads.clear()
        events = await sse(c, "/v1/completions", greedy(n=16, ignore_eos=True, stream=True))
        streamed = "".join(e["choices"][0]["text"] for e in events if e != "[DONE]" and e["choices"])
        reads.clear()
        await post(c, "/v1/completions", greedy(n=16, ignore_eos=True, stop=["never appears"]))
        return whole, first, streamed, list(reads)
    (status, data), whole_reads, streamed, stop_reads = run(body)
    assert status == 200 and data["choices"][0]["text"] == streamed
    assert whole_reads == [1, 15], whole_reads
    assert len(stop_reads) > 2 and sum(stop_reads) == 16, stop_reads


def test_a_stream_interval_sends_fewer_chunks_of_the_same_text(run, engine, booted):
    """A streamed completion under --stream_interval 4 carries the same text as at 1 (greedy), its first
    token alone in the first chunk, in at most 1 + ceil(15 / 4) content chunks; at 1 a chunk a token."""
    cfg4 = validate(ServerConfig(**FLAGS, max_waiting_requests=2, stream_interval=4))
    body = greedy(n=16, stream=True, ignore_eos=True, logprobs=1)

    async def streamed(c, app):
        events = await sse(c, "/v1/completions", body)
        chunks = [e for e in events if e != "[DONE]" and e["choices"] and e["choices"][0]["logprobs"]]
        return ["".join(e["choices"][0]["text"] for e in chunks),
                [len(e["choices"][0]["logprobs"]["tokens"]) for e in chunks]]
    text1, sizes1 = run(streamed)
    text4, sizes4 = serve(engine, booted[1], streamed, cfg4)
    assert text4 == text1 and sum(sizes4) == sum(sizes1) == 16
    assert sizes4[0] == 1 and len(sizes4) <= 5 and all(n >= 4 for n in sizes4[1:-1]), sizes4
    assert len(sizes1) >= 12, sizes1


def test_request_output_then_keeps_the_prompt_logprobs_of_the_first():
    first = RequestOutput("r", [1], False, None, 4, 1, ["a"], [None, "p1", "p2", "p3"])
    later = RequestOutput("r", [2, 3], True, "stop", 4, 3, ["b", "c"])
    both = first.then(later)
    assert (both.new_token_ids, both.finished, both.finish_reason, both.completion_tokens) == \
        ([1, 2, 3], True, "stop", 3)
    assert both.logprobs == ["a", "b", "c"] and both.prompt_logprobs == [None, "p1", "p2", "p3"]
    assert RequestOutput("r", [1], False, None, 4, 1).then(later).logprobs == ["b", "c"]
    assert RequestOutput("r", [1], False, None, 4, 1).then(
        RequestOutput("r", [2], False, None, 4, 2)).logprobs is None


def test_metrics_count_the_cpu_of_the_event_loop_and_the_engine_threads(run):
    """autoprofile_thread_cpu_seconds_total{thread}: what the two threads sharing the GIL spent; the engine
    thread's grows with the steps it runs."""
    async def body(c, app):
        def cpu(text):
            s = metric_samples(text)
            return {t: s[("autoprofile_thread_cpu_seconds_total", (("thread", t),))]
                    for t in ("event_loop", "engine")}
        before = cpu(await (await c.get("/metrics")).text())
        status, _ = await post(c, "/v1/completions", greedy(n=48, ignore_eos=True))
        assert status == 200
        await idle(app)
        return before, cpu(await (await c.get("/metrics")).text())
    before, after = run(body)
    assert after["engine"] > before["engine"] > 0
    assert after["event_loop"] > before["event_loop"] > 0
