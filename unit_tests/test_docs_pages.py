"""The user docs stay in step with the code: docs/api.md is what scripts/api_docs.py writes from
protocol.FIELDS, docs/troubleshooting.md has an entry for every flag a startup error names, the README stays
short, and the docs' index and links resolve."""
from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from autoprofile.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# calls that raise a startup error, and the argument naming its flag
FLAG_ARG = {"_check": 1, "ConfigError": 0, "UsageError": 0}
LEADING_FLAG = re.compile(r"^(?:error: )?--(\w+): ")  # "--flag: why" texts (ProfileError, CPUSizeError, ...)


def api_docs():
    spec = importlib.util.spec_from_file_location("api_docs", ROOT / "scripts" / "api_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_md_is_what_the_script_writes_from_protocol_fields():
    docs = api_docs()
    assert not docs.undescribed(), f"describe these served fields in scripts/api_docs.py: {docs.undescribed()}"
    assert (DOCS / "api.md").read_text() == docs.render(), "docs/api.md is stale: run python3 scripts/api_docs.py"


def test_api_md_lists_every_field_of_protocol():
    from autoprofile.serving.protocol import FIELDS
    text = (DOCS / "api.md").read_text()
    assert all(f"`{k}`" in text for k in FIELDS)


def _strings(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.IfExp):
        yield from _strings(node.body)
        yield from _strings(node.orelse)


def _leading_text(node: ast.AST) -> str | None:
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return node.values[0].value
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def error_flags() -> dict[str, set[str]]:
    """Each flag a startup error of autoprofile/ names -> the files that raise it: _check / ConfigError /
    UsageError's flag argument, and every text that starts with "--flag: "."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "autoprofile").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in FLAG_ARG and len(node.args) > FLAG_ARG[name]:
                    names = [s.lstrip("-") for s in _strings(node.args[FLAG_ARG[name]])]
            elif (text := _leading_text(node)) and (m := LEADING_FLAG.match(text)):
                names = [m.group(1)]
            for name in names:
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def troubleshooting_entries() -> list[str]:
    return re.findall(r"^### `(--)?(\w+)`", (DOCS / "troubleshooting.md").read_text(), re.M)


def test_every_flag_a_startup_error_names_has_a_troubleshooting_entry():
    flags = error_flags()
    assert {"model", "max_total_token_num", "device", "tp", "command"} <= set(flags)  # the scan finds them
    entries = {name for _, name in troubleshooting_entries()}
    missing = {f: sorted(files) for f, files in flags.items() if f not in entries}
    assert not missing, f"add an entry to docs/troubleshooting.md for: {missing}"


def test_every_troubleshooting_entry_names_a_flag_that_exists():
    parser = build_parser()
    subs = next(a.choices for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    known = {o[2:] for p in subs.values() for a in p._actions for o in a.option_strings if o.startswith("--")}
    stale = [name for dashes, name in troubleshooting_entries() if dashes and name not in known]
    assert not stale, f"docs/troubleshooting.md has entries for flags the CLI does not take: {stale}"


def test_the_readme_is_short_and_for_users():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    for heading in ("## Set up", "## Try it on a CPU", "## Serve a checkpoint", "## Example requests",
                    "## Measured", "## Supported architectures", "## Where the rest lives"):
        assert f"\n{heading}\n" in text, heading
    assert "import graph" not in text.lower() and "## Tests" not in text  # developer material: docs/


def test_the_readme_lists_every_architecture_the_code_serves():
    from autoprofile.model_config import HYBRID_ARCHITECTURES
    text = (ROOT / "README.md").read_text().split("## Supported architectures")[1].split("\n## ")[0]
    for arch in ("LlamaForCausalLM", "DeepseekV3ForCausalLM", "Qwen2_5_VLForConditionalGeneration",
                 *HYBRID_ARCHITECTURES):
        assert f"`{arch}`" in text, arch


def test_the_docs_index_names_every_page():
    index = (DOCS / "README.md").read_text()
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    assert all(f"]({p})" in index for p in pages), pages


@pytest.mark.parametrize("page", ["README.md", "docs/README.md", "docs/api.md", "docs/development.md",
                                  "docs/troubleshooting.md", "docs/server.md"])
def test_links_of_the_user_pages_resolve(page):
    path = ROOT / page
    text = path.read_text()
    for target, anchor in re.findall(r"\]\(([^)#\s:]+)(?:#([^)]*))?\)", text):
        assert (path.parent / target).exists(), f"{page} links to {target}, which does not exist"
        if anchor and target.endswith(".md"):
            headings = re.findall(r"^#+ (.+)$", (path.parent / target).read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, f"{page} links to {target}#{anchor}, a heading it does not have"
