"""Issue 50: the backend's non-attention operations are an interface of their own (layers.ops.KernelOps), and
the model's layers name the interface they call: norms, MLPs and experts the kernel ops, attention the
attention backend."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import models
from autoprofile.engine.attention import AiterNativeBackend, AiterTritonBackend, TorchBackend
from autoprofile.layers import moe
from autoprofile.layers.attention import AttentionBackend
from autoprofile.layers.ops import KernelOps

OPS = {"gemm", "gemm_add", "router_gemm", "fp8_gemm", "silu_mul", "silu_mul_quant", "fused_moe",
       "route_experts", "rms_norm", "rms_norm_quant", "moe_capturable"}
MODEL_FILES = sorted(Path(models.__file__).parent.glob("*.py")) + [Path(moe.__file__)]


def own_members(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("__")}


def attention_members() -> set[str]:
    """What AttentionBackend declares itself, its __init__'s attributes included."""
    init = ast.parse(inspect.getsource(AttentionBackend.__init__).strip())
    assigned = {t.attr for node in ast.walk(init) if isinstance(node, ast.Assign) for target in node.targets
                for t in (target.elts if isinstance(target, ast.Tuple) else [target])
                if isinstance(t, ast.Attribute)}
    return own_members(AttentionBackend) | assigned


def calls_on(attr: str) -> dict[str, set[str]]:
    """Per model file, the members read of `self.<attr>` (self.ops.rms_norm -> rms_norm)."""
    out = {}
    for path in MODEL_FILES:
        names = {node.attr for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                 and node.value.attr == attr and isinstance(node.value.value, ast.Name)
                 and node.value.value.id == "self"}
        if names:
            out[path.name] = names
    return out


def test_the_kernel_ops_are_their_own_interface_and_the_attention_backend_declares_none_of_them():
    assert OPS <= own_members(KernelOps)
    assert not OPS & own_members(AttentionBackend), sorted(OPS & own_members(AttentionBackend))
    for backend in (TorchBackend, AiterTritonBackend, AiterNativeBackend):
        assert issubclass(backend, AttentionBackend) and issubclass(backend, KernelOps)
        undeclared = {m for m in own_members(backend) if not m.startswith("_")} & OPS - own_members(KernelOps)
        assert not undeclared, (backend.__name__, undeclared)


def test_the_models_layers_name_the_interface_they_call():
    """self.ops.x is a kernel op (norms, MLPs, experts); self.backend.x an attention member (attention, the
    KV cache, MLA's latents, the hybrids' state): no layer reaches an op through the attention backend."""
    ops, attention = calls_on("ops"), calls_on("backend")
    assert ops and attention
    for name, used in ops.items():
        assert used <= own_members(KernelOps), (name, sorted(used - own_members(KernelOps)))
    for name, used in attention.items():
        assert used <= attention_members(), (name, sorted(used - attention_members()))
