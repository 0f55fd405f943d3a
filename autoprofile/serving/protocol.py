"""The OpenAI wire format's requests: validation (every client mistake is an APIError naming the field) into
GenerateArgs, and its sampling parameters (serving.bodies builds the responses).

Above the house's 500 lines on purpose: every endpoint's parser reads the one table of fields (FIELDS) through
the same checks (_get, check_fields, show), so that a field is served, ignored or refused in one place."""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import reprlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from autoprofile.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from autoprofile.serving.errors import APIError, bad
from autoprofile.serving.structured import parse_structured
from autoprofile.serving.tools import parse_tools, refuse_unrendered_tool_defs

INT64 = 1 << 63
MAX_STOP = 16  # stop strings per request
MAX_N = 128  # choices (n, best_of) per request
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Body bytes: the longest token list a valid request carries, each id with ", ", times a margin (whitespace,
# pretty-printing, a text prompt's JSON escapes), plus room for every other field.
BODY_MARGIN = 4
BODY_OVERHEAD = 1 << 20
# /generate: per id a comma, a newline and a pretty-printer's indentation; per prompt its brackets and indent
ID_SEPARATOR = 16
PROMPT_ALLOWANCE = 64
_DEEP = re.compile(rb"(?:[\[{]\s*){64}")
_KEY_BEFORE = re.compile(rb'"((?:[^"\\]|\\.){1,64})"\s*:\s*$')


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _short_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxdict, r.maxstring, r.maxother = 3, 8, 4, 60, 60
    return r


_SHOW = _short_repr()


def show(value) -> str:
    """A short repr for an error message, bounded in depth and length whatever the value's size."""
    return _SHOW.repr(value)


def _get(body: dict, key: str, default, ok: Callable[[object], bool], rule: str):
    """body[key] (null -> default) if ok(value), else a 400 naming key."""
    value = body.get(key)
    if value is None:
        return default
    if not ok(value):
        raise bad(key, f"'{key}' {rule}, got {show(value)}")
    return value


def text(value: str, param: str) -> str:
    """value if it is encodable Unicode; a lone surrogate ("\\ud800" in JSON) is a 400 naming param."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(param, f"'{param}' holds a lone surrogate {show(value[e.start:e.end])} at character "
                  f"{e.start}: send valid Unicode text (a surrogate pair, or the character itself)") from None
    return value


def max_body_bytes(context_len: int, vocab_size: int) -> int:
    """The OpenAI endpoints' body bound: one token list of context_len ids with ", ", times BODY_MARGIN
    (room for whitespace and for a text prompt's escapes), plus BODY_OVERHEAD for every other field."""
    per_id = len(str(vocab_size - 1)) + 2
    return context_len * per_id * BODY_MARGIN + BODY_OVERHEAD


def id_width(vocab_size: int) -> int:
    """The widest JSON spelling of a valid id: its digits ("-0" spells 0)."""
    return max(len(str(vocab_size - 1)), 2)


def generate_body_bytes(context_len: int, vocab_size: int, prompts: int) -> int:
    """/generate's body bound: the most prompts it admits at once, each of the longest prompt (context_len - 1
    ids: one token is left to generate) at the widest spelling with separators, plus BODY_OVERHEAD."""
    per_prompt = (context_len - 1) * (id_width(vocab_size) + ID_SEPARATOR) + PROMPT_ALLOWANCE
    return prompts * per_prompt + BODY_OVERHEAD


def decode_json(raw: bytes | bytearray):
    """The parsed body, or a 400: not JSON, not UTF-8, or nested deeper than the parser goes (naming the
    key that holds the nesting when one does)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise bad(_deep_key(raw), "the body nests arrays or objects deeper than the JSON parser allows "
                  "(a prompt is a string or a flat list of token ids)", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(None, f"the body is not valid JSON: {e}", code="invalid_json") from None


def _deep_key(raw: bytes | bytearray) -> str | None:
    deep = _DEEP.search(raw)
    key = deep and _KEY_BEFORE.search(raw[max(deep.start() - 200, 0):deep.start()])
    return key.group(1).decode("utf-8", "replace") if key else None


# ---------------------------------------------------------------- the fields each endpoint knows
# One table for every body field: SERVED (the server reads it), IGNORED (OpenAI's, changes nothing here:
# accepted and dropped), UNSUPPORTED (not implemented yet: a 400 naming it unless its value is `noop`, the
# value that changes nothing). Implementing a field flips its kind here to SERVED.
SERVED, IGNORED, UNSUPPORTED = "served", "ignored", "unsupported"
COMPLETIONS, CHAT, GENERATE = "/v1/completions", "/v1/chat/completions", "/generate"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"  # vLLM's
RESPONSES = "/v1/responses"  # serving.responses: its body becomes a chat request
OPENAI = (COMPLETIONS, CHAT)


@dataclass(frozen=True)
class Field:
    kind: str
    endpoints: tuple[str, ...] = OPENAI
    noop: object = None  # UNSUPPORTED: the value (besides null) that asks for nothing


def _served(*endpoints: str) -> Field:
    return Field(SERVED, endpoints or OPENAI)


def _refused(noop=None, *endpoints: str) -> Field:
    return Field(UNSUPPORTED, endpoints or OPENAI, noop)


SAMPLING = (COMPLETIONS, CHAT, GENERATE)
FIELDS: dict[str, Field] = {
    "model": _served(COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE, RESPONSES),
    "prompt": _served(COMPLETIONS, TOKENIZE),
    "messages": _served(CHAT, TOKENIZE), "add_special_tokens": _served(TOKENIZE),
    "return_token_strs": _served(TOKENIZE), "tokens": _served(DETOKENIZE),
    "max_tokens": _served(), "max_completion_tokens": _served(CHAT), "stop": _served(),
    "stream": _served(COMPLETIONS, CHAT, RESPONSES), "stream_options": _served(COMPLETIONS, CHAT, RESPONSES),
    "ignore_eos": _served(),
    **{k: _served(*SAMPLING, RESPONSES) for k in ("temperature", "top_p")},
    **{k: _served(*SAMPLING) for k in ("top_k", "seed")},
    "input_ids": _served(GENERATE), "max_new_tokens": _served(GENERATE),
    **{k: Field(IGNORED, (*OPENAI, RESPONSES)) for k in ("user", "metadata", "service_tier",
                                                         "prompt_cache_key", "safety_identifier")},
    "store": _served(COMPLETIONS, CHAT, RESPONSES),  # Responses: kept for previous_response_id; else no-op
    **{k: _served(*SAMPLING) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                                       "logit_bias", "min_p")},
    "min_tokens": _served(), "stop_token_ids": _served(),
    "n": _served(), "best_of": _served(COMPLETIONS), "logprobs": _served(), "top_logprobs": _served(CHAT),
    "echo": _served(COMPLETIONS),
    "suffix": _refused(""),
    **{k: _served(CHAT, RESPONSES) for k in ("tools", "tool_choice", "parallel_tool_calls")},
    "functions": _refused([], CHAT), "function_call": _refused("none", CHAT),
    "response_format": _served(), "structured_outputs": _served(),  # structured output (serving.structured)
    "modalities": _refused(["text"], CHAT),
    **{k: _refused(None, CHAT) for k in ("audio", "reasoning_effort", "web_search_options", "prediction",
                                         "verbosity")},
    # vLLM's extras
    "use_beam_search": _refused(False), "length_penalty": _refused(1),
    "include_stop_str_in_output": _refused(False), "skip_special_tokens": _refused(True),
    "bad_words": _refused([]), "return_token_ids": _served(),
    "prompt_logprobs": _served(), "allowed_token_ids": _served(),
    **{k: _served() for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")},
    **{k: _served(CHAT, TOKENIZE) for k in ("add_generation_prompt", "continue_final_message",
                                            "chat_template_kwargs")},
    "chat_template": _refused(None, CHAT),
    # the Responses API (serving.responses)
    **{k: _served(RESPONSES) for k in ("input", "instructions", "max_output_tokens", "text",
                                        "previous_response_id")},
    **{k: Field(IGNORED, (RESPONSES,)) for k in ("include", "prompt_cache_retention")},
    "background": _refused(False, RESPONSES), "truncation": _refused("disabled", RESPONSES),
    **{k: _refused(None, RESPONSES) for k in ("conversation", "reasoning", "max_tool_calls")},
}
STREAM_OPTIONS: dict[str, Field] = {"include_usage": _served(),
                                    "include_obfuscation": Field(IGNORED, (*OPENAI, RESPONSES)),
                                    "continuous_usage_stats": _served()}
# a chat message's own fields (name, tool_calls and tool_call_id go to the chat template)
MESSAGE_FIELDS: dict[str, Field] = {
    **{k: _served() for k in ("role", "content", "name", "tool_calls", "tool_call_id")},
    **{k: _refused() for k in ("refusal", "audio", "function_call")}}


def _same(value, noop) -> bool:
    """value asks for nothing: null, or noop itself (a number equal to a numeric noop; true/false exactly)."""
    if value is None:
        return True
    if isinstance(noop, bool) or isinstance(value, bool):
        return value is noop
    if _is_num(noop):
        return _is_num(value) and value == noop
    return value == noop


def check_fields(body: dict, endpoint: str, table: dict[str, Field] = FIELDS, where: str = "") -> None:
    """A 400 for the first field of body that endpoint does not know (naming the nearest known field), or
    that it does not implement yet with a value other than its no-op."""
    known = [k for k, f in table.items() if endpoint in f.endpoints]
    for key, value in body.items():
        name = f"{where}{key:.64}"
        if key not in known:
            raise bad(name, _unknown(str(key), table, endpoint, where), code="unknown_parameter")
        f = table[key]
        if f.kind == UNSUPPORTED and not _same(value, f.noop):
            shown = "" if f.noop is None else f" or {json.dumps(f.noop)}"
            raise bad(name, f"'{name}' is not supported yet by this server: leave it out (or send "
                      f"null{shown}), got {show(value)}", code="unsupported_parameter")


def _unknown(key: str, table: dict[str, Field], endpoint: str, where: str) -> str:
    known = [k for k, f in table.items() if endpoint in f.endpoints]
    msg = f"unknown field '{where}{key:.64}'"
    other = next((e for e in (COMPLETIONS, CHAT) if not where and e != endpoint and key in FIELDS
                  and e in FIELDS[key].endpoints), None)
    if other:
        msg += f" for {endpoint} (a field of {other})"
    close = _nearest(key, [k for k in known if table[k].kind != UNSUPPORTED]) or _nearest(key, known)
    if close:
        return f"{msg}; did you mean '{where}{close[0]}'?"
    if other:
        return msg
    served = sorted(k for k in known if table[k].kind == SERVED)
    return f"{msg} for {endpoint}; the fields it serves are {', '.join(served)}"


def _nearest(key: str, candidates: list[str]) -> list[str]:
    """difflib's closest candidate; a tie goes to the longer shared prefix (max_completion_tokens: max_tokens,
    not min_tokens)."""
    close = difflib.get_close_matches(key, candidates, n=5)
    ratio = lambda c: difflib.SequenceMatcher(None, key, c).ratio()  # noqa: E731
    prefix = lambda c: len(os.path.commonprefix([key, c]))  # noqa: E731
    return sorted(close, key=lambda c: (-ratio(c), -prefix(c)))[:1]


@dataclass(frozen=True)
class Limits:
    """What the served engine accepts; given by the server."""

    model_names: tuple[str, ...]  # the first is the served name
    context_len: int
    vocab_size: int
    max_images: int = 0  # images per request (--max_images_per_request); 0: the model takes no images


@dataclass
class GenerateArgs:
    """One engine request: what a validated body asks for."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    chat: bool = False
    model: str = ""
    prompt_param: str = "prompt"
    extra: dict = field(default_factory=dict)
    # a chat request with images: its ids, max_tokens and engine images are made once the images are loaded
    images: list = field(default_factory=list)  # serving.images.ImagePart, in order
    rendered: object = None  # serving.tokenizer.RenderedChat: the template's text, an IMAGE_MARK per image
    max_tokens_body: dict | None = None  # {key: value} of the request's max_tokens / max_completion_tokens
    mm: object = None  # engine.multimodal.MultiModalInput
    logprobs: int | None = None  # top logprobs of each output token (None: no logprobs)
    echo: bool = False  # completions: the prompt (and with logprobs, its tokens' logprobs) before the text
    prompt_text: str | None = None  # completions: the prompt as the client sent it (None: token ids)
    n: int = 1  # choices returned
    best_of: int = 1  # choices generated (the n with the highest cumulative logprob are returned)
    echo_only: bool = False  # max_tokens 0 with echo: one token is generated and dropped
    structured: object = None  # serving.structured.Spec: the grammar the output follows
    tools: object = None  # serving.tools.Tools: the tools the reply may call (chat)
    # logits processors (engine.logits_process); min_tokens <= max_tokens is the engine's check
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # end the request (finish_reason "stop"), not in the text
    others: list[GenerateArgs] = field(default_factory=list)  # completions: the other prompts of the body
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage in every chunk
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the response
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: the sampled tokens are among these (engine.grammar)
    thinking: bool | None = None  # --reasoning_parser: the reply begins inside <think> (None: no parser)
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs, their top-k (None: none)

    def to_sampling_params(self, index: int = 0) -> SamplingParams:
        """Choice `index`'s parameters (serving.choices): its own seed stream (seed + index); the sampled
        tokens' logprobs when asked, or for best_of's ranking; the prompt's logprobs (echo, prompt_logprobs:
        the larger top-k of the two) on the first choice only; the logits processors' fields."""
        seed = None if self.seed is None else self.seed + index
        k = self.logprobs
        asked = [p for p in (k if self.echo else None, self.prompt_logprobs) if p is not None]
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=seed,
                              logprobs=0 if k is None and self.best_of > self.n else k,
                              prompt_logprobs=max(asked) if asked and index == 0 else None,
                              presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
                              min_p=self.min_p, min_tokens=self.min_tokens)


