"""Triton compiles after the boot (kernels.compile_watch): Triton's own compiler, run for an H100 (sm_90) on
this CPU into a fresh cache, calls the watch; a compile is counted, named and logged, a load from the cache is
counted apart, and the listener that was there before still hears both."""
from __future__ import annotations

import importlib.util
import logging

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def _compile_add_one(block: int, attrs: dict | None = None, n_is_one: bool = False):
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    constants = {(2,): block, **({(1,): 1} if n_is_one else {})}
    signature = {"x_ptr": "*fp32", "n": "constexpr" if n_is_one else "i32", "BLOCK": "constexpr"}
    src = ASTSource(add_one, signature, constants, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))


@pytest.fixture
def fresh_triton(tmp_path, monkeypatch):
    """An empty Triton cache and no listener; the watch module's state restored after."""
    from triton import knobs

    from autoprofile.kernels import compile_watch
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(knobs.compilation, "listener", None)
    monkeypatch.setattr(compile_watch, "_WATCH", None)
    return knobs


def test_a_compile_after_the_boot_is_counted_named_and_logged_and_a_cache_load_apart(fresh_triton, caplog):
    from autoprofile.kernels import compile_watch
    heard = []
    fresh_triton.compilation.listener = lambda **kw: heard.append(kw["cache_hit"])
    assert compile_watch._WATCH is None
    watch = compile_watch.watch_after_boot()
    assert compile_watch.watch_after_boot() is watch is compile_watch._WATCH
    assert fresh_triton.compilation.listener is watch
    with caplog.at_level(logging.WARNING, logger="autoprofile.kernels.compile_watch"):
        _compile_add_one(64)
    assert (watch.compiles, watch.loads, dict(watch.kernels)) == (1, 0, {"add_one": 1})
    assert 0 < watch.seconds < 120
    logged = [r.getMessage().split(" (")[0] for r in caplog.records]
    assert logged == ["Triton compiled add_one after the boot"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autoprofile.kernels.compile_watch"):
        _compile_add_one(64)  # the same specialization: Triton's cache
    assert (watch.compiles, watch.loads) == (1, 1) and not caplog.records
    _compile_add_one(128)  # another constexpr: another compile
    assert (watch.compiles, watch.loads, watch.kernels["add_one"]) == (2, 1, 2)
    assert heard == [False, True, False]


def test_a_boot_s_compiles_are_not_counted_as_a_served_step_s(fresh_triton):
    """A second boot in a process already serving (CompileAhead open): its compiles pass the watch by, and
    the watch is the listener again once the boot's context closes."""
    import torch

    from autoprofile.kernels.compile_ahead import CompileAhead
    from autoprofile.kernels.compile_watch import watch_after_boot
    watch = watch_after_boot()
    ahead = CompileAhead(torch.device("cuda"))
    ahead.enabled = True  # (no GPU here: the context's listener and JIT hooks alone)
    with ahead:
        _compile_add_one(64)
    assert (watch.compiles, watch.loads) == (0, 0) and ahead.mode is not None
    assert fresh_triton.compilation.listener is watch
    _compile_add_one(32)
    assert watch.compiles == 1


def test_the_log_names_what_the_compile_specialized_its_arguments_on(fresh_triton, caplog):
    """The warning says which arguments' specialization (an integer equal to 1, a pointer or integer divisible
    by 16) made the compile, not the declared constexprs."""
    from autoprofile.kernels import compile_watch
    compile_watch.watch_after_boot()
    with caplog.at_level(logging.WARNING, logger="autoprofile.kernels.compile_watch"):
        _compile_add_one(64, attrs={(0,): [["tt.divisibility", 16]]})
        _compile_add_one(64, n_is_one=True)
        _compile_add_one(32)
    said = [r.getMessage().split("specialization: ")[1].split(")")[0] for r in caplog.records]
    assert said == ["x_ptr %16", "n=1", "none"]
