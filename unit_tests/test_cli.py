"""The CLI commands on a CPU machine and the HTTP server against a fake runner."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from autoprofile import cli, server
from autoprofile.config import ServerConfig, validate
from autoprofile.engine.sampling import SamplingParams


# ---------------------------------------------------------------- commands
def test_plan_prints_the_breakdown(capsys):
    assert cli.main(["plan", "--model", "llama-3.1-8b", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    for text in ("llama-3.1-8b", "weights", "14.96", "KV cache", "request table", "decode graph pools",
                 "CUDA context", "ESTIMATED", "predicted --max_total_token_num"):
        assert text in out, text


def test_plan_takes_server_flags(capsys):
    assert cli.main(["plan", "--gpu", "h100", "--json"]) == 0
    default = capsys.readouterr().out
    assert cli.main(["plan", "--gpu", "h100", "--json", "--max_req_total_len", "8192", "--tp", "2"]) == 0
    short = capsys.readouterr().out
    assert '"context_len": 8192' in short and '"tp": 2' in short and short != default


def test_plan_never_asks_for_a_gpu(mocker, capsys):
    avail = mocker.patch("torch.cuda.is_available", side_effect=AssertionError("plan touched torch.cuda"))
    assert cli.main(["plan", "--gpu", "mi300x", "--model", "qwen3-8b"]) == 0
    assert cli.main(["plan", "--gpu", "mi300x", "--model", "qwen3-30b-a3b"]) == 2  # planned, but not servable
    assert not avail.called
    out = capsys.readouterr()
    assert "aiter" in out.out and "error: --model: architecture Qwen3MoeForCausalLM" in out.err


@pytest.mark.parametrize("command", ["serve", "profile"])
def test_no_gpu_exits_1_pointing_to_plan(command, mocker, capsys):
    mocker.patch("torch.cuda.is_available", return_value=False)
    assert cli.main([command, "--model", "qwen3-8b"]) == 1
    err = capsys.readouterr().err
    assert "needs a CUDA/ROCm GPU" in err
    assert "autoprofile plan --model qwen3-8b --gpu h100" in err


@dataclass
class FakeResult:
    cfg: ServerConfig
    tokens: int = 4096
    cell_bytes: int = 16384
    phases: list = field(default_factory=lambda: [("probe", 1.5), ("measure", 0.25),
                                                  ("rebuild+validate#1", 3.0)])

    @property
    def kv_bytes(self) -> int:
        return self.tokens * self.cell_bytes

    def report_text(self) -> str:
        return f"REPORT {self.tokens} tokens"


def test_profile_with_a_gpu_prints_the_report(mocker, capsys):
    mocker.patch("torch.cuda.is_available", return_value=True)
    prof = mocker.patch("autoprofile.profiler.profile", create=True,
                        side_effect=lambda cfg: FakeResult(cfg))
    argv = ["profile", "--model", "tiny", "--max_req_total_len", "1024", "--batch_max_tokens", "512"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.strip() == "REPORT 4096 tokens"
    cfg = prof.call_args.args[0]
    assert (cfg.model, cfg.max_req_total_len, cfg.batch_max_tokens) == ("tiny", 1024, 512)


def test_profile_give_up_exits_1_with_the_diagnostic(mocker, capsys):
    from autoprofile.profiler import ProfileError
    mocker.patch("torch.cuda.is_available", return_value=True)
    mocker.patch("autoprofile.profiler.profile", create=True,
                 side_effect=ProfileError("no size survived: knobs"))
    assert cli.main(["profile", "--model", "tiny"]) == 1
    assert "no size survived: knobs" in capsys.readouterr().err


def test_serve_boots_then_starts_the_server(mocker):
    mocker.patch("torch.cuda.is_available", return_value=True)
    runner = object()
    boot = mocker.patch("autoprofile.profiler.boot", side_effect=lambda cfg: (runner, FakeResult(cfg)))
    run = mocker.patch("autoprofile.server.run_server")
    assert cli.main(["serve", "--model", "tiny", "--port", "0"]) == 0
    (cfg, served_runner, result), _ = run.call_args
    assert boot.call_args.args == (cfg,)
    assert cfg.port == 0 and served_runner is runner and result.cfg is cfg


def test_serve_give_up_exits_1_without_serving(mocker, capsys):
    from autoprofile.profiler import ProfileError
    mocker.patch("torch.cuda.is_available", return_value=True)
    mocker.patch("autoprofile.profiler.boot", side_effect=ProfileError("turn one of these knobs"))
    run = mocker.patch("autoprofile.server.run_server")
    assert cli.main(["serve", "--model", "tiny"]) == 1
    assert "turn one of these knobs" in capsys.readouterr().err and not run.called


# ---------------------------------------------------------------- the server
class FakeRunner:
    """Echoes prompts reversed, max_new_tokens long; records calls and concurrency."""

    def __init__(self, delay: float = 0.0, fail: bool = False):
        self.calls, self.delay, self.fail = [], delay, fail
        self.active = self.max_active = 0
        self.lock = threading.Lock()

    def generate(self, prompts, max_new_tokens, sampling=None):
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            self.calls.append((prompts, max_new_tokens, sampling, threading.current_thread().name))
            time.sleep(self.delay)
            if self.fail:
                raise RuntimeError("CUDA error: device-side assert")
            pad = [[0] * max(0, max_new_tokens - len(p)) for p in prompts]
            return [list(reversed(p))[:max_new_tokens] + z for p, z in zip(prompts, pad)]
        finally:
            with self.lock:
                self.active -= 1


def tiny_result() -> FakeResult:
    return FakeResult(validate(ServerConfig(model="tiny", max_req_total_len=64, batch_max_tokens=32)))


def with_client(runner, body):
    """Run `body(client)` against make_app(runner, result) inside a fresh event loop."""
    async def go():
        async with TestClient(TestServer(server.make_app(runner, tiny_result()))) as client:
            return await body(client)
    return asyncio.run(go())


def test_health():
    async def body(c):
        r = await c.get("/health")
        return r.status, await r.json()
    status, data = with_client(FakeRunner(), body)
    assert status == 200 and data == {"status": "ok", "kv_tokens": 4096, "kv_bytes": 4096 * 16384}


def test_metrics_expose_kv_and_phases():
    async def body(c):
        r = await c.get("/metrics")
        return r.status, r.headers["Content-Type"], await r.text()
    status, ctype, text = with_client(FakeRunner(), body)
    assert status == 200 and ctype.startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("autoprofile_kv_cache_tokens", ())] == 4096
    assert samples[("autoprofile_kv_cache_bytes", ())] == 4096 * 16384
    assert samples[("autoprofile_profile_phase_seconds", (("phase", "probe"),))] == 1.5
    assert samples[("autoprofile_profile_phase_seconds", (("phase", "measure"),))] == 0.25
    assert samples[("autoprofile_profile_phase_seconds", (("phase", "rebuild+validate#1"),))] == 3.0


def test_generate_calls_the_runner():
    runner = FakeRunner()

    async def body(c):
        r = await c.post("/generate", json={"input_ids": [[1, 2, 3], [7]], "max_new_tokens": 2,
                                            "temperature": 0.7, "top_p": 0.9, "top_k": 40})
        return r.status, await r.json()
    status, data = with_client(runner, body)
    assert status == 200 and data == {"output_ids": [[3, 2], [7, 0]]}
    prompts, n, sampling, thread = runner.calls[0]
    assert prompts == [[1, 2, 3], [7]] and n == 2
    assert sampling == SamplingParams(temperature=0.7, top_p=0.9, top_k=40)
    assert thread != threading.main_thread().name  # off the event loop


def test_generate_defaults_to_greedy():
    runner = FakeRunner()

    async def body(c):
        return (await c.post("/generate", json={"input_ids": [[5]]})).status
    assert with_client(runner, body) == 200
    assert runner.calls[0][1:3] == (16, SamplingParams())  # greedy


@pytest.mark.parametrize("payload, field_named", [
    ({}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, 2]}, "input_ids"),
    ({"input_ids": [[]]}, "input_ids"),
    ({"input_ids": [[1, "a"]]}, "input_ids"),
    ({"input_ids": [[4096]]}, "input_ids"),  # tiny's vocab is 4096
    ({"input_ids": [[-1]]}, "input_ids"),
    ({"input_ids": [[1]], "max_new_tokens": 0}, "max_new_tokens"),
    ({"input_ids": [[1]], "max_new_tokens": 1.5}, "max_new_tokens"),
    ({"input_ids": [[1] * 30], "max_new_tokens": 35}, "max_req_total_len"),  # 30 + 35 > 64
    ({"input_ids": [[1] * 33], "max_new_tokens": 1}, "batch_max_tokens"),  # 33 > 32
    ({"input_ids": [[1]], "temperature": -1}, "temperature"),
    ({"input_ids": [[1]], "top_p": 0}, "top_p"),
    ({"input_ids": [[1]], "top_p": 1.5}, "top_p"),
    ({"input_ids": [[1]], "top_k": -2}, "top_k"),
    ({"input_ids": [[1]], "top_k": True}, "top_k"),
    ([1, 2], "JSON object"),
])
def test_generate_rejects_bad_requests(payload, field_named):
    runner = FakeRunner()

    async def body(c):
        r = await c.post("/generate", json=payload)
        return r.status, await r.json()
    status, data = with_client(runner, body)
    assert status == 400 and field_named in data["error"]
    assert runner.calls == []


def test_generate_rejects_non_json():
    async def body(c):
        r = await c.post("/generate", data=b"not json", headers={"Content-Type": "application/json"})
        return r.status
    assert with_client(FakeRunner(), body) == 400


def test_runner_failure_is_500_and_the_server_stays_up():
    async def body(c):
        r = await c.post("/generate", json={"input_ids": [[1]]})
        h = await c.get("/health")
        m = await (await c.get("/metrics")).text()
        return r.status, await r.json(), h.status, m
    status, data, health, metrics = with_client(FakeRunner(fail=True), body)
    assert status == 500 and "device-side assert" in data["error"] and health == 200
    assert 'autoprofile_generate_requests_total{status="error"} 1.0' in metrics


def test_generate_runs_one_at_a_time_and_counts():
    runner = FakeRunner(delay=0.05)

    async def body(c):
        rs = await asyncio.gather(*[c.post("/generate", json={"input_ids": [[i, i + 1]], "max_new_tokens": 3})
                                    for i in range(4)])
        bad = await c.post("/generate", json={})
        m = await (await c.get("/metrics")).text()
        return [r.status for r in rs], bad.status, m
    statuses, bad, metrics = with_client(runner, body)
    assert statuses == [200] * 4 and bad == 400
    assert runner.max_active == 1 and len(runner.calls) == 4
    assert 'autoprofile_generate_requests_total{status="ok"} 4.0' in metrics
    assert 'autoprofile_generate_requests_total{status="bad_request"} 1.0' in metrics
    assert "autoprofile_generated_tokens_total 12.0" in metrics


def test_two_apps_keep_their_own_metrics():
    a = server.make_app(FakeRunner(), tiny_result())
    b = server.make_app(FakeRunner(), FakeResult(tiny_result().cfg, tokens=8))
    assert a[server.METRICS].registry is not b[server.METRICS].registry


def test_port_0_binds_a_free_port():
    async def go():
        app = server.make_app(FakeRunner(), tiny_result())
        runner = await server.start(app, "127.0.0.1", 0)
        try:
            host, port = runner.addresses[0][:2]
            assert port != 0
            async with aiohttp.ClientSession() as s, s.get(f"http://{host}:{port}/health") as r:
                return r.status
        finally:
            await runner.cleanup()
    assert asyncio.run(go()) == 200
