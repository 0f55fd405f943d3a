"""kernels.compile_ahead on the CPU: the pool's size, a no-op off CUDA, and the context's effect on Triton
(its AsyncCompileMode active in this thread only while open, JITFunction.run given back). The compiles
themselves need a GPU: tests/test_compile_ahead_gpu.py."""
from __future__ import annotations

import importlib.util
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

    run = JITFunction.run
    seen = {}

    def other_thread():
        seen["other"] = _async_compile.active_mode.get()

    assert active() is None
    with CompileAhead(torch.device("cuda"), max_workers=2) as ahead:  # no CUDA call until a launch
        assert ahead.enabled and _async_compile.active_mode.get() is ahead.mode
        assert active() is ahead
        assert JITFunction.run is not run
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        ahead.dry(lambda: seen.setdefault("dry", True))
    assert seen == {"other": None, "dry": True}
    assert _async_compile.active_mode.get() is None and active() is None
    assert JITFunction.run is run
