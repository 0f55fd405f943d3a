"""The import graph of autoprofile/ and models/, its layers, and the two rules: no circle, and no import from
a lower layer to a higher one (imports follow the data: the CLI down to the pure arithmetic). The GPU kernels
(autoprofile.kernels) sit below the engine that calls them; the rank launcher (autoprofile.launch) at the
CLI's level, above the server and the profiler it starts. The kernels' launch rules
(autoprofile.kernels.launch_rules: pure arithmetic, no torch) sit in the base layer beside the budget that
counts what those launches hold.

    python3 scripts/import_graph.py            # the layers, each module's imports; exit 1 on a broken rule
    python3 scripts/import_graph.py --dot      # Graphviz
Imports inside functions count too (a lazy import is still a dependency). `from pkg import name` counts as
an import of pkg.name when that is a module, else of pkg.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("autoprofile", "models")
# Highest first; a module takes the layer of the longest prefix it starts with (whole dotted parts).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cli", ("autoprofile.cli", "autoprofile.launch")),
    ("server", ("autoprofile.server",)),
    ("serving", ("autoprofile.serving",)),
    ("profiler", ("autoprofile.profiler", "autoprofile.report", "autoprofile.plan", "autoprofile.cpu")),
    ("tp", ("autoprofile.tp.broadcast", "autoprofile.tp.channel")),
    ("engine", ("autoprofile.engine",)),
    ("kernels", ("autoprofile.kernels",)),  # called by the engine's backends and sampler; never import it
    ("models", ("models",)),
    ("layers", ("autoprofile.layers",)),
    ("config", ("autoprofile.config", "autoprofile.model_config")),
    ("base", ("autoprofile.budget", "autoprofile.kernels.launch_rules", "autoprofile.memory",
              "autoprofile.profile_cache", "autoprofile.tp.votes", "autoprofile.tp", "autoprofile")),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports (anywhere in it)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if base.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    out.discard(name)
    return out


def layer_of(name: str) -> int:
    """Index in LAYERS, 0 the highest: the layer of the longest prefix that `name` starts with."""
    found = [(len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
             if name == p or name.startswith(p + ".")]
    if not found:
        raise ValueError(f"{name} is in no layer of scripts/import_graph.py: add it to LAYERS")
    return max(found)[1]


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every circle found by a depth-first walk (each reported once, from where the walk entered it)."""
    out, state, stack = [], {}, []

    def walk(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(g.get(u, ())):
            if state.get(v) == 1:
                out.append(stack[stack.index(v):] + [v])
            elif v not in state:
                walk(v)
        stack.pop()
        state[u] = 2

    for m in sorted(g):
        if m not in state:
            walk(m)
    return out


def upward(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a lower layer to a higher one."""
    return [(a, b) for a in sorted(g) for b in sorted(g[a]) if layer_of(b) < layer_of(a)]


def problems(g: dict[str, set[str]]) -> list[str]:
    return ([" -> ".join(c) + "  (a circle)" for c in cycles(g)]
            + [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]}): a lower layer "
               "imports a higher one" for a, b in upward(g)])


def stale(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """LAYERS entries that no module of the whole tree `g` is or starts with (a moved module's old name)."""
    return [(layer, p) for layer, prefixes in LAYERS for p in prefixes
            if not any(m == p or m.startswith(p + ".") for m in g)]


def summary(g: dict[str, set[str]]) -> str:
    return (f"{len(g)} modules in {len(LAYERS)} layers: {len(cycles(g))} circles, "
            f"{len(upward(g))} upward imports")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dot", action="store_true", help="print the graph for Graphviz")
    args = p.parse_args(argv)
    g = graph()
    if args.dot:
        print("digraph imports {\n  rankdir=TB;")
        print("\n".join(f'  "{a}" -> "{b}";' for a in sorted(g) for b in sorted(g[a])))
        print("}")
    else:
        for i, (layer, _) in enumerate(LAYERS):
            members = [m for m in sorted(g) if layer_of(m) == i]
            print(f"{layer}:")
            for m in members:
                print(f"  {m} -> {', '.join(sorted(g[m])) or '-'}")
        print(summary(g))
    bad = problems(g) + [f"{p} (layer {layer}) names no module: remove it from LAYERS"
                         for layer, p in stale(g)]
    for line in bad:
        print(f"FAIL: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
