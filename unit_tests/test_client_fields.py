"""vLLM's allowed_token_ids and prompt_logprobs through HTTP (issue 47), on the tiny model (random weights,
CPU, torch backend) on 127.0.0.1, with the overlapped engine and the plain one."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from autoprofile import server
from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from unit_tests.cpu_server import booted_fixture
from unit_tests.test_server import FLAGS, post, sse

pytest.importorskip("xgrammar")

CFG = validate(ServerConfig(**FLAGS, max_waiting_requests=8))
VOCAB = CFG.model_config.vocab_size


booted = booted_fixture(CFG)


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


# ---------------------------------------------------------------- prompt_logprobs
PROMPT_IDS = [(7 * i + 3) % (VOCAB - 1) + 1 for i in range(90)]  # two prefill chunks of batch_max_tokens 64


def scored_ids(entries: list) -> list[dict]:
    """vLLM's prompt_logprobs entries after the first (null), their keys as ints."""
    assert entries[0] is None
    return [{int(t): v for t, v in e.items()} for e in entries[1:]]


def test_prompt_logprobs_are_echos_logprobs_with_vllms_ranks(run):
    """Completions: prompt_logprobs k gives each prompt token (the first null) its logprob, rank and decoded
    text, and its position's top k (ranks 1..k): the values echo + logprobs gives the same prompt."""
    async def body(c):  # the prompt ends in 30 greedy tokens (rank 1) after 60 others (mostly past 20)
        _, head = await post(c, "/v1/completions", {"prompt": PROMPT_IDS[:60], "max_tokens": 30,
                                                     "temperature": 0, "ignore_eos": True,
                                                     "return_token_ids": True})
        prompt = PROMPT_IDS[:60] + head["choices"][0]["token_ids"]
        echo = await post(c, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "echo": True,
                                                  "logprobs": 3, "temperature": 0})
        outs = [await post(c, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                  "prompt_logprobs": k}) for k in (0, 3, 20)]
        return prompt, echo, outs
    prompt, (status, echo), outs = run(body)
    assert status == 200 and all(s == 200 for s, _ in outs), outs
    block = echo["choices"][0]["logprobs"]
    zero, three, twenty = (scored_ids(o["choices"][0]["prompt_logprobs"]) for _, o in outs)
    assert len(zero) == len(three) == len(twenty) == len(prompt) - 1 == 89
    inside = 0
    for i, tok in enumerate(prompt[1:]):
        own = zero[i][tok]
        assert list(zero[i]) == [tok] and own["decoded_token"] == block["tokens"][i + 1]
        assert own["logprob"] == pytest.approx(block["token_logprobs"][i + 1], abs=1e-5)
        assert three[i][tok]["logprob"] == twenty[i][tok]["logprob"] == own["logprob"]
        assert sorted(v["rank"] for v in three[i].values())[:3] == [1, 2, 3] and len(three[i]) in (3, 4)
        texts: dict[str, float] = {}  # echo's top_logprobs: the top 3 and the prompt token, by text
        for v in sorted(three[i].values(), key=lambda v: -v["logprob"]):
            texts.setdefault(v["decoded_token"], v["logprob"])
        assert texts == pytest.approx(block["top_logprobs"][i + 1], abs=1e-5)
        # the prompt token's rank (vLLM's: the logprobs >= its own): known exactly when inside the top 20
        top20 = [v["logprob"] for v in twenty[i].values() if v["rank"] <= 20]
        assert len(top20) == 20
        if own["logprob"] >= min(top20):
            inside += 1
            assert own["rank"] == sum(lp >= own["logprob"] for lp in top20), (i, own, top20)
        else:
            assert own["rank"] > 20, (i, own)
    assert 30 <= inside < len(prompt) - 1  # both cases seen


