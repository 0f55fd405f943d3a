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
import inspect
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
    seq_partition_size: int  # tokens per partition of AITER's v2 decode (1024)
    pa_kernels: types.ModuleType  # its partition kernels, launched by aiter_triton.decode_v2 with our reduce
    flash_attn_varlen_func: Callable


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

    def get_arch() -> str:
        try:
            return str(raw_get_arch())
        except (RuntimeError, ImportError):  # no GPU driver (Triton's interpreter on CPU): AITER tried JAX
            return "cpu"

    arch_info.get_arch = get_arch
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


# aiter_triton.decode_v2 launches these two positionally, as AITER's paged_attn_decode_v2 does.
PARTITION_KERNEL_PARAMS = {
    "_paged_attn_decode_v2_w_dot_kernel": tuple("""
        exp_sums_ptr max_logits_ptr logits_ptr q_ptr k_cache_ptr v_cache_ptr blk_tables_ptrs seq_lens_ptr
        scale k_scale v_scale alibi_slopes stride_max_logits_s stride_max_logits_nh stride_max_logits_p
        stride_logits_s stride_logits_nh stride_logits_p stride_logits_g stride_q_s stride_q_nh stride_k_b
        stride_k_nh stride_k_kb stride_bt_s compute_type HEAD_SZ HEAD_SZ_POW2 QUERY_GRP_SZ QUERY_GRP_SZ_POW2
        KV_BLK_SZ KV_BLK_SZ_POW2 SEQ_PARTITION_SZ
    """.split()),
    "_paged_attn_decode_v2_wo_dot_kernel": tuple("""
        exp_sums_ptr max_logits_ptr logits_ptr q_ptr k_cache_ptr v_cache_ptr blk_tables_ptr seq_lens_ptr
        scale k_scale v_scale alibi_slopes stride_exp_s stride_exp_h stride_logits_s stride_logits_h
        stride_logits_p stride_q_s stride_q_h stride_k_b stride_k_nh stride_k_kb stride_bt_s stride_bt_nb
        compute_type KV_BLK_SZ KV_BLK_SZ_POW2 HEAD_SZ HEAD_SZ_POW2 QUERY_GRP_SZ SEQ_PARTITION_SZ
        MAX_NUM_BLKS_PER_SEQ MAX_SEQ_LEN_POW2
    """.split()),
}


def load_pa_kernels() -> types.ModuleType:
    """AITER's paged decode kernels (imports without a GPU), their partition kernels' parameters checked."""
    triton_ops_package()
    module = importlib.import_module("aiter.ops.triton._triton_kernels.pa_decode")
    for name, expected in PARTITION_KERNEL_PARAMS.items():
        got = tuple(inspect.signature(getattr(module, name).fn).parameters)  # .fn: JIT and interpreted alike
        if got != expected:
            raise RuntimeError(f"AITER's Triton kernel {name} takes {got}, autoprofile launches it with "
                               f"{expected}: this amd-aiter is not the one autoprofile pins (pip install "
                               f"amd-aiter=={PINNED_AITER}), or run --attention_backend torch")
    return module


# NOTE: Triton compiles a kernel once per specialization of its integer arguments (== 1, divisible by 16).
# These follow a step's shape (tokens, longest request, requests), so a step of a new class compiled while
# serving: an H100 server's first traffic stalled ~5 s on one _attn_fwd compile (p99 TTFT 5.8 s, against
# 0.34 s once warm), and the module it loaded was never in the profile. Unspecialized, one compile in the
# probe serves every shape. Q/K/V/O strides stay specialized: they are the model's, fixed.
UNSPECIALIZED = (
    ("aiter.ops.triton._triton_kernels.mha", "_attn_fwd",
     ("SEQLEN_Q", "SEQLEN_K", "BATCH", "stride_lse_z_in", "stride_lse_h_in", "stride_lse_m_in")),
)
# The MoE kernels' token counts (T * k) follow the step (the rest is the model's)
MOE_UNSPECIALIZED = (
    ("aiter.ops.triton._triton_kernels.moe_op_silu_fused", "_fused_moe_silu_kernel", ("num_valid_tokens",)),
    ("aiter.ops.triton._triton_kernels.moe_op", "_fused_moe_kernel", ("num_valid_tokens",)),
)


def unspecialize(kernel, names: tuple[str, ...]) -> None:
    """Mark integer parameters of a Triton kernel as not specialized, before its first launch builds its
    argument binder. A parameter this AITER does not have is an error naming it (the pinned version moved)."""
    while not hasattr(kernel, "params"):  # a @triton.heuristics (or autotune) wrapper: the JIT function inside
        if not hasattr(kernel, "fn"):  # Triton's interpreter (TRITON_INTERPRET=1) specializes nothing
            return
        kernel = kernel.fn
    params = {p.name: p for p in kernel.params}
    missing = [n for n in names if n not in params]
    if missing:
        raise RuntimeError(f"AITER's Triton kernel {kernel.__name__} has no parameter {missing}: this "
                           f"amd-aiter "
                           f"is not the one autoprofile pins (pip install amd-aiter=={PINNED_AITER}), or run "
                           f"--attention_backend torch")
    for n in names:
        params[n].do_not_specialize = True
    caches = getattr(kernel, "device_caches", None)
    if caches:  # launched already: rebuild the binder (its compiled kernels are dropped)
        caches.clear()


@functools.cache
def load_aiter_triton() -> AiterTriton:
    """Import the Triton kernels (paged decode, varlen flash attention); needs a GPU.

    Cached: the second call returns the same object. A missing amd-aiter raises RuntimeError naming
    --attention_backend torch."""
    pa = load_pa_decode()
    mha = importlib.import_module("aiter.ops.triton.mha")
    for module, kernel, names in UNSPECIALIZED:
        unspecialize(getattr(importlib.import_module(module), kernel), names)
    return AiterTriton(
        paged_attn_decode_v1=pa.paged_attn_decode_v1,
        seq_partition_size=pa._SEQ_PARTITION_SIZE,
        pa_kernels=load_pa_kernels(),
        flash_attn_varlen_func=mha.flash_attn_varlen_func,
    )


@functools.cache
def load_unified_attention() -> Callable:
    """AITER's Triton `kernel_unified_attention_2d` (--deterministic's attention:
    kernels.triton_unified), its sequence count unspecialized (it follows the step). Imports without
    a GPU."""
    triton_ops_package()
    module = importlib.import_module("aiter.ops.triton._triton_kernels.unified_attention")
    unspecialize(module.kernel_unified_attention_2d, ("num_seqs",))
    return module.kernel_unified_attention_2d


@dataclass(frozen=True)
class AiterMoE:
    """AITER's Triton MoE entry points (kernels.triton_moe calls them)."""

    silu: Callable  # fused_moe_silu: gate_up with silu(gate) * up fused
    moe: Callable  # fused_moe: down, weighted by the routing


@functools.cache
def load_aiter_moe() -> AiterMoE:
    """Import AITER's Triton MoE kernels (needs a GPU: its quant module reads the device), their token
    counts unspecialized."""
    triton_ops_package()
    silu = importlib.import_module("aiter.ops.triton.moe_op_silu_fused")
    moe = importlib.import_module("aiter.ops.triton.moe_op")
    for module, kernel, names in MOE_UNSPECIALIZED:
        unspecialize(getattr(importlib.import_module(module), kernel), names)
    return AiterMoE(silu=silu.fused_moe_silu, moe=moe.fused_moe)
