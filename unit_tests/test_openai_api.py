"""The OpenAI API as agents and eval harnesses use it, through the real `openai` client against the real
server (the tiny model with random weights on the CPU, torch backend, on 127.0.0.1): strict fields (a typo
is a 400 naming it and the nearest field; a field not implemented yet is a 400 unless it asks for nothing),
assistant messages with content null and tool calls, --api_key and --served_model_name."""
from __future__ import annotations

import argparse
import json
import logging

import openai
import pytest

from autoprofile import profile_cache
from autoprofile.config import API_KEY_ENV, ConfigError, add_server_args, config_from_args
from autoprofile.serving import protocol
from autoprofile.serving.tokenizer import ChatTemplate, load_tokenizer
from unit_tests import test_server
from unit_tests.test_server import CFG, MSG, post, serve

booted, engine, run = test_server.booted, test_server.engine, test_server.run  # the server tests' fixtures


def client(c, **kw) -> openai.AsyncOpenAI:
    url = str(c.make_url("/v1"))
    assert url.startswith("http://127.0.0.1:")
    return openai.AsyncOpenAI(base_url=url, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


async def refused(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as e:
        await call
    return e.value


# ---------------------------------------------------------------- strict fields
def test_a_typo_is_a_400_naming_the_field_and_the_nearest_one(run):
    async def body(c, app):
        async with client(c) as oa:
            comp = await refused(oa.completions.create(model="tiny", prompt="Hi",
                                                       extra_body={"maxtokens": 8}))
            chat = await refused(oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=4,
                                                            extra_body={"temprature": 0}))
            opts = await refused(oa.chat.completions.create(
                model="tiny", messages=MSG, max_tokens=4, stream=True,
                extra_body={"stream_options": {"include_usge": True}}))
            other = await refused(oa.completions.create(model="tiny", prompt="Hi", max_tokens=4,
                                                        extra_body={"max_completion_tokens": 4}))
        gen = await post(c, "/generate", {"input_ids": [[5, 6]], "max_new_token": 4})
        far = await post(c, "/v1/completions", {"prompt": "Hi", "zzzzqqq": 1})
        return comp, chat, opts, other, gen, far
    comp, chat, opts, other, (gen_status, gen), (far_status, far) = run(body)
    assert isinstance(comp, openai.BadRequestError) and comp.param == "maxtokens"
    assert "unknown field 'maxtokens'; did you mean 'max_tokens'?" in comp.message
    assert comp.code == "unknown_parameter"
    assert isinstance(chat, openai.BadRequestError) and chat.param == "temprature"
    assert "did you mean 'temperature'?" in chat.message
    assert opts.status_code == 400 and opts.param == "stream_options.include_usge"
    assert "did you mean 'stream_options.include_usage'?" in opts.message
    assert other.status_code == 400 and other.param == "max_completion_tokens"
    assert "a field of /v1/chat/completions" in other.message
    assert "did you mean 'max_tokens'?" in other.message
    assert gen_status == 400 and gen["error"]["param"] == "max_new_token"
    assert "did you mean 'max_new_tokens'?" in gen["error"]["message"]
    assert far_status == 400 and far["error"]["param"] == "zzzzqqq"
    assert "did you mean" not in far["error"]["message"]
    assert "max_tokens" in far["error"]["message"]  # the fields it serves are listed instead


# (endpoint, field, a value that asks for something the server does not do yet)
NOT_YET = [
    ("completions", "suffix", "end"),
    ("chat", "functions", [{"name": "f"}]),
    ("chat", "reasoning_effort", "low"),
]


def test_each_field_not_implemented_yet_is_a_400_naming_it(run):
    async def body(c, app):
        out = []
        async with client(c) as oa:
            for endpoint, name, value in NOT_YET:
                if endpoint == "chat":
                    call = oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=4,
                                                      extra_body={name: value})
                else:
                    call = oa.completions.create(model="tiny", prompt="Hi", max_tokens=4,
                                                 extra_body={name: value})
                out.append(await refused(call))
        return out
    for (endpoint, name, _), err in zip(NOT_YET, run(body), strict=True):
        assert isinstance(err, openai.BadRequestError), (endpoint, name, err)
        assert err.param == name and err.code == "unsupported_parameter", (endpoint, name, err.body)
        assert f"'{name}' is not supported yet" in err.message


def asks(noop):
    """A value other than noop: one that asks for something."""
    if isinstance(noop, bool):
        return not noop
    if isinstance(noop, (int, float)):
        return noop + 1
    return "x" if isinstance(noop, str) else ["x"] if isinstance(noop, list) else {"x": 1}