# ---------------------------------------------------------------- request bodies
def _common(body: object, limits: Limits, endpoint: str) -> dict:
    if not isinstance(body, dict):
        raise bad(None, "the body must be a JSON object", code="invalid_json")
    check_fields(body, endpoint)
    check_model(body, limits)
    stream = _get(body, "stream", False, lambda v: isinstance(v, bool), "must be true or false")
    opts = _get(body, "stream_options", {}, lambda v: isinstance(v, dict), "must be an object")
    if opts and not stream:
        raise bad("stream_options", "'stream_options' is only allowed with stream: true")
    check_fields(opts, endpoint, STREAM_OPTIONS, "stream_options.")
    include_usage = _get(opts, "include_usage", False, lambda v: isinstance(v, bool), "must be true or false")
    continuous = _get(opts, "continuous_usage_stats", False, lambda v: isinstance(v, bool),
                      "must be true or false")
    stop = _get(body, "stop", [], lambda v: isinstance(v, (str, list)),
                "must be a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", f"'stop' must hold at most {MAX_STOP} non-empty strings, got {show(stop)}")
    stop = [text(s, "stop") for s in stop]
    seed = _get(body, "seed", None, lambda v: _is_int(v) and -INT64 <= v < INT64, "must be a 64-bit integer")
    n, best_of = choices(body, stream)
    return dict(
        n=n, best_of=best_of,
        temperature=float(_get(body, "temperature", 1.0, lambda v: _is_num(v) and v >= 0,
                               "must be a number >= 0 (0 = greedy)")),
        top_p=float(_get(body, "top_p", 1.0, lambda v: _is_num(v) and 0 < v <= 1,
                         "must be a number in (0, 1]")),
        top_k=max(_get(body, "top_k", 0, lambda v: _is_int(v) and v >= -1,
                       "must be an integer >= -1 (-1 or 0 = off)"), 0),
        seed=seed, stop=tuple(stop), stream=stream, include_usage=include_usage,
        continuous_usage=include_usage and continuous,  # vLLM's: only with include_usage
        return_token_ids=_get(body, "return_token_ids", False, lambda v: isinstance(v, bool),
                              "must be true or false"),
        ignore_eos=_get(body, "ignore_eos", False, lambda v: isinstance(v, bool), "must be true or false"),
        prompt_logprobs=prompt_logprobs(body), model=limits.model_names[0], **processors(body, limits),
        **stop_controls(body, limits),
    )


