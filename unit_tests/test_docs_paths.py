"""Every repository path a doc (README.md, docs/*.md) names exists: a path in backticks or a link target, read
from the repository root, autoprofile/ or docs/ (the docs write `kernels/triton_decode.py` for
autoprofile/kernels/triton_decode.py); `module.py::name`, `module.py:NAME` and `package/module.name` name
the file."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BASES = (ROOT, ROOT / "autoprofile", ROOT / "docs")
FILE = re.compile(r"\.(py|md|json|csv|sh|png|txt|toml|cfg|ya?ml)$")
NAMED = re.compile(r"`([^`\s]+)`|\]\(([^)\s#]+)(?:#[^)]*)?\)")


def top_dirs() -> set[str]:
    return {p.name for base in BASES[:2] for p in base.iterdir()
            if p.is_dir() and not p.name.startswith((".", "_"))}


def named_paths(text: str, dirs: set[str]) -> set[str]:
    """The repository paths a doc names: under a folder of the tree, or with a file's suffix."""
    out = set()
    for m in NAMED.finditer(text):
        t = re.sub(r":\w+$", "", (m.group(1) or m.group(2)).split("::")[0])
        if "://" in t or "/" not in t or t.startswith(("~", "/", ".", "$")):
            continue
        if t.split("/")[0] in dirs or FILE.search(t):
            out.add(t.rstrip("/"))
    return out


def exists(path: str) -> bool:
    return any((base / p).exists() for base in BASES for p in (path, re.sub(r"\.\w+$", ".py", path)))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_doc_names_exists(doc):
    missing = sorted(p for p in named_paths(doc.read_text(), top_dirs()) if not exists(p))
    assert missing == [], f"{doc.name} names paths that do not exist: {missing}"


def test_a_moved_path_is_caught():
    dirs = top_dirs()
    text = "the sampler (`autoprofile/engine/triton_sample.py`), [the plan](kernels/launch_rules.py)"
    assert named_paths(text, dirs) == {"autoprofile/engine/triton_sample.py", "kernels/launch_rules.py"}
    assert [p for p in named_paths(text, dirs) if not exists(p)] == ["autoprofile/engine/triton_sample.py"]
    assert named_paths("`~/models/x.json`, `/v1/models`, `config.json`, <https://a.b/c.py>", dirs) == set()
