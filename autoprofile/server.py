"""The HTTP server: the OpenAI wire format over the engine loop, LightLLM's /generate, health, metrics.

    GET  /health               200 once the profile is validated; 503 while starting and while draining
    GET  /metrics              Prometheus text (this app's own registry)
    GET  /v1/models            the served model (--served_model_name, else --model)
    POST /v1/completions       prompt (text or token ids) -> text; stream: true sends server-sent events
    POST /v1/chat/completions  messages (the model's chat template) -> text; stream as above
    POST /v1/responses         OpenAI's Responses API over the chat path (serving.responses); GET one stored
    POST /generate             LightLLM parity: {"input_ids": [[ids]], "max_new_tokens"} -> {"output_ids"}
    POST /tokenize, /detokenize, GET /version   vLLM's: text or chat messages <-> token ids; the version

Handlers only translate HTTP to engine requests and stream tokens back; the engine runs on its own
thread (autoprofile/serving/async_engine.py). Every client mistake is a 4xx with an OpenAI error object
naming the field; a 500 never carries internal text. SIGTERM/SIGINT: stop accepting (503), finish every
request already accepted, exit 0. Everything is per app: two servers in one process share nothing.
With --api_key every request but /health and /metrics (so every /v1/* and /generate) must send
"Authorization: Bearer <key>", else a 401.

Bodies are bounded in bytes while they are read, each endpoint by what a valid request to it can carry
(BodyBound: the OpenAI endpoints one longest token list with margin plus the images' base64, /generate the
most prompts it admits at once of the longest prompt), and one larger than PARSE_ON_LOOP_BYTES is parsed and
validated on a worker thread. An engine loop that dies or wedges turns /health to 503 "dead", fails every
outstanding request with a 503, and `serve` ends the process with exit code 1 (a supervisor restarts it).
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from autoprofile import __version__
from autoprofile.budget import running_reqs
from autoprofile.engine.request import RequestError
from autoprofile.engine.sampling import SamplingParams
from autoprofile.serving.async_engine import AsyncEngine, EngineFailure, QueueFull, settle
from autoprofile.serving.images import FETCH_TIMEOUT_S, MAX_IMAGE_BYTES
from autoprofile.serving.metrics import ServerMetrics
from autoprofile.serving.protocol import (BODY_MARGIN, BODY_OVERHEAD, APIError, GenerateArgs, Limits, bad,
                                          chunk, decode_json, generate_body_bytes, max_body_bytes, parse_chat,
                                          parse_completion, parse_detokenize, parse_generate, parse_tokenize,
                                          show, with_image_ids)
from autoprofile.serving.protocol import request_id as new_request_id
from autoprofile.serving.protocol import choice as choice_body
from autoprofile.serving.protocol import response, usage
from autoprofile.serving.choices import Choice, best, merged
from autoprofile.serving.logprobs import chat_content, completion_block, echo_entries
from autoprofile.serving.reasoning import END, ReasoningStream, reasoning_tokens, split, starts_thinking
from autoprofile.serving.responses import (ResponseEvents, ResponseStore, not_found, output_items,
                                           parse_responses, remember, response_object, sse)
from autoprofile.serving.responses import usage as responses_usage
from autoprofile.serving.structured import Grammars
from autoprofile.serving.tools import ToolStream, reply_calls
from autoprofile.serving.vision import ImageOptions, encode_with_images, load_prepared, multimodal_input
from autoprofile.serving.tokenizer import TextStream, load_tokenizer

log = logging.getLogger(__name__)
PARSE_ON_LOOP_BYTES = 64 << 10  # larger bodies are parsed and validated on a worker thread
READ_CHUNK_BYTES = 64 << 10
RETRY_AFTER_S = 1
EXIT_OK, EXIT_FAILED = 0, 1


class EngineDead(RuntimeError):
    """The engine loop died or wedged while serving: the process must end (exit 1)."""


@dataclass
class ServerState:
    """Everything one app holds. phase: "starting" until the profile is validated, "ready", "draining",
    or "dead" (the engine loop died or wedged: `dead` says how; `died` is set)."""

    cfg: object
    phase: str = "starting"
    engine: AsyncEngine | None = None
    tokenizer: object = None
    grammars: Grammars | None = None  # structured output's compiler and cache (serving.structured)
    grammars_error: str | None = None  # why there is none
    limits: Limits | None = None
    result: object = None
    dead: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.metrics = ServerMetrics(lambda: self.engine.snapshot if self.engine else None, self._device,
                                     lambda: self.grammars.stats if self.grammars else None)
        self.bounds = body_bounds(self.cfg)
        self.max_body = max(b.limit for b in self.bounds.values())  # aiohttp's client_max_size
        self.http = None  # aiohttp.ClientSession for allow-listed image URLs (made on the app's loop)
        self.parser = ThreadPoolExecutor(2, thread_name_prefix="parse")
        self.responses = ResponseStore(registry=self.metrics.registry)  # for previous_response_id
        self.died = asyncio.Event()

    def _device(self):
        runner = getattr(self.engine.engine, "runner", None) if self.engine is not None else None
        return getattr(runner, "device", None)


STATE = web.AppKey("state", ServerState)


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


def sampling_params(args, index: int = 0) -> SamplingParams:
    """Choice `index`'s parameters (serving.choices): its own seed stream (seed + index); the sampled tokens'
    logprobs when asked, or for best_of's ranking; the prompt's logprobs (echo) on the first choice only;
    the logits processors' fields."""
    seed = None if args.seed is None else args.seed + index
    k = args.logprobs
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=seed,
                          logprobs=0 if k is None and args.best_of > args.n else k,
                          prompt_logprobs=k if args.echo and index == 0 else None,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty, logit_bias=args.logit_bias,
                          min_p=args.min_p, min_tokens=args.min_tokens)


