"""kernels.compile_ahead on the CPU: the pool's size, a no-op off CUDA, the context's effect on Triton (its
AsyncCompileMode active in this thread only while open, JITFunction's methods given back), and dry launches
compiled for an H100 (sm_90) through a driver stub: each specialization hashed and compiled once however many
dry launches it gets, nothing written. Real launches after dry ones: tests/test_compile_ahead_gpu.py."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading

import pytest
import torch

from autoprofile.kernels.compile_ahead import MAX_WORKERS, CompileAhead, active, workers

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@pytest.mark.parametrize("cpus, want", [(1, 1), (2, 1), (4, 3), (64, MAX_WORKERS)])
def test_the_pool_leaves_a_cpu_to_the_boot(cpus, want):
    assert workers(cpus) == want


def test_off_cuda_it_runs_nothing():
    called = []
    with CompileAhead(torch.device("cpu")) as ahead:
        ahead.dry(called.append, 1)
    assert not ahead.enabled and called == []


@needs_triton
def test_the_async_mode_is_this_threads_while_open():
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction

    run, do_compile = JITFunction.run, JITFunction._do_compile
    seen = {}

    def other_thread():
        seen["other"] = _async_compile.active_mode.get()

    assert active() is None
    with CompileAhead(torch.device("cuda"), max_workers=2) as ahead:  # no CUDA call until a launch
        assert ahead.enabled and _async_compile.active_mode.get() is ahead.mode
        assert active() is ahead
        assert JITFunction.run is not run and JITFunction._do_compile is not do_compile
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        ahead.dry(lambda: seen.setdefault("dry", True))
    assert seen == {"other": None, "dry": True}
    assert _async_compile.active_mode.get() is None and active() is None
    assert JITFunction.run is run and JITFunction._do_compile is do_compile



@needs_triton
def test_a_failed_dry_call_is_logged_and_once_is_once(caplog):
    """A dry call only gives compiles a head start: its error is logged, the boot goes on; `once` lets the
    decode graphs' dry capture run in the boot's first build only."""
    def broken():
        raise RuntimeError("no such kernel argument")

    with CompileAhead(torch.device("cuda"), max_workers=1) as ahead:
        ahead.dry(broken)
        assert [ahead.once("decode graphs"), ahead.once("decode graphs"), ahead.once("other")] == [
            True, False, True]
    assert "no such kernel argument" in caplog.text and "broken" in caplog.text

STUB_SM90 = r'''
import torch, triton, triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from autoprofile.kernels.compile_ahead import CompileAhead


class StubDriver:  # the CUDA driver's calls a compile-only launch makes, on a machine without a GPU
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def launcher_cls(self, src, metadata): return None  # gcc and libcuda: a GPU host's


driver.set_active(StubDriver())
misses = []
knobs.runtime.jit_cache_hook = lambda **kw: misses.append(kw["key"]) and False


@triton.jit
def _ones(out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.full([BLOCK], 1, tl.int32), mask=offs < n)

'''
DRY_SM90 = STUB_SM90 + r'''
out = torch.zeros(64, dtype=torch.int32)
with CompileAhead(torch.device("cuda"), max_workers=2) as ahead:
    ahead.dry(lambda: [_ones[(1,)](out, 64, BLOCK=64) for _ in range(50)])
    ahead.dry(lambda: _ones[(1,)](out, 7, BLOCK=64))  # another specialization (n % 16 != 0)
    assert ahead.dry_compiles == 2, ahead.dry_compiles
assert len(misses) == 2, len(misses)  # each specialization's source hashed once, not once a launch
cache = _ones.device_caches[0][0]
assert len(cache) == 2 and all("cubin" in k.asm for k in cache.values()), cache
assert int(out.sum()) == 0
print("ok")
'''


@needs_triton
def test_dry_launches_compile_once_a_specialization_for_sm90(tmp_path):
    """50 dry launches of one specialization and one of another: two cache misses (Triton 3.6 hashed the
    source at every dry launch until the pending compile was seated in the kernel's cache: 51 here), two
    sm_90 cubins in the kernel's cache after the context, the output never written."""
    (tmp_path / "case.py").write_text(DRY_SM90)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PYTHONPATH": root}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, str(tmp_path / "case.py")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]


WARM_SM90 = STUB_SM90 + r'''
import concurrent.futures
out = torch.zeros(64, dtype=torch.int32)
with CompileAhead(torch.device("cuda"), max_workers=2) as ahead:
    assert not ahead.cache_warm()  # nothing started: nothing known
    ahead.dry(lambda: (_ones[(1,)](out, 64, BLOCK=64), _ones[(1,)](out, 7, BLOCK=64)))
    concurrent.futures.wait(ahead.mode.raw_futures)
    print("warm" if ahead.cache_warm() else "cold", ahead.cache_hits)
'''


@needs_triton
def test_a_boot_knows_a_warm_triton_cache(tmp_path):
    """cache_warm: False on an empty TRITON_CACHE_DIR (two real sm_90 compiles), True in the next process on
    the same cache (both found there): the decode graphs skip their dry capture on it."""
    (tmp_path / "case.py").write_text(WARM_SM90)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PYTHONPATH": root}
    env.pop("TRITON_INTERPRET", None)
    said = []
    for _ in range(2):
        out = subprocess.run([sys.executable, str(tmp_path / "case.py")], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        said.append(out.stdout.split()[-2:])
    assert said == [["cold", "0"], ["warm", "2"]]


@needs_triton
@pytest.mark.parametrize("model,kept", [("tiny-fp8", True), ("tiny", False)])
def test_fp8_weights_get_the_split_gemms_counters_before_any_capture(model, kept, monkeypatch):
    """The split skinny FP8 GEMM's counters are made by a build before its graphs (runner.keep_scratch), not
    at its first launch, which is inside a capture (the decode graphs' dry one, or a graph no warm-up precedes):
    there they may not be made (the dry capture failed, its compiles came one by one)."""
    from autoprofile.config import ServerConfig, validate
    from autoprofile.engine.runner import keep_scratch
    from autoprofile.kernels import triton_fp8_skinny
    monkeypatch.setattr(triton_fp8_skinny, "_counters", {})
    cpu = torch.device("cpu")
    keep_scratch(validate(ServerConfig(model=model, device="cpu", report_dir=None)).model_config, cpu)
    assert (cpu in triton_fp8_skinny._counters) is kept
    if kept:  # the launches' own call finds them, zeros as a launch leaves them
        counters = triton_fp8_skinny.tile_counters(cpu)
        assert counters is triton_fp8_skinny._counters[cpu]
        assert counters.shape == (triton_fp8_skinny.COUNTERS,) and not counters.any()
