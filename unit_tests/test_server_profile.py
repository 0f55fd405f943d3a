"""POST /start_profile and /stop_profile (--profile_dir): a torch.profiler trace of the engine's steps as
served, on the tiny model through the real server and engine (CPU: the trace holds the steps' CPU ops)."""
from __future__ import annotations

import asyncio
import gzip
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from autoprofile import server
from autoprofile.config import ConfigError, validate
from autoprofile.engine.engine import LLMEngine
from unit_tests.test_server import CFG, booted, greedy, idle, post  # noqa: F401 - booted: the module's runner


@pytest.fixture
def engine(booted):
    eng = LLMEngine.from_config(booted[0], CFG)
    yield eng
    assert eng.stats.pages_used == 0 and not eng.has_unfinished()


def serve(engine, result, body, cfg):
    async def go():
        app = server.make_app(cfg, engine, result)
        async with TestClient(TestServer(app)) as client:
            return await body(client, app)
    return asyncio.run(go())


def steps_in(trace: str) -> list[str]:
    events = json.load(gzip.open(trace))["traceEvents"]
    return sorted({e["name"] for e in events if e.get("name", "").startswith("engine step ")},
                  key=lambda n: int(n.split()[-1]))


def test_a_trace_holds_each_step_served_between_start_and_stop(engine, booted, tmp_path):
    cfg = CFG.replace(profile_dir=str(tmp_path / "traces"))

    async def body(c, app):
        started = await post(c, "/start_profile", {})
        again = await post(c, "/start_profile", {})
        status, out = await post(c, "/v1/completions", greedy(n=6))
        await idle(app)
        steps = app[server.STATE].engine.snapshot.steps
        stopped = await post(c, "/stop_profile", {})
        return started, again, status, out, steps, stopped, await post(c, "/stop_profile", {})

    started, again, status, out, steps, (code, t), none = serve(engine, booted[1], body, cfg)
    assert started == (200, {"profiling": True, "num_steps": None, "folder": cfg.profile_dir})
    assert again[0] == 409 and again[1]["error"]["code"] == "profile_state"
    assert status == 200 and out["usage"]["completion_tokens"] == 6
    assert code == 200 and t["steps"] >= 6  # a prefill step, then a decode step a token
    assert steps_in(t["trace"]) == [f"engine step {i}" for i in range(1, t["steps"] + 1)]
    table = open(t["table"]).read()
    assert table.startswith(f"{t['steps']} engine steps") and "aten::" in table
    assert none[0] == 409 and "POST /start_profile first" in none[1]["error"]["message"]


def test_num_steps_ends_the_trace_by_itself_and_stop_returns_it_once(engine, booted, tmp_path):
    cfg = CFG.replace(profile_dir=str(tmp_path))

    async def body(c, app):
        started = await post(c, "/start_profile", {"num_steps": 2})
        await post(c, "/v1/completions", greedy(n=8))
        await idle(app)
        return started, await post(c, "/stop_profile", {}), await post(c, "/stop_profile", {})

    started, (code, t), (again, _) = serve(engine, booted[1], body, cfg)
    assert started[1]["num_steps"] == 2 and code == 200 and t["steps"] == 2
    assert steps_in(t["trace"]) == ["engine step 1", "engine step 2"]
    assert again == 409


@pytest.mark.parametrize("raw, param", [
    (b'{"num_steps": 0}', "num_steps"), (b'{"num_steps": true}', "num_steps"),
    (b'{"num_steps": 1.5}', "num_steps"), (b'{"steps": 3}', None), (b"[2]", None), (b"{num", None)])
def test_a_bad_start_body_is_a_400_naming_what_to_send(engine, booted, tmp_path, raw, param):
    cfg = CFG.replace(profile_dir=str(tmp_path))

    async def body(c, app):
        r = await c.post("/start_profile", data=raw)
        return r.status, await r.json(), await post(c, "/stop_profile", {})

    status, err, after = serve(engine, booted[1], body, cfg)
    assert status == 400 and err["error"]["param"] == param and "num_steps" in err["error"]["message"]
    assert after[0] == 409  # nothing was started


def test_a_body_nested_past_the_parser_is_a_400_not_a_500(engine, booted, tmp_path):
    cfg = CFG.replace(profile_dir=str(tmp_path))

    async def body(c, app):
        r = await c.post("/start_profile", data=b'{"num_steps": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        return r.status, await r.json()

    status, err = serve(engine, booted[1], body, cfg)
    assert status == 400 and err["error"]["code"] == "invalid_json" and err["error"]["param"] == "num_steps"


def test_a_trace_that_cannot_be_written_fails_its_stop_not_the_engine(engine, booted, tmp_path):
    """The folder turns into a file after the start: the trace written after num_steps fails, the engine
    serves on, and /stop_profile answers 500 naming --profile_dir."""
    folder = tmp_path / "traces"
    cfg = CFG.replace(profile_dir=str(folder))

    async def body(c, app):
        await post(c, "/start_profile", {"num_steps": 2})
        folder.rmdir()
        folder.write_text("not a folder")
        first = await post(c, "/v1/completions", greedy(n=4))
        second = await post(c, "/v1/completions", greedy(n=4))
        await idle(app)
        return first[0], second[0], await post(c, "/stop_profile", {}), app[server.STATE].phase

    first, second, (status, err), phase = serve(engine, booted[1], body, cfg)
    assert first == second == 200 and phase == "ready"
    assert status == 500 and err["error"]["code"] == "profile_write"
    assert "--profile_dir" in err["error"]["message"]


def test_a_profile_running_when_the_server_stops_is_dropped(engine, booted, tmp_path):
    """The engine loop's end stops a running profile (unwritten): nothing is left recording after the server,
    and a later server starts its own."""
    cfg = CFG.replace(profile_dir=str(tmp_path))

    async def start(c, app):
        return (await post(c, "/start_profile", {}))[0], app[server.STATE].engine.profiler

    for _ in range(2):
        status, profiler = serve(engine, booted[1], start, cfg)
        assert status == 200 and not profiler.active
    assert not list(tmp_path.iterdir())  # dropped, not written


def test_without_profile_dir_the_endpoints_name_the_flag(engine, booted):
    async def body(c, app):
        return await post(c, "/start_profile", {}), await post(c, "/stop_profile", {})

    for status, err in serve(engine, booted[1], body, CFG):
        assert status == 400 and err["error"]["code"] == "profiling_disabled"
        assert "--profile_dir" in err["error"]["message"]


def test_a_profile_dir_that_is_a_file_is_refused_before_the_boot(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError) as e:
        validate(CFG.replace(profile_dir=str(f)))
    assert e.value.flag == "profile_dir" and "try --profile_dir" in str(e.value)
