"""`serve --engine_process` (serving.engine_process): the engine loop in a spawned process of its own, against
the engine thread of the same server, on the tiny CPU model (unit_tests.cpu_server: the same random weights
in both processes). Real servers over loopback: the same tokens, grammars built there from their specs, a
disconnect that frees its pages there, the allocator's readings through the snapshots, a clean stop that
leaves no process behind, and an engine process that dies failing every request and ending the server."""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from autoprofile.engine.request import RequestError
from autoprofile.serving.engine_loop import Snapshot
from autoprofile.serving.metrics import device_memory
from unit_tests.cpu_server import bound_url

FLAGS = ["--model", "tiny", "--dtype", "float32", "--attention_backend", "torch",
         "--max_req_total_len", "256", "--report_dir", "", "--profile_cache", ""]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


class Server:
    def __init__(self, *extra: str, flags=tuple(FLAGS)):
        self.proc = subprocess.Popen([sys.executable, "-m", "unit_tests.cpu_server", "--port", "0", *flags,
                                      *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        lines = iter(self.proc.stdout.readline, "")
        self.url = bound_url(self._kept(lines))
        assert self.url, "".join(self.log)
        ready = next((line for line in self._kept(lines) if "ready:" in line or "Error" in line), "")
        assert "ready:" in ready, "".join(self.log)
        threading.Thread(target=lambda: [None for _ in self._kept(lines)], daemon=True).start()

    def _kept(self, lines):
        for line in lines:
            self.log.append(line)
            yield line

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body: dict) -> tuple[int, dict | list[str]]:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
        if body.get("stream"):
            return r.status, [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        return r.status, json.loads(text)

    def engine_children(self) -> list[psutil.Process]:
        """This server's engine process (a spawned child; the resource tracker is one too)."""
        return [c for c in psutil.Process(self.proc.pid).children()
                if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def _answers(s: Server) -> dict:
    """What the comparison asks of each server: greedy text, a stream, a JSON schema, allowed ids, a 400."""
    out = {}
    _, c = s.post("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 16,
                                      "temperature": 0, "ignore_eos": True})
    out["greedy"] = c["choices"][0]["text"]
    _, chunks = s.post("/v1/completions", {"prompt": "Once upon", "max_tokens": 12, "temperature": 0,
                                           "ignore_eos": True, "stream": True})
    out["stream"] = "".join(json.loads(x)["choices"][0]["text"] for x in chunks if x != "[DONE]")
    _, c = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "a json"}],
                                           "max_tokens": 60, "temperature": 0,
                                           "response_format": {"type": "json_schema",
                                                               "json_schema": {"name": "t",
                                                                               "schema": SCHEMA}}})
    out["schema"] = c["choices"][0]["message"]["content"]
    _, c = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "another"}],
                                           "max_tokens": 60, "temperature": 0,
                                           "response_format": {"type": "json_schema",
                                                               "json_schema": {"name": "t",
                                                                               "schema": SCHEMA}}})
    out["schema_again"] = c["choices"][0]["message"]["content"]  # compiled there already: built at once
    _, c = s.post("/v1/completions", {"prompt": "Hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                      "allowed_token_ids": [70, 71, 72]})
    out["allowed"] = c["choices"][0]["text"]
    status, err = s.post("/v1/completions", {"prompt": "x" * 300, "max_tokens": 4})
    out["too_long"] = (status, err["error"]["param"])
    return out


@pytest.fixture(scope="module")
def pair():
    """(the engine in a process of its own, its answers; the same server's engine thread, its answers)."""
    servers = []
    try:
        servers = [Server("--engine_process"), Server()]
        yield [(s, _answers(s)) for s in servers]
    finally:
        for s in servers:
            s.stop()


def test_an_engine_process_answers_as_the_engine_thread_does(pair):
    (remote, got), (_, want) = pair
    assert got == want
    assert json.loads(got["schema"]).keys() == {"a", "b"}
    assert set(got["allowed"]) <= {"C", "D", "E"}  # ids 70-72: the byte-level tokenizer's offset is 3
    assert got["too_long"][0] == 400 and got["too_long"][1] == "prompt"
    assert len(remote.engine_children()) == 1  # the engine in its own process
    assert "[engine]" in "".join(remote.log)  # its log lines, marked


def test_a_disconnect_frees_its_pages_in_the_engine_process(pair):
    (remote, _), _ = pair
    req = urllib.request.Request(remote.url + "/v1/completions", json.dumps(
        {"prompt": "go", "max_tokens": 200, "ignore_eos": True, "stream": True}).encode(),
        {"Content-Type": "application/json"})
    r = urllib.request.urlopen(req, timeout=60)
    r.readline()  # its first chunk: running there
    held = _gauge(remote, "autoprofile_kv_pages_used")
    steps = _gauge(remote, "autoprofile_engine_steps_total")
    r.close()  # the client goes away
    deadline = time.monotonic() + 30
    while _gauge(remote, "autoprofile_kv_pages_used") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert held > 0 and _gauge(remote, "autoprofile_kv_pages_used") == 0
    # aborted there, not run to its 200 tokens: a few steps past the disconnect (the steps in flight)
    assert _gauge(remote, "autoprofile_engine_steps_total") - steps < 50
    assert json.loads(remote.get("/health")[1])["outstanding_requests"] == 0


def _gauge(s: Server, name: str) -> float:
    text = s.get("/metrics")[1]
    line = next(x for x in text.splitlines() if x.startswith(name + " ") or x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_the_engine_process_counts_its_own_cpu_time(pair):
    (remote, _), (local, _) = pair
    for s in (remote, local):
        assert _cpu(s, "engine") > 0 and _cpu(s, "event_loop") > 0
    # the engine process's figure is the whole process: at least its boot's
    child = psutil.Process(remote.engine_children()[0].pid).cpu_times()
    assert _cpu(remote, "engine") >= child.user + child.system - 0.5


def _cpu(s: Server, thread: str) -> float:
    text = s.get("/metrics")[1]
    prefix = f'autoprofile_thread_cpu_seconds_total{{thread="{thread}"}} '
    return float(next(x for x in text.splitlines() if x.startswith(prefix))[len(prefix):])


def test_a_stop_ends_the_engine_process_and_exits_0():
    s = Server("--engine_process")
    child = s.engine_children()[0]
    assert s.stop() == 0
    child.wait(timeout=30)  # gone, not orphaned
    assert not child.is_running()


def test_a_killed_engine_process_fails_every_request_and_the_server_exits_1():
    """An engine process that dies (OOM-killed, a crash) is a dead engine: outstanding requests get a 503,
    /health says why, and the server exits 1 so that a supervisor restarts it."""
    s = Server("--engine_process")
    try:
        answers = []

        def ask():
            answers.append(s.post("/v1/completions", {"prompt": "slow", "max_tokens": 230,
                                                      "ignore_eos": True}))
        t = threading.Thread(target=ask)
        t.start()
        deadline = time.monotonic() + 30
        while not json.loads(s.get("/health")[1]).get("outstanding_requests") and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(s.engine_children()[0].pid, signal.SIGKILL)
        t.join(60)
        status, body = answers[0]
        assert status == 503 and body["error"]["code"] == "engine_dead", body
        assert s.proc.wait(timeout=60) == 1
        assert "the engine process ended (exit code -9) without being stopped" in "".join(s.log)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def test_a_request_error_crosses_the_pipe_with_its_field():
    e = pickle.loads(pickle.dumps(RequestError("images", "too many")))
    assert e.field == "images" and str(e) == "images: too many"


def test_an_engine_process_s_device_memory_comes_from_its_snapshot_not_this_process():
    """The server process never reads CUDA for an engine process: /metrics takes its snapshot's figures."""
    assert device_memory(Snapshot(device_memory=(5 << 30, 7, 1024)), None) == (5 << 30, 7, 1024)
    assert device_memory(Snapshot(), None) == (0, 0, None)


VL = ["--model", "tiny-vl", "--dtype", "float32", "--attention_backend", "torch",
      "--max_req_total_len", "512", "--max_image_pixels", str(64 * 28 * 28),
      "--min_image_pixels", str(4 * 28 * 28), "--report_dir", "", "--profile_cache", ""]


def test_an_image_crosses_to_the_engine_process_and_is_answered_as_in_one_process():
    """tiny-vl (Qwen2.5-VL): the image's patches go over the pipe with the request; the answer and its
    image tokens are those of the engine thread."""
    from unit_tests.test_server_images import data_url, png
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(90, 60, seed=3))}},
        {"type": "text", "text": "describe"}]}], "max_tokens": 6, "temperature": 0}
    answers = []
    for extra in (["--engine_process"], []):
        s = Server(*VL, *extra, flags=())
        try:
            status, out = s.post("/v1/chat/completions", body)
            assert status == 200, out
            answers.append((out["choices"][0]["message"]["content"], out["usage"]))
        finally:
            # -6 twice in local runs on a loaded CPU (not reproduced alone, 3 of 3 passed): the second time the
            # log ended "drained", then "FATAL: exception not rethrown" (glibc: a thread unwound at exit inside
            # a C++ catch-all); its cause is not yet found
            code = s.stop()
            assert code == 0, (extra, code, "".join(s.log)[-4000:])
    assert answers[0] == answers[1] and answers[0][1]["prompt_tokens"] > 20  # the image's tokens counted


