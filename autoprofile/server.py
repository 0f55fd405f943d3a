"""Minimal HTTP server: /health, /metrics (Prometheus), /generate (token ids in, token ids out).

`make_app(runner, result)` holds everything per app (registry, lock): two servers in one process or on
one host never share state; the only port is cfg.port (0 = a free one, logged once bound).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from autoprofile.engine.sampling import SamplingParams

log = logging.getLogger(__name__)
MAX_BODY = 64 << 20  # JSON token ids of long prompts outgrow aiohttp's 1 MiB default


class BadRequest(ValueError):
    pass


@dataclass(frozen=True)
class GenerateRequest:
    input_ids: list[list[int]]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


def _number(body: dict, key: str, default, kind: type, ok, rule: str):
    value = body.get(key, default)
    allowed = (int, float) if kind is float else int
    if isinstance(value, bool) or not isinstance(value, allowed) or not ok(value):
        raise BadRequest(f"'{key}' {rule}, got {value!r}")
    return kind(value)


def parse_generate(body: object, vocab_size: int, context_len: int, batch_max_tokens: int) -> GenerateRequest:
    """Validate a /generate body against the served limits; BadRequest names the field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    ids = body.get("input_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(p, list) and p for p in ids)):
        raise BadRequest("'input_ids' must be a non-empty list of non-empty lists of token ids")
    for p in ids:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in p):
            raise BadRequest(f"'input_ids' must hold integers in [0, {vocab_size})")
    n = _number(body, "max_new_tokens", 16, int, lambda v: v >= 1, "must be an integer >= 1")
    longest = max(len(p) for p in ids)
    if longest > batch_max_tokens:
        raise BadRequest(f"'input_ids' holds a prompt of {longest} tokens, more than one prefill batch "
                         f"(--batch_max_tokens {batch_max_tokens})")
    if longest + n > context_len:
        raise BadRequest(f"prompt ({longest} tokens) + 'max_new_tokens' ({n}) exceeds the "
                         f"{context_len}-token request limit (--max_req_total_len)")
    return GenerateRequest(
        input_ids=ids, max_new_tokens=n,
        temperature=_number(body, "temperature", 0.0, float, lambda v: v >= 0, "must be >= 0 (0 = greedy)"),
        top_p=_number(body, "top_p", 1.0, float, lambda v: 0 < v <= 1, "must be in (0, 1]"),
        top_k=_number(body, "top_k", 0, int, lambda v: v >= 0, "must be an integer >= 0 (0 = off)"),
    )


@dataclass
class Metrics:
    registry: CollectorRegistry
    requests: Counter
    generated_tokens: Counter


def make_metrics(result) -> Metrics:
    """A registry of this app's own: KV size and profile phase durations from `result`, request counters."""
    reg = CollectorRegistry()
    Gauge("autoprofile_kv_cache_tokens", "KV cache size in tokens", registry=reg).set(result.tokens)
    Gauge("autoprofile_kv_cache_bytes", "KV cache size in bytes (this rank)",
          registry=reg).set(result.kv_bytes)
    phases = Gauge("autoprofile_profile_phase_seconds", "duration of each startup profile phase",
                   ["phase"], registry=reg)
    for name, seconds in result.phases:
        phases.labels(phase=name).set(seconds)
    return Metrics(
        registry=reg,
        requests=Counter("autoprofile_generate_requests", "/generate requests by outcome", ["status"],
                         registry=reg),
        generated_tokens=Counter("autoprofile_generated_tokens", "tokens generated", registry=reg),
    )


# Typed app keys: per-app state, no module-level mutable objects.
RUNNER = web.AppKey("runner", object)
RESULT = web.AppKey("result", object)
METRICS = web.AppKey("metrics", Metrics)
LOCK = web.AppKey("lock", asyncio.Lock)


async def health(request: web.Request) -> web.Response:
    result = request.app[RESULT]
    return web.json_response({"status": "ok", "kv_tokens": result.tokens, "kv_bytes": result.kv_bytes})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def generate(request: web.Request) -> web.Response:
    app = request.app
    m, cfg = app[METRICS], app[RESULT].cfg
    try:
        req = parse_generate(await request.json(), cfg.model_config.vocab_size, cfg.context_len,
                             cfg.batch_max_tokens)
    except (BadRequest, ValueError) as e:  # ValueError: the body is not JSON
        m.requests.labels(status="bad_request").inc()
        return web.json_response({"error": str(e)}, status=400)
    try:
        # NOTE: the runner is not thread-safe; one generate at a time, off the event loop.
        async with app[LOCK]:
            out = await asyncio.to_thread(app[RUNNER].generate, req.input_ids, req.max_new_tokens,
                                          sampling=req.sampling)
    except Exception as e:  # noqa: BLE001 - the server stays up and says what failed
        log.exception("generate failed")
        m.requests.labels(status="error").inc()
        return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500)
    m.requests.labels(status="ok").inc()
    m.generated_tokens.inc(sum(len(o) for o in out))
    return web.json_response({"output_ids": out})


def make_app(runner, result) -> web.Application:
    """runner: .generate(prompts, max_new_tokens, sampling=...) -> list[list[int]];
    result: a ProfileResult (.cfg, .tokens, .kv_bytes, .phases as (name, seconds) pairs)."""
    app = web.Application(client_max_size=MAX_BODY)
    app[RUNNER], app[RESULT], app[METRICS] = runner, result, make_metrics(result)
    app[LOCK] = asyncio.Lock()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/generate", generate)
    return app


async def start(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Bind and start serving; port 0 takes a free port (see the returned runner's .addresses)."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    log.info("serving on %s", ", ".join(f"http://{a[0]}:{a[1]}" for a in runner.addresses))
    return runner


async def serve_forever(app: web.Application, host: str, port: int) -> None:
    runner = await start(app, host, port)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def run_server(cfg, runner, result) -> None:
    try:
        asyncio.run(serve_forever(make_app(runner, result), cfg.host, cfg.port))
    except KeyboardInterrupt:
        log.info("stopped")
