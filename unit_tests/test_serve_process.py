"""`autoprofile serve` as a process on the CPU, flags to behaviour: --tp 2 (serve_tp really launching gloo
ranks) binds before the ranks boot, serves, stops on SIGTERM and fails at once on a port clash;
--disable_prefix_caching reaches the engine."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPAWN_S = 90  # two spawned ranks importing torch, on 2 slow cores


def _start(args: list[str], env: dict | None = None) -> tuple[subprocess.Popen, list[str]]:
    """A server process; its stderr lines are collected by a thread (read them from the returned list)."""
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    return proc, lines


def _url(proc, lines, timeout: float = SPAWN_S) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        found = [ln for ln in list(lines) if "serving on " in ln]
        if found:
            return found[0].split("serving on ")[1].split(",")[0].strip()
        time.sleep(0.1)
    raise AssertionError("the server never bound:\n" + "".join(lines[-40:]))


def _get(url: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            status, body = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read().decode()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_ready(url: str, timeout: float = SPAWN_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _get(f"{url}/health")[0] == 200:
            return
        time.sleep(0.2)
    raise AssertionError("never ready")


def _stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---------------------------------------------------------------- serve --tp 2
@pytest.mark.slow
def test_serve_tp_binds_before_the_ranks_boot_serves_and_stops_on_sigterm(tmp_path):
    release = tmp_path / "release"
    proc, lines = _start(["unit_tests.tp_cpu_boot", "0"], {"AUTOPROFILE_TEST_RELEASE": str(release)})
    try:
        url = _url(proc, lines)
        status, body = _get(f"{url}/health")
        assert (status, body) == (503, {"status": "starting"})  # the ranks are still booting
        release.touch()
        _wait_ready(url)
        status, body = _post(f"{url}/generate", {"input_ids": [[5, 6, 7, 8]], "max_new_tokens": 4})
        assert status == 200 and len(body["output_ids"][0]) == 4, body  # a step ran on both ranks
        proc.send_signal(signal.SIGTERM)  # the launcher forwards it to rank 0, which stops rank 1
        assert proc.wait(timeout=60) == 0, "".join(lines[-40:])
    finally:
        _stop(proc)


@pytest.mark.slow
def test_serve_tp_with_its_port_taken_fails_at_once_not_after_the_boot(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    t0 = time.monotonic()
    # the boot would wait 120 s for a release that never comes: only a bind before it ends this early
    proc, lines = _start(["unit_tests.tp_cpu_boot", str(port)],
                         {"AUTOPROFILE_TEST_RELEASE": str(tmp_path / "never")})
    try:
        code = proc.wait(timeout=SPAWN_S)
        took = time.monotonic() - t0
    finally:
        _stop(proc)
        taken.close()
    text = "".join(lines)
    assert code == 1 and "address already in use" in text.lower(), text[-3000:]
    assert took < SPAWN_S, took


@pytest.mark.slow
def test_serve_tp_whose_profile_gives_up_exits_1_printing_the_ranks_text_once():
    text = "autoprofile: no KV cache size survived the worst-case stress (injected)"
    proc, lines = _start(["unit_tests.tp_cpu_boot", "0"], {"AUTOPROFILE_TEST_BOOT_FAILS": text})
    try:
        code = proc.wait(timeout=SPAWN_S)
    finally:
        _stop(proc)
    out = "".join(lines)
    assert code == 1 and out.count(text) == 1 and out.rstrip().endswith(text), out[-3000:]
    assert "Traceback" not in out, out[-3000:]


# ---------------------------------------------------------------- --disable_prefix_caching
def _prefix_hits(url: str) -> float:
    status, text = _get(f"{url}/metrics")
    line = next(ln for ln in text.splitlines() if ln.startswith("autoprofile_prefix_cache_hit_tokens_total"))
    return float(line.split()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("flags, hits", [([], True), (["--disable_prefix_caching"], False)])
def test_disable_prefix_caching_reaches_the_engine(flags, hits):
    proc, lines = _start(["unit_tests.cpu_server", "--model", "tiny", "--dtype", "float32",
                          "--attention_backend", "torch", "--port", "0", "--max_req_total_len", "256",
                          "--batch_max_tokens", "64", "--graph_max_batch_size", "4", "--report_dir", "",
                          *flags])
    try:
        url = _url(proc, lines)
        _wait_ready(url)
        prompt = [(7 * i) % 200 + 3 for i in range(40)]  # two full 16-token pages
        answers = [_post(f"{url}/generate", {"input_ids": [prompt], "max_new_tokens": 3}) for _ in range(2)]
        assert all(s == 200 for s, _ in answers) and answers[0][1] == answers[1][1], answers
        assert (_prefix_hits(url) >= 32) is hits
        assert (_prefix_hits(url) == 0) is not hits
    finally:
        _stop(proc)