def check_model(body: dict, limits: Limits) -> None:
    """A request's `model`, if given, must be a name the server answers to (else a 404)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"'model' must be a string, got {show(model)}")
    if model is not None and model not in limits.model_names:
        raise APIError(404, f"the model '{model:.200}' does not exist; this server serves "
                            f"'{limits.model_names[0]}' "
                       "(GET /v1/models)", param="model", code="model_not_found")


def chat_options(body: dict):
    """vLLM's chat-template fields: add_generation_prompt (default true), continue_final_message (the last
    message left open; needs add_generation_prompt false), chat_template_kwargs (extra template variables)."""
    from autoprofile.serving.tokenizer import RESERVED, ChatOptions
    flag = lambda v: isinstance(v, bool)  # noqa: E731
    add = _get(body, "add_generation_prompt", True, flag, "must be true or false")
    cont = _get(body, "continue_final_message", False, flag, "must be true or false")
    if add and cont:
        raise bad("continue_final_message", "'continue_final_message' leaves the last message open, "
                  "'add_generation_prompt' starts a new one: send add_generation_prompt: false with it")
    kwargs = _get(body, "chat_template_kwargs", {}, lambda v: isinstance(v, dict),
                  "must be an object of template variables")
    taken = next((k for k in kwargs if k in RESERVED), None)
    if taken is not None:
        raise bad(f"chat_template_kwargs.{taken}", f"'chat_template_kwargs.{taken}' is set by the server "
                  f"(its own variables are {', '.join(RESERVED)}): use the request field instead")
    return ChatOptions(add, cont, tuple(kwargs.items()))


def parse_tokenize(body: object, limits: Limits, tokenizer) -> tuple[list[int], bool]:
    """POST /tokenize (vLLM's): a prompt (add_special_tokens default true) or chat messages rendered with the
    template (default false) -> (ids, return_token_strs)."""
    from autoprofile.serving.tokenizer import ChatTemplateError
    if not isinstance(body, dict):
        raise bad(None, "the body must be a JSON object", code="invalid_json")
    check_fields(body, TOKENIZE)
    check_model(body, limits)
    strs = _get(body, "return_token_strs", False, lambda v: isinstance(v, bool), "must be true or false")
    chat = body.get("messages") is not None
    special = _get(body, "add_special_tokens", not chat, lambda v: isinstance(v, bool), "must be true or false")
    if not chat:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad("prompt", f"'prompt' (or 'messages') must be a string, got {show(prompt)}")
        return tokenizer.encode(text(prompt, "prompt"), add_special_tokens=special), strs
    messages = body["messages"]
    if not (isinstance(messages, list) and messages):
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    turns = [_message(i, m, dataclasses.replace(limits, max_images=0), []) for i, m in enumerate(messages)]
    try:
        rendered = tokenizer.render_chat(turns, options=chat_options(body))
    except ChatTemplateError as e:
        raise bad("messages", str(e)) from None
    if special:
        return tokenizer.encode(rendered.text, add_special_tokens=True), strs
    return tokenizer.encode(rendered.text, add_special_tokens=False, plain=rendered.client or ()), strs


MAX_PROFILE_STEPS = 100_000


def parse_start_profile(raw: bytes | bytearray) -> int | None:
    """POST /start_profile's body (the server's --profile_dir): empty, {} or {"num_steps": N}, 1 <= N <=
    MAX_PROFILE_STEPS (None: until POST /stop_profile)."""
    try:
        body = decode_json(raw) if raw.strip() else {}
    except APIError as e:  # what to send instead, beside the parser's reason
        e.message += "; send {} or {\"num_steps\": 50}"
        raise
    if not isinstance(body, dict) or set(body) - {"num_steps"}:
        raise bad(None, "the body takes one field, 'num_steps', e.g. {\"num_steps\": 50}")
    return _get(body, "num_steps", None, lambda n: _is_int(n) and 1 <= n <= MAX_PROFILE_STEPS,
                f"must be an integer in [1, {MAX_PROFILE_STEPS}] (or absent: until POST /stop_profile)")


def parse_detokenize(body: object, limits: Limits) -> list[int]:
    """POST /detokenize (vLLM's): token ids -> their text."""
    if not isinstance(body, dict):
        raise bad(None, "the body must be a JSON object", code="invalid_json")
    check_fields(body, DETOKENIZE)
    check_model(body, limits)
    tokens = body.get("tokens")
    if not (isinstance(tokens, list) and all(_is_int(t) and 0 <= t < limits.vocab_size for t in tokens)):
        raise bad("tokens", f"'tokens' must be a list of token ids in [0, {limits.vocab_size}), got "
                  f"{show(tokens)}")
    return tokens


def choices(body: dict, stream: bool) -> tuple[int, int]:
    """(n, best_of): n choices returned of best_of generated (vLLM's rules: n <= best_of; streaming returns
    every choice it generates, so best_of > n is refused with stream)."""
    n = _get(body, "n", 1, lambda v: _is_int(v) and 1 <= v <= MAX_N, f"must be an integer in [1, {MAX_N}]")
    best_of = _get(body, "best_of", n, lambda v: _is_int(v) and 1 <= v <= MAX_N,
                   f"must be an integer in [1, {MAX_N}]")
    if best_of < n:
        raise bad("best_of", f"'best_of' ({best_of}) must be >= 'n' ({n}): send best_of >= {n}, or leave it "
                  "out")
    if stream and best_of > n:
        raise bad("best_of", f"'best_of' ({best_of}) > 'n' ({n}) cannot be streamed (the best choices are "
                  "known only at the end): send stream: false, or best_of equal to n")
    return n, best_of


def completion_logprobs(body: dict) -> tuple[int | None, bool]:
    """/v1/completions' (logprobs, echo): logprobs an integer in [0, MAX_LOGPROBS] (the top logprobs of each
    token; 0: the sampled token's only) or null."""
    k = _get(body, "logprobs", None, lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
             f"must be an integer in [0, {MAX_LOGPROBS}] (the top logprobs of each token) or null")
    return k, _get(body, "echo", False, lambda v: isinstance(v, bool), "must be true or false")


def prompt_logprobs(body: dict) -> int | None:
    """vLLM's prompt_logprobs: each prompt token's logprob with the top-k of its position, k in
    [0, MAX_LOGPROBS] (0: the prompt token's own only), or null."""
    return _get(body, "prompt_logprobs", None, lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
                f"must be an integer in [0, {MAX_LOGPROBS}] (the top logprobs of each prompt token; 0: the "
                "prompt token's own) or null")


def chat_logprobs(body: dict) -> int | None:
    """/v1/chat/completions' logprobs (true/false) and top_logprobs (in [0, MAX_LOGPROBS], with logprobs true)
    as the top-k of each token (None: no logprobs)."""
    on = _get(body, "logprobs", False, lambda v: isinstance(v, bool), "must be true or false")
    top = _get(body, "top_logprobs", None, lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
               f"must be an integer in [0, {MAX_LOGPROBS}]")
    if top is not None and not on:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if on else None


def processors(body: dict, limits: Limits) -> dict:
    """The logits processors' fields (vLLM's ranges): penalties, logit_bias, min_p."""
    penalty = lambda v: _is_num(v) and -2 <= v <= 2  # noqa: E731
    return dict(
        presence_penalty=float(_get(body, "presence_penalty", 0.0, penalty, "must be a number in [-2, 2]")),
        frequency_penalty=float(_get(body, "frequency_penalty", 0.0, penalty, "must be a number in [-2, 2]")),
        repetition_penalty=float(_get(body, "repetition_penalty", 1.0, lambda v: _is_num(v) and v > 0,
                                      "must be a number > 0 (1 = off)")),
        logit_bias=logit_bias(body, limits.vocab_size),
        min_p=float(_get(body, "min_p", 0.0, lambda v: _is_num(v) and 0 <= v <= 1,
                         "must be a number in [0, 1] (0 = off)")))


def logit_bias(body: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias in [-100, 100]} as sorted (id, bias) pairs."""
    bias = _get(body, "logit_bias", {}, lambda v: isinstance(v, dict), "must be an object of token id: bias")
    out = []
    for key, value in bias.items():
        tok = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else -1
        if not 0 <= tok < vocab:
            raise bad("logit_bias", f"'logit_bias' keys must be token ids in [0, {vocab}), got {show(key)}")
        if not (_is_num(value) and -100 <= value <= 100):
            raise bad("logit_bias", f"'logit_bias' values must be numbers in [-100, 100], got {show(value)} "
                      f"for token {tok}")
        out.append((tok, float(value)))
    return tuple(sorted(out))


def stop_controls(body: dict, limits: Limits) -> dict:
    """vLLM's min_tokens and stop_token_ids (OpenAI endpoints; /generate has no stop)."""
    stop_ids = _get(body, "stop_token_ids", [], lambda v: isinstance(v, list) and all(
        _is_int(t) and 0 <= t < limits.vocab_size for t in v),
        f"must be a list of token ids in [0, {limits.vocab_size})")
    return dict(min_tokens=_get(body, "min_tokens", 0, lambda v: _is_int(v) and v >= 0,
                                "must be an integer >= 0"),
                stop_token_ids=tuple(stop_ids), allowed_token_ids=allowed_token_ids(body, limits.vocab_size))


def allowed_token_ids(body: dict, vocab: int) -> tuple[int, ...]:
    """vLLM's allowed_token_ids: a non-empty list of token ids, the only ones sampled (() when not sent)."""
    return tuple(sorted(set(_get(body, "allowed_token_ids", [], lambda v: _token_ids(v, vocab),
                                 f"must be a non-empty list of token ids in [0, {vocab})"))))


def _max_tokens(body: dict, key: str, prompt_len: int, limits: Limits, default: int | None,
                param: str) -> int:
    n = _get(body, key, default, lambda v: _is_int(v) and v >= 1, "must be an integer >= 1")
    room = limits.context_len - prompt_len
    if room < 1:
        raise bad(param,
                  f"the prompt is {prompt_len} tokens; the longest request is {limits.context_len} tokens "
                  "(prompt + output, --max_req_total_len), leaving no room for output",
                  code="context_length_exceeded")
    if n is None:
        return room
    if n > room:
        raise bad(key,
                  f"the prompt ({prompt_len} tokens) + '{key}' ({n}) exceed the {limits.context_len}-token "
                  f"request limit (--max_req_total_len): ask for at most {room}",
                  code="context_length_exceeded")
    return n


def _token_ids(v, vocab: int) -> bool:
    return isinstance(v, list) and bool(v) and all(_is_int(t) and 0 <= t < vocab for t in v)


def _prompts(prompt) -> list:
    """/v1/completions' prompt as a list of prompts: a string or a list of token ids is one; a list of those
    (OpenAI's batch) is several."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return [prompt]


def parse_completion(body: object, limits: Limits, tokenizer) -> GenerateArgs:
    """POST /v1/completions: prompt is a string or a list of token ids, or a list of those (several prompts:
    the first prompt's args, the others' in its `others`)."""
    args = _common(body, limits, COMPLETIONS)
    prompts = _prompts(body.get("prompt"))
    logprobs, echo = completion_logprobs(body)
    # max_tokens 0 with echo: the prompt's logprobs alone (one token is generated and dropped)
    if echo and _is_int(body.get("max_tokens")) and body["max_tokens"] == 0:
        body = {**body, "max_tokens": 1}
        args["echo_only"] = True
    structured = parse_structured(body)
    one = [_completion(body, p, f"prompt[{i}]" if len(prompts) > 1 else "prompt", limits, tokenizer,
                       dict(args, logprobs=logprobs, echo=echo, structured=structured))
           for i, p in enumerate(prompts)]
    one[0].others = one[1:]
    return one[0]


def _completion(body: dict, prompt, param: str, limits: Limits, tokenizer, args: dict) -> GenerateArgs:
    """One prompt of a completions request."""
    prompt_text = prompt if isinstance(prompt, str) else None
    if isinstance(prompt, str) and prompt:
        ids = tokenizer.encode(text(prompt, param), add_special_tokens=True)
    elif _token_ids(prompt, limits.vocab_size):
        ids = prompt
    else:
        raise bad(param, f"'{param}' must be a non-empty string or a non-empty list of token ids in "
                  f"[0, {limits.vocab_size}) (or a list of those), got {show(prompt)}")
    if not ids:
        raise bad(param, f"'{param}' encodes to no tokens")
    n = _max_tokens(body, "max_tokens", len(ids), limits, COMPLETIONS_DEFAULT_MAX_TOKENS, param)
    return GenerateArgs(prompt_ids=ids, max_tokens=n, prompt_text=prompt_text, prompt_param=param, **args)


ROLES = ("system", "user", "assistant", "tool", "developer")


def _message(i: int, m, limits: Limits, images: list) -> dict:
    """One message for the chat template, its content a list of pieces: the client's text, and for each image
    part of a vision model a Verbatim IMAGE_MARK (the part goes to `images`)."""
    from autoprofile.serving.tokenizer import Verbatim
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(where, f"'{where}' must be an object with 'role' and 'content'")
    if m.get("role") not in ROLES:
        raise bad(f"{where}.role",
                  f"'{where}.role' must be one of {', '.join(ROLES)}, got {show(m.get('role'))}")
    check_fields(m, CHAT, MESSAGE_FIELDS, f"{where}.")
    role, content = m["role"], m.get("content")
    extra = _tool_fields(where, m)
    if m.get("name") is not None:
        if not isinstance(m["name"], str):
            raise bad(f"{where}.name", f"'{where}.name' must be a string, got {show(m['name'])}")
        extra["name"] = text(m["name"], f"{where}.name")
    if content is None and role == "assistant":  # OpenAI's: an assistant turn that only calls tools
        content = ""
    if isinstance(content, list) and limits.max_images:
        from autoprofile.serving.images import ImagePart, parse_content
        from autoprofile.serving.vision import IMAGE_MARK
        parts = parse_content(content, i)
        images += [p for p in parts if isinstance(p, ImagePart)]
        pieces = [Verbatim(IMAGE_MARK) if isinstance(p, ImagePart) else p.text for p in parts]
    elif isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad(f"{where}.content", f"'{where}.content' parts must be text parts "
                      '({"type": "text", "text": ...}); images and audio are not supported',
                      code="unsupported_value")
        pieces = ["".join(p["text"] for p in content)]
    elif isinstance(content, str):
        pieces = [content]
    else:
        raise bad(f"{where}.content", f"'{where}.content' must be a string or a list of text parts (null "
                  "only in an assistant message)")
    text("".join(pieces), f"{where}.content")
    return {"role": role, "content": pieces, **extra}


def _tool_fields(where: str, m: dict) -> dict:
    """An assistant message's tool_calls (each call's arguments parsed from their JSON text: tool-use
    templates expect an object, as vLLM gives them) and a tool message's tool_call_id, for the template."""
    calls, call_id = m.get("tool_calls"), m.get("tool_call_id")
    if calls is not None and m["role"] != "assistant":
        raise bad(f"{where}.tool_calls", f"'{where}.tool_calls' is only allowed in an assistant message")
    if call_id is not None and not (m["role"] == "tool" and isinstance(call_id, str)):
        raise bad(f"{where}.tool_call_id", f"'{where}.tool_call_id' must be a string, in a tool message")
    if calls is None:
        return {} if call_id is None else {"tool_call_id": text(call_id, f"{where}.tool_call_id")}
    shape = (f"'{where}.tool_calls' must be a list of {{\"id\", \"type\": \"function\", \"function\": "
             '{"name", "arguments": JSON text}}')
    if not (isinstance(calls, list) and all(_is_call(c) for c in calls)):
        raise bad(f"{where}.tool_calls", f"{shape}, got {show(calls)}")
    out = []
    for j, c in enumerate(calls):
        param = f"{where}.tool_calls[{j}].function.arguments"
        try:
            arguments = json.loads(text(c["function"]["arguments"], param))
        except ValueError:
            raise bad(param, f"'{param}' must be JSON text, got {show(c['function']['arguments'])}") from None
        out.append({**c, "function": {**c["function"], "arguments": arguments}})
    return {"tool_calls": out}


