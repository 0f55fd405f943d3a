"""Reasoning models (--reasoning_parser qwen3 / deepseek_r1): the reply's <think>...</think> as
reasoning_content apart from content, whole and streamed, against the real server and engine on a tiny model
whose tokenizer (written here with `tokenizers`) has <think> and </think> in its vocabulary. The replies are
steered with a regex grammar (random weights never think on their own)."""
from __future__ import annotations

import json

import pytest

from autoprofile.config import ConfigError, ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.serving.reasoning import ReasoningStream, split, starts_thinking
from autoprofile.serving.tokenizer import BYTE_CHAT_TEMPLATE, HFTokenizer
from unit_tests.cpu_server import boot_cpu
from unit_tests.test_server import FLAGS, post, serve, sse

pytest.importorskip("xgrammar")

END_OF_TEXT = "<|endoftext|>"
GENERATION = "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
# the byte-level template, its generation prompt Qwen3's: <think>\n\n</think>\n\n when enable_thinking is
# false, an open <think>\n with open_thinking (a thinking-2507-style template)
THINK_TEMPLATE = BYTE_CHAT_TEMPLATE.replace(GENERATION, (
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif open_thinking is defined and open_thinking %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"))
MSG = [{"role": "user", "content": "hi"}]


def write_model(folder) -> None:
    """A model folder: the tiny config at the tokenizer's vocabulary, a byte-level BPE tokenizer.json with
    <think> and </think> as added (non-special) tokens, the template above."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from autoprofile.model_config import load_model_config
    assert GENERATION in BYTE_CHAT_TEMPLATE
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the weather in oslo is sunny, think then answer"] * 20, trainer)
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(folder / "tokenizer.json"))
    cfg = dict(load_model_config("tiny").raw)
    cfg.update(vocab_size=tok.get_vocab_size(), eos_token_id=tok.token_to_id(END_OF_TEXT))
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": END_OF_TEXT,
                                                              "chat_template": THINK_TEMPLATE}))


def think_config(folder, **kw) -> ServerConfig:
    return validate(ServerConfig(**{**FLAGS, "model": str(folder), "load_format": "dummy",
                                    "max_req_total_len": 1024, "batch_max_tokens": 256},
                                 max_waiting_requests=8, served_model_name="tiny", **kw))


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("think_model")
    write_model(folder)
    cfg = think_config(folder)
    runner, result = boot_cpu(cfg)
    yield folder, runner, result
    runner.teardown()


@pytest.fixture
def run(think_model):
    """body(client, app) against a server with --reasoning_parser `parser` (None: none)."""
    folder, runner, result = think_model
    engines = []

    def go(body, parser="qwen3"):
        cfg = think_config(folder, reasoning_parser=parser)
        engines.append(LLMEngine.from_config(runner, cfg))
        return serve(engines[-1], result, body, cfg)
    yield go
    assert all(e.stats.pages_used == 0 and not e.has_unfinished() for e in engines)


def chat(regex: str | None = None, **kw) -> dict:
    grammar = {"structured_outputs": {"regex": regex}} if regex else {}
    return {"messages": MSG, "max_tokens": 40, "temperature": 0, **grammar, **kw}


# ---------------------------------------------------------------- the parsers
@pytest.mark.parametrize("text, thinking, want", [
    ("<think>\nabc\n</think>\n\nhello", False, ("\nabc\n", "\n\nhello")),
    ("hello <think>x</think>", False, (None, "hello <think>x</think>")),  # opens only at the start
    ("<think>cut short", False, ("cut short", None)),
    ("abc</think>hello", True, ("abc", "hello")),  # deepseek_r1: the prompt opened it
    ("<think>abc</think>", True, ("abc", None)),
    ("no end", True, ("no end", None)),
    ("</think>only", True, (None, "only")),
    ("", False, (None, None)),
])
def test_a_reply_splits_into_reasoning_and_content(text, thinking, want):
    assert split(text, thinking) == want


def test_the_prompts_end_says_whether_the_reply_starts_thinking():
    assert starts_thinking("deepseek_r1", "<|assistant|>\n")
    assert starts_thinking("qwen3", "<|assistant|>\n<think>\n")
    assert not starts_thinking("qwen3", "<|assistant|>\n<think>\n\n</think>\n\n")
    assert not starts_thinking("qwen3", "<|user|>\nhi\n<|assistant|>\n")


@pytest.mark.parametrize("text", ["<think>\nabc\n</think>\n\nhello", "<thin", "<think>a</thin", "ab</think>",
                                  "x</think>y</think>z", "<think></think>", "plain text", "<t<think>"])
@pytest.mark.parametrize("thinking", [False, True])
def test_a_streamed_reply_splits_as_the_whole_one_at_every_cut(text, thinking):
    def joined(pieces):
        s, reasoning, content = ReasoningStream(thinking), "", ""
        for p in pieces:
            r, c = s.push(p)
            reasoning, content = reasoning + r, content + c
        r, c = s.finish()
        return reasoning + r or None, content + c or None
    for cut in range(len(text) + 1):
        assert joined([text[:cut], text[cut:]]) == split(text, thinking), cut
    assert joined(list(text)) == split(text, thinking)


def test_the_flag_is_checked_naming_a_value_that_works():
    with pytest.raises(ConfigError) as e:
        validate(ServerConfig(model="tiny", reasoning_parser="qwen"))
    assert e.value.flag == "reasoning_parser" and "--reasoning_parser qwen3" in str(e.value)


# ---------------------------------------------------------------- through the server
def test_qwen3_returns_the_thinking_as_reasoning_content_whole_and_streamed(run):
    regex = "<think>[a-z]{2,4}</think>[a-z]{1,3}"

    async def body(c, app):
        whole = await post(c, "/v1/chat/completions", chat(regex, return_token_ids=True))
        streamed = await sse(c, "/v1/chat/completions", chat(regex, stream=True))
        return whole, streamed, app
    (status, whole), streamed, app = run(body)
    assert status == 200, whole
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"].isalpha() and 2 <= len(message["reasoning_content"]) <= 4, message
    assert message["content"].isalpha() and "<think>" not in message["content"]
    deltas = [ch["choices"][0]["delta"] for ch in streamed[:-1] if ch["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert not any("<think>" in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in deltas)


def test_deepseek_r1_thinks_from_the_first_token_and_max_tokens_counts_the_thinking(run):
    async def body(c, app):
        closed = await post(c, "/v1/chat/completions", chat("[a-z]{2,4}</think>[a-z]{1,3}"))
        cut = await post(c, "/v1/chat/completions", chat(max_tokens=3, return_token_ids=True))
        return closed[1], cut[1]
    closed, cut = run(body, parser="deepseek_r1")
    message = closed["choices"][0]["message"]
    assert message["reasoning_content"].isalpha() and message["content"].isalpha(), message
    # cut by max_tokens while thinking: all of it is reasoning, and the thinking tokens are the output's
    assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 3
    assert len(cut["choices"][0]["token_ids"]) == 3 and cut["choices"][0]["message"]["content"] is None
    assert cut["choices"][0]["message"]["reasoning_content"]


def test_enable_thinking_reaches_the_template_and_an_open_think_in_the_prompt_starts_the_reasoning(run):
    async def body(c, app):
        off = await post(c, "/tokenize", {"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}})
        started = await post(c, "/v1/chat/completions", chat(
            "[a-z]{2,3}</think>[a-z]{2}", chat_template_kwargs={"open_thinking": True}))
        closed = await post(c, "/v1/chat/completions", chat(
            "[a-z]{2,3}", chat_template_kwargs={"enable_thinking": False}))
        text = await post(c, "/detokenize", {"tokens": off[1]["tokens"]})
        return text[1]["prompt"], started[1], closed[1]
    prompt, started, closed = run(body)
    assert prompt.endswith("<|assistant|>\n<think>\n\n</think>\n\n")
    assert started["choices"][0]["message"]["reasoning_content"].isalpha(), started
    assert closed["choices"][0]["message"]["reasoning_content"] is None
    assert closed["choices"][0]["message"]["content"].isalpha()


def test_without_the_flag_the_thinking_stays_content(run):
    async def body(c, app):
        return await post(c, "/v1/chat/completions", chat("<think>[a-z]{2}</think>[a-z]{2}"))
    status, out = run(body, parser=None)
    message = out["choices"][0]["message"]
    assert status == 200 and message["content"].startswith("<think>") and "reasoning_content" not in message
