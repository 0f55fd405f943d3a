"""The prefix cache's host-memory tier (SGLang's HiCache, vLLM's CPU offload): KV pages that the GPU's prefix
cache evicts are copied to pinned host memory first, under the same key (chain id before the page, its
tokens and images' hashes), and a request whose prefix continues there gets them copied back into fresh GPU
pages, scheduled like a prefill that has already run.

Two owners: HostPages, the bookkeeping (host-side, no torch: in engine.prefix_cache, behind its PrefixCache:
which host page holds which key, least recently used first), and HostKVPool, the pinned buffer
[parts, num_layers, host_pages, heads, page, width] (the GPU cache's layout per layer) and the copies (the
runner's, one per rank under --tp: each rank keeps its own shard, moved by the same page lists that the step
broadcast ships). A page lives on one tier: a page copied back leaves the host tier (moved, not shared), so
every key is in the GPU's prefix cache, in the host tier, or gone (dropped by the host tier's LRU).

An FP8 cache's scales are per layer (KVCache.scales), fixed before any page is cached: a page's bytes mean
the same on both tiers, so the key needs no scale.
"""
from __future__ import annotations

import logging
import math
import time
import weakref
from dataclasses import dataclass

import psutil
import torch

from autoprofile.budget import gib
from autoprofile.config import ConfigError, ServerConfig, parse_host_kv
from autoprofile.engine.pinned import PinnedBuffers
from autoprofile.engine.prefix_cache import HostPages  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

GIB = 1 << 30
AUTO_SHARE = 0.5  # --host_kv auto: this share of the host's available memory ...
PROCESS_MARGIN = 8 * GIB  # ... less this much for the process (weights' host copies, tokenizer, Python)


class HostKVError(ValueError):
    """--host_kv does not fit the host (raised as ConfigError by the runner, naming the flag)."""


def host_kv_bytes(flag: str, available: int, ranks_on_host: int, gpus_on_host: int) -> int:
    """The host tier's bytes for one rank. available: the host's available memory (psutil); ranks_on_host:
    this server's ranks on the host (--tp); gpus_on_host: the host's GPUs (servers on the other GPUs may take
    their share too). auto: AUTO_SHARE of available less PROCESS_MARGIN, split over max(ranks, gpus); N GiB:
    N a rank, HostKVError if ranks x N exceeds available less PROCESS_MARGIN (its message names a value that
    fits)."""
    value = parse_host_kv(flag)
    if value == "off":
        return 0
    usable = max(available - PROCESS_MARGIN, 0)
    if value == "auto":
        return int(max(AUTO_SHARE * available - PROCESS_MARGIN, 0) / max(ranks_on_host, gpus_on_host, 1))
    want = int(value * GIB)
    if want * ranks_on_host > usable:
        fits = math.floor(usable / max(ranks_on_host, 1) / GIB * 10) / 10
        each = f" on each of {ranks_on_host} ranks" if ranks_on_host > 1 else ""
        hint = f"try --host_kv {fits:g} or --host_kv auto" if fits > 0 else "try --host_kv off"
        raise HostKVError(f"{value:g} GiB of pinned host memory{each} does not fit: the host has "
                          f"{available / GIB:.1f} GiB available, less {PROCESS_MARGIN // GIB} GiB for the "
                          f"process; {hint}")
    return want


# ---------------------------------------------------------------- the tier's figures
@dataclass
class HostTierStats:
    pages: int = 0  # pages of the tier
    cached: int = 0  # pages holding a key now
    saved: int = 0  # pages copied GPU -> host
    loaded: int = 0  # pages copied host -> GPU (prefix hits in the host tier)
    dropped: int = 0  # keys the tier's LRU dropped (or a failed step's copies)
    hit_tokens: int = 0  # prompt tokens whose K/V came back from the host tier
    bytes_moved: int = 0  # both directions (the runner's pool counts them)
    copy_seconds: float = 0.0  # the copies' time (CUDA events on the copy stream; wall time on the CPU)


# ---------------------------------------------------------------- the pinned buffer and the copies
def page_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) page pairs as runs (src first, dst first, length) of consecutive pages on both sides, in
    order: one copy a run and layer."""
    runs: list[list[int]] = []
    for s, d in pairs:
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


HOST_REGISTER_PORTABLE, HOST_REGISTER_MAPPED = 1, 2  # cudaHostRegister flags


def pin_in_place(t: torch.Tensor) -> None:
    """Page-lock a host tensor's memory (cudaHostRegister), so copies to and from it run asynchronously, and
    map it into the device's address space (cudaHostRegisterMapped, stated rather than left to the platform's
    default): the page-transfer kernel reads and writes it from the GPU. Portable: every device's context
    sees it pinned.
    NOTE: not pin_memory=True: torch's pinned allocator rounds a block up to a power of two (52 GiB would
    pin 64). RuntimeError if CUDA refuses (a locked-memory limit) or is absent."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes,
                                                   HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED)
    except (AssertionError, AttributeError, RuntimeError) as e:  # no CUDA: AssertionError
        raise RuntimeError(f"cudaHostRegister is unavailable: {e}") from None
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed with CUDA error {int(err)}")