def _is_call(c) -> bool:
    f = c.get("function") if isinstance(c, dict) else None
    return (isinstance(f, dict) and c.get("type", "function") == "function" and isinstance(f.get("name"), str)
            and bool(f["name"]) and isinstance(f.get("arguments"), str))


def _refuse_unrendered_tools(messages: list[dict], tokenizer, options) -> None:
    """Tool calls and tool messages only where the chat template renders them: each call's name and each tool
    message's text is swapped for a probe word, and a probe missing from the rendered prompt is a 400 naming
    its message."""
    nonce, probes, swapped = secrets.token_hex(6), [], []
    for i, m in enumerate(messages):
        m = {**m, "content": "".join(m["content"])}
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "name": f"p{nonce}m{i}c{j}"}}
                               for j, c in enumerate(m["tool_calls"])]
            probes += [(f"messages[{i}].tool_calls", "an assistant message's tool_calls",
                        c["function"]["name"]) for c in m["tool_calls"]]
        if m["role"] == "tool":
            m["content"] = f"p{nonce}m{i}"
            probes.append((f"messages[{i}]", "a tool message", m["content"]))
        swapped.append(m)
    if not probes:
        return
    prompt = tokenizer.apply_chat_template(swapped, None, options)
    for param, what, probe in probes:
        if probe not in prompt:
            raise bad(param, f"this model's chat template does not render {what} ('{param}' would be left "
                      "out of the prompt): tool use is not supported with this model",
                      code="unsupported_value")


