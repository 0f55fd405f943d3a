"""What clients send today (issue 47): model retrieval, lists of prompts, the body's media type, and vLLM's
extensions (/tokenize, /detokenize, /version, continuous usage, token ids, chat template controls), against
the real server and engine on the tiny model (CPU, torch backend)."""
from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
from pathlib import Path

import openai
import pytest

from autoprofile import server
from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from unit_tests.cpu_server import boot_cpu, booted_fixture
from unit_tests.test_server import FLAGS, post, sse

CFG = validate(ServerConfig(**FLAGS, max_waiting_requests=4, served_model_name="served"))
MSG = [{"role": "user", "content": "Hi"}]


def greedy(prompt="Hello", max_tokens=4, **kw) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}


booted = booted_fixture(CFG)


@pytest.fixture
def run(booted):
    """body(client, app) against a server over a fresh engine; every test leaves no page held."""
    from unit_tests.test_server import serve
    eng = LLMEngine.from_config(booted[0], CFG)
    yield lambda body, **kw: serve(eng, booted[1], body, **{"cfg": CFG, **kw})
    assert eng.stats.pages_used == 0 and not eng.has_unfinished()


# ---------------------------------------------------------------- GET /v1/models/{model}
def test_models_retrieve_answers_every_name_a_request_may_give(run):
    async def body(c, app):
        url = str(c.make_url("/v1"))
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            got = [await client.models.retrieve(name) for name in ("served", "tiny")]
            with pytest.raises(openai.NotFoundError) as missing:
                await client.models.retrieve("llama")
        return got, missing.value
    got, missing = run(body)
    assert [m.id for m in got] == ["served", "served"] and got[0].max_model_len == 256
    assert missing.code == "model_not_found" and missing.param == "model" and "'served'" in missing.message


# ---------------------------------------------------------------- several prompts
def test_a_list_of_prompts_gets_n_choices_each_indexed_prompt_by_prompt_usage_summed(run):
    async def body(c, app):
        alone = [await post(c, "/v1/completions", greedy(p, 4)) for p in ("Hello", [5, 6, 7])]
        both = await post(c, "/v1/completions", greedy(["Hello", [5, 6, 7]], 4, n=2))
        ids = await post(c, "/v1/completions", greedy([[5, 6, 7], [8, 9]], 3))
        return alone, both, ids
    alone, (status, both), (ids_status, ids) = run(body)
    assert status == 200 and ids_status == 200, (both, ids)
    texts = [a[1]["choices"][0]["text"] for a in alone]
    assert [(ch["index"], ch["text"]) for ch in both["choices"]] == \
        [(0, texts[0]), (1, texts[0]), (2, texts[1]), (3, texts[1])]  # greedy: n copies of each prompt's text
    prompt_tokens = sum(a[1]["usage"]["prompt_tokens"] for a in alone)
    assert both["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 16,
                             "total_tokens": prompt_tokens + 16}
    assert [ch["index"] for ch in ids["choices"]] == [0, 1] and ids["usage"]["prompt_tokens"] == 5


def test_a_list_of_prompts_streams_every_choice_with_its_index(run):
    async def body(c, app):
        one = await post(c, "/v1/completions", greedy([9, 10], 4))
        events = await sse(c, "/v1/completions", greedy(["Hello", [9, 10]], 4, stream=True,
                                                        stream_options={"include_usage": True}))
        return one[1], events
    one, events = run(body)
    text = {0: "", 1: ""}
    for e in events[:-2]:
        text[e["choices"][0]["index"]] += e["choices"][0]["text"]
    assert text[1] == one["choices"][0]["text"] and text[0]
    assert events[-2]["usage"]["completion_tokens"] == 8 and events[-1] == "[DONE]"


@pytest.mark.parametrize("prompt, param", [(["Hello", ""], "prompt[1]"), ([[1, 2], [4096]], "prompt[1]"),
                                           ([], "prompt")])
