"""/metrics reads the CUDA caching allocator at scrape time (reserved bytes, segments) beside the profile's
reserved peak, and bench_serving's soak samples them over time into its result and a PNG."""
from __future__ import annotations

import asyncio
import types

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from autoprofile import server
from autoprofile.engine.engine import LLMEngine
from autoprofile.serving.metrics import ServerMetrics, allocator_reading, profile_reserved
from unit_tests.test_bench_serving import bench_serving
from unit_tests.test_server import CFG, booted, metric_samples, serve  # noqa: F401

GAUGES = ("autoprofile_cuda_memory_reserved_bytes", "autoprofile_cuda_memory_segments",
          "autoprofile_profile_peak_reserved_bytes")


@pytest.fixture
def cuda_allocator(mocker):
    """The CUDA memory API only: 3 GiB reserved in 5 segments on cuda:0."""
    mocker.patch.object(torch.cuda, "is_initialized", return_value=True)
    reserved = mocker.patch.object(torch.cuda, "memory_reserved", return_value=3 << 30)
    stats = mocker.patch.object(torch.cuda, "memory_stats", return_value={"segment.all.current": 5})
    return reserved, stats


def test_on_a_cpu_the_gauges_are_0(booted):  # noqa: F811
    runner, result = booted

    async def body(c, app):
        return await (await c.get("/metrics")).text()
    s = metric_samples(serve(LLMEngine(runner), result, body))
    assert [s[(g, ())] for g in GAUGES] == [0, 0, 0]
    assert allocator_reading(torch.device("cpu")) == (0, 0)


def test_the_gauges_read_the_allocator_at_scrape_time(cuda_allocator):
    reserved, stats = cuda_allocator
    m = ServerMetrics(lambda: None, lambda: torch.device("cuda", 0))
    m.add_profile(types.SimpleNamespace(tokens=1024, kv_bytes=1 << 20, phases=[("probe", 1.0)],
                                        terms={"reserved_after": 70 << 30}))
    from prometheus_client import generate_latest
    first = metric_samples(generate_latest(m.registry).decode())
    reserved.return_value, stats.return_value = 4 << 30, {"segment.all.current": 9}
    second = metric_samples(generate_latest(m.registry).decode())
    assert [first[(g, ())] for g in GAUGES] == [3 << 30, 5, 70 << 30]
    assert [second[(g, ())] for g in GAUGES] == [4 << 30, 9, 70 << 30]  # read now, not at start
    assert reserved.call_args.args[0] == torch.device("cuda", 0)


def test_profile_reserved_is_the_profiles_reading_after_validation():
    assert profile_reserved(types.SimpleNamespace(terms={"reserved_after": 123})) == 123
    assert profile_reserved(types.SimpleNamespace()) == 0  # the CPU test server's result has no terms


def test_a_soak_samples_the_gauges_over_time_and_plots_them(booted, tmp_path):  # noqa: F811
    runner, result = booted
    engine = LLMEngine(runner)
    plot = tmp_path / "soak.png"
    argv = ["--soak-minutes", "0.05", "--soak-sample-seconds", "0.5", "--soak-plot", str(plot),
            "--random-output-len", "16", "--request-timeout", "60"]

    async def go():
        async with TestClient(TestServer(server.make_app(CFG, engine, result))) as c:
            url = str(c.make_url("")).rstrip("/")
            health = await bench_serving.wait_ready(url, 10, None)
            return await bench_serving.bench(bench_serving.parse_args(argv), url, health)
    s = asyncio.run(go())
    timeline = s["memory_timeline"]
    assert 4 <= len(timeline) <= 9  # every 0.5 s over 3 s, plus the last one
    ts = [x["t"] for x in timeline]
    assert ts == sorted(ts) and ts[-1] >= 2.5
    assert all(0.4 < b - a < 1.5 for a, b in zip(ts[:-2], ts[1:-1]))
    assert max(x["kv_pages_used"] for x in timeline) > 0 and max(x["running"] for x in timeline) > 0
    assert all(x["reserved"] == 0 and x["segments"] == 0 for x in timeline)  # a CPU: no CUDA allocator
    assert s["memory"]["samples"] == len(timeline) and s["memory"]["reserved_past_profile_peak"] is None
    assert s["memory_plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_memory_summary_and_plot_against_a_profile_peak(tmp_path):
    gib = 1 << 30
    timeline = [{"t": 5.0 * i, "reserved": (60 + i) * gib, "segments": 10 + i, "kv_pages_used": 1,
                 "running": 1,
                 "profile_peak": 62 * gib} for i in range(5)]
    m = bench_serving.memory_summary(timeline)
    assert m["max_reserved"] == 64 * gib and m["reserved_past_profile_peak"] == 2 * gib
    assert m["max_segments"] == 14 and m["first_reserved"] == 60 * gib
    out = bench_serving.plot_soak_memory(timeline, tmp_path / "m.png")
    assert out.stat().st_size > 10_000
