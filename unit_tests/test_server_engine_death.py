"""An engine loop that dies (an exception outside a step) or wedges (no progress with work outstanding) on the
real tiny-model engine: /health turns 503, every outstanding request (running and waiting) fails with a 503,
new ones are refused, and `serve` ends the process with exit code 1."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import aiohttp
import pytest

from autoprofile import server
from autoprofile.engine.engine import LLMEngine
from autoprofile.serving import async_engine
from unit_tests.test_server import CFG, ROOT, RUNNING, _cli_flags, booted, greedy, serve  # noqa: F401
from unit_tests.cpu_server import bound_url

WAITING = 2  # CFG.max_waiting_requests
DETECTED_WITHIN_S = 3.0


@pytest.fixture
def faulty(booted):  # noqa: F811
    """A fresh engine over the module's runner, its steps slowed so that no request ends by itself."""
    runner, result = booted
    engine, real_execute = LLMEngine(runner), runner.execute

    def execute(step):
        time.sleep(0.02)
        return real_execute(step)
    runner.execute = execute
    yield engine, result
    del runner.execute


async def _fill(c, app, stream_first: bool):
    """A stream that is running, then requests up to running + waiting; returns (stream response, tasks)."""
    eng = app[server.STATE].engine
    stream = await c.post("/v1/completions", json=greedy(n=200, ignore_eos=True, stream=True))
    await stream.content.readline()
    tasks = [asyncio.ensure_future(c.post("/v1/completions", json=greedy(f"p{i}", n=200, ignore_eos=True)))
             for i in range(RUNNING + WAITING - 1)]
    while eng.snapshot.running < RUNNING or eng.snapshot.waiting < WAITING:
        await asyncio.sleep(0.01)
    return stream, tasks


async def _answers(c, tasks) -> tuple[list[tuple[int, dict]], float]:
    t0 = time.monotonic()
    done = await asyncio.wait_for(asyncio.gather(*tasks), DETECTED_WITHIN_S)
    return [(r.status, await r.json()) for r in done], time.monotonic() - t0


async def _after(c) -> tuple:
    h = await c.get("/health")
    new = await c.post("/v1/completions", json=greedy(n=2))
    gen = await c.post("/generate", json={"input_ids": [[5, 6]]})
    return (h.status, await h.json()), (new.status, await new.json()), gen.status


def _assert_dead(answers, after, reason: str) -> None:
    assert len(answers) == RUNNING + WAITING - 1
    for status, body in answers:
        assert status == 503 and body["error"]["code"] == "engine_dead", body
    (h_status, health), (new_status, new), gen_status = after
    assert h_status == 503 and health["status"] == "dead" and reason in health["reason"]
    assert new_status == 503 and new["error"]["code"] == "engine_dead" and gen_status == 503


def test_an_exception_while_applying_an_abort_kills_the_loop_and_every_request_gets_503(faulty):
    engine, result = faulty

    def abort(request_id):
        raise RuntimeError("injected fault in abort")
    engine.abort = abort

    async def body(c, app):
        stream, tasks = await _fill(c, app, stream_first=True)
        stream.close()  # the disconnect's abort raises on the engine thread
        answers, _ = await _answers(c, tasks)
        return answers, await _after(c), app[server.STATE].died.is_set()
    answers, after, died = serve(engine, result, body)
    _assert_dead(answers, after, "injected fault in abort")
    assert died  # what `serve` waits on to exit 1


def test_a_wedged_loop_is_dead_after_the_watchdogs_limit(faulty, monkeypatch):
    engine, result = faulty
    monkeypatch.setattr(async_engine, "WEDGED_AFTER_S", 0.5)
    real_step, release = engine.step, threading.Event()
    wedge = threading.Event()

    def step():
        if wedge.is_set():
            release.wait(30)
        return real_step()
    engine.step = step
    threads = []

    async def body(c, app):
        threads.append(app[server.STATE].engine._thread)
        stream, tasks = await _fill(c, app, stream_first=True)
        wedge.set()  # the next step never returns
        answers, waited = await _answers(c, tasks)
        return answers, waited, await _after(c)
    try:
        answers, waited, after = serve(engine, result, body)
    finally:
        release.set()
        for t in threads:
            t.join(10)
    _assert_dead(answers, after, "no progress for 0.5 s")
    assert 0.5 <= waited < DETECTED_WITHIN_S
    assert not threads[0].is_alive()  # once its step returned, the dead loop ended


@pytest.mark.slow  # a server process each: its imports and boot
@pytest.mark.parametrize("fault", ["abort", "wedge"])
def test_serve_exits_1_when_the_engine_loop_dies(fault):
    proc = subprocess.Popen([sys.executable, "-m", "unit_tests.cpu_server", *_cli_flags(), "--inject_fault",
                             fault,
                             "--wedged_after_s",
                             "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        url = bound_url(proc.stderr)
        assert url, "the server never bound"
        lines = []
        threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()

        async def go():
            async with aiohttp.ClientSession() as s:
                while True:
                    async with s.get(f"{url}/health") as h:
                        if h.status == 200:
                            break
                    await asyncio.sleep(0.05)
                pending = asyncio.ensure_future(s.post(f"{url}/v1/completions",
                                                       json=greedy(n=200, ignore_eos=True)))
                async with s.post(f"{url}/v1/completions",
                                  json=greedy(n=200, ignore_eos=True, stream=True)) as r:
                    await r.content.readline()  # running; leaving the block hangs up (abort)
                async with await pending as r:
                    return r.status, await r.json()
        status, err = asyncio.run(go())
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status == 503 and err["error"]["code"] == "engine_dead"
    assert code == 1
    text = "".join(lines)
    assert "the engine loop died while serving" in text and "supervisor" in text
