"""The profiler on a real GPU: real kernels, real OOMs (no mocks).

Faults are injected through the profiler's test-only checkpoint callback. The callback never raises
itself: it fills the GPU (after releasing the cache) so that the runtime's OWN next allocation fails
with a real CUDA OOM, then gives the memory back at the next build.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from autoprofile import budget
from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.runner import ModelRunner
from autoprofile.profiler import LeakError, Profiler, ProfileError, boot

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MiB, GiB = 1 << 20, 1 << 30


# The tiny model with 32 layers: 8 KiB of KV a token, so an 80 GB card's memory binds before the 32-bit offset
# cap (2 KV heads x 32: 33.5 M tokens, 32 GiB at tiny's 4 layers, which left most of an H100 free)
DEEP_LAYERS = 32


def tiny_cfg(tmp_path, **kw) -> ServerConfig:
    folder = tmp_path / "tiny-deep"
    if not folder.exists():
        folder.mkdir()
        tiny = Path(__file__).resolve().parents[1] / "models" / "configs" / "tiny" / "config.json"
        config = json.loads(tiny.read_text())
        (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": DEEP_LAYERS}))
    base = dict(model=str(folder), load_format="dummy",
                max_req_total_len=2048, batch_max_tokens=4096, graph_max_batch_size=32,
                report_dir=str(tmp_path / "report"))
    base.update(kw)
    return validate(ServerConfig(**base))


class Ballast:
    """Fills the GPU so the next allocation of the runtime hits a real OOM."""

    def __init__(self, leave: int = 0):
        self.leave, self.chunks = leave, []

    def fill(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the runtime's cached blocks become free, and then ours
        step = 1 << 30
        while step >= 4096:  # take everything but `leave`, down to the last small block
            free = torch.cuda.mem_get_info()[0]
            if free - step < self.leave:
                step //= 2
                continue
            try:
                self.chunks.append(torch.empty(step, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                step //= 2

    def drop(self) -> None:
        self.chunks.clear()
        torch.cuda.empty_cache()


class FailOnce:
    """Fill the GPU at `point` (in the rebuild, unless it is a probe point); give the memory back at the
    `skip`+1-th kv_alloc after that."""

    def __init__(self, point: str, leave: int = 0, skip: int = 0):
        self.point, self.ballast, self.fired, self.skip = point, Ballast(leave), False, skip
        self.armed = point.startswith("probe") or point == "after_measure"

    def __call__(self, point: str) -> None:
        self.armed |= point == "after_measure"
        if point == self.point and self.armed and not self.fired:
            self.fired = True
            self.ballast.fill()
        elif point == "kv_alloc" and self.ballast.chunks:
            if self.skip:
                self.skip -= 1
            else:
                self.ballast.drop()


def serve_check(runner) -> None:
    out = LLMEngine(runner).generate([[1, 2, 3, 4], [5, 6]], max_tokens=8)
    assert [len(o) for o in out] == [8, 8]


def test_full_cycle_tiny(tmp_path):
    cfg = tiny_cfg(tmp_path)
    runner, result = boot(cfg, plot_later=False)  # the PNG drawn before boot returns (serve: apart)
    try:
        free, total = torch.cuda.mem_get_info()
        assert result.attempts == 1 and not result.pinned
        assert result.tokens == runner.built_tokens and result.tokens > result.probe_tokens
        assert result.kv_bytes == runner.kv_bytes
        # the budget was used: what is left free is the canary's headroom, not 10-20 % of the card
        assert free < 0.05 * total
        serve_check(runner)
        report = json.loads((tmp_path / "report" / "budget_report.json").read_text())
        assert report["max_total_token_num"] == result.tokens
        assert (tmp_path / "report" / "budget_timeline.png").stat().st_size > 10_000
    finally:
        runner.teardown()
        torch.cuda.empty_cache()


# graph_capture: a real OOM inside CUDA graph capture (it aborted the process before issue 11's fix)
@pytest.mark.parametrize("point",
                         ["kv_alloc", "graph_capture", "canary", "validate_prefill", "validate_decode"])
def test_fault_in_rebuild_or_validate_is_retried(tmp_path, point):
    if point == "kv_alloc":  # fill after measuring, so the rebuild's own KV allocation fails
        fault = FailOnce("after_measure", skip=1)
    else:
        fault = FailOnce(point, leave=128 * MiB if point == "canary" else 0)
    runner, result = boot(tiny_cfg(tmp_path), checkpoint=fault)
    try:
        assert fault.fired and result.attempts == 2, (result.attempts, result.errors)
        assert "OutOfMemoryError" in result.errors[0]
        first = budget.shrink(result.initial_target, 0.95, 16)
        assert result.tokens == first
        serve_check(runner)
    finally:
        runner.teardown()
        fault.ballast.drop()


@pytest.mark.parametrize("point", ["probe_prefill", "probe_decode"])
def test_fault_in_probe_fails_fast_and_releases(tmp_path, point):
    torch.cuda.empty_cache()
    fault = FailOnce(point)
    with pytest.raises(ProfileError, match="even with the small probe cache") as ei:
        boot(tiny_cfg(tmp_path), checkpoint=fault)
    fault.ballast.drop()
    assert "OutOfMemoryError" in str(ei.value) and "--batch_max_tokens" in str(ei.value)
    # nothing half-built holds memory: only what the test process itself keeps
    assert torch.cuda.memory_allocated() < 64 * MiB


def test_peer_grabbing_memory_after_measure_is_absorbed(tmp_path):
    peer = None

    def grab(point):
        nonlocal peer
        if point == "after_measure" and peer is None:
            code = textwrap.dedent("""
                import sys, time, torch
                x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
                print("ready", flush=True)
                time.sleep(600)
            """)
            peer = subprocess.Popen([sys.executable, "-c", code, str(2 * GiB)], stdout=subprocess.PIPE,
                                    text=True)
            assert peer.stdout.readline().strip() == "ready"

    try:
        runner, result = boot(tiny_cfg(tmp_path), checkpoint=grab)
        assert result.attempts >= 2 and "OutOfMemoryError" in result.errors[0]
        serve_check(runner)
        runner.teardown()
    finally:
        if peer:
            peer.kill()
            peer.wait()


def test_leaked_kv_reference_is_a_clear_error(tmp_path):
    cfg = tiny_cfg(tmp_path)
    runner = ModelRunner(cfg)
    held = []

    def leak(point):
        if point == "probe_decode":
            held.append(runner.kv_buffer)  # e.g. a debug hook that kept the cache alive

    try:
        with pytest.raises(LeakError, match="still referenced by a list"):
            Profiler(cfg, runner, checkpoint=leak).run()
        assert runner.built_tokens is None  # never rebuilt on top of the leak
    finally:
        held.clear()
        runner.teardown()
        torch.cuda.empty_cache()


def test_escape_hatch_builds_once(tmp_path):
    builds = []
    runner, result = boot(tiny_cfg(tmp_path, max_total_token_num=65536),
                          checkpoint=lambda p: builds.append(p) if p == "kv_alloc" else None)
    try:
        assert result.pinned and result.tokens == runner.built_tokens == 65536 and result.attempts == 1
        assert builds == ["kv_alloc"] and result.probe_tokens is None
        serve_check(runner)
    finally:
        runner.teardown()


def test_escape_hatch_too_big_says_what_fits(tmp_path):
    _, total = torch.cuda.mem_get_info()
    cell = budget.kv_cell_bytes(DEEP_LAYERS, 2, 32, 2)
    with pytest.raises(ProfileError, match=r"try --max_total_token_num \d+") as ei:
        boot(tiny_cfg(tmp_path, max_total_token_num=total // cell // 16 * 16))
    fits = int(str(ei.value).split("try --max_total_token_num ")[1].split(",")[0])
    assert 0 < fits < total // cell
    assert torch.cuda.memory_allocated() < 64 * MiB


@pytest.mark.slow
def test_full_cycle_8b_shaped(tmp_path):
    cfg = validate(ServerConfig(model="llama-3.1-8b", max_req_total_len=32768,
                                report_dir=str(tmp_path / "r8b")))
    runner, result = boot(cfg)
    try:
        free, total = torch.cuda.mem_get_info()
        assert result.attempts >= 1 and result.tokens >= 32768
        assert free < 0.05 * total
        serve_check(runner)
        print("\n" + result.report_text())
    finally:
        runner.teardown()
        torch.cuda.empty_cache()
