"""Loading AITER's Triton kernels, on ROCm and on NVIDIA.

`import aiter` runs a package __init__ that probes the ROCm toolchain and fails elsewhere. Its Triton
kernels do not need it: on CUDA we register a bare `aiter` package whose __path__ is the installed
folder, then import `aiter.ops.triton.*` directly. Two AMD-only assumptions are patched there:
`arch_info.get_arch()` returns an int on NVIDIA (types.py compares it with strings), and
`arch_info.get_device()` only knows gfx942/gfx950 (it names the tuned-config files).

Nothing here runs at import time: call load_aiter_triton() when a backend is built.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

MISSING_HINT = ("amd-aiter is not installed: `pip install amd-aiter`, or run the torch reference "
                "backend with --attention_backend torch")
FALLBACK_DEVICE = "MI300X"  # config-file name for archs AITER does not know
PINNED_AITER = "0.1.7.post2.dev18"  # pyproject.toml's pin


def is_rocm() -> bool:
    return torch.version.hip is not None


def aiter_installed() -> bool:
    return "aiter" in sys.modules or importlib.util.find_spec("aiter") is not None


@dataclass(frozen=True)
class AiterTriton:
    """The AITER Triton entry points the backends use."""

    paged_attn_decode_v1: Callable
    paged_attn_decode_v2: Callable
    seq_partition_size: int  # tokens per partition of the v2 decode (1024)
    pa_decode: types.ModuleType  # its v2 launcher reads _SEQ_PARTITION_SIZE when called (decode_v2)
    flash_attn_varlen_func: Callable
    rms_norm: Callable

    def decode_v2(self, *args, partition: int, max_seq_len: int) -> None:
        """paged_attn_decode_v2 in partitions of `partition` tokens (budget.triton_decode_partition). AITER's
        launcher passes its module's _SEQ_PARTITION_SIZE to both kernels as a constexpr, read at the call:
        it is set for this call only (decode runs on one thread per process)."""
        pa = self.pa_decode
        default, pa._SEQ_PARTITION_SIZE = pa._SEQ_PARTITION_SIZE, partition
        try:
            self.paged_attn_decode_v2(*args, -(-max_seq_len // partition))
        finally:
            pa._SEQ_PARTITION_SIZE = default


def _register_bare_package() -> None:
    """Make `aiter` importable as a namespace for its submodules without running its __init__."""
    if "aiter" in sys.modules:
        return
    spec = importlib.util.find_spec("aiter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(MISSING_HINT)
    pkg = types.ModuleType("aiter")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    sys.modules["aiter"] = pkg


def _patch_arch_info(arch_info: types.ModuleType) -> None:
    """NOTE: must run before any other aiter.ops.triton module is imported: some bind get_arch by name."""
    if getattr(arch_info, "_autoprofile_patched", False):
        return
    raw_get_arch = arch_info.get_arch
    known = dict(arch_info._ARCH_TO_DEVICE)
    arch_info.get_arch = lambda: str(raw_get_arch())
    arch_info.get_device = lambda: known.get(arch_info.get_arch(), FALLBACK_DEVICE)
    arch_info._autoprofile_patched = True


@functools.cache
def triton_ops_package() -> str:
    """Prepare `aiter.ops.triton` for import (idempotent); returns the aiter package path.

    On ROCm the real package imports; elsewhere the bare package plus the arch patches."""
    if not aiter_installed():
        raise RuntimeError(MISSING_HINT)
    if is_rocm():
        import aiter  # noqa: F401  (the real package works on ROCm)
    else:
        _register_bare_package()
        _patch_arch_info(importlib.import_module("aiter.ops.triton.utils._triton.arch_info"))
    return sys.modules["aiter"].__path__[0]


def load_pa_decode() -> types.ModuleType:
    """The Triton paged decode module: the only AITER Triton module that imports without a GPU."""
    triton_ops_package()
    return importlib.import_module("aiter.ops.triton.pa_decode")


# NOTE: Triton compiles a kernel once per specialization of its integer arguments (== 1, divisible by 16).
# These follow a step's shape (tokens, longest request, requests), so a step of a new class compiled while
# serving: an H100 server's first traffic stalled ~5 s on one _attn_fwd compile (p99 TTFT 5.8 s, against
# 0.34 s once warm), and the module it loaded was never in the profile. Unspecialized, one compile in the
# probe serves every shape. Q/K/V/O strides stay specialized: they are the model's, fixed.
UNSPECIALIZED = (
    ("aiter.ops.triton._triton_kernels.mha", "_attn_fwd",
     ("SEQLEN_Q", "SEQLEN_K", "BATCH", "stride_lse_z_in", "stride_lse_h_in", "stride_lse_m_in")),
    ("aiter.ops.triton._triton_kernels.rmsnorm", "_rms_norm_kernel", ("n_rows",)),
)


def unspecialize(kernel, names: tuple[str, ...]) -> None:
    """Mark integer parameters of a Triton kernel as not specialized, before its first launch builds its
    argument binder. A parameter this AITER does not have is an error naming it (the pinned version moved)."""
    params = {p.name: p for p in kernel.params}
    missing = [n for n in names if n not in params]
    if missing:
        raise RuntimeError(f"AITER's Triton kernel {kernel.__name__} has no parameter {missing}: this amd-aiter "
                           f"is not the one autoprofile pins (pip install amd-aiter=={PINNED_AITER}), or run "
                           f"--attention_backend torch")
    for n in names:
        params[n].do_not_specialize = True
    caches = getattr(kernel, "device_caches", None)
    if caches:  # launched already: rebuild the binder (its compiled kernels are dropped)
        caches.clear()


@functools.cache
def load_aiter_triton() -> AiterTriton:
    """Import the Triton kernels (paged decode, varlen flash attention, RMSNorm); needs a GPU.

    Cached: the second call returns the same object. A missing amd-aiter raises RuntimeError naming
    --attention_backend torch."""
    pa = load_pa_decode()
    mha = importlib.import_module("aiter.ops.triton.mha")
    rmsnorm = importlib.import_module("aiter.ops.triton.rmsnorm")
    for module, kernel, names in UNSPECIALIZED:
        unspecialize(getattr(importlib.import_module(module), kernel), names)
    return AiterTriton(
        paged_attn_decode_v1=pa.paged_attn_decode_v1,
        paged_attn_decode_v2=pa.paged_attn_decode_v2,
        seq_partition_size=pa._SEQ_PARTITION_SIZE,
        pa_decode=pa,
        flash_attn_varlen_func=mha.flash_attn_varlen_func,
        rms_norm=rmsnorm.rms_norm,
    )
