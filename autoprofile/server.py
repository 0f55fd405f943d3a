"""The HTTP server: the OpenAI wire format over the engine loop, LightLLM's /generate, health, metrics.

    GET  /health               200 once the profile is validated; 503 while starting and while draining
    GET  /metrics              Prometheus text (this app's own registry)
    GET  /v1/models            the served model (--served_model_name, else --model)
    POST /v1/completions       prompt (text or token ids) -> text; stream: true sends server-sent events
    POST /v1/chat/completions  messages (the model's chat template) -> text; stream as above
    POST /v1/responses         OpenAI's Responses API over the chat path (serving.responses); GET one stored
    POST /generate             LightLLM parity: {"input_ids": [[ids]], "max_new_tokens"} -> {"output_ids"}
    POST /tokenize, /detokenize, GET /version   vLLM's: text or chat messages <-> token ids; the version

Handlers only translate HTTP to engine requests and stream tokens back; the engine runs in a process of
its own with one CUDA GPU (serving.engine_process; --engine_thread: not), else on its own thread of this
process (autoprofile/serving/async_engine.py). Every client mistake is a 4xx with an OpenAI error object
naming the field; a 500 never carries internal text. SIGTERM/SIGINT: stop accepting (503), finish every
request already accepted, exit 0. Everything is per app: two servers in one process share nothing.
With --api_key every request but /health and /metrics (so every /v1/* and /generate) must send
"Authorization: Bearer <key>", else a 401.

The OpenAI handlers are serving.openai's (serving.responses' for the Responses API): each route here
hands one the app's state while the server accepts requests. An engine loop that dies or wedges turns
/health to 503 "dead", fails every outstanding request with a 503, and `serve` ends the process with exit
code 1 (a supervisor restarts it).
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from autoprofile import __version__
from autoprofile.serving import openai, responses
from autoprofile.serving.async_engine import AsyncEngine, settle
from autoprofile.serving.engine_process import EngineBootError, EngineProcess
from autoprofile.engine.step_profile import ProfileError
from autoprofile.serving.errors import APIError
from autoprofile.serving.metrics import ServerMetrics
from autoprofile.serving.openai import RETRY_AFTER_S, body_bounds, engine_dead
from autoprofile.serving.protocol import Limits, parse_start_profile
from autoprofile.serving.responses import ResponseStore
from autoprofile.serving.structured import Grammars
from autoprofile.serving.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
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
    grammars_loading: asyncio.Future | None = None  # grammars' build, when the server was ready before it
    limits: Limits | None = None
    result: object = None
    dead: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.metrics = ServerMetrics(lambda: self.engine.snapshot if self.engine else None, self._device,
                                     lambda: self.grammars.stats if self.grammars else None,
                                     lambda: self.engine.cpu_seconds() if self.engine else {})
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


def _accepting(app: web.Application) -> ServerState:
    st = app[STATE]
    if st.phase == "dead":
        raise engine_dead()
    if st.phase == "starting":
        raise APIError(503, "the server is starting: the memory profile is not validated yet",
                       type="service_unavailable", code="starting",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    if st.phase == "draining":
        raise APIError(503, "the server is shutting down and accepts no new requests",
                       type="service_unavailable",
                       code="draining")
    return st


def accepting(handler):
    """handler(request, state) as a route, called only while the server accepts requests (else a 503)."""
    @functools.wraps(handler)
    async def route(request: web.Request) -> web.StreamResponse:
        return await handler(request, _accepting(request.app))
    return route


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


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def start_profile(request: web.Request, st: ServerState) -> web.Response:
    """vLLM's POST /start_profile (SGLang's num_steps): a torch.profiler trace of the engine's steps."""
    num_steps = parse_start_profile(await request.read())
    await _profile(st, "start", num_steps)
    return web.json_response({"profiling": True, "num_steps": num_steps, "folder": st.cfg.profile_dir})


async def stop_profile(request: web.Request, st: ServerState) -> web.Response:
    t = await _profile(st, "stop")
    return web.json_response({"profiling": False, "trace": t.trace, "table": t.table, "steps": t.steps})