def text_ids(args, out) -> list[int]:
    """The ids whose text the client gets: a stop_token_ids token that ended the request is no text."""
    ids = out.new_token_ids
    if out.finish_reason == "stop" and ids and ids[-1] in args.stop_token_ids:
        return ids[:-1]
    return ids


def served_names(cfg) -> tuple[str, ...]:
    """The names a request's `model` may give; the first is the one /v1/models lists and responses carry."""
    return tuple(dict.fromkeys(n for n in (cfg.served_model_name, cfg.model, cfg.model_config.name) if n))


# ---------------------------------------------------------------- errors
def _error_response(e: APIError) -> web.Response:
    return web.json_response(e.body(), status=e.status, headers=e.headers)


HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


@web.middleware
async def errors(request: web.Request, handler):
    """APIError -> its body; aiohttp's own 4xx (unknown path, method, too large) -> the same shape;
    anything else -> a 500 without internal text (logged here)."""
    m = request.app[STATE].metrics
    endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
    try:
        resp = await handler(request)
    except APIError as e:
        resp = _error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        msg = (f"the body is larger than {request.app[STATE].max_body} bytes, the largest of this server's "
               "body bounds" if e.status == 413 else
               f"{request.method} {request.path}: {e.reason}; the endpoints are listed in docs/server.md")
        resp = _error_response(APIError(e.status, msg,
                                        type=HTTP_ERROR_TYPES.get(e.status, "invalid_request_error"),
                                        code=e.reason.lower().replace(" ", "_")))
    except ConnectionResetError:  # the client went away: nobody to answer
        raise
    except Exception:  # noqa: BLE001 - the client gets no internal text; the log gets the traceback
        log.exception("%s %s failed", request.method, request.path)
        resp = _error_response(APIError(500, "internal server error (see the server log)",
                                        type="server_error",
                                        code="internal_error"))
    m.requests.labels(endpoint=endpoint, status=str(resp.status)).inc()
    return resp