def _refuse_special_fields(messages: list[dict], tokenizer) -> None:
    """Special-token text in a message's name, tool_calls or tool_call_id is a 400: only message content is
    kept as plain text in the prompt."""
    for i, m in enumerate(messages):
        for key in ("name", "tool_calls", "tool_call_id"):
            written = json.dumps(m.get(key), ensure_ascii=False)
            token = next((s for s in tokenizer.special_texts if s in written), None)
            if token is not None:
                raise bad(f"messages[{i}].{key}", f"'messages[{i}].{key}' holds the special token {token!r}: "
                          "remove it", code="special_token_in_content")


def _refuse_special_text(rendered, tokenizer) -> None:
    """Where the template changed the clients' text (so its place in the prompt is unknown), a special token
    written in it is a 400: it could not be kept as plain text."""
    for i, t in rendered.texts:
        token = next((s for s in tokenizer.special_texts if s in t), None)
        if token is not None:
            raise bad(f"messages[{i}].content",
                      f"'messages[{i}].content' holds the special token {token!r}; this model's chat "
                      "template rewrites message text, so the server cannot keep it as plain text: remove it",
                      code="special_token_in_content")


def parse_chat(body: object, limits: Limits, tokenizer) -> GenerateArgs:
    """POST /v1/chat/completions: messages rendered with the model's chat template."""
    from autoprofile.serving.tokenizer import ChatTemplateError
    args = _common(body, limits, CHAT)
    args["logprobs"] = chat_logprobs(body)
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages):
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    images = []
    structured, tools = parse_structured(body), parse_tools(body, tokenizer)
    if tools is not None and tools.forced is not None:
        if structured is not None:
            raise bad(structured.param, f"'{structured.param}' and 'tool_choice' "
                      f"{show(body['tool_choice'])} both constrain the output: send one")
        structured = tools.forced
    args.update(structured=structured, tools=tools)
    options = chat_options(body)
    try:
        turns = [_message(i, m, limits, images) for i, m in enumerate(messages)]
        _refuse_special_fields(turns, tokenizer)
        _refuse_unrendered_tools(turns, tokenizer, options)
        rendered = tokenizer.render_chat(turns, tools=tools.rendered if tools is not None else None,
                                         options=options)
        if tools is not None:
            refuse_unrendered_tool_defs(tools, rendered.text)
    except ChatTemplateError as e:
        raise bad("messages", str(e)) from None
    if rendered.client is None:
        _refuse_special_text(rendered, tokenizer)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if images:
        if len(images) > limits.max_images:
            raise bad("messages", f"the request has {len(images)} images; this server takes at most "
                      f"{limits.max_images} per request (--max_images_per_request)")
        _get(body, key, None, lambda v: _is_int(v) and v >= 1, "must be an integer >= 1")
        return GenerateArgs(prompt_ids=[], max_tokens=0, chat=True, prompt_param="messages", images=images,
                            rendered=rendered, max_tokens_body={key: body.get(key)}, **args)
    # the template holds BOS (as transformers does); the clients' special-token text stays text
    ids = tokenizer.encode(rendered.text, add_special_tokens=False, plain=rendered.client or ())
    if not ids:
        raise bad("messages", "the messages encode to no tokens")
    n = _max_tokens(body, key, len(ids), limits, None, "messages")
    return GenerateArgs(prompt_ids=ids, max_tokens=n, chat=True, prompt_param="messages", **args)