def test_every_refused_field_of_the_table_is_refused_and_its_noop_accepted(run):
    fields = {k: f for k, f in protocol.FIELDS.items() if f.kind == protocol.UNSUPPORTED}
    assert {name for _, name, _ in NOT_YET} <= fields.keys()

    async def body(c, app):
        out = []
        for name, f in fields.items():
            path, base = (("/v1/chat/completions", {"messages": MSG, "max_tokens": 2})
                          if protocol.CHAT in f.endpoints else
                          ("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
                          if protocol.COMPLETIONS in f.endpoints else
                          ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}))
            out.append((name, await post(c, path, {**base, name: asks(f.noop)}),
                        await post(c, path, {**base, name: f.noop}),
                        await post(c, path, {**base, name: None})))
        return out
    for name, (s1, refused_body), (s2, noop), (s3, null) in run(body):
        assert s1 == 400 and refused_body["error"]["param"] == name, (name, refused_body)
        assert s2 == 200 and s3 == 200, (name, noop, null)


def test_each_choice_gets_its_seed_and_only_the_first_the_prompts_logprobs():
    """GenerateArgs.to_sampling_params: choice i draws from seed + i, best_of > n ranks by logprobs it
    did not ask for, echo's prompt logprobs go to the first choice, the processors' fields pass through."""
    args = protocol.GenerateArgs(prompt_ids=[1, 2], max_tokens=4, temperature=0.7, top_p=0.9, top_k=5, seed=5,
                                 n=1, best_of=3, echo=True, presence_penalty=0.5, logit_bias=((3, 1.0),),
                                 min_p=0.1, min_tokens=2)
    first, third = args.to_sampling_params(0), args.to_sampling_params(2)
    assert (first.seed, third.seed) == (5, 7)
    assert first.logprobs == third.logprobs == 0 and first.prompt_logprobs is None
    assert (first.temperature, first.top_p, first.top_k, first.presence_penalty, first.logit_bias,
            first.min_p, first.min_tokens) == (0.7, 0.9, 5, 0.5, ((3, 1.0),), 0.1, 2)
    asked = protocol.GenerateArgs(prompt_ids=[1], max_tokens=1, logprobs=2, echo=True, n=2, best_of=2)
    assert [(p.seed, p.logprobs, p.prompt_logprobs) for p in map(asked.to_sampling_params, (0, 1))] == \
        [(None, 2, 2), (None, 2, None)]
    assert protocol.GenerateArgs(prompt_ids=[1], max_tokens=1).to_sampling_params().logprobs is None


def test_no_op_values_and_openais_bookkeeping_fields_are_accepted(run):
    async def body(c, app):
        async with client(c) as oa:
            plain = await oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0)
            noted = await oa.chat.completions.create(
                model="tiny", messages=MSG, max_tokens=6, temperature=0, user="eval-7",
                metadata={"run": "a"}, store=False, service_tier="auto", n=1, logprobs=False,
                presence_penalty=0, frequency_penalty=0.0, tool_choice="none",
                response_format={"type": "text"},
                extra_body={"repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": []})
            comp = await oa.completions.create(model="tiny", prompt="Hi", max_tokens=4, user="u", echo=False,
                                               logprobs=None, best_of=1)
        return plain, noted, comp
    plain, noted, comp = run(body)
    assert noted.choices[0].message.content == plain.choices[0].message.content  # greedy: nothing changed
    assert noted.usage == plain.usage and comp.usage.completion_tokens == 4


# ---------------------------------------------------------------- assistant content null, tool messages
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
TOOL_TURNS = [MSG[0], {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
# a template that renders tool calls (as tool-use templates do: arguments as an object) and tool results
TOOL_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
                 "{% for c in m.tool_calls or [] %}"
                 "<call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
                 "</call>{% endfor %}\n{% endfor %}<|assistant|>\n")
CONTENT_ONLY_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                         "<|assistant|>\n")
# a template that drops tool messages
NO_TOOL_TEMPLATE = ("{% for m in messages %}{% if m.role != 'tool' %}<|{{ m.role }}|>\n{{ m.content }}"
                    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>{% endfor %}\n"
                    "{% endif %}{% endfor %}<|assistant|>\n")


def tokenizer_with(template: str):
    tok = load_tokenizer(CFG)
    tok.chat = ChatTemplate(template)
    return tok


