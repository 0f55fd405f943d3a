"""A simulated GPU behind the torch.cuda memory API, and an engine double that allocates on it.

Only the CUDA memory API is replaced (mem_get_info, memory_reserved, max_memory_reserved, ...); the
profiler's own decision logic runs for real against it."""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass, field
from unittest import mock

import torch

from autoprofile import budget

MiB, GiB = 1 << 20, 1 << 30


@dataclass
class FakeGPU:
    total: int = 80 * GiB
    non_torch: int = 512 * MiB  # CUDA context
    peers: int = 0
    allocated: int = 0
    reserved: int = 0
    peak: int = 0

    def alloc(self, n: int) -> None:
        need = max(self.allocated + n - self.reserved, 0)
        if self.reserved + need + self.non_torch + self.peers > self.total:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n / GiB:.2f} GiB")
        self.allocated += n
        self.reserved += need
        self.peak = max(self.peak, self.reserved)

    def free(self, n: int) -> None:
        self.allocated -= n

    def empty_cache(self) -> None:
        self.reserved = self.allocated

    @contextlib.contextmanager
    def patched(self):
        """Replace the torch.cuda memory API (and hide NVML) for the duration."""
        with contextlib.ExitStack() as st:
            p = lambda name, fn: st.enter_context(mock.patch(f"torch.cuda.{name}", fn))  # noqa: E731
            p("mem_get_info",
              lambda *a: (self.total - self.non_torch - self.peers - self.reserved, self.total))
            p("memory_reserved", lambda *a: self.reserved)
            p("memory_allocated", lambda *a: self.allocated)
            p("max_memory_reserved", lambda *a: self.peak)
            p("reset_peak_memory_stats", lambda *a: setattr(self, "peak", self.reserved))
            p("empty_cache", self.empty_cache)
            p("synchronize", lambda *a: None)
            p("current_device", lambda: 0)
            st.enter_context(mock.patch.dict(sys.modules, {"pynvml": None}))
            yield self


@dataclass
class FakeRunner:
    """Engine double: same interface as ModelRunner, allocations go to the FakeGPU."""

    gpu: FakeGPU
    sizing: budget.Sizing
    weight_bytes: int = 16 * GiB
    vision_weight_bytes: int = 0  # a text model
    mm_buffer: torch.Tensor | None = None
    prefill_act: int = 3 * GiB
    decode_act: int = 1 * GiB
    graph_pool: int = 512 * MiB
    device: torch.device = torch.device("cpu")
    built_tokens: int | None = None
    kv_buffer: torch.Tensor | None = None
    kv_bytes: int = 0
    events: list = field(default_factory=list)
    profiler: object = None  # set by tests that check the canary at build time
    forced_routings: tuple[str, ...] = ()  # an MoE model's (ModelRunner.forced_routings)
    boot_steps: list = field(default_factory=list)  # ModelRunner's timed steps (take_boot_steps)
    forgot_warm_ups: int = 0  # ModelRunner.forget_warm_ups calls (after a failed attempt)
    _held: int = 0

    def __post_init__(self):
        self.gpu.alloc(self.weight_bytes)

    def fingerprint(self) -> dict:
        return {"gpu": "fake", "total_memory": self.gpu.total}

    def cut_context(self, cfg) -> None:
        if self.kv_buffer is not None:  # as ModelRunner.cut_context: a built runner keeps its envelope
            raise RuntimeError("cut_context() on a built runner: teardown() first")
        self.events.append(("cut_context", cfg.context_len))
        self.sizing = dataclasses.replace(self.sizing, context_len=cfg.context_len)

    def build(self, kv_tokens: int, checkpoint=None) -> None:
        checkpoint = checkpoint or (lambda p: None)
        self.events.append(("build", kv_tokens, None if self.profiler is None else self.profiler.canary))
        try:
            checkpoint("kv_alloc")
            kv = kv_tokens * self.sizing.cell_bytes
            self.gpu.alloc(kv)
            self._held, self.kv_bytes, self.built_tokens = kv, kv, kv_tokens
            self.kv_buffer = torch.empty(8)  # stands in for the one KV tensor (weakref-able)
            extra = self.sizing.overhead(kv_tokens)
            self.gpu.alloc(extra)
            self._held += extra
            checkpoint("graph_capture")
            self.gpu.alloc(self.graph_pool)
            self._held += self.graph_pool
        except BaseException:
            self.teardown()
            raise

    def forget_warm_ups(self) -> None:
        self.forgot_warm_ups += 1

    def teardown(self) -> None:
        self.events.append(("teardown", self.built_tokens))
        self.gpu.free(self._held)
        self._held, self.kv_bytes, self.built_tokens, self.kv_buffer = 0, 0, None, None

    def _stress(self, n: int, name: str) -> None:
        self.events.append((name, self.built_tokens))
        self.gpu.alloc(n)
        self.gpu.free(n)
        self.boot_steps.append((name.replace("_", " "), n / GiB))  # "seconds": the stress's GiB

    def take_boot_steps(self) -> list:
        steps, self.boot_steps = self.boot_steps, []
        return steps

    def stress_prefill(self) -> None:
        self._stress(self.prefill_act, "stress_prefill")

    def stress_decode(self) -> None:
        self._stress(self.decode_act, "stress_decode")


def llama8b_sizing(page_size: int = 16, context_len: int = 8192) -> budget.Sizing:
    return budget.Sizing(cell_bytes=budget.kv_cell_bytes(32, 8, 128, 2), context_len=context_len,
                         page_size=page_size, running_reqs=256, decode_rows=256, workspace=None)
