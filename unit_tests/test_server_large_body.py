"""A large body never stalls the streams: a ~40 MiB token list is refused past the byte bound before it is
parsed, and a body above PARSE_ON_LOOP_BYTES is decoded and validated on a worker thread."""
from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import pytest

from autoprofile import server
from autoprofile.engine.engine import LLMEngine
from autoprofile.serving.openai import PARSE_ON_LOOP_BYTES
from autoprofile.serving.tokenizer import ByteTokenizer
from unit_tests.test_server import booted, greedy, serve  # noqa: F401

BIG_IDS = 7_000_000  # ~40 MiB of JSON token ids
# a stream's longest inter-token gap while the body arrives (parsing it on the loop: seconds)
MAX_GAP_S = 0.25


@pytest.fixture
def slow_engine(booted):  # noqa: F811
    runner, result = booted
    real_execute = runner.execute

    def execute(step):
        time.sleep(0.01)  # the stream outlasts the upload
        return real_execute(step)
    runner.execute = execute
    yield LLMEngine(runner), result
    del runner.execute


def _send(port: int, raw: bytes, out: dict) -> None:
    """POST raw from another thread (its own socket), as a second client would."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    out["start"] = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", raw, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out["status"], out["body"] = resp.status, resp.read()
    except (ConnectionError, OSError) as e:  # the server may close before the upload ends
        out["status"], out["body"] = None, repr(e)
    out["end"] = time.monotonic()


def test_a_40_mib_body_does_not_stall_a_stream(slow_engine):
    engine, result = slow_engine
    raw = json.dumps({"model": "tiny", "prompt": [1000] * BIG_IDS, "max_tokens": 4}).encode()
    assert len(raw) > 35 << 20

    async def body(c, app):
        arrivals, big = [], {}
        r = await c.post("/v1/completions", json=greedy(n=200, ignore_eos=True, stream=True))
        sender = None
        async for _ in r.content:
            arrivals.append(time.monotonic())
            if len(arrivals) == 20:
                sender = threading.Thread(target=_send, args=(c.port, raw, big))
                sender.start()
        await asyncio.to_thread(sender.join)
        return arrivals, big, app[server.STATE].max_body
    arrivals, big, limit = serve(engine, result, body)
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if big["start"] <= b and a <= big["end"]]
    # the gaps that overlap the upload (refused after ~1 MiB it can take under 30 ms: one gap, or two)
    assert len(during) >= 1, (big, len(arrivals))
    assert max(during) < MAX_GAP_S, (max(during), big["end"] - big["start"])
    assert big["status"] in (413, None), big  # refused (or cut off) after at most `limit` bytes
    if big["status"] == 413:
        assert json.loads(big["body"])["error"]["code"] == "request_entity_too_large"
    assert limit < len(raw) // 8


class ThreadRecordingTokenizer(ByteTokenizer):
    def __init__(self):
        super().__init__(4096, {2}, {1})
        self.threads: list[str] = []

    def encode(self, text, add_special_tokens=True):
        self.threads.append(threading.current_thread().name)
        return super().encode(text, add_special_tokens)


def test_a_large_body_is_parsed_off_the_loop_and_a_small_one_on_it(booted):  # noqa: F811
    runner, result = booted
    tok = ThreadRecordingTokenizer()

    async def body(c, app):
        small = await c.post("/v1/completions", json=greedy("hi", n=2))
        large = await c.post("/v1/completions", json=greedy("x" * (PARSE_ON_LOOP_BYTES + 1), n=2))
        return small.status, large.status, (await large.json())["error"]["param"]
    small, large, param = serve(LLMEngine(runner), result, body, tokenizer=tok)
    assert small == 200 and large == 400 and param == "prompt"  # longer than --max_req_total_len
    assert tok.threads[0] == threading.main_thread().name
    assert tok.threads[1].startswith("parse")
