"""The OpenAI endpoints' handlers (completions, chat, vLLM's /tokenize and /detokenize, LightLLM's /generate;
the Responses API's in serving.responses run on the chat path here): a body, bounded in bytes while it is
read (BodyBound) and validated by serving.protocol (on a worker thread past PARSE_ON_LOOP_BYTES), becomes
one engine request per choice (serving.choices), answered as a body or server-sent events (serving.bodies).

Above the house's 500 lines on purpose: one owner of the OpenAI request's way from body to engine and back;
its streamed and whole answers share the choice and chunk helpers that live beside them.
"""
from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from aiohttp import web

from autoprofile.budget import running_reqs
from autoprofile.config import ServerConfig
from autoprofile.engine.grammar import AllowedTokens
from autoprofile.engine.request import RequestError
from autoprofile.serving.async_engine import AsyncEngine, EngineFailure, QueueFull
from autoprofile.serving.bodies import (chat_content, chunk, completion_block, echo_entries,
                                       prompt_logprobs_body, response, usage)
from autoprofile.serving.bodies import choice as choice_body
from autoprofile.serving.bodies import request_id as new_request_id
from autoprofile.serving.choices import Choice, best, merged
from autoprofile.serving.engine_process import GrammarRequest
from autoprofile.serving.errors import APIError, bad
from autoprofile.serving.images import FETCH_TIMEOUT_S, MAX_IMAGE_BYTES
from autoprofile.serving.metrics import ServerMetrics
from autoprofile.serving.protocol import (BODY_MARGIN, BODY_OVERHEAD, GenerateArgs, Limits, decode_json,
                                          generate_body_bytes, max_body_bytes, parse_chat, parse_completion,
                                          parse_detokenize, parse_generate, parse_tokenize, show,
                                          with_image_ids)
from autoprofile.serving.reasoning import ReasoningStream, split, starts_thinking
from autoprofile.serving.structured import Grammars
from autoprofile.serving.tokenizer import TextStream
from autoprofile.serving.tools import ToolStream, reply_calls
from autoprofile.serving.vision import ImageOptions, encode_with_images, load_prepared, multimodal_input

PARSE_ON_LOOP_BYTES = 64 << 10  # larger bodies are parsed and validated on a worker thread
READ_CHUNK_BYTES = 64 << 10
RETRY_AFTER_S = 1


class Serving(Protocol):
    """What the handlers read of the app's state (server.ServerState)."""

    cfg: ServerConfig
    engine: AsyncEngine
    tokenizer: object
    grammars: Grammars | None
    grammars_error: str | None
    grammars_loading: asyncio.Future | None  # the grammars' build when the server was ready before it
    limits: Limits
    metrics: ServerMetrics
    bounds: dict[str, BodyBound]
    parser: Executor  # parses large bodies off the loop
    http: aiohttp.ClientSession | None  # fetches allow-listed image URLs


@dataclass(frozen=True)
class BodyBound:
    """An endpoint's body bound in bytes, and what it has room for (the 413 says it)."""

    limit: int
    room: str

    def error(self) -> APIError:
        return APIError(413, f"the body is larger than {self.limit} bytes, this endpoint's bound: room for "
                        f"{self.room} at the widest JSON spelling, and {BODY_OVERHEAD >> 10} KiB for every "
                        "other field", type="invalid_request_error", code="request_entity_too_large")