def _engine_failure(e: EngineFailure) -> APIError:
    if e.code == "dead":
        return _dead()
    if e.code == "oom":
        return APIError(500,
                        "the engine ran out of GPU memory in a step that held this request; the server is "
                        "still up: retry", type="server_error", code="engine_oom")
    return APIError(500, "the engine failed this request (see the server log); the server is still up",
                    type="server_error", code="engine_error")


def _dead() -> APIError:
    return APIError(503, "the engine loop died; the server is going down to be restarted (see the server "
                    "log)", type="service_unavailable", code="engine_dead")


def _accepting(app: web.Application) -> ServerState:
    st = app[STATE]
    if st.phase == "dead":
        raise _dead()
    if st.phase == "starting":
        raise APIError(503, "the server is starting: the memory profile is not validated yet",
                       type="service_unavailable", code="starting",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    if st.phase == "draining":
        raise APIError(503, "the server is shutting down and accepts no new requests",
                       type="service_unavailable",
                       code="draining")
    return st


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


async def _parsed(request: web.Request, bound: BodyBound, parse, *args):
    """parse(json body, *args), the body bounded in bytes (a 413 past it); a large body is decoded and
    validated on a worker thread so that streams keep flowing."""
    raw = await _read(request, bound)
    work = functools.partial(_decode_and_parse, raw, parse, args)
    if len(raw) <= PARSE_ON_LOOP_BYTES:
        return work()
    # NOTE: json.loads holds the GIL for its whole call (~14 ms/MiB): the byte bound is what caps that stall
    return await asyncio.get_running_loop().run_in_executor(request.app[STATE].parser, work)


def _decode_and_parse(raw: bytearray, parse, args: tuple):
    return parse(decode_json(raw), *args)


def _queue_full(e: QueueFull) -> APIError:
    return APIError(429, f"the server is at capacity ({e}); retry later", type="rate_limit_error",
                    code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


async def _with_images(st: ServerState, args: GenerateArgs) -> GenerateArgs:
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


async def _submit(st: ServerState, args: GenerateArgs, index: int = 0):
    """Queue choice `index` of a request (its images loaded already: _with_images)."""
    eos = () if args.ignore_eos else st.tokenizer.eos_token_ids
    stop_ids = sorted({*eos, *args.stop_token_ids})
    # structured output: each choice its own matcher of the request's grammar (compiled off the loop, cached)
    grammar = None
    if args.structured is not None:
        if st.grammars is None:
            raise bad(args.structured.param, "structured output is not available with this model's tokenizer "
                      f"({st.grammars_error})", code="unsupported_value")
        grammar = await st.grammars.matcher(args.structured)
    try:
        handle = await st.engine.submit(args.prompt_ids, sampling_params(args, index), args.max_tokens,
                                        stop_ids, mm=args.mm, grammar=grammar)
    except QueueFull as e:
        raise _queue_full(e) from None
    except RequestError as e:
        param = args.prompt_param if e.field in ("prompt", "images") else e.field
        raise bad(param, str(e)) from None
    except EngineFailure as e:
        raise _engine_failure(e) from None
    st.metrics.prompt_tokens.inc(len(args.prompt_ids))
    return handle


def _authorized(header: str, key: str) -> bool:
    scheme, _, token = header.partition(" ")
    # NOTE: constant time in the key's content: the token is compared whole, never by prefix
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


OPEN_PATHS = ("/health", "/metrics")  # --api_key guards every other path (a new endpoint too)


@web.middleware
async def auth(request: web.Request, handler):
    """--api_key: the OpenAI endpoints and /generate answer 401 without "Authorization: Bearer <key>"."""
    key = request.app[STATE].cfg.api_key
    if key is not None and request.path not in OPEN_PATHS and not _authorized(
            request.headers.get("Authorization", ""), key):
        raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>' with the "
                       "server's --api_key", type="invalid_request_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


# ---------------------------------------------------------------- endpoints
async def health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.phase == "dead":
        return web.json_response({"status": "dead", "reason": st.dead}, status=503)
    if st.phase != "ready":
        return web.json_response({"status": st.phase}, status=503)
    return web.json_response({"status": "ok", "kv_tokens": st.result.tokens, "kv_bytes": st.result.kv_bytes,
                              "max_running_requests": st.engine.max_running,
                              "max_waiting_requests": st.engine.max_waiting,
                              "max_req_total_len": st.limits.context_len,
                              "weights": st.cfg.model_config.weight_format,
                              "outstanding_requests": st.engine.outstanding, **state_slots(st)})


def state_slots(st) -> dict:
    """A hybrid model's state slots and those held, from the engine loop's last snapshot ({} for any other)."""
    snap = st.engine.snapshot
    if snap is None or not snap.state_slots:
        return {}
    return {"state_slots": snap.state_slots, "state_slots_used": snap.state_slots_used}


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def model_card(st: ServerState) -> dict:
    return {"id": served_names(st.cfg)[0], "object": "model", "created": st.created,
            "owned_by": "autoprofile", "root": st.cfg.model, "max_model_len": st.cfg.context_len}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [model_card(request.app[STATE])]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the served model under any name a request may give, else a 404."""
    st, name = request.app[STATE], request.match_info["model"]
    if name not in served_names(st.cfg):
        raise APIError(404, f"the model '{name:.200}' does not exist; this server serves "
                       f"'{served_names(st.cfg)[0]}' (GET /v1/models)", param="model", code="model_not_found")
    return web.json_response(model_card(st))


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a prompt or chat messages (the chat template, vLLM's fields) -> their token ids."""
    st = _accepting(request.app)
    ids, strs = await _parsed(request, st.bounds["openai"], parse_tokenize, st.limits, st.tokenizer)
    return web.json_response({"count": len(ids), "max_model_len": st.limits.context_len, "tokens": ids,
                              "token_strs": [st.tokenizer.decode([i]) for i in ids] if strs else None})


async def detokenize(request: web.Request) -> web.Response:
    st = _accepting(request.app)
    ids = await _parsed(request, st.bounds["openai"], parse_detokenize, st.limits)
    return web.json_response({"prompt": st.tokenizer.decode(ids)})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, parse_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, parse_chat)


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses: the body as a chat request (serving.responses); its reply as a response object,
    or as Responses events."""
    st = _accepting(request.app)
    args, req = await _parsed(request, st.bounds["openai"], parse_responses, st.limits, st.tokenizer,
                              st.responses)
    if args.images:
        args = await _with_images(st, args)
    _think(st, args)
    _room(st, args, 1)
    choices = await _start(st, args)
    try:
        if args.stream:
            return await _respond_stream(request, st, args, req, choices)
        chat = (await _complete_body(st, args, [(args, choices)]))
    finally:
        for c in choices:
            c.handle.close()
    first, used = chat["choices"][0], chat["usage"]
    message = first["message"]
    thought = _reasoning_count(st, args, first["token_ids"], message.get("reasoning_content"))
    body = response_object(req, args.model, "completed", output_items(message),
                           responses_usage(used["prompt_tokens"], used["completion_tokens"], thought),
                           first["finish_reason"])
    remember(st.responses, req, body)
    return web.json_response(body)


async def _respond_stream(request: web.Request, st: ServerState, args: GenerateArgs, req,
                          choices: list[Choice]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    events = ResponseEvents(req, args.model, functools.partial(_reasoning_count, st, args))
    try:
        for e in events.start():
            await resp.write(sse(e))
        async for body in _chunks(st, args, [(args, choices)]):
            for e in events.feed(body):
                await resp.write(sse(e))
    except EngineFailure as e:
        await resp.write(sse(events.error(_engine_failure(e).body())))
    except ConnectionResetError:  # the client went away: close() aborts the request
        return resp
    if events.response is not None:
        remember(st.responses, req, events.response)
    await resp.write_eof()
    return resp


def _reasoning_count(st: ServerState, args: GenerateArgs, ids: list[int], reasoning: str | None) -> int:
    if args.thinking is None:
        return 0
    return reasoning_tokens(ids, st.tokenizer.encode(END, add_special_tokens=False), args.thinking, reasoning)


async def stored_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{response_id}: a stored response (this server's memory), else a 404."""
    st = _accepting(request.app)
    rid = request.match_info["response_id"]
    stored = st.responses.get(rid)
    if stored is None:
        raise not_found(rid, None)
    return web.json_response(stored.response)


async def _openai(request: web.Request, parse) -> web.StreamResponse:
    st = _accepting(request.app)
    args = await _parsed(request, st.bounds["openai"], parse, st.limits, st.tokenizer)
    if args.images:
        args = await _with_images(st, args)
    _think(st, args)
    prompts = [args, *args.others]
    _room(st, args, args.best_of * len(prompts))
    groups: list[tuple[GenerateArgs, list[Choice]]] = []
    try:
        for k, a in enumerate(prompts):  # a list of prompts: prompt k's choices are indexed from k * n
            groups.append((a, await _start(st, a, k * a.n)))
        if args.stream:
            return await _stream(request, st, args, groups)
        return await _complete(st, args, groups)
    finally:
        for _, choices in groups:
            for c in choices:
                c.handle.close()


THINK_TAIL_TOKENS = 16  # the prompt's last tokens read for an open <think>


def _think(st: ServerState, args: GenerateArgs) -> None:
    """--reasoning_parser: whether a chat reply begins inside <think> (the prompt's end says)."""
    if args.chat and st.cfg.reasoning_parser is not None:
        tail = st.tokenizer.decode(args.prompt_ids[-THINK_TAIL_TOKENS:])
        args.thinking = starts_thinking(st.cfg.reasoning_parser, tail)


def _room(st: ServerState, args: GenerateArgs, count: int) -> None:
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


async def _start(st: ServerState, args: GenerateArgs, base: int = 0) -> list[Choice]:
    """Submit a prompt's best_of choices (indexed from base): the first alone, the others once its first token
    is back (its prompt's full pages are then in the prefix cache: serving.choices)."""
    count = args.best_of
    handles, head = [await _submit(st, args)], []
    try:
        if count > 1:
            try:
                head.append(await handles[0].__anext__())
            except EngineFailure as e:
                raise _engine_failure(e) from None
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


def _logprobs_body(st: ServerState, args: GenerateArgs, c: Choice, entries: list, echo: list,
                   offset: int) -> dict | None:
    """A choice's logprobs in the endpoint's shape (None: not asked); echo: the prompt's entries first."""
    if args.logprobs is None:
        return None
    if args.chat:
        return {"content": chat_content(st.tokenizer, entries)}
    return completion_block(st.tokenizer, echo + entries, offset)


def _echo(st: ServerState, args: GenerateArgs, choices: list[Choice]) -> tuple[str, list]:
    """The echoed prompt (completions' echo): its text and its tokens' logprob entries (the first
    choice's)."""
    if not args.echo:
        return "", []
    text = args.prompt_text if args.prompt_text is not None else st.tokenizer.decode(args.prompt_ids)
    return text, echo_entries(args.prompt_ids, choices[0].prompt if args.logprobs is not None else None)


async def _complete(st: ServerState, args: GenerateArgs,
                    groups: list[tuple[GenerateArgs, list[Choice]]]) -> web.Response:
    return web.json_response(await _complete_body(st, args, groups))


async def _complete_body(st: ServerState, args: GenerateArgs,
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
    return body


async def _choice_bodies(st: ServerState, args: GenerateArgs,
                         choices: list[Choice]) -> tuple[list[dict], int]:
    """One prompt's returned choices (its n best of best_of) and their completion tokens (vLLM's usage: the
    returned choices only)."""
    ids: dict[int, list[int]] = {c.index: [] for c in choices}
    try:
        async for c, out in merged(choices):
            ids[c.index] += out.new_token_ids
            c.advance(out, _finish_reason, text_ids(args, out))
    except EngineFailure as e:
        raise _engine_failure(e) from None
    prefix, echo = _echo(st, args, choices)
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
        bodies.append(body)
    return bodies, 0 if args.echo_only else sum(c.tokens for c in returned)


async def _stream(request: web.Request, st: ServerState, args: GenerateArgs,
                  groups: list[tuple[GenerateArgs, list[Choice]]]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(body: dict) -> None:
        await resp.write(f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode())
    try:
        async for body in _chunks(st, args, groups):
            await send(body)
    except EngineFailure as e:
        await send(_engine_failure(e).body())
    except ConnectionResetError:  # the client went away: close() aborts the request
        return resp
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _chunks(st: ServerState, args: GenerateArgs,
                  groups: list[tuple[GenerateArgs, list[Choice]]]) -> AsyncIterator[dict]:
    """The stream's chunks as they become known (an EngineFailure is raised)."""
    rid, created = new_request_id(args.chat), int(time.time())
    owner = {c.index: (a, choices) for a, choices in groups for c in choices}  # each choice's prompt
    choices = [c for _, group in groups for c in group]
    echoed: set[int] = set()
    started: set[int] = set()

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
        if prefix + delta or lps or ids:
            body = chunk(args, rid, created, prefix + delta, index=c.index, logprobs=lps)
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


async def generate(request: web.Request) -> web.Response:
    """LightLLM parity: token ids in, token ids out, exactly max_new_tokens each (no EOS stop);
    each prompt is one engine request, admitted all together or not at all."""
    st = _accepting(request.app)
    prompts, max_new, params = await _parsed(request, st.bounds["generate"], parse_generate, st.limits)
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
        raise _engine_failure(e) from None
    finally:
        for h in handles:
            h.close()
    return web.json_response({"output_ids": outs})


async def _collect(handle) -> list[int]:
    ids = []
    async for out in handle:
        ids += out.new_token_ids
    return ids


# ---------------------------------------------------------------- the app
def make_app(cfg, engine=None, result=None, tokenizer=None) -> web.Application:
    """An app in the "starting" phase; with an engine (an LLMEngine) and its ProfileResult it becomes
    ready when it starts (else call `activate` once the profile is validated)."""
    state = ServerState(cfg)
    app = web.Application(client_max_size=state.max_body, middlewares=[errors, auth])
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{response_id}", stored_response)
    app.router.add_post("/generate", generate)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    if engine is not None:
        async def on_startup(app):
            activate(app, engine, result, tokenizer)
        app.on_startup.append(on_startup)
    app.on_cleanup.append(_stop_engine)
    return app


def activate(app: web.Application, engine, result, tokenizer=None) -> None:
    """Start the engine loop (call on the app's event loop) and accept requests."""
    st = app[STATE]
    context = engine.envelope.max_req_total_len  # --max_req_total_len auto: the profile may have cut it
    if context != st.cfg.context_len:
        st.cfg = st.cfg.replace(max_req_total_len=context)
    cfg = st.cfg
    st.tokenizer = tokenizer or load_tokenizer(cfg)
    try:  # the tokenizer's vocabulary for xgrammar, once
        st.grammars = Grammars(st.tokenizer, cfg.model_config.vocab_size)
    except Exception as e:  # noqa: BLE001 - the server serves on; structured requests get a 400 saying why
        st.grammars_error = f"{type(e).__name__}: {e}"
        log.warning("structured output and forced tool calls are off: xgrammar cannot read the tokenizer "
                    "(%s)", st.grammars_error)
    st.limits = Limits(served_names(cfg), cfg.context_len, cfg.model_config.vocab_size,
                       cfg.max_images_per_request if cfg.model_config.vision is not None else 0)
    if cfg.model_config.vision is not None and cfg.allowed_media_domains:
        st.http = aiohttp.ClientSession()
    st.result = result
    st.metrics.add_profile(result)
    st.engine = AsyncEngine(engine, engine.envelope.running_reqs, cfg.max_waiting_requests, st.metrics,
                            on_dead=functools.partial(_on_dead, st))
    st.engine.start()
    st.phase = "ready"
    log.info("ready: %d KV tokens, %d running + %d waiting requests at most", result.tokens,
             st.engine.max_running,
             st.engine.max_waiting)


def _on_dead(st: ServerState, reason: str) -> None:
    st.phase, st.dead = "dead", reason
    st.died.set()


async def _stop_engine(app: web.Application) -> None:
    st = app[STATE]
    if st.engine is not None:
        await st.engine.stop()
    st.parser.shutdown(wait=False, cancel_futures=True)
    if st.http is not None:
        await st.http.close()


async def drain(app: web.Application) -> None:
    """Stop accepting (503), then wait for every accepted request to finish."""
    st = app[STATE]
    st.phase = "draining"
    if st.engine is not None:
        log.info("draining: %d requests to finish", st.engine.outstanding)
        await st.engine.wait_idle()
    log.info("drained")


async def start(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Bind and start serving; port 0 takes a free port (see the returned runner's .addresses)."""
    runner = web.AppRunner(app, handler_cancellation=True)  # a client that disconnects cancels its handler
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    log.info("serving on %s", ", ".join(f"http://{a[0]}:{a[1]}" for a in runner.addresses))
    return runner


# ---------------------------------------------------------------- the process
async def serve(cfg, boot) -> int:
    """Bind first (/health says 503 "starting"), boot (load + profile) on a thread, serve until SIGTERM or
    SIGINT, drain, exit 0. boot(cfg) -> (runner, result); ProfileError ends with its diagnostic, exit 1.
    An engine loop that dies or wedges raises EngineDead once the failed requests are answered."""
    from autoprofile.engine.engine import LLMEngine
    from autoprofile.profiler import ProfileError

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            log.warning("second %s: exiting now", sig.name)
            os._exit(EXIT_FAILED)
        log.info("%s: stopping", sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    app = make_app(cfg)
    site = await start(app, cfg.host, cfg.port)
    booted: asyncio.Future = loop.create_future()

    def run_boot() -> None:
        try:
            outcome = (None, boot(cfg))
        except BaseException as e:  # noqa: BLE001 - handed to the event loop
            outcome = (e, None)
        loop.call_soon_threadsafe(settle, booted, *outcome)

    # NOTE: a daemon thread: a signal during the profile must not wait for it
    threading.Thread(target=run_boot, name="boot", daemon=True).start()
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({booted, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not booted.done():
        log.info("stopped during startup: nothing was being served")
        await site.cleanup()
        logging.shutdown()
        os._exit(EXIT_OK)  # NOTE: the boot thread holds the GPU mid-profile; only the process exit frees it
    try:
        runner, result = booted.result()
    except BaseException as e:
        await site.cleanup()
        if isinstance(e, ProfileError):
            print(str(e), file=sys.stderr)
            return EXIT_FAILED
        raise
    st = app[STATE]
    try:
        activate(app, LLMEngine.from_config(runner, cfg), result)
        died = asyncio.ensure_future(st.died.wait())
        await asyncio.wait({stopping, died}, return_when=asyncio.FIRST_COMPLETED)
        if not st.died.is_set():
            await drain(app)
    finally:
        await site.cleanup()  # stops the engine loop (on_cleanup); the failed requests get their 503 first
        if st.dead is None:
            runner.teardown()  # NOTE: a dead loop's thread may still hold the runner: only the exit frees it
    if st.dead is not None:
        raise EngineDead(f"error: the engine loop died while serving: {st.dead}; exiting with code "
                         f"{EXIT_FAILED} so that a supervisor restarts the server")
    return EXIT_OK


def run_server(cfg, boot) -> int:
    try:
        return asyncio.run(serve(cfg, boot))
    except EngineDead as e:
        print(str(e), file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(EXIT_FAILED)  # NOTE: a wedged engine thread may never return: no interpreter teardown
