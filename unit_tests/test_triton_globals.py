"""Every @triton.jit function of the package reads only globals that Triton's compiler accepts. The compiler
refuses a plain global ("Cannot access global variable BIG from within @jit'ed function": an int, float,
str, tuple, or a Python function that is not jit); the CPU interpreter (TRITON_INTERPRET=1) runs Python and
accepts it, so the interpreter tests never see it. This reads each kernel's source with `ast`, takes the
names it reads and does not bind, and resolves them in the imported module by the rules of the installed
Triton (code_generator.CodeGenerator's global lookup and jit.DependenciesFinder's record_reference)."""
from __future__ import annotations

import ast
import importlib
import pathlib
from types import ModuleType

import pytest
import triton.language as tl
from triton._utils import is_namedtuple
from triton.compiler.code_generator import CodeGenerator
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITCallable, KernelInterface

import autoprofile

PACKAGE = pathlib.Path(autoprofile.__file__).parent
KERNEL_DECORATORS = {"jit", "triton.jit", "triton.autotune", "triton.heuristics"}
# jit.DependenciesFinder does not look into attributes of these modules.
TRITON_MODULES = ("triton", "math", "copy")
TRITON_BUILTINS = frozenset(CodeGenerator.builtin_namespace)


def dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        return dotted(node.func)
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def kernel_defs(tree: ast.Module) -> list[ast.FunctionDef]:
    """The module-level functions decorated with triton.jit, triton.autotune or triton.heuristics."""
    return [node for node in tree.body if isinstance(node, ast.FunctionDef)
            and any(dotted(d) in KERNEL_DECORATORS for d in node.decorator_list)]


def bound_names(fn: ast.FunctionDef) -> set[str]:
    """Arguments and every name the body stores: assignments, for and with targets, comprehension vars."""
    args = fn.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)) and node is not fn:
            names |= {a.arg for a in node.args.args}
            if isinstance(node, ast.FunctionDef):
                names.add(node.name)
    return names


def free_reads(fn: ast.FunctionDef) -> dict[str, ast.Name]:
    """The names the body reads and does not bind (an argument's default may read any global)."""
    bound = bound_names(fn)
    reads: dict[str, ast.Name] = {}
    for stmt in fn.body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in bound:
                reads.setdefault(node.id, node)
    return reads


def is_jit(value: object) -> bool:
    return isinstance(value, (JITCallable, InterpretedFunction))


def unwrap(value: object) -> object:
    """The jit function under triton.autotune / triton.heuristics."""
    while isinstance(value, KernelInterface) and not is_jit(value):
        value = value.fn
    return value


def unsupported_function(value: object) -> bool:
    """jit.DependenciesFinder.record_reference's "Unsupported function referenced"."""
    return (callable(value) and not isinstance(value, (type, tl.constexpr)) and not is_jit(value)
            and not getattr(value, "__triton_builtin__", False) and type(value) is not ModuleType)


def global_accepted(value: object) -> bool:
    """CodeGenerator's global lookup: constexpr, jit function, module, Triton builtin, dtype, namedtuple."""
    module = str(getattr(value, "__module__", "") or "")
    return (isinstance(value, tl.constexpr) or is_jit(value) or type(value) is ModuleType
            or getattr(value, "__triton_builtin__", False) or getattr(value, "__triton_aggregate__", False)
            or module.startswith(("triton.language", "triton.experimental.gluon.language"))
            or isinstance(value, tl.dtype) or is_namedtuple(value))


def refusal(name: str, namespace: dict[str, object]) -> str | None:
    """Why Triton's compiler refuses this global read from a kernel; None when it accepts it."""
    if name not in namespace:
        return None if name in TRITON_BUILTINS else "not a module global nor a builtin Triton knows"
    value = namespace[name]
    if name in TRITON_BUILTINS or (global_accepted(value) and not unsupported_function(value)):
        return None
    if callable(value):
        return f"a Python {type(value).__name__} that is not @triton.jit"
    return f"a plain {type(value).__name__} global: make it tl.constexpr(...)"


def attribute_refusals(fn: ast.FunctionDef, namespace: dict[str, object]) -> list[tuple[str, int, str]]:
    """`module.f` reads, for modules outside Triton: f must not be a Python function that is not jit."""
    bound = bound_names(fn)
    found = []
    for stmt in fn.body:
        for node in ast.walk(stmt):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
                continue
            module = None if node.value.id in bound else namespace.get(node.value.id)
            if type(module) is not ModuleType or module.__name__.split(".")[0] in TRITON_MODULES:
                continue
            if unsupported_function(getattr(module, node.attr, None)):
                why = "a Python function that is not @triton.jit"
                found.append((f"{node.value.id}.{node.attr}", node.lineno, why))
    return found


def kernel_refusals(tree: ast.Module, namespace: dict[str, object], where: str) -> list[str]:
    """Each global read that Triton's compiler refuses, as 'module.kernel reads NAME (line N): why'."""
    found = []
    for fn in kernel_defs(tree):
        reads = [(name, node.lineno, refusal(name, namespace)) for name, node in free_reads(fn).items()]
        for name, line, why in reads + attribute_refusals(fn, namespace):
            if why is not None:
                found.append(f"{where}.{fn.name} reads {name} (line {line}): {why}")
    return found


def kernel_modules() -> dict[str, ast.Module]:
    """The package's modules that define a @triton.jit function, by dotted name, parsed."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if "jit" not in source:
            continue
        tree = ast.parse(source, filename=str(path))
        if kernel_defs(tree):
            parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = tree
    return found


MODULES = kernel_modules()


def test_finds_the_kernels_and_each_imports_as_a_jit_function():
    sampler = MODULES["autoprofile.kernels.triton_sample"]
    assert {"_sample_kernel", "_race"} <= {fn.name for fn in kernel_defs(sampler)}
    for name, tree in MODULES.items():
        module = importlib.import_module(name)
        for fn in kernel_defs(tree):
            assert is_jit(unwrap(getattr(module, fn.name))), f"{name}.{fn.name}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_kernels_read_only_globals_the_compiler_accepts(name):
    namespace = vars(importlib.import_module(name))
    found = kernel_refusals(MODULES[name], namespace, name)
    assert not found, "Triton's compiler refuses these globals:\n" + "\n".join(found)


def test_refuses_plain_globals_and_python_functions_accepts_constexpr_jit_modules_and_builtins():
    import collections
    import math

    from autoprofile.kernels.triton_sample import _race

    source = """
@triton.jit
def kernel(x, n: tl.constexpr, limit=LIMIT):
    acc = 0
    for i in range(n):
        acc += tl.load(x + i) * SCALE + OK + min(i, n) + abs(i)
    helper(acc)
    return _race, math.pi, [j for j in range(3)], tl.float32, Pair, NAME, lib.rows, lib.jitted, lib.pure

def not_a_kernel():
    return SCALE
"""
    lib = ModuleType("lib")
    lib.rows, lib.jitted, lib.pure = 4, _race, math.ceil
    namespace = {"tl": tl, "math": math, "lib": lib, "LIMIT": 7, "SCALE": 0.5, "OK": tl.constexpr(3),
                 "helper": math.ceil, "_race": _race, "Pair": collections.namedtuple("Pair", "a b"),
                 "NAME": "x"}
    found = kernel_refusals(ast.parse(source), namespace, "m")
    assert sorted(line.split(" (")[0].removeprefix("m.kernel reads ") for line in found) == [
        "NAME", "SCALE", "abs", "helper", "lib.pure"]