def chat_status(engine, booted, messages, tokenizer=None):
    async def body(c, app):
        return await post(c, "/v1/chat/completions",
                          {"messages": messages, "max_tokens": 2, "temperature": 0})
    return serve(engine, booted[1], body, tokenizer=tokenizer)


def test_an_assistant_message_with_content_null_is_empty_text(engine, booted):
    history = [MSG[0], {"role": "assistant", "content": None}, {"role": "user", "content": "and?"}]
    status, out = chat_status(engine, booted, history)
    tok = load_tokenizer(CFG)
    empty = tok.apply_chat_template([{**m, "content": m["content"] or ""} for m in history])
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] == len(tok.encode(empty, add_special_tokens=False))
    status, out = chat_status(engine, booted, [{"role": "user", "content": None}])
    assert status == 400 and out["error"]["param"] == "messages[0].content"


def test_tool_calls_and_tool_messages_where_the_template_renders_them(engine, booted):
    tok = tokenizer_with(TOOL_TEMPLATE)
    status, out = chat_status(engine, booted, TOOL_TURNS, tok)
    assert status == 200, out
    parsed = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    prompt = tok.apply_chat_template([TOOL_TURNS[0], {"role": "assistant", "content": "",
                                                      "tool_calls": [parsed]}, TOOL_TURNS[2]])
    assert '<call>get_weather {"city": "Oslo"}</call>' in prompt and "sunny, 21 C" in prompt
    assert out["usage"]["prompt_tokens"] == len(tok.encode(prompt, add_special_tokens=False))


def test_tool_calls_or_tool_messages_a_template_drops_are_a_400_naming_the_message(engine, booted):
    # a template that writes each message's content only: the call would vanish from the prompt
    status, out = chat_status(engine, booted, TOOL_TURNS, tokenizer_with(CONTENT_ONLY_TEMPLATE))
    assert status == 400 and out["error"]["param"] == "messages[1].tool_calls", out
    assert "does not render" in out["error"]["message"]
    status, out = chat_status(engine, booted, TOOL_TURNS, tokenizer_with(NO_TOOL_TEMPLATE))
    assert status == 400 and out["error"]["param"] == "messages[2]", out
    bad_args = [MSG[0], {"role": "assistant", "content": None,
                         "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{not json"}}]}]
    status, out = chat_status(engine, booted, bad_args, tokenizer_with(TOOL_TEMPLATE))
    assert status == 400 and out["error"]["param"] == "messages[1].tool_calls[0].function.arguments", out
    status, out = chat_status(engine, booted, [{"role": "user", "content": "hi", "tool_calls": [CALL]}])
    assert status == 400 and out["error"]["param"] == "messages[0].tool_calls", out


NAME_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}|>\n"
                 "{{ m.content }}\n{% endfor %}<|assistant|>\n")


def test_a_messages_own_fields_are_strict_and_its_name_reaches_the_template(engine, booted):
    typo = [*TOOL_TURNS[:2], {"role": "tool", "tool_call_ids": "call_1", "content": "sunny"}]
    status, out = chat_status(engine, booted, typo, tokenizer_with(TOOL_TEMPLATE))
    assert status == 400 and out["error"]["param"] == "messages[2].tool_call_ids", out
    assert "did you mean 'messages[2].tool_call_id'?" in out["error"]["message"]
    refusal = [MSG[0], {"role": "assistant", "content": None, "refusal": "I can't"}, MSG[0]]
    status, out = chat_status(engine, booted, refusal)
    assert status == 400 and out["error"]["param"] == "messages[1].refusal", out
    assert chat_status(engine, booted, [MSG[0], {**refusal[1], "refusal": None}, MSG[0]])[0] == 200
    tok = tokenizer_with(NAME_TEMPLATE)
    named = [{"role": "user", "name": "alice", "content": "hi"}]
    status, out = chat_status(engine, booted, named, tok)
    prompt = tok.apply_chat_template(named)
    assert status == 200 and "<|user:alice|>" in prompt
    assert out["usage"]["prompt_tokens"] == len(tok.encode(prompt, add_special_tokens=False))


def test_special_token_text_outside_message_content_is_a_400(engine, booted):
    tok = tokenizer_with(TOOL_TEMPLATE)
    tok.special_texts = ("<|im_end|>",)
    status, out = chat_status(engine, booted, [{**MSG[0], "name": "a<|im_end|>"}], tok)
    assert status == 400 and out["error"]["param"] == "messages[0].name", out
    call = {**CALL, "function": {"name": "f", "arguments": '{"q": "<|im_end|>"}'}}
    status, out = chat_status(engine, booted, [MSG[0], {"role": "assistant", "content": None,
                                                        "tool_calls": [call]}], tok)
    assert status == 400 and out["error"]["param"] == "messages[1].tool_calls", out
    assert out["error"]["code"] == "special_token_in_content"
    assert chat_status(engine, booted, TOOL_TURNS, tok)[0] == 200


