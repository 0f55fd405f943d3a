"""GPU test fixtures: backend availability, and a clean allocator between tests."""
from __future__ import annotations

import gc

import pytest
import torch


def require_backend(name: str) -> None:
    """Skip unless `name` can run here (AITER's Triton kernels need the amd-aiter package and a GPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if name.startswith("aiter"):
        from autoprofile.kernels.aiter_loader import load_aiter_triton

        try:
            load_aiter_triton()
        except (RuntimeError, ImportError) as e:
            pytest.skip(f"AITER Triton kernels unavailable: {e}")


def release_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _clean_gpu_after_test():
    """What one test leaves cached must not count in the next test's memory readings."""
    yield
    release_gpu()