async def _profile(st: ServerState, action: str, num_steps: int | None = None):
    if st.engine.profile_dir is None:
        raise APIError(400, "this server takes no traces: start it with --profile_dir DIR (e.g. "
                       "--profile_dir autoprofile_traces)", code="profiling_disabled")
    try:
        return await st.engine.profile(action, num_steps)
    except ProfileError as e:
        raise APIError(409, str(e), code="profile_state") from None
    except OSError as e:  # the folder's disk or permissions changed since the flag was checked
        raise APIError(500, f"the trace could not be written in --profile_dir {st.cfg.profile_dir}: {e}",
                       type="server_error", code="profile_write") from None


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
    app.router.add_post("/v1/completions", accepting(openai.completions))
    app.router.add_post("/v1/chat/completions", accepting(openai.chat_completions))
    app.router.add_post("/v1/responses", accepting(responses.responses))
    app.router.add_get("/v1/responses/{response_id}", accepting(responses.stored_response))
    app.router.add_post("/generate", accepting(openai.generate))
    app.router.add_post("/tokenize", accepting(openai.tokenize))
    app.router.add_post("/detokenize", accepting(openai.detokenize))
    app.router.add_get("/version", version)
    app.router.add_post("/start_profile", accepting(start_profile))
    app.router.add_post("/stop_profile", accepting(stop_profile))
    if engine is not None:
        async def on_startup(app):
            activate(app, engine, result, tokenizer)
        app.on_startup.append(on_startup)
    app.on_cleanup.append(_stop_engine)
    return app


def serving_vocab(cfg, tokenizer=None) -> tuple:
    """(tokenizer, Grammars or None, why there is none): the tokenizer (`tokenizer`, else --tokenizer's or
    the model's) and xgrammar's view of its vocabulary (`grammars_for`)."""
    tokenizer = tokenizer or load_tokenizer(cfg)
    return (tokenizer, *grammars_for(tokenizer, cfg.model_config.vocab_size))


def grammars_for(tokenizer, vocab_size: int) -> tuple:
    """(Grammars or None, why there is none): structured output's compiler for the tokenizer, built once.
    Importing xgrammar (it imports transformers) took 5.7-7 s of host time on the GPU hosts: `serve` builds
    this after the boot, beside the first requests (`activate(grammars_later=True)`), not beside the boot,
    whose host-bound steps it slowed."""
    try:
        return Grammars(tokenizer, vocab_size), None
    except Exception as e:  # noqa: BLE001 - the server serves on; structured requests get a 400 saying why
        error = f"{type(e).__name__}: {e}"
        log.warning("structured output and forced tool calls are off: xgrammar cannot read the tokenizer "
                    "(%s)", error)
        return None, error


def activate(app: web.Application, engine, result, tokenizer=None, vocab: tuple | None = None,
             grammars_later: bool = False) -> None:
    """Start the engine loop (call on the app's event loop) and accept requests. vocab: serving_vocab's
    result when it was built already. grammars_later: the server is ready before structured output's
    compiler is built (on a thread, `grammars_for`); a request with a grammar waits for it (vLLM builds its
    grammar backend at the first such request)."""
    st = app[STATE]
    context = engine.envelope.max_req_total_len  # --max_req_total_len auto: the profile may have cut it
    if context != st.cfg.context_len:
        st.cfg = st.cfg.replace(max_req_total_len=context)
    cfg = st.cfg
    if grammars_later:
        st.tokenizer = tokenizer or load_tokenizer(cfg)
        build_grammars_later(st, cfg.model_config.vocab_size)
    else:
        st.tokenizer, st.grammars, st.grammars_error = vocab or serving_vocab(cfg, tokenizer)
    st.limits = Limits(served_names(cfg), cfg.context_len, cfg.model_config.vocab_size,
                       cfg.max_images_per_request if cfg.model_config.vision is not None else 0)
    if cfg.model_config.vision is not None and cfg.allowed_media_domains:
        st.http = aiohttp.ClientSession()
    st.result = result
    st.metrics.add_profile(result)
    st.engine = AsyncEngine(engine, engine.envelope.running_reqs, cfg.max_waiting_requests, st.metrics,
                            on_dead=functools.partial(_on_dead, st), profile_dir=cfg.profile_dir,
                            stream_interval=cfg.stream_interval)
    st.engine.start()
    st.phase = "ready"
    log.info("ready: %d KV tokens, %d running + %d waiting requests at most", result.tokens,
             st.engine.max_running,
             st.engine.max_waiting)


