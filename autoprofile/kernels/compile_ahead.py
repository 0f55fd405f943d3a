"""Triton kernels compiled before their first launch, several at once, beside the boot (issue 48, item 5).

A cold boot compiled each Triton kernel at its first launch, one after the other, on the boot's critical
path: llama-3.1-8b on an H100 made 16 compiles, 14.4 s, 8.8 s of them the sampler's two kernels in the first
prefill corner (and each kernel's C launcher, built by gcc at its first launch, on top). `CompileAhead` opens
Triton's AsyncCompileMode (its thread pool compiles, keyed by Triton's cache key) for the boot:

    with CompileAhead(device) as ahead:       # profiler.boot
        ahead.dry(sampling.compile_ahead, vocab, dtype, device)   # returns at once; the pool compiles
        ...                                   # weights, graphs: a launch of a kernel the pool is still
                                              # compiling waits for that compile instead of starting its own

and code that can run a step's launches dry offers them to the open one (`active()`): the decode graphs
capture every graph's step once, dry, inside a capture they drop (engine.cuda_graph), before the real
captures, so every batch size's and bucket's kernels compile at once.

`dry(fn)` runs fn with every Triton launch of this thread compile-only: JITFunction.run with warmup=True
(specialized exactly as a launch of those arguments would be, nothing enqueued: fn's outputs are never
written, so fn must not read them). The pool also builds each kernel's launcher, so the first real launch
finds it in Triton's cache. Launches outside `dry` compile as before, each waited for at its launch. Leaving
the context waits for every compile it started; a compile's error is raised where the kernel is launched.

NOTE: while a CompileAhead is open, JITFunction.run is a wrapper (Triton has no per-launch "compile only"
switch other than `kernel.warmup`, which the launch sites would each need; the wrapper changes nothing for
other threads or outside `dry`: a ContextVar), and JITFunction._do_compile seats a pending compile in the
kernel's cache (as Triton 3.9 does itself).
"""
from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from autoprofile.kernels import triton_key
from autoprofile.kernels.compile_watch import CompileWatch

log = logging.getLogger(__name__)

_DRY: contextvars.ContextVar[bool] = contextvars.ContextVar("compile_ahead_dry", default=False)
_OPEN: contextvars.ContextVar[CompileAhead | None] = contextvars.ContextVar("compile_ahead_open",
                                                                           default=None)
MAX_WORKERS = 8  # compiles at once (a boot has about 16 distinct kernels; ptxas and LLVM release the GIL)


def workers(cpus: int | None = None) -> int:
    """Compile threads: the host's CPUs less one for the boot itself, at most MAX_WORKERS, at least 1."""
    cpus = cpus if cpus is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                          else os.cpu_count() or 1)
    return max(1, min(MAX_WORKERS, cpus - 1))


def _compile_and_launcher(compile_fn: Callable):
    """A pool job: Triton's compile, then its launcher built once (gcc, into Triton's cache) and dropped."""
    kernel = compile_fn()
    from triton.runtime.driver import driver
    driver.active.launcher_cls(kernel.src, kernel.metadata)
    return kernel


class _Pool(ThreadPoolExecutor):
    def submit(self, fn, /, *args, **kwargs):
        if args or kwargs:
            return super().submit(fn, *args, **kwargs)
        return super().submit(_compile_and_launcher, fn)