def test_a_trace_of_the_engine_process_s_steps(tmp_path):
    """--profile_dir: POST /start_profile and /stop_profile reach the profiler in the engine process; its
    trace is written there and named in the answer."""
    s = Server("--engine_process", "--profile_dir", str(tmp_path))
    try:
        assert s.post("/start_profile", {"num_steps": 3})[0] == 200
        s.post("/v1/completions", {"prompt": "hi", "max_tokens": 8, "ignore_eos": True})
        status, out = s.post("/stop_profile", {})
        assert status == 200 and out["steps"] >= 1, out
        assert (tmp_path / os.path.basename(out["trace"])).exists()
        status, err = s.post("/stop_profile", {})  # none running: the engine process's ProfileError, a 409
        assert status == 409 and err["error"]["code"] == "profile_state"
    finally:
        s.stop()


class _SlowCompiler:
    """Stands for the engine process's compiler (engine_process._Grammars): a spec compiles once `gate` is
    set, then stays compiled."""

    def __init__(self):
        self.gate, self.done = threading.Event(), set()

    def compiled(self, req) -> bool:
        return req.spec in self.done

    def build(self, req):
        if req.spec not in self.done:
            assert self.gate.wait(30)
            self.done.add(req.spec)
        return ("matcher of", req.spec)


