"""vLLM's allowed_token_ids and prompt_logprobs through HTTP (issue 47), on the tiny model (random weights,
CPU, torch backend) on 127.0.0.1, with the overlapped engine and the plain one."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from autoprofile import server
from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from unit_tests.cpu_server import boot_cpu
from unit_tests.test_server import FLAGS, post

pytest.importorskip("xgrammar")

CFG = validate(ServerConfig(**FLAGS, max_waiting_requests=8))
VOCAB = CFG.model_config.vocab_size


@pytest.fixture(scope="module")
def booted():
    runner, result = boot_cpu(CFG)
    yield runner, result
    runner.teardown()


@pytest.fixture(params=[True, False], ids=["overlap", "plain"])
def run(booted, request):
    engine = LLMEngine(booted[0], overlap=request.param)

    def go(body):
        async def main():
            app = server.make_app(CFG, engine, booted[1])
            async with TestClient(TestServer(app)) as c:
                return await body(c)
        return asyncio.run(main())
    yield go
    assert engine.stats.pages_used == 0 and not engine.has_unfinished()


def sampled(allowed, seed, **kw) -> dict:
    return {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 1.0, "seed": seed, "n": 2,
            "ignore_eos": True, "return_token_ids": True, "allowed_token_ids": allowed, **kw}


# ---------------------------------------------------------------- allowed_token_ids
def test_every_sampled_token_is_an_allowed_one(run):
    allowed = [3, 40, 41, 77, VOCAB - 1]

    async def body(c):
        free = await post(c, "/v1/completions", sampled(None, 0))
        chat = await post(c, "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "seed": 1,
            "temperature": 1.0, "ignore_eos": True, "return_token_ids": True, "allowed_token_ids": [40, 41]})
        outs = await asyncio.gather(*[post(c, "/v1/completions", sampled(allowed, s)) for s in range(3)])
        return free, outs, chat
    (_, free), outs, (chat_status, chat) = run(body)
    assert not set(free["choices"][0]["token_ids"]) <= set(allowed)  # unmasked, the sample leaves the set
    for status, out in outs:
        assert status == 200, out
        for ch in out["choices"]:
            assert len(ch["token_ids"]) == 8 and set(ch["token_ids"]) <= set(allowed), ch
    assert len({tuple(ch["token_ids"]) for _, out in outs for ch in out["choices"]}) > 1
    assert chat_status == 200 and set(chat["choices"][0]["token_ids"]) <= {40, 41}, chat


def test_allowed_token_ids_and_a_grammar_both_hold(run):
    async def body(c):
        ids = [(await post(c, "/tokenize", {"model": "tiny", "prompt": ch, "add_special_tokens": False}))[1]
               ["tokens"] for ch in "abc"]
        outs = await asyncio.gather(*[post(c, "/v1/completions", {
            "model": "tiny", "prompt": "Hi", "max_tokens": 12, "temperature": 1.0, "seed": s,
            "structured_outputs": {"regex": "[a-c]{4}"},
            "allowed_token_ids": [*ids[0], *ids[1], 9]}) for s in range(4)])
        return ids, outs
    ids, outs = run(body)
    assert all(len(i) == 1 for i in ids), ids
    for status, out in outs:
        assert status == 200, out
        text = out["choices"][0]["text"]
        assert set(text) <= {"a", "b"} and len(text) == 4, out  # "c" refused by the ids
        assert out["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("value,rule", [([], "non-empty"), ([0, VOCAB], f"[0, {VOCAB})"), ([-1], "token ids"),
                                        ("5", "list"), ([1.5], "token ids")])
def test_allowed_token_ids_outside_the_vocabulary_or_empty_is_a_400_naming_it(booted, value, rule):
    engine = LLMEngine(booted[0], overlap=False)

    async def main():
        app = server.make_app(CFG, engine, booted[1])
        async with TestClient(TestServer(app)) as c:
            return await post(c, "/v1/completions", sampled(value, 0))
    status, out = asyncio.run(main())
    assert status == 400 and out["error"]["param"] == "allowed_token_ids", out
    assert rule in out["error"]["message"]