def build_grammars_later(st: ServerState, vocab_size: int) -> None:
    """`grammars_for` on a daemon thread; st.grammars_loading is done once st.grammars is set. A daemon: a
    server stopped before the build ends exits without waiting for it (xgrammar's import cannot be cut
    short; in the loop's default executor the exit waited for it)."""
    loop = asyncio.get_running_loop()
    st.grammars_loading = loop.create_future()

    def build() -> None:
        built = grammars_for(st.tokenizer, vocab_size)
        try:
            loop.call_soon_threadsafe(_grammars_built, st, built)
        except RuntimeError:  # the loop closed first: nobody is left to serve them
            pass
    threading.Thread(target=build, name="grammars", daemon=True).start()


def _grammars_built(st: ServerState, built: tuple) -> None:
    st.grammars, st.grammars_error = built
    if not st.grammars_loading.done():
        st.grammars_loading.set_result(None)
    log.info("structured output: %s", "ready" if st.grammars is not None else "off")


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
async def serve(cfg, boot, remote: EngineProcess | None = None) -> int:
    """Bind first (/health says 503 "starting"), boot (load + profile) on a thread, serve until SIGTERM or
    SIGINT, drain, exit 0. boot(cfg) -> (runner, result); ProfileError ends with its diagnostic, exit 1.
    cfg.uses_engine_process: the boot and the engine loop run in `remote` (an EngineProcess, started already
    or not), else in one made here from boot.
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
    if remote is None and cfg.uses_engine_process:
        remote = EngineProcess(cfg, boot)  # boots there, serves from there

    def run_boot() -> None:
        try:
            outcome = (None, boot(cfg) if remote is None else (remote, remote.boot()))
        except BaseException as e:  # noqa: BLE001 - handed to the event loop
            outcome = (e, None)
        loop.call_soon_threadsafe(settle, booted, *outcome)

    # NOTE: a daemon thread: a signal during the profile must not wait for it
    threading.Thread(target=run_boot, name="boot", daemon=True).start()
    vocab_pool = ThreadPoolExecutor(1, thread_name_prefix="vocab")
    tokenizer = vocab_pool.submit(load_tokenizer, cfg)  # beside the boot; xgrammar's vocabulary after it
    vocab_pool.shutdown(wait=False)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({booted, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not booted.done():
        log.info("stopped during startup: nothing was being served")
        await site.cleanup()
        if remote is not None:
            remote.kill()
        logging.shutdown()
        os._exit(EXIT_OK)  # NOTE: the boot thread holds the GPU mid-profile; only the process exit frees it
    try:
        runner, result = booted.result()
    except BaseException as e:
        await site.cleanup()
        if isinstance(e, (ProfileError, EngineBootError)):
            print(str(e), file=sys.stderr)
            return EXIT_FAILED
        raise
    st = app[STATE]
    try:
        tokenizer = await asyncio.wrap_future(tokenizer)
        engine = runner if remote is not None else LLMEngine.from_config(runner, cfg)
        activate(app, engine, result, tokenizer=tokenizer, grammars_later=True)
        died = asyncio.ensure_future(st.died.wait())
        await asyncio.wait({stopping, died}, return_when=asyncio.FIRST_COMPLETED)
        if not st.died.is_set():
            await drain(app)
    finally:
        await site.cleanup()  # stops the engine loop (on_cleanup); the failed requests get their 503 first
        if remote is not None:
            remote.kill()  # stopped already (on_cleanup), or dead: a wedged one never ends by itself
        elif st.dead is None:
            runner.teardown()  # NOTE: a dead loop's thread may still hold the runner: only the exit frees it
    if st.dead is not None:
        raise EngineDead(f"error: the engine loop died while serving: {st.dead}; exiting with code "
                         f"{EXIT_FAILED} so that a supervisor restarts the server")
    return EXIT_OK


def run_server(cfg, boot, remote: EngineProcess | None = None) -> int:
    try:
        return asyncio.run(serve(cfg, boot, remote))
    except EngineDead as e:
        print(str(e), file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(EXIT_FAILED)  # NOTE: a wedged engine thread may never return: no interpreter teardown