def test_a_first_seen_grammar_compiles_aside_and_an_abort_meanwhile_drops_it():
    """The engine process's pipe reader (a real pipe, the loop's real inbox): an add whose grammar is not
    compiled there yet waits on a compile thread while the commands behind it go on; its abort during the
    compile drops it (it never reaches the loop, which would run it with nobody listening)."""
    import multiprocessing
    import queue

    from autoprofile.serving.engine_loop import STOP
    from autoprofile.serving.engine_process import GrammarRequest, _Reader
    ours, theirs = multiprocessing.Pipe()
    inbox, compiler = queue.SimpleQueue(), _SlowCompiler()
    reader = _Reader(theirs, inbox, compiler, lambda msg: None)
    threading.Thread(target=reader.run, daemon=True).start()

    def add(rid, grammar):
        ours.send(("add", rid, ([1, 2], None, 4, (), None, grammar)))
    add("slow", GrammarRequest("S"))
    add("plain", None)
    assert inbox.get(timeout=30)[1] == "plain"  # not held behind the compile
    ours.send(("abort", "slow"))
    _until(lambda: reader.pending.get("slow"))  # the abort read while "slow" compiles
    compiler.gate.set()
    _until(lambda: "S" in compiler.done and not reader.pending)
    add("again", GrammarRequest("S"))  # compiled there now: built at once, in its turn
    ours.send(STOP)
    got = [inbox.get(timeout=30) for _ in range(2)]
    assert [c if c == STOP else (c[1], c[2][5]) for c in got] == [("again", ("matcher of", "S")), STOP]
    assert inbox.empty()


