"""Memory readings: the torch.cuda memory API, NVML per-process usage, MIN/agreement across ranks.

Everything the profiler reads about GPU memory goes through this module, so unit tests mock it here.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemorySnapshot:
    total: int
    free: int
    reserved: int
    allocated: int
    peak_reserved: int
    process_used: int | None  # NVML: this process on this GPU (None when NVML cannot tell)


def device_index(device: torch.device | int | None = None) -> int:
    if isinstance(device, int):
        return device
    if device is not None and getattr(device, "index", None) is not None:
        return device.index
    return torch.cuda.current_device()


def process_used_bytes(index: int) -> int | None:
    """This process's memory on GPU `index` by NVML (None if NVML is missing or does not list us)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            uuid = torch.cuda.get_device_properties(index).uuid
            handle = _nvml_handle(pynvml, index, str(uuid))
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        log.debug("NVML per-process reading unavailable: %s", e)
        return None
    pid = os.getpid()
    used = [p.usedGpuMemory for p in procs if p.pid == pid and p.usedGpuMemory is not None]
    return used[0] if used else None


def _nvml_handle(pynvml, index: int, uuid: str):
    """NVML enumerates all GPUs; torch may see a subset (CUDA_VISIBLE_DEVICES): match by UUID."""
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        nv_uuid = pynvml.nvmlDeviceGetUUID(h)
        nv_uuid = nv_uuid.decode() if isinstance(nv_uuid, bytes) else nv_uuid
        if nv_uuid.removeprefix("GPU-") == uuid.removeprefix("GPU-"):
            return h
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def snapshot(device: torch.device | int | None = None) -> MemorySnapshot:
    idx = device_index(device)
    free, total = torch.cuda.mem_get_info(idx)
    return MemorySnapshot(
        total=total,
        free=free,
        reserved=torch.cuda.memory_reserved(idx),
        allocated=torch.cuda.memory_allocated(idx),
        peak_reserved=torch.cuda.max_memory_reserved(idx),
        process_used=process_used_bytes(idx),
    )


def reserved(device: torch.device | int | None = None) -> int:
    return torch.cuda.memory_reserved(device_index(device))


def allocated(device: torch.device | int | None = None) -> int:
    return torch.cuda.memory_allocated(device_index(device))


def free_and_total(device: torch.device | int | None = None) -> tuple[int, int]:
    return torch.cuda.mem_get_info(device_index(device))


def reset_peak(device: torch.device | int | None = None) -> None:
    torch.cuda.synchronize(device_index(device))
    torch.cuda.reset_peak_memory_stats(device_index(device))


def release_cached(device: torch.device | int | None = None) -> None:
    """Return the caching allocator's unused blocks to the driver."""
    torch.cuda.synchronize(device_index(device))
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- local memory
CU_LIMIT_STACK_SIZE = 0x00
STACK_BOUND = 1024  # bytes per thread: the CUDA default; a serving kernel needing more spills


@functools.cache
def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _driver(lib, name: str):
    """A driver entry point by its exported name (the _v2 one where the header renames it)."""
    return getattr(lib, name + "_v2", None) or getattr(lib, name)


def stack_limit_bytes(device: torch.device | int | None = None) -> int | None:
    """The per-thread stack limit of this process's (primary) CUDA context on `device`: cuCtxGetLimit(
    CU_LIMIT_STACK_SIZE). The driver raises it when a kernel needs more local memory than it allows and
    reserves limit x every resident thread for good (local_memory_bytes). None without CUDA (CPU, ROCm).

    Read through the primary context pushed on this thread, so any thread (HTTP, engine) may ask."""
    if torch.version.hip is not None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    lib = _libcuda()
    if lib is None:
        return None
    dev, ctx, value = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_size_t()
    if lib.cuDeviceGet(ctypes.byref(dev), device_index(device)) != 0:
        return None
    if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
        return None
    try:
        if _driver(lib, "cuCtxPushCurrent")(ctx) != 0:
            return None
        try:
            err = lib.cuCtxGetLimit(ctypes.byref(value), CU_LIMIT_STACK_SIZE)
        finally:
            _driver(lib, "cuCtxPopCurrent")(ctypes.byref(ctypes.c_void_p()))
    finally:
        _driver(lib, "cuDevicePrimaryCtxRelease")(dev)
    return value.value if err == 0 else None


def local_memory_bytes(stack_limit: int, sms: int, threads_per_sm: int) -> int:
    """What the driver holds for a stack limit: limit x every thread that can be resident (H100: 132 x 2048
    threads, 264 MiB per KiB)."""
    return stack_limit * sms * threads_per_sm


def local_memory_reserved(device: torch.device | int | None = None) -> tuple[int, int] | None:
    """(stack limit per thread, bytes the driver reserves for it) on `device`; None without CUDA."""
    limit = stack_limit_bytes(device)
    if limit is None:
        return None
    p = torch.cuda.get_device_properties(device_index(device))
    return limit, local_memory_bytes(limit, p.multi_processor_count, p.max_threads_per_multi_processor)


# ---------------------------------------------------------------- collective decisions
def _reduce(value: int, op, group) -> int:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=op, group=group)  # group is a gloo (CPU) group: decisions never touch the GPU
    return int(t.item())


def all_reduce_min(value: int, group=None) -> int:
    """MIN across TP ranks (every rank gets the same, smallest value)."""
    return _reduce(value, dist.ReduceOp.MIN, group)


def all_reduce_max(value: int, group=None) -> int:
    return _reduce(value, dist.ReduceOp.MAX, group)


def all_ok(ok: bool, group=None) -> bool:
    """Collective AND: True only if every rank says True."""
    return all_reduce_min(int(ok), group) == 1