class CompileAhead:
    """Triton compiles in a pool for the time the context is open (see the module's text). On a device that
    is not CUDA, or without Triton, it does nothing."""

    def __init__(self, device: torch.device, max_workers: int | None = None):
        self.enabled = device.type == "cuda" and _triton() is not None
        self.max_workers = max_workers or workers()
        self.pool = self.mode = self._run = self._do_compile = None
        self.dry_s = 0.0
        self.dry_compiles = 0  # compiles the dry calls started (the rest: real launches' own)
        self.cache_hits = 0  # compiles Triton found in its on-disk cache (its compilation listener says)
        self._done: set[str] = set()  # once()'s names
        self._lock = threading.Lock()
        self._listener = None

    def __enter__(self) -> CompileAhead:
        if not self.enabled:
            return self
        triton_key.wait()  # the process's key, hashed beside its imports: not a second time here
        triton = _triton()
        from triton.runtime.jit import JITFunction
        self.pool = _Pool(self.max_workers, thread_name_prefix="triton-compile")
        self.mode = triton.AsyncCompileMode(self.pool)
        self.mode.__enter__()
        self._run = JITFunction.run
        run = self._run

        def run_or_compile(kernel, *args, grid, warmup, **kwargs):
            return run(kernel, *args, grid=grid, warmup=warmup or _DRY.get(), **kwargs)

        JITFunction.run = run_or_compile
        self._do_compile = JITFunction._do_compile
        do_compile = self._do_compile

        def do_compile_seated(kernel, key, signature, device, *args, **kwargs):
            # NOTE: Triton 3.6 leaves a pending compile out of the kernel's cache until a launch waits for it,
            # so each dry launch of the same specialization hashed its source again (~0.3 ms; 62 dry graph
            # steps took 7 s); later Triton (3.9) seats the FutureKernel there itself, as this does
            compiled = do_compile(kernel, key, signature, device, *args, **kwargs)
            if compiled is not None and hasattr(compiled, "result"):
                kernel.device_caches[device][0].setdefault(key, compiled)
            return compiled

        JITFunction._do_compile = do_compile_seated
        from triton import knobs
        self._listener = knobs.compilation.listener
        # a boot after serving began (a test's second boot): its compiles are not a served step's
        chained = self._listener.chained if isinstance(self._listener, CompileWatch) else self._listener

        def count_hits(**kwargs):
            with self._lock:
                self.cache_hits += bool(kwargs.get("cache_hit"))
            if chained is not None:
                chained(**kwargs)

        knobs.compilation.listener = count_hits
        self._open = _OPEN.set(self)
        return self

    def cache_warm(self) -> bool:
        """Every compile started so far has finished and Triton found each in its on-disk cache: the boot
        runs on a warm TRITON_CACHE_DIR, where a dry pass costs its host time and saves nothing (llama-3.1-8b
        on an H100: the decode graphs' step 5.1 s without their dry capture, 10.5 s with it). False before
        any compile started (nothing known: the dry passes run) or while one is still running (a cache hit
        takes milliseconds, a compile seconds)."""
        if not self.enabled:
            return False
        started = len(self.mode.raw_futures)
        with self._lock:
            return started > 0 and self.cache_hits == started

    def dry(self, fn: Callable, *args, **kwargs) -> None:
        """fn(*args, **kwargs), this thread's Triton launches compile-only (the compiles: the pool's). Its
        failure is logged, never raised: a dry call only gives compiles a head start, the real launches
        compile whatever it did not reach (and raise what fails there)."""
        if not self.enabled:
            return
        t0, before = time.perf_counter(), len(self.mode.raw_futures)
        token = _DRY.set(True)
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.warning("compile ahead: a dry call (%s) failed, its kernels compile at their launch: %s",
                        getattr(fn, "__qualname__", fn), (str(e).splitlines() or [type(e).__name__])[0])
        finally:
            _DRY.reset(token)
            self.dry_s += time.perf_counter() - t0
            self.dry_compiles += len(self.mode.raw_futures) - before

    def once(self, name: str) -> bool:
        """True the first time `name` asks (then False): work whose compiles one dry pass covers for the whole
        boot (the decode graphs: the probe's build and the rebuild's are the same graphs)."""
        first = name not in self._done
        self._done.add(name)
        return first

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        from triton import knobs
        from triton.runtime.jit import JITFunction
        JITFunction.run, JITFunction._do_compile = self._run, self._do_compile
        _OPEN.reset(self._open)
        t0 = time.perf_counter()
        started = len(self.mode.raw_futures)
        try:
            # waits for every compile started; one that failed is not raised here: it raises where the kernel
            # is launched
            self.mode.ignore_errors = True
            self.mode.__exit__(*exc)
        finally:
            self.pool.shutdown(wait=True)
            knobs.compilation.listener = self._listener
        log.info("compile ahead: %d Triton compiles in a pool of %d (%d found in Triton's cache), %d of them "
                 "started by dry calls (%.2f s); %.2f s waited at the end", started, self.max_workers,
                 self.cache_hits, self.dry_compiles, self.dry_s, time.perf_counter() - t0)


def active() -> CompileAhead | None:
    """The CompileAhead open in this thread's context (a boot's), else None: code that can run a step's
    launches dry (engine.cuda_graph's decode graphs) offers them to it."""
    return _OPEN.get()


def _triton():
    try:
        import triton
    except ImportError:
        return None
    return triton if hasattr(triton, "AsyncCompileMode") else None
