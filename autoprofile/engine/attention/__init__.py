"""Attention backends behind one seam (base.AttentionBackend), chosen by --attention_backend.

    torch         SDPA reference, runs on CPU and any GPU (slow decode at long max_seq_len)
    aiter_triton  AITER's Triton kernels: the NVIDIA fast path (also runs on ROCm)
    aiter         AITER's native ROCm ops (untested on hardware here)
    auto          aiter on ROCm, aiter_triton on CUDA
Kernel modules are imported when a backend is constructed, never when this package is imported.
"""
from __future__ import annotations

from types import MappingProxyType

import torch

from autoprofile.config import ConfigError
from autoprofile.kernels.aiter_loader import aiter_installed, is_rocm
from autoprofile.engine.attention.aiter_native import AiterNativeBackend
from autoprofile.engine.attention.aiter_triton import AiterTritonBackend
from autoprofile.layers.attention import AttentionBackend, AttentionMetadata
from autoprofile.engine.attention.torch_sdpa import TorchBackend

BACKENDS: MappingProxyType[str, type[AttentionBackend]] = MappingProxyType({
    cls.name: cls for cls in (TorchBackend, AiterTritonBackend, AiterNativeBackend)})

__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "get_backend_class", "resolve_backend_name"]


def resolve_backend_name(name: str) -> str:
    """Map --attention_backend to a concrete backend name for this machine, or raise ConfigError."""
    if name != "auto" and name not in BACKENDS:
        raise ConfigError("attention_backend",
                          f"unknown backend '{name}'; choose one of auto, {', '.join(BACKENDS)}")
    if name == "torch":
        return name
    if not torch.cuda.is_available():
        raise ConfigError("attention_backend", f"'{name}' needs a GPU and none is visible; torch is the only "
                                               "backend that runs on CPU: --attention_backend torch")
    if name == "auto":
        name = "aiter" if is_rocm() else "aiter_triton"
    if name == "aiter" and not is_rocm():
        raise ConfigError("attention_backend", "'aiter' (native ops) needs ROCm; on NVIDIA use "
                                               "--attention_backend aiter_triton (or torch)")
    if not aiter_installed():
        raise ConfigError("attention_backend", f"'{name}' needs amd-aiter (`pip install amd-aiter`); "
                                               "or use --attention_backend torch")
    return name


def get_backend_class(name: str) -> type[AttentionBackend]:
    return BACKENDS[resolve_backend_name(name)]
