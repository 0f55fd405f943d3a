"""Triton compiles after the boot, counted and named (issue 48: the first minutes of serving).

Triton specializes a kernel on its integer arguments (equal to 1, a multiple of 16, anything else) and
compiles each specialization at its first launch. The stress runs the envelope's corners, and the boot's
compiles are those corners' specializations: a served step whose shapes none of them had (a prefill of
4,103 tokens where every corner's count is 1 or a multiple of 16) compiles on the serving path, for seconds,
with requests waiting. On a warm Triton cache the compile is a disk read; on a machine's first boot it is
not. `watch_after_boot()` (the profiler calls it once the boot's CompileAhead has closed) chains a listener
onto Triton's compilation listener that counts every compile and cache load from then on and logs each real
compile with its kernel's name and seconds: what a step outside the stress's specializations cost.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class CompileWatch:
    """Counts of Triton's compilation listener's calls since install(): compiles (not in Triton's on-disk
    cache), loads (found there), the compiles' seconds, the compiles by kernel name."""

    compiles: int = 0
    loads: int = 0
    seconds: float = 0.0
    kernels: Counter = field(default_factory=Counter)
    chained: object = None  # the listener this one calls after counting (Triton has one slot)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit, **kwargs) -> None:
        name = kernel_name(src, metadata)
        seconds = compile_seconds(times)
        with self._lock:
            if cache_hit:
                self.loads += 1
            else:
                self.compiles += 1
                self.seconds += seconds
                self.kernels[name] += 1
        if not cache_hit:
            log.warning("Triton compiled %s after the boot (%.2f s; its arguments' specialization: %s): a "
                        "step with a specialization the stress's corners did not launch (%d such compiles so "
                        "far, %.1f s)", name, seconds, specialization(src) or "none", self.compiles,
                        self.seconds)
        if self.chained is not None:
            self.chained(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                         cache_hit=cache_hit, **kwargs)


def specialization(src) -> str:
    """What Triton specialized a compile's arguments on (its ASTSource: the non-constexpr parameters that
    became constants, such as an integer equal to 1, and the pointers and integers known divisible by 16),
    as "n=1, x_ptr %16": the part of the key that a step outside the stress's corners changed. "" where src
    carries none of it."""
    fn = getattr(src, "fn", None)
    names = getattr(fn, "arg_names", None)
    if not names:
        return ""
    declared = {i for i, param in enumerate(getattr(fn, "params", ()))
                if getattr(param, "is_constexpr", False)}
    parts = []
    for key, value in sorted((getattr(src, "constants", None) or {}).items()):
        if len(key) == 1 and key[0] not in declared and key[0] < len(names):
            parts.append(f"{names[key[0]]}={value}")
    for key, attrs in sorted((getattr(src, "attrs", None) or {}).items()):
        for attr in attrs:
            if len(key) == 1 and key[0] < len(names) and attr[0] == "tt.divisibility":
                parts.append(f"{names[key[0]]} %{attr[1]}")
    return ", ".join(parts)


def kernel_name(src, metadata) -> str:
    """The kernel a compilation listener's call is about (its source's name, else the metadata's)."""
    return getattr(src, "name", None) or str(metadata.get("name", "?"))


def compile_seconds(times) -> float:
    """A compile's seconds from Triton's CompileTimes (microseconds: IR, each lowering stage, the store)."""
    if times is None:
        return 0.0
    stages = sum(us for _, us in getattr(times, "lowering_stages", ()) or ())
    return (getattr(times, "ir_initialization", 0) + stages + getattr(times, "store_results", 0)) / 1e6


_WATCH: CompileWatch | None = None


def watch_after_boot() -> CompileWatch | None:
    """Install the process's watch on Triton's compilation listener (once; None without Triton): from now
    on a compile is a step outside the boot's specializations."""
    global _WATCH
    try:
        from triton import knobs
    except ImportError:
        return None
    if _WATCH is None or knobs.compilation.listener is not _WATCH:
        _WATCH = CompileWatch(chained=knobs.compilation.listener)
        knobs.compilation.listener = _WATCH
    return _WATCH