def _until(ok, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_cli_spawns_the_engine_process_before_importing_torch():
    """`serve --engine_process` starts the engine process first, so that its imports and boot overlap the
    server's own: the module that starts it imports no torch, and the boot function goes by name."""
    code = ("import sys, pickle; from autoprofile.serving.engine_process import BootRef; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "b = pickle.loads(pickle.dumps(BootRef('autoprofile.cpu', 'boot_cpu'))); "
            "assert 'torch' not in sys.modules and b.name == 'boot_cpu'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_cli_serves_through_an_engine_process_and_stops_it():
    """The command a user types, on the CPU: the engine process booted by name (autoprofile.cpu's boot)."""
    proc = subprocess.Popen([sys.executable, "-m", "autoprofile.cli", "serve", "--device", "cpu",
                             "--port", "0", "--max_req_total_len", "256", "--report_dir", "",
                             "--profile_cache", "", "--engine_process"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    s = Server.__new__(Server)
    s.proc, s.log = proc, []
    try:
        lines = iter(proc.stdout.readline, "")
        s.url = bound_url(s._kept(lines))
        assert s.url and "ready:" in next((x for x in s._kept(lines) if "ready:" in x or "Error" in x), "")
        threading.Thread(target=lambda: [None for _ in s._kept(lines)], daemon=True).start()
        status, out = s.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
        assert status == 200 and out["usage"]["completion_tokens"] == 4
        assert len(s.engine_children()) == 1
        status, text = s.get("/metrics")  # the engine process's start (its spawn and imports) is a phase
        (start,) = [float(x.split()[-1]) for x in text.splitlines()
                    if x.startswith('autoprofile_profile_phase_seconds{phase="start"}')]
        assert status == 200 and 0 < start < 300
    finally:
        assert s.stop() == 0, "".join(s.log)


def _boot_dies(cfg):
    os._exit(3)  # the engine process ends during its boot, as an OOM kill would end it


def _boot_names_threads(cfg):
    raise RuntimeError(f"threads while booting: {sorted(t.name for t in threading.enumerate())}")


def test_the_engine_process_builds_its_grammar_compiler_at_the_first_request_with_a_grammar():
    """xgrammar's vocabulary is built on a thread the first request with a grammar starts: its import held
    the GIL beside the boot (llama-3.1-8b's warm boot 3.7-5.1 s longer, H200) and, after `ready`, beside a
    hybrid's first served steps. The boot runs without it, plain requests never start it; a grammar's
    request starts it once and gets its matcher."""
    from autoprofile.config import ServerConfig, validate
    from autoprofile.serving.engine_process import (BootRef, EngineBootError, EngineProcess, GrammarRequest,
                                                    _Grammars)
    from autoprofile.serving.structured import Spec
    cfg = validate(ServerConfig(model="tiny", device="cpu", report_dir=None))
    with pytest.raises(EngineBootError, match=r"threads while booting: ") as booting:
        EngineProcess(cfg, BootRef("unit_tests.test_engine_process", "_boot_names_threads")).boot()
    assert "'grammars'" not in str(booting.value)

    def loading() -> int:
        return sum(t.name == "grammars" for t in threading.enumerate())
    grammars = _Grammars(cfg, cfg.model_config.vocab_size)
    assert grammars.compiled(GrammarRequest(None)) and grammars.build(GrammarRequest(None)) is None
    assert not grammars.started and loading() == 0
    spec = Spec("json_object", "", "response_format")
    assert not grammars.compiled(GrammarRequest(spec))  # starts the build, does not wait for it
    assert grammars.started
    assert grammars.build(GrammarRequest(spec)) is not None  # waits, then the matcher
    assert grammars.ready.is_set() and grammars.error is None and grammars.compiled(GrammarRequest(spec))
    _until(lambda: loading() == 0)  # one build, done


def test_prepare_grammars_starts_the_engine_process_s_build_with_no_request():
    """The server's hint (PREPARE_GRAMMARS, a real pipe into the real reader and compiler): the engine
    process's build starts and ends with no request in the loop's inbox, and only once."""
    import multiprocessing
    import queue

    from autoprofile.config import ServerConfig, validate
    from autoprofile.serving.engine_loop import PREPARE_GRAMMARS, STOP
    from autoprofile.serving.engine_process import _Grammars, _Reader
    cfg = validate(ServerConfig(model="tiny", device="cpu", report_dir=None))
    ours, theirs = multiprocessing.Pipe()
    inbox, grammars = queue.SimpleQueue(), _Grammars(cfg, cfg.model_config.vocab_size)
    reader = _Reader(theirs, inbox, grammars, lambda msg: None)
    threading.Thread(target=reader.run, daemon=True).start()
    ours.send((PREPARE_GRAMMARS,))
    ours.send((PREPARE_GRAMMARS,))
    assert grammars.ready.wait(60) and grammars.grammars is not None, grammars.error
    ours.send(STOP)
    assert inbox.get(timeout=30) == STOP and inbox.empty()
    _until(lambda: sum(t.name == "grammars" for t in threading.enumerate()) == 0)


def test_a_first_grammar_request_starts_the_engine_process_s_build_before_the_server_s_is_done(monkeypatch):
    """The server's own compiler still loading (held here), a json_schema request has already told the
    engine process (a real one, booted on the CPU) to build its compiler: the two builds overlap instead of
    one after the other (llama-3.1-8b's first JSON request 7.1-8.2 s with the engine's build after the
    server's, H200). Released, the answer satisfies its schema."""
    import asyncio

    import jsonschema
    from aiohttp.test_utils import TestClient, TestServer

    from autoprofile import server
    from autoprofile.config import ServerConfig, validate
    from autoprofile.serving.engine_loop import PREPARE_GRAMMARS
    from autoprofile.serving.engine_process import BootRef, EngineProcess
    pytest.importorskip("xgrammar")
    cfg = validate(ServerConfig(model="tiny", device="cpu", dtype="float32", attention_backend="torch",
                                max_req_total_len=256, report_dir=None, profile_cache=None))
    release, real, sent = threading.Event(), server.grammars_for, []

    def held(tokenizer, vocab_size):
        assert release.wait(60)
        return real(tokenizer, vocab_size)
    monkeypatch.setattr(server, "grammars_for", held)
    engine = EngineProcess(cfg, BootRef("unit_tests.cpu_server", "boot_cpu"))
    result = engine.boot()
    send = engine.send
    monkeypatch.setattr(engine, "send", lambda cmd: (sent.append(cmd[0]), send(cmd)))
    body = {"messages": [{"role": "user", "content": "a json"}], "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}

    async def main():
        app = server.make_app(cfg)
        async with TestClient(TestServer(app)) as c:
            server.activate(app, engine, result, grammars_later=True)
            answer = asyncio.ensure_future(c.post("/v1/chat/completions", json=body))
            for _ in range(500):
                if sent:
                    break
                await asyncio.sleep(0.01)
            told = list(sent), app[server.STATE].grammars is None
            release.set()
            r = await answer
            return told, r.status, await r.json()
    try:
        told, status, out = asyncio.run(main())
    finally:
        release.set()
    assert told == ([PREPARE_GRAMMARS], True)  # told while the server's own build was still held
    assert status == 200 and sent.count(PREPARE_GRAMMARS) == 1
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), SCHEMA)


def test_an_engine_process_that_dies_booting_names_the_flag_that_boots_in_the_server():
    from autoprofile.config import ServerConfig, validate
    from autoprofile.serving.engine_process import BootRef, EngineBootError, EngineProcess
    cfg = validate(ServerConfig(model="tiny", device="cpu", report_dir=None))
    with pytest.raises(EngineBootError, match="code 3 during the boot.*serve with --engine_thread"):
        EngineProcess(cfg, BootRef("unit_tests.test_engine_process", "_boot_dies")).boot()


@pytest.mark.parametrize("flags", [[], ["--engine_process"]])
def test_no_gpu_with_an_engine_process_started_still_ends_with_the_message(flags):
    """On a host without a GPU `serve` (its engine process spawned before the check: the default, or asked
    for) says so and exits 1: the command ends, it does not wait on the engine process."""
    r = subprocess.run([sys.executable, "-m", "autoprofile.cli", "serve", *flags, "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "needs a CUDA/ROCm GPU" in r.stderr, r.stderr


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-mla", "tiny-hybrid"])
def test_other_families_answer_through_an_engine_process_as_through_the_thread(model):
    """MoE, MLA and a hybrid model (its per-request state beside the KV cache) served through an engine
    process: the same greedy text and stream as the engine thread's, and the state slots in /health."""
    flags = ["--model", model, *FLAGS[2:]]
    got = []
    for extra in (["--engine_process"], []):
        s = Server(*extra, flags=flags)
        try:
            _, c = s.post("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12,
                                              "temperature": 0, "ignore_eos": True})
            _, chunks = s.post("/v1/completions", {"prompt": "Once upon", "max_tokens": 8, "temperature": 0,
                                                   "ignore_eos": True, "stream": True})
            health = json.loads(s.get("/health")[1])
            got.append((c["choices"][0]["text"],
                        "".join(json.loads(x)["choices"][0]["text"] for x in chunks if x != "[DONE]"),
                        health.get("state_slots")))
        finally:
            assert s.stop() == 0
    assert got[0] == got[1] and len(got[0][0]) > 0
    assert (got[0][2] is not None) == (model == "tiny-hybrid")
