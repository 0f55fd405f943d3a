"""AITER's Triton kernels are launched with their shape-following integer arguments unspecialized
(aiter_loader.UNSPECIALIZED), so no step compiles while serving; on the GPU, tests/test_kernels.py counts
the compiled kernels across shapes."""
from __future__ import annotations

import importlib
import importlib.util

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("aiter") is None, reason="amd-aiter not installed")


def test_the_named_parameters_exist_and_are_unspecialized():
    from autoprofile.kernels import aiter_loader
    aiter_loader.triton_ops_package()
    for module, kernel, names in aiter_loader.UNSPECIALIZED:
        k = getattr(importlib.import_module(module), kernel)
        aiter_loader.unspecialize(k, names)
        flags = {p.name: p.do_not_specialize for p in k.params}
        assert all(flags[n] for n in names), (kernel, flags)
        # the model's strides
        assert not flags["stride_qm_in" if kernel == "_attn_fwd" else "input_row_stride"]


def test_a_parameter_the_kernel_lacks_is_named():
    from autoprofile.kernels import aiter_loader
    aiter_loader.triton_ops_package()
    k = importlib.import_module("aiter.ops.triton._triton_kernels.rmsnorm")._rms_norm_kernel
    with pytest.raises(RuntimeError,
                       match=r"_rms_norm_kernel has no parameter \['num_rows'\].*--attention_backend torch"):
        aiter_loader.unspecialize(k, ("num_rows",))


def test_the_pin_named_in_the_error_is_pyprojects():
    from pathlib import Path
    from autoprofile.kernels import aiter_loader
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'"amd-aiter=={aiter_loader.PINNED_AITER}"' in pyproject