def test_prompt_logprobs_with_n_choices_several_prompts_and_chat(run):
    """Every choice of a prompt carries that prompt's prompt_logprobs (n > 1, a list of prompts); chat puts
    them beside the choices, the values of its rendered prompt's ids sent to completions."""
    chat_body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3, "n": 2,
                 "temperature": 1.0, "seed": 3, "prompt_logprobs": 2, "return_token_ids": True}

    async def body(c):
        one = await post(c, "/v1/completions", {"prompt": PROMPT_IDS[:40], "max_tokens": 1,
                                                 "prompt_logprobs": 2})
        many = await post(c, "/v1/completions", {"prompt": [PROMPT_IDS[:40], PROMPT_IDS[40:50]],
                                                  "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 5,
                                                  "prompt_logprobs": 2})
        chat = await post(c, "/v1/chat/completions", chat_body)
        ids = chat[1]["prompt_token_ids"]
        direct = await post(c, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
        plain = await post(c, "/v1/chat/completions", {**chat_body, "prompt_logprobs": None})
        return one, many, chat, direct, plain
    outs = run(body)
    assert all(status == 200 for status, _ in outs), outs
    (_, one), (_, many), (_, chat), (_, direct), (_, plain) = outs
    first = one["choices"][0]["prompt_logprobs"]
    assert len(first) == 40 and first[0] is None
    got = many["choices"]
    assert [len(ch["prompt_logprobs"]) for ch in got] == [40, 40, 10, 10]
    assert scored_ids(got[0]["prompt_logprobs"]) == scored_ids(got[1]["prompt_logprobs"])
    assert scored_ids(got[2]["prompt_logprobs"]) == scored_ids(got[3]["prompt_logprobs"])
    close(scored_ids(got[0]["prompt_logprobs"]), scored_ids(first))
    assert "prompt_logprobs" not in chat["choices"][0] and len(chat["choices"]) == 2
    close(scored_ids(chat["prompt_logprobs"]), scored_ids(direct["choices"][0]["prompt_logprobs"]))
    assert "prompt_logprobs" not in plain and all("prompt_logprobs" not in ch for ch in plain["choices"])


def close(a: list[dict], b: list[dict]) -> None:
    """The same tokens, ranks and texts; logprobs within float noise (other batches)."""
    assert [{t: (v["rank"], v["decoded_token"]) for t, v in e.items()} for e in a] == \
        [{t: (v["rank"], v["decoded_token"]) for t, v in e.items()} for e in b]
    assert [v["logprob"] for e in a for v in e.values()] == \
        pytest.approx([v["logprob"] for e in b for v in e.values()], abs=1e-5)


def test_streamed_prompt_logprobs_come_in_each_choices_first_chunk(run):
    """Streamed: a completions choice's first chunk carries its prompt's prompt_logprobs (every choice, once),
    chat's first chunk after the role carries them beside the choices (once); the values of the whole
    answer."""
    comp = {"prompt": PROMPT_IDS[:70], "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 2,
            "prompt_logprobs": 1}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "temperature": 1.0,
            "seed": 2, "prompt_logprobs": 1}

    async def body(c):
        return (await sse(c, "/v1/completions", {**comp, "stream": True}),
                await post(c, "/v1/completions", comp),
                await sse(c, "/v1/chat/completions", {**chat, "stream": True}),
                await post(c, "/v1/chat/completions", chat))
    comp_events, (_, whole), chat_events, (_, chat_whole) = run(body)
    chunks = [e for e in comp_events if e != "[DONE]"]
    carried = [(e["choices"][0]["index"], e["choices"][0]["prompt_logprobs"]) for e in chunks
               if "prompt_logprobs" in e["choices"][0]]
    assert sorted(i for i, _ in carried) == [0, 1]
    for i, lps in carried:
        first = next(e for e in chunks if e["choices"][0]["index"] == i)
        assert first["choices"][0].get("prompt_logprobs") == lps
        close(scored_ids(lps), scored_ids(whole["choices"][0]["prompt_logprobs"]))
    chat_chunks = [e for e in chat_events if e != "[DONE]"]
    top = [e["prompt_logprobs"] for e in chat_chunks if "prompt_logprobs" in e]
    assert len(top) == 1 and all("prompt_logprobs" not in e["choices"][0] for e in chat_chunks)
    roles = [e for e in chat_chunks if e["choices"][0]["delta"].get("role")]
    carrier = next(e for e in chat_chunks if "prompt_logprobs" in e)
    assert chat_chunks.index(carrier) == len(roles) == 2  # right after both choices' role chunks
    close(scored_ids(top[0]), scored_ids(chat_whole["prompt_logprobs"]))


@pytest.mark.parametrize("value", [-1, 21, "2", True, 1.5, [1]])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_outside_0_to_20_is_a_400_naming_it(booted, path, value):
    engine = LLMEngine(booted[0], overlap=False)
    body = {"prompt": "Hi"} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "Hi"}]}

    async def main():
        app = server.make_app(CFG, engine, booted[1])
        async with TestClient(TestServer(app)) as c:
            return await post(c, path, {**body, "max_tokens": 2, "prompt_logprobs": value})
    status, out = asyncio.run(main())
    assert status == 400 and out["error"]["param"] == "prompt_logprobs", out
    assert "[0, 20]" in out["error"]["message"]