def test_a_bad_prompt_of_a_list_is_a_400_naming_it(run, prompt, param):
    async def body(c, app):
        return await post(c, "/v1/completions", greedy(prompt, 4))
    status, err = run(body)
    assert status == 400 and err["error"]["param"] == param, err


def test_more_choices_than_the_server_holds_is_a_400_naming_the_prompt(run):
    async def body(c, app):
        return await post(c, "/v1/completions", greedy(["a"] * 7, 4, n=2))  # 14 > 8 running + 4 waiting
    status, err = run(body)
    assert status == 400 and err["error"]["param"] == "prompt" and "at most 12" in err["error"]["message"]


# ---------------------------------------------------------------- the body's media type
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_declared_json_is_415_and_not_parsed(run, path, content_type):
    async def body(c, app):
        raw = json.dumps({"input_ids": [[1, 2]], "max_new_tokens": 2} if path == "/generate" else
                         {"messages": MSG, "max_tokens": 2} if "chat" in path else greedy()).encode()
        headers = {} if content_type is None else {"Content-Type": content_type}
        r = await c.post(path, data=raw, headers=headers, skip_auto_headers=["Content-Type"])
        ok = await c.post(path, data=raw, headers={"Content-Type": "application/json; charset=utf-8"})
        return r.status, await r.json(), ok.status
    status, err, ok = run(body)
    assert status == 415 and err["error"]["param"] == "Content-Type", err
    assert err["error"]["code"] == "unsupported_media_type" and "application/json" in err["error"]["message"]
    assert ok == 200


# ---------------------------------------------------------------- vLLM's extensions
def test_return_token_ids_gives_the_prompts_and_each_choices_ids(run, booted):
    async def body(c, app):
        comp = await post(c, "/v1/completions", greedy([5, 6, 7], 4, return_token_ids=True, n=2))
        chat = await post(c, "/v1/chat/completions", {"messages": MSG, "max_tokens": 3, "temperature": 0,
                                                      "return_token_ids": True})
        plain = await post(c, "/v1/completions", greedy([5, 6, 7], 4))
        events = await sse(c, "/v1/completions", greedy([5, 6, 7], 4, return_token_ids=True, stream=True))
        tok = app[server.STATE].tokenizer
        return comp[1], chat[1], plain[1], events, tok
    comp, chat, plain, events, tok = run(body)
    for ch in comp["choices"]:
        assert ch["prompt_token_ids"] == [5, 6, 7] and len(ch["token_ids"]) == 4
        assert tok.decode(ch["token_ids"]) == ch["text"]
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    ids = chat["choices"][0]["token_ids"]
    assert len(ids) == chat["usage"]["completion_tokens"] == 3
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    streamed = [t for e in events[:-1] for t in e["choices"][0].get("token_ids", [])]
    assert streamed == comp["choices"][0]["token_ids"]
    assert events[0]["choices"][0]["prompt_token_ids"] == [5, 6, 7]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(run, path):
    req = greedy([5, 6, 7], 5) if "completions" == path[4:] else {"messages": MSG, "max_tokens": 5,
                                                                    "temperature": 0}

    async def body(c, app):
        both = await sse(c, path, req | {"stream": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}})
        alone = await sse(c, path, req | {"stream": True, "stream_options": {"continuous_usage_stats": True}})
        return both, alone
    both, alone = run(body)
    chunks, final = both[:-2], both[-2]
    assert all(e["usage"] is not None for e in chunks), chunks
    done = [e["usage"]["completion_tokens"] for e in chunks]
    assert done == sorted(done) and done[-1] == final["usage"]["completion_tokens"] == 5
    assert all(e["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"] for e in chunks)
    assert all("usage" not in e for e in alone[:-1])  # vLLM's rule: only with include_usage