def with_image_ids(args: GenerateArgs, ids: list[int], limits: Limits) -> GenerateArgs:
    """A chat request with images, its prompt ids made: max_tokens against the request limit."""
    (key, value), = args.max_tokens_body.items()
    args.prompt_ids, args.max_tokens = ids, _max_tokens({key: value}, key, len(ids), limits, None, "messages")
    return args


def parse_generate(body: object, limits: Limits) -> tuple[list[list[int]], int, dict]:
    """POST /generate (LightLLM parity): input_ids (a list of prompts), max_new_tokens, sampling (greedy by
    default)."""
    if not isinstance(body, dict):
        raise bad(None, "the body must be a JSON object", code="invalid_json")
    check_fields(body, GENERATE)
    ids = body.get("input_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(p, list) and p for p in ids)):
        raise bad("input_ids", "'input_ids' must be a non-empty list of non-empty lists of token ids")
    if not all(_is_int(t) and 0 <= t < limits.vocab_size for p in ids for t in p):
        raise bad("input_ids", f"'input_ids' must hold integers in [0, {limits.vocab_size})")
    n = _get(body, "max_new_tokens", 16, lambda v: _is_int(v) and v >= 1, "must be an integer >= 1")
    longest = max(len(p) for p in ids)
    if longest + n > limits.context_len:
        raise bad("max_new_tokens", f"prompt ({longest} tokens) + 'max_new_tokens' ({n}) exceeds the "
                  f"{limits.context_len}-token request limit (--max_req_total_len)",
                  code="context_length_exceeded")
    params = dict(
        temperature=float(_get(body, "temperature", 0.0, lambda v: _is_num(v) and v >= 0,
                               "must be >= 0 (0 = greedy)")),
        top_p=float(_get(body, "top_p", 1.0, lambda v: _is_num(v) and 0 < v <= 1, "must be in (0, 1]")),
        top_k=_get(body, "top_k", 0, lambda v: _is_int(v) and v >= 0, "must be an integer >= 0 (0 = off)"),
        seed=_get(body, "seed", None, lambda v: _is_int(v) and -INT64 <= v < INT64,
                  "must be a 64-bit integer"), **processors(body, limits))
    return ids, n, params