# ---------------------------------------------------------------- --api_key, --served_model_name
KEY = "sk-test-0123456789abcdef"


def test_an_api_key_guards_the_api_but_not_health_or_metrics(engine, booted, caplog):
    caplog.set_level(logging.DEBUG)
    cfg = CFG.replace(api_key=KEY)
    comp_body = {"prompt": "Hi", "max_tokens": 2}

    async def body(c, app):
        async with client(c, api_key="sk-wrong") as oa:
            wrong = await refused(oa.completions.create(model="tiny", prompt="Hi", max_tokens=2))
        async with client(c, api_key=KEY) as oa:
            models = await oa.models.list()
            comp = await oa.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        bearer = {"Authorization": f"Bearer {KEY}"}
        out = {
            "none": await c.post("/v1/completions", json=comp_body),
            "prefix": await c.post("/v1/completions", json=comp_body,
                                   headers={"Authorization": f"Bearer {KEY[:-1]}"}),
            "basic": await c.post("/v1/completions", json=comp_body,
                                  headers={"Authorization": f"Basic {KEY}"}),
            "models": await c.get("/v1/models"),
            "generate": await c.post("/generate", json={"input_ids": [[5, 6]], "max_new_tokens": 2}),
            "generate+key": await c.post("/generate", json={"input_ids": [[5, 6]], "max_new_tokens": 2},
                                         headers=bearer),
            "health": await c.get("/health"), "metrics": await c.get("/metrics")}
        return wrong, models, comp, {k: (r.status, r.headers, await r.text()) for k, r in out.items()}
    wrong, models, comp, out = serve(engine, booted[1], body, cfg=cfg)
    assert isinstance(wrong, openai.AuthenticationError) and wrong.code == "invalid_api_key"
    assert [m.id for m in models.data] == ["tiny"] and comp.usage.completion_tokens == 2
    for name in ("none", "prefix", "basic", "models", "generate"):
        status, headers, text = out[name]
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer", (name, status, text)
        assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
        assert KEY not in text
    assert [out[k][0] for k in ("generate+key", "health", "metrics")] == [200, 200, 200]
    assert KEY not in caplog.text and KEY not in repr(cfg)


def test_the_api_key_comes_from_the_flag_or_the_environment_and_must_be_sendable(monkeypatch):
    def parsed(*argv):
        p = argparse.ArgumentParser()
        add_server_args(p)
        return config_from_args(p.parse_args(["--model", "tiny", "--report_dir", "", *argv]), serving=False)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert parsed().api_key is None
    assert parsed("--api-key", KEY).api_key == KEY  # vLLM's spelling
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert parsed().api_key == KEY and parsed("--api_key", "sk-flag").api_key == "sk-flag"
    assert profile_cache.key(parsed(), CFG.model_config, {}, 0, 1) == \
        profile_cache.key(parsed().replace(api_key=None), CFG.model_config, {}, 0, 1)
    for bad_key in ("sk two words", "", "sk-\u00e9"):
        with pytest.raises(ConfigError) as e:
            parsed("--api_key", bad_key)
        assert e.value.flag == "api_key" and (not bad_key or bad_key not in str(e.value))
    with pytest.raises(ConfigError) as e:
        parsed("--served_model_name", " ")
    assert e.value.flag == "served_model_name"


def test_a_served_model_name_is_listed_and_usable_and_another_name_is_404(engine, booted):
    cfg = CFG.replace(served_model_name="team/llm-v2")

    async def body(c, app):
        async with client(c) as oa:
            models = await oa.models.list()
            named = await oa.completions.create(model="team/llm-v2", prompt="Hi", max_tokens=3, temperature=0)
            folder = await oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=3)
            other = await refused(oa.completions.create(model="gpt-4o", prompt="Hi", max_tokens=3))
        return models, named, folder, other
    models, named, folder, other = serve(engine, booted[1], body, cfg=cfg)
    assert [m.id for m in models.data] == ["team/llm-v2"]
    assert named.model == folder.model == "team/llm-v2" and named.usage.completion_tokens == 3
    assert isinstance(other, openai.NotFoundError) and other.code == "model_not_found"
    assert other.param == "model" and "'team/llm-v2'" in other.message