# ---------------------------------------------------------------- the README's example requests, as written
README = Path(__file__).resolve().parents[1] / "README.md"
README_URL = "http://127.0.0.1:8000"


def readme_examples() -> list[tuple[str, str]]:
    """The code blocks of the README's "Example requests" section: (language, text)."""
    section = README.read_text().split("\n## Example requests\n")[1].split("\n## ")[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


def readme_curls() -> list[list[str]]:
    return [shlex.split(cmd) for lang, text in readme_examples() if lang == "bash"
            for cmd in text.replace("\\\n", " ").splitlines() if cmd.startswith("curl ")]


def test_the_readme_names_no_model_that_its_set_up_does_not_serve():
    assert len(readme_curls()) >= 3
    for lang, text in readme_examples():
        assert not re.search(r"""model["']?\s*[:=]\s*["']qwen""", text), text  # the set-up serves llama


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl command")
def test_the_readmes_curl_examples_work_as_written(run):
    async def body(c, app):
        url, out = str(c.make_url("")).rstrip("/"), []
        for argv in readme_curls():
            proc = await asyncio.create_subprocess_exec(
                *[a.replace(README_URL, url) for a in argv], "-w", "\n%{http_code}",
                stdout=asyncio.subprocess.PIPE)
            text = (await proc.communicate())[0].decode()
            out.append((argv, text.rsplit("\n", 1)))
        return out
    for argv, (text, status) in run(body):
        assert status == "200", (argv, text)
        assert '"choices"' in text or '"data"' in text, text


def test_the_readmes_openai_client_examples_work_as_written(capsys):
    code = [text for lang, text in readme_examples() if lang == "python" and "cat.png" not in text]
    assert code and "client.models.list()" in code[0]
    cfg = validate(ServerConfig(**{**FLAGS, "max_req_total_len": 1024}, served_model_name="served"))
    runner, result = boot_cpu(cfg)  # a tools prompt of the byte-level tokenizer is ~300 tokens

    async def body(c, app):
        ns: dict = {}
        for text in code:
            if "response_format" in text and app[server.STATE].grammars is None:
                continue  # structured output needs xgrammar (test_structured_api)
            text = text.replace(f"{README_URL}/v1", str(c.make_url("/v1")))
            await asyncio.to_thread(exec, compile(text, "README.md", "exec"), ns)
        return ns
    from unit_tests.test_server import serve
    try:
        ns = serve(LLMEngine.from_config(runner, cfg), result, body, cfg)
    finally:
        runner.teardown()
    assert ns["model"] == "served" and ns["r"].choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert capsys.readouterr().out


# ---------------------------------------------------------------- /tokenize, /detokenize, /version
def test_tokenize_detokenize_and_version(run):
    chat = {"messages": MSG, "max_tokens": 1, "temperature": 0, "return_token_ids": True}

    async def body(c, app):
        text = await post(c, "/tokenize", {"prompt": "Hello", "return_token_strs": True})
        msgs = await post(c, "/tokenize", {"model": "served", "messages": MSG})
        served = await post(c, "/v1/chat/completions", chat)
        back = await post(c, "/detokenize", {"tokens": text[1]["tokens"]})
        bad = [await post(c, "/detokenize", {"tokens": [4096]}), await post(c, "/tokenize", {"prompt": 5}),
               await post(c, "/tokenize", {"prompt": "a", "model": "nope"}),
               await post(c, "/tokenize", {"prompt": "a", "max_tokens": 1})]
        version = await (await c.get("/version")).json()
        return text[1], msgs[1], served[1], back, bad, version, app[server.STATE].tokenizer
    text, msgs, served, back, bad, version, tok = run(body)
    assert text == {"count": 5, "max_model_len": 256, "tokens": tok.encode("Hello"),
                    "token_strs": ["H", "e", "l", "l", "o"]}
    assert msgs["tokens"] == served["prompt_token_ids"] and msgs["token_strs"] is None  # the chat's own prompt
    assert back == (200, {"prompt": "Hello"})
    assert [(s, e["error"]["param"]) for s, e in bad] == [(400, "tokens"), (400, "prompt"), (404, "model"),
                                                          (400, "max_tokens")]
    from autoprofile import __version__
    assert version == {"version": __version__}


# ---------------------------------------------------------------- the chat template's fields
def test_add_generation_prompt_and_continue_final_message_shape_the_prompt(run):
    turns = MSG + [{"role": "assistant", "content": "The answer is"}]

    async def body(c, app):
        async def text(req: dict) -> str:
            status, out = await post(c, "/tokenize", req)
            assert status == 200, out
            return (await post(c, "/detokenize", {"tokens": out["tokens"]}))[1]["prompt"]
        default = await text({"messages": MSG})
        bare = await text({"messages": MSG, "add_generation_prompt": False})
        open_ = await text({"messages": turns, "add_generation_prompt": False, "continue_final_message": True})
        closed = await text({"messages": turns, "add_generation_prompt": False})
        both = await post(c, "/v1/chat/completions", {"messages": turns, "continue_final_message": True})
        served = await post(c, "/v1/chat/completions", {
            "messages": turns, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 2,
            "return_token_ids": True})
        return default, bare, open_, closed, both, served, app[server.STATE].tokenizer
    default, bare, open_, closed, (status, err), (ok, served), tok = run(body)
    assert default == bare + "<|assistant|>\n" and not bare.endswith("<|assistant|>\n")
    assert open_.endswith("<|assistant|>\nThe answer is") and closed.startswith(open_) and closed != open_
    assert status == 400 and err["error"]["param"] == "continue_final_message"
    assert ok == 200 and tok.decode(served["prompt_token_ids"]) == open_


THINKING = ("{%- for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content + '\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
            "{%- if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{%- endif %}"
            "{%- endif %}")


def test_chat_template_kwargs_reach_the_template(run):
    from autoprofile.serving.tokenizer import ByteTokenizer, ChatTemplate
    tok = ByteTokenizer(4096, [2])
    tok.chat = ChatTemplate(THINKING)

    async def body(c, app):
        on = await post(c, "/tokenize", {"messages": MSG})
        off = await post(c, "/tokenize", {"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}})
        served = await post(c, "/v1/chat/completions", {
            "messages": MSG, "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 1,
            "return_token_ids": True})
        taken = await post(c, "/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {"messages": []}})
        return on[1], off[1], served, taken
    on, off, (ok, served), (status, err) = run(body, tokenizer=tok)
    assert tok.decode(on["tokens"]) == "<|user|>\nHi\n<|assistant|>\n"
    assert tok.decode(off["tokens"]) == "<|user|>\nHi\n<|assistant|>\n<think></think>"
    assert ok == 200 and served["prompt_token_ids"] == off["tokens"]
    assert status == 400 and err["error"]["param"] == "chat_template_kwargs.messages", err


# ---------------------------------------------------------------- docs/server.md against protocol.FIELDS
def test_the_docs_list_of_fields_not_supported_yet_is_the_codes():
    from autoprofile.serving.protocol import FIELDS, IGNORED, UNSUPPORTED
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "server.md").read_text().split())
    refused = docs.split("Not implemented yet,")[1].split("None is accepted and ignored")[0]
    listed = re.findall(r"`(\w+)`", refused.split(":", 1)[1])
    unsupported = [k for k, f in FIELDS.items() if f.kind == UNSUPPORTED]
    assert listed == unsupported, "edit docs/server.md's 'Not implemented yet' list to match protocol.FIELDS"
    ignored = docs.split("OpenAI fields that change nothing here")[1].split("are accepted")[0]
    assert all(f"`{k}`" in ignored for k, f in FIELDS.items() if f.kind == IGNORED), ignored
    assert "not supported yet\" unless their value" not in docs  # the old list named served fields