def unpin(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class PageLists(PinnedBuffers):
    """The copies' page lists on their way to the page-transfer kernel: int32 [src ids | dst ids] of the
    saves, then of the loads, in pinned host memory that the device reads through its mapped address (no GPU
    memory; engine.pinned's reuse rule)."""

    def __init__(self, pin_memory: bool = True):
        super().__init__(torch.int32, 10, pin_memory)

    def stage(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]
              ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(buffer index, saves [2, ns], loads [2, nl]) views of one buffer; release(index, event) once the
        copies that read them are queued."""
        i, buf = self.take(2 * (len(saves) + len(loads)))
        views, at = [], 0
        for pairs in (saves, loads):
            view = buf[at:at + 2 * len(pairs)].view(2, len(pairs))
            if pairs:
                view.copy_(torch.tensor(pairs, dtype=torch.int32).T)
            views.append(view)
            at += 2 * len(pairs)
        return i, views[0], views[1]


class HostKVPool:
    """The host tier's pages, [parts, num_layers, num_pages, heads, page, width] like KVCache.buffer (pinned
    when CUDA is up, and mapped), and the copies between it and the GPU's pages: on CUDA one page-transfer
    kernel launch a direction (kernels.triton_kv_copy; its page lists in pinned host memory, PageLists), else
    one copy per run of pages, part and layer. Host memory only: no GPU buffer."""

    def __init__(self, num_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype, pin: bool):
        """page_shape: (parts, num_layers, heads, page, width) of one page on one rank."""
        parts, layers, *cell = page_shape
        self.num_pages = num_pages
        self.buffer = torch.empty((parts, layers, num_pages, *cell), dtype=dtype)
        if pin:
            pin_in_place(self.buffer)
            # unregistered before its memory goes back (the finalizer holds the buffer until then)
            weakref.finalize(self, unpin, self.buffer).atexit = False  # at exit the process's memory goes
        self.page_bytes = self.buffer.nbytes // max(num_pages, 1)
        self.stream: torch.cuda.Stream | None = None  # the saves'
        self.load_stream: torch.cuda.Stream | None = None
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.bytes_moved, self.copy_seconds = 0, 0.0
        # the page-transfer kernel (one launch a direction); False: the per-run copies (the GPU test compares)
        self.use_kernel = pin
        self._copy_pages = None
        self._lists = PageLists(pin_memory=pin)

    @classmethod
    def for_cache(cls, nbytes: int, parts: int, layers: int, heads: int, page: int, width: int,
                  dtype: torch.dtype, pin: bool) -> HostKVPool:
        """As many pages as fit nbytes."""
        page_bytes = parts * layers * heads * page * width * torch.empty(0, dtype=dtype).element_size()
        return cls(nbytes // page_bytes, (parts, layers, heads, page, width), dtype, pin)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def transfer(self, gpu: torch.Tensor, saves: list[tuple[int, int]],
                 loads: list[tuple[int, int]]) -> torch.cuda.Event | None:
        """saves (gpu page, host page) then loads (host page, gpu page) on `gpu` (KVCache.buffer). On CUDA: on
        the copy stream, after the work queued on the current stream (the steps that wrote the saved pages,
        or still read the pages being loaded into); the current stream waits for the SAVES (a step writes into
        the pages just saved), never for the loads. Returns the loads' event (None: no loads, or the CPU's
        copies, done when this returns): the scheduler keeps every step off the loaded pages until it has
        completed (Scheduler.loads_done). A host page being loaded from is held (HostPages.take) until its
        load has landed, so no later save writes it meanwhile."""
        if not saves and not loads:
            return None
        self.bytes_moved += (len(saves) + len(loads)) * self.page_bytes
        if gpu.device.type != "cuda":
            t0 = time.perf_counter()
            self._copy(gpu, saves, loads)
            self.copy_seconds += time.perf_counter() - t0
            return None
        if self.stream is None:  # saves and loads on streams of their own: no save waits for a load
            self.stream, self.load_stream = torch.cuda.Stream(gpu.device), torch.cuda.Stream(gpu.device)
        compute = torch.cuda.current_stream(gpu.device)
        staged = self._lists.stage(saves, loads) if self._kernel() is not None else None
        saved = torch.cuda.Event()
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            if saves:
                self._timed(lambda: self._move(gpu, saves, staged, save=True))
            saved.record()
        if saves:
            compute.wait_event(saved)
        if not loads:
            if staged is not None:
                self._lists.release(staged[0], saved)
            return None
        # a load writes GPU pages that earlier steps may still use (the stream before), and reads host pages
        # that saves before it wrote (the save stream, in order: `saved` follows them all)
        self.load_stream.wait_stream(compute)
        self.load_stream.wait_event(saved)
        with torch.cuda.stream(self.load_stream):
            loaded = self._timed(lambda: self._move(gpu, loads, staged, save=False))
        if staged is not None:
            self._lists.release(staged[0], loaded)
        return loaded

    def _timed(self, copy) -> torch.cuda.Event:
        """Run the copies between two timing events on the current stream; the end event."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy()
        end.record()
        self._timing.append((start, end))
        self._harvest()
        return end

    def _move(self, gpu: torch.Tensor, pairs: list[tuple[int, int]], staged, save: bool) -> None:
        if staged is None:
            self._copy(gpu, pairs if save else [], [] if save else pairs)
        elif save:
            self._kernel()(gpu, self.buffer, staged[1])
        else:
            self._kernel()(self.buffer, gpu, staged[2])

    def _kernel(self):
        """The page-transfer kernel's launcher (kernels.triton_kv_copy.copy_pages), or None: the per-run
        copies (use_kernel False, or Triton missing)."""
        if not self.use_kernel:
            return None
        if self._copy_pages is None:
            try:
                from autoprofile.kernels.triton_kv_copy import copy_pages
            except ImportError as e:
                log.warning("host KV tier: no page-transfer kernel (%s); one copy per run of pages and layer",
                            e)
                self.use_kernel = False
                return None
            self._copy_pages = copy_pages
        return self._copy_pages

    def _copy(self, gpu: torch.Tensor, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """The per-run copies (the CPU's, and the fallback): one copy per run of pages, part and layer."""
        host, blocking = self.buffer, gpu.device.type != "cuda"
        for src, dst, n in page_runs(saves):
            for part in range(gpu.shape[0]):
                for layer in range(gpu.shape[1]):
                    host[part, layer, dst:dst + n].copy_(gpu[part, layer, src:src + n],
                                                         non_blocking=not blocking)
        for src, dst, n in page_runs(loads):
            for part in range(gpu.shape[0]):
                for layer in range(gpu.shape[1]):
                    gpu[part, layer, dst:dst + n].copy_(host[part, layer, src:src + n],
                                                        non_blocking=not blocking)

    def _harvest(self) -> None:
        """Add the finished copies' event times (never waits)."""
        left = []
        for start, end in self._timing:
            if end.query():
                self.copy_seconds += start.elapsed_time(end) / 1000
            else:
                left.append((start, end))
        self._timing = left


def host_tier(cfg: ServerConfig, world_size: int, heads: int, width: int, kv_dtype: torch.dtype,
              pin: bool, available: int | None = None) -> HostKVPool | None:
    """This rank's host tier (--host_kv), or None (off, or smaller than a page). available: the host's
    available memory (default: psutil's reading now). ConfigError naming --host_kv when it does not fit
    or the host refuses to pin it."""
    mc = cfg.model_config
    available = psutil.virtual_memory().available if available is None else available
    gpus = torch.cuda.device_count() if pin else 0
    try:
        nbytes = host_kv_bytes(cfg.host_kv, available, world_size, gpus)
    except HostKVError as e:
        raise ConfigError("host_kv", str(e)) from None
    if not nbytes:
        return None
    parts = 1 if mc.is_mla else 2
    try:
        pool = HostKVPool.for_cache(nbytes, parts, mc.num_layers, heads, cfg.page_size, width, kv_dtype, pin)
    except RuntimeError as e:  # cudaHostAlloc refused (a locked-memory limit, a container's cap)
        half = math.floor(nbytes / 2 / 2**30 * 10) / 10
        raise ConfigError("host_kv", f"the host refused to pin {gib(nbytes):.1f} GiB ({e}); try --host_kv "
                          f"{half:g} or --host_kv off") from None
    log.info("host KV tier: %d pages of %d tokens (%.2f GiB %s host memory)", pool.num_pages, cfg.page_size,
             gib(pool.nbytes), "pinned" if pin else "pageable")
    return pool if pool.num_pages else None