def body_bounds(cfg) -> dict[str, BodyBound]:
    """The OpenAI endpoints' and /generate's body bounds."""
    mc, n = cfg.model_config, cfg.context_len
    openai = BodyBound(max_body_bytes(n, mc.vocab_size),
                       f"one prompt of {n} token ids (x{BODY_MARGIN}: whitespace, a text prompt's escapes)")
    if mc.vision is not None:  # data: URLs: base64 is 4/3 of the image's bytes
        images = cfg.max_images_per_request
        openai = BodyBound(openai.limit + images * (MAX_IMAGE_BYTES * 4 // 3 + 1024),
                           f"{openai.room} and {images} images of {MAX_IMAGE_BYTES} bytes as base64 "
                           "(--max_images_per_request)")
    prompts = running_reqs(cfg.running_max_req_size, cfg.graph_max_batch_size) + cfg.max_waiting_requests
    generate = BodyBound(generate_body_bytes(n, mc.vocab_size, prompts),
                         f"{prompts} prompts (the most admitted at once: running + --max_waiting_requests) "
                         f"of {n - 1} token ids")
    return {"openai": openai, "generate": generate}


def text_ids(args, out) -> list[int]:
    """The ids whose text the client gets: a stop_token_ids token that ended the request is no text."""
    ids = out.new_token_ids
    if out.finish_reason == "stop" and ids and ids[-1] in args.stop_token_ids:
        return ids[:-1]
    return ids


def engine_failure(e: EngineFailure) -> APIError:
    if e.code == "dead":
        return engine_dead()
    if e.code == "oom":
        return APIError(500,
                        "the engine ran out of GPU memory in a step that held this request; the server is "
                        "still up: retry", type="server_error", code="engine_oom")
    return APIError(500, "the engine failed this request (see the server log); the server is still up",
                    type="server_error", code="engine_error")


def engine_dead() -> APIError:
    return APIError(503, "the engine loop died; the server is going down to be restarted (see the server "
                    "log)", type="service_unavailable", code="engine_dead")


def _json_only(request: web.Request) -> None:
    """A 415 for a body that is not declared JSON (vLLM's rule): it is not parsed."""
    if request.headers.get("Content-Type", "").partition(";")[0].strip().lower() != "application/json":
        raise APIError(415, f"the body must be JSON sent with 'Content-Type: application/json', got "
                       f"{show(request.headers.get('Content-Type'))}", param="Content-Type",
                       code="unsupported_media_type")


async def _read(request: web.Request, bound: BodyBound) -> bytearray:
    """The body (not copied: json.loads takes a bytearray), a 413 as soon as it is over the bound (announced
    or read); a 415 unless it is declared JSON."""
    _json_only(request)
    if (request.content_length or 0) > bound.limit:
        raise bound.error()
    raw = bytearray()
    async for piece in request.content.iter_chunked(READ_CHUNK_BYTES):
        raw += piece
        if len(raw) > bound.limit:
            raise bound.error()
    return raw


async def parsed(request: web.Request, st: Serving, bound: BodyBound, parse, *args):
    """parse(json body, *args), the body bounded in bytes (a 413 past it); a large body is decoded and
    validated on a worker thread so that streams keep flowing."""
    raw = await _read(request, bound)
    work = functools.partial(_decode_and_parse, raw, parse, args)
    if len(raw) <= PARSE_ON_LOOP_BYTES:
        return work()
    # NOTE: json.loads holds the GIL for its whole call (~14 ms/MiB): the byte bound is what caps that stall
    return await asyncio.get_running_loop().run_in_executor(st.parser, work)


def _decode_and_parse(raw: bytearray, parse, args: tuple):
    return parse(decode_json(raw), *args)


def _queue_full(e: QueueFull) -> APIError:
    return APIError(429, f"the server is at capacity ({e}); retry later", type="rate_limit_error",
                    code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


async def with_images(st: Serving, args: GenerateArgs) -> GenerateArgs:
    """Load, resize and patch a chat request's images (off the loop), then its prompt ids and engine
    images."""
    cfg, mc = st.cfg, st.cfg.model_config
    opts = ImageOptions(cfg.min_image_pixels, cfg.max_image_pixels, cfg.allowed_media_domains,
                        MAX_IMAGE_BYTES,
                        FETCH_TIMEOUT_S)
    images = await load_prepared(args.images, opts, st.parser, st.http)
    ids = encode_with_images(st.tokenizer, args.rendered, images, mc)
    args = with_image_ids(args, ids, st.limits)
    args.mm = multimodal_input(ids, images, mc)
    return args


async def _submit(st: Serving, args: GenerateArgs, index: int = 0):
    """Queue choice `index` of a request (its images loaded already: with_images)."""
    eos = () if args.ignore_eos else st.tokenizer.eos_token_ids
    stop_ids = sorted({*eos, *args.stop_token_ids})
    # structured output: each choice its own matcher of the request's grammar (compiled off the loop, cached)
    grammar = None
    if args.structured is not None:
        st.engine.prepare_grammars()  # an engine process's own build, beside ours below
        if st.grammars_loading is not None:  # a server's first seconds: xgrammar still loading
            await asyncio.shield(st.grammars_loading)
        if st.grammars is None:
            raise bad(args.structured.param, "structured output is not available with this model's tokenizer "
                      f"({st.grammars_error})", code="unsupported_value")
        grammar = await st.grammars.matcher(args.structured)  # compiled here: a bad spec is a 400 here
    if st.engine.remote and (args.structured is not None or args.allowed_token_ids):
        # an engine process builds its own matcher from the spec (an xgrammar matcher does not pickle)
        grammar = GrammarRequest(args.structured, tuple(args.allowed_token_ids or ()), st.limits.vocab_size)
    elif args.allowed_token_ids:
        grammar = AllowedTokens.of(args.allowed_token_ids, st.limits.vocab_size, grammar)
    try:
        # a whole answer without stop strings needs no output before the end (vLLM's FINAL_ONLY): no turn on
        # the event loop a step; stop strings are looked for as the text comes, to end the request there
        handle = await st.engine.submit(args.prompt_ids, args.to_sampling_params(index), args.max_tokens,
                                        stop_ids, mm=args.mm, grammar=grammar,
                                        final_only=not args.stream and not args.stop)
    except QueueFull as e:
        raise _queue_full(e) from None
    except RequestError as e:
        param = args.prompt_param if e.field in ("prompt", "images") else e.field
        raise bad(param, str(e)) from None
    except EngineFailure as e:
        raise engine_failure(e) from None
    st.metrics.prompt_tokens.inc(len(args.prompt_ids))
    return handle


async def tokenize(request: web.Request, st: Serving) -> web.Response:
    """vLLM's /tokenize: a prompt or chat messages (the chat template, vLLM's fields) -> their token ids."""
    ids, strs = await parsed(request, st, st.bounds["openai"], parse_tokenize, st.limits, st.tokenizer)
    return web.json_response({"count": len(ids), "max_model_len": st.limits.context_len, "tokens": ids,
                              "token_strs": [st.tokenizer.decode([i]) for i in ids] if strs else None})


async def detokenize(request: web.Request, st: Serving) -> web.Response:
    ids = await parsed(request, st, st.bounds["openai"], parse_detokenize, st.limits)
    return web.json_response({"prompt": st.tokenizer.decode(ids)})


async def completions(request: web.Request, st: Serving) -> web.StreamResponse:
    return await _openai(request, st, parse_completion)


async def chat_completions(request: web.Request, st: Serving) -> web.StreamResponse:
    return await _openai(request, st, parse_chat)


async def _openai(request: web.Request, st: Serving, parse) -> web.StreamResponse:
    args = await parsed(request, st, st.bounds["openai"], parse, st.limits, st.tokenizer)
    if args.images:
        args = await with_images(st, args)
    think(st, args)
    prompts = [args, *args.others]
    room(st, args, args.best_of * len(prompts))
    groups: list[tuple[GenerateArgs, list[Choice]]] = []
    try:
        for k, a in enumerate(prompts):  # a list of prompts: prompt k's choices are indexed from k * n
            groups.append((a, await start(st, a, k * a.n)))
        if args.stream:
            return await _stream(request, st, args, groups)
        return await _complete(st, args, groups)
    finally:
        for _, choices in groups:
            for c in choices:
                c.handle.close()


THINK_TAIL_TOKENS = 16  # the prompt's last tokens read for an open <think>


def think(st: Serving, args: GenerateArgs) -> None:
    """--reasoning_parser: whether a chat reply begins inside <think> (the prompt's end says)."""
    if args.chat and st.cfg.reasoning_parser is not None:
        tail = st.tokenizer.decode(args.prompt_ids[-THINK_TAIL_TOKENS:])
        args.thinking = starts_thinking(st.cfg.reasoning_parser, tail)


def room(st: Serving, args: GenerateArgs, count: int) -> None:
    """A 400 for more choices (best_of per prompt) than the server ever holds, a 429 for more than it has
    room for now."""
    if count > st.engine.capacity:
        param = "prompt" if args.others else "best_of" if args.best_of > args.n else "n"
        raise bad(param, f"{count} choices can never run together: this server holds at most "
                  f"{st.engine.capacity} requests ({st.engine.max_running} running + {st.engine.max_waiting} "
                  f"waiting); ask for at most {st.engine.capacity}")
    if not st.engine.has_room(count):
        raise _queue_full(QueueFull(f"{count} choices, {st.engine.outstanding} requests outstanding, limit "
                                    f"{st.engine.capacity}"))


async def start(st: Serving, args: GenerateArgs, base: int = 0) -> list[Choice]:
    """Submit a prompt's best_of choices (indexed from base): the first alone, the others once its first token
    is back (its prompt's full pages are then in the prefix cache: serving.choices)."""
    count = args.best_of
    handles, head = [await _submit(st, args)], []
    try:
        if count > 1:
            try:
                head.append(await handles[0].__anext__())
            except EngineFailure as e:
                raise engine_failure(e) from None
            for i in range(1, count):
                handles.append(await _submit(st, args, i))
    except BaseException:
        for h in handles:
            h.close()
        raise
    return [Choice(base + i, h, TextStream(st.tokenizer, args.prompt_ids, args.stop, args.min_tokens),
                   head if i == 0 else []) for i, h in enumerate(handles)]


def _finish_reason(out) -> str:
    if out.finish_reason in ("stop", "length"):
        return out.finish_reason
    raise EngineFailure("internal")  # the engine dropped a request the server did not abort


def _logprobs_body(st: Serving, args: GenerateArgs, c: Choice, entries: list, echo: list,
                   offset: int) -> dict | None:
    """A choice's logprobs in the endpoint's shape (None: not asked); echo: the prompt's entries first."""
    if args.logprobs is None:
        return None
    if args.chat:
        return {"content": chat_content(st.tokenizer, entries)}
    return completion_block(st.tokenizer, echo + entries, offset)


def _echo(st: Serving, args: GenerateArgs, choices: list[Choice]) -> tuple[str, list]:
    """The echoed prompt (completions' echo): its text and its tokens' logprob entries (the first
    choice's)."""
    if not args.echo:
        return "", []
    text = args.prompt_text if args.prompt_text is not None else st.tokenizer.decode(args.prompt_ids)
    return text, echo_entries(args.prompt_ids, choices[0].prompt if args.logprobs is not None else None,
                              args.logprobs or 0)


def _prompt_logprobs(st: Serving, args: GenerateArgs, choices: list[Choice]) -> list | None:
    """vLLM's prompt_logprobs of a prompt (its first choice's engine request scored them); None: not asked or
    not known yet."""
    if args.prompt_logprobs is None or choices[0].prompt is None:
        return None
    return prompt_logprobs_body(st.tokenizer, choices[0].prompt, args.prompt_logprobs)


async def _complete(st: Serving, args: GenerateArgs,
                    groups: list[tuple[GenerateArgs, list[Choice]]]) -> web.Response:
    return web.json_response(await complete_body(st, args, groups))


async def complete_body(st: Serving, args: GenerateArgs,
                         groups: list[tuple[GenerateArgs, list[Choice]]]) -> dict:
    """Every prompt's n choices, indexed prompt by prompt (OpenAI's order), usage summed over the prompts."""
    bodies, tokens = [], 0
    for k, (a, choices) in enumerate(groups):
        more, used = await _choice_bodies(st, a, choices)
        for i, b in enumerate(more):
            b["index"] = k * a.n + i
        bodies, tokens = bodies + more, tokens + used
    first = bodies[0]
    text = first["message"]["content"] if args.chat else first["text"]
    calls = first["message"].get("tool_calls") if args.chat else None
    body = response(args, new_request_id(args.chat), text, first["finish_reason"],
                    sum(len(a.prompt_ids) for a, _ in groups), tokens, first["logprobs"], bodies[1:], calls)
    body["choices"][0] = first
    if args.return_token_ids and args.chat:
        body["prompt_token_ids"] = args.prompt_ids
    if args.chat and args.prompt_logprobs is not None:  # vLLM's chat: beside the choices
        body["prompt_logprobs"] = _prompt_logprobs(st, args, groups[0][1])
    return body


async def _choice_bodies(st: Serving, args: GenerateArgs,
                         choices: list[Choice]) -> tuple[list[dict], int]:
    """One prompt's returned choices (its n best of best_of) and their completion tokens (vLLM's usage: the
    returned choices only)."""
    ids: dict[int, list[int]] = {c.index: [] for c in choices}
    try:
        async for c, out in merged(choices):
            ids[c.index] += out.new_token_ids
            c.advance(out, _finish_reason, text_ids(args, out))
    except EngineFailure as e:
        raise engine_failure(e) from None
    prefix, echo = _echo(st, args, choices)
    prompt_lps = None if args.chat else _prompt_logprobs(st, args, choices)
    bodies, returned = [], best(choices, args.n)
    for i, c in enumerate(returned):
        text, entries = ("", []) if args.echo_only else ("".join(c.parts), c.entries)
        reason, calls, thought = c.reason, None, None
        if args.thinking is not None:
            thought, text = split(text, args.thinking)
        if args.tools is not None and args.tools.parses:
            text, calls = reply_calls(text or "", args.tools)
            reason = "tool_calls" if calls else reason
        body = choice_body(args, text if text is None else prefix + text, reason, i,
                           _logprobs_body(st, args, c, entries, echo, 0), calls)
        if args.thinking is not None:
            body["message"]["reasoning_content"] = thought
        if args.return_token_ids:
            body |= {"token_ids": ids[c.index]} if args.chat else \
                {"prompt_token_ids": args.prompt_ids, "token_ids": ids[c.index]}
        if prompt_lps is not None:  # vLLM's completions: every choice of the prompt
            body["prompt_logprobs"] = prompt_lps
        bodies.append(body)
    return bodies, 0 if args.echo_only else sum(c.tokens for c in returned)


async def _stream(request: web.Request, st: Serving, args: GenerateArgs,
                  groups: list[tuple[GenerateArgs, list[Choice]]]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(body: dict) -> None:
        await resp.write(f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode())
    try:
        async for body in chunks(st, args, groups):
            await send(body)
    except EngineFailure as e:
        await send(engine_failure(e).body())
    except ConnectionResetError:  # the client went away: close() aborts the request
        return resp
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def chunks(st: Serving, args: GenerateArgs,
                  groups: list[tuple[GenerateArgs, list[Choice]]]) -> AsyncIterator[dict]:
    """The stream's chunks as they become known (an EngineFailure is raised)."""
    rid, created = new_request_id(args.chat), int(time.time())
    owner = {c.index: (a, choices) for a, choices in groups for c in choices}  # each choice's prompt
    choices = [c for _, group in groups for c in group]
    echoed: set[int] = set()
    started: set[int] = set()
    scored: set[int] = set()  # choices (chat: -1, once) whose prompt_logprobs are sent

    def counted(body: dict, c: Choice | None = None) -> dict:
        if c is not None and args.continuous_usage:  # vLLM's continuous_usage_stats: its usage so far
            body["usage"] = usage(len(owner[c.index][0].prompt_ids), c.tokens)
        return body

    tools = {c.index: ToolStream(args.tools) for c in choices} \
        if args.tools is not None and args.tools.parses else {}
    thinks = {c.index: ReasoningStream(args.thinking) for c in choices} if args.thinking is not None else {}
    if args.chat:
        for c in choices:
            body = chunk(args, rid, created, None, role=True, index=c.index)
            if args.return_token_ids:
                body["prompt_token_ids"] = args.prompt_ids
            yield counted(body, c)
    async for c, out in merged(choices):
        a, group = owner[c.index]
        delta, new = c.advance(out, _finish_reason, text_ids(a, out))
        ids = out.new_token_ids if args.return_token_ids else []
        if args.echo_only:
            delta, new = "", []
        prefix, echo = "", []
        if a.echo and c.index not in echoed:
            echoed.add(c.index)
            prefix, echo = _echo(st, a, group)
        thought = ""
        if c.index in thinks:
            thought, delta = _reasoning_deltas(thinks[c.index], delta, c.reason is not None)
        new_calls = None
        if c.index in tools:
            calls = tools[c.index]
            delta, new_calls = _tool_deltas(calls, delta, c.reason is not None)
            if c.reason is not None and calls.calls:
                c.reason = "tool_calls"
        if thought:
            body = chunk(args, rid, created, None, index=c.index)
            body["choices"][0]["delta"]["reasoning_content"] = thought
            yield counted(body, c)
        lps = _logprobs_body(st, a, c, new, echo, c.offset) if new or echo else None
        if lps is not None and not args.chat:  # text_offset counts the tokens' own texts, as whole
            c.offset = lps["text_offset"][-1] + len(lps["tokens"][-1])
        key = -1 if args.chat else c.index
        prompt_lps = None if key in scored else _prompt_logprobs(st, a, group)
        if prefix + delta or lps or ids or prompt_lps is not None:
            body = chunk(args, rid, created, prefix + delta, index=c.index, logprobs=lps)
            if prompt_lps is not None:  # in the first chunk that knows them; chat's beside the choices
                scored.add(key)
                (body if args.chat else body["choices"][0])["prompt_logprobs"] = prompt_lps
            if ids:
                body["choices"][0]["token_ids"] = ids
            if ids and not args.chat and c.index not in started:
                body["choices"][0]["prompt_token_ids"] = a.prompt_ids
            started.add(c.index)
            yield counted(body, c)
        if new_calls:
            yield counted(chunk(args, rid, created, None, index=c.index, tool_calls=new_calls), c)
        if c.reason is not None:
            yield counted(chunk(args, rid, created, None, finish_reason=c.reason, index=c.index), c)
    if args.include_usage:
        tokens = 0 if args.echo_only else sum(c.tokens for c in choices)
        prompt = sum(len(a.prompt_ids) for a, _ in groups)
        yield chunk(args, rid, created, None, usage_body=usage(prompt, tokens))


def _reasoning_deltas(think: ReasoningStream, delta: str, last: bool) -> tuple[str, str]:
    """A text delta split into reasoning and content (what is held comes out at the end)."""
    thought, content = think.push(delta)
    if last:
        more, rest = think.finish()
        thought, content = thought + more, content + rest
    return thought, content


def _tool_deltas(calls: ToolStream, delta: str, last: bool) -> tuple[str, list[dict]]:
    """A text delta split into content and the tool calls it completes (each with its stream index)."""
    first = len(calls.calls)
    content, new = calls.push(delta)
    if last:
        rest, more = calls.finish()
        content, new = content + rest, new + more
    return content, [{"index": first + k, **c} for k, c in enumerate(new)]


async def generate(request: web.Request, st: Serving) -> web.Response:
    """LightLLM parity: token ids in, token ids out, exactly max_new_tokens each (no EOS stop);
    each prompt is one engine request, admitted all together or not at all."""
    prompts, max_new, params = await parsed(request, st, st.bounds["generate"], parse_generate, st.limits)
    if len(prompts) > st.engine.capacity:
        raise bad("input_ids", f"{len(prompts)} prompts can never be admitted together: at most "
                  f"{st.engine.capacity} requests are outstanding ({st.engine.max_running} running + "
                  f"{st.engine.max_waiting} waiting, --max_waiting_requests); send at most "
                  f"{st.engine.capacity}",
                  code="too_many_prompts")
    if not st.engine.has_room(len(prompts)):
        raise _queue_full(QueueFull(f"{len(prompts)} prompts, {st.engine.outstanding} requests outstanding, "
                                    f"limit {st.engine.capacity}"))
    handles = []
    try:
        for p in prompts:
            args = GenerateArgs(prompt_ids=p, max_tokens=max_new, ignore_eos=True, prompt_param="input_ids",
                                **params)
            handles.append(await _submit(st, args))
        outs = await asyncio.gather(*[_collect(h) for h in handles])
    except EngineFailure as e:
        raise engine_failure(e) from None
    finally:
        for h in handles:
            h.close()
    return web.json_response({"output_ids": outs})


async def _collect(handle) -> list[int]:
    ids = []
    async for out in handle:
        ids += out.new_token_ids
    return ids
