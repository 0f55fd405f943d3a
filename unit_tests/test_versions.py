"""One torch and one triton version where it matters: every version the README names (the setup's pin, the
measurements' versions) satisfies pyproject.toml's requirement."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
from packaging.requirements import Requirement  # noqa: E402
from packaging.version import Version  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def requirements() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: r for r in map(Requirement, deps)}


def named_versions(text: str, package: str) -> list[str]:
    """`torch==2.13.0` (a pin) and `torch 2.11` (a measurement's version) in the README."""
    return re.findall(rf"\b{package}(?:==| )(\d+\.\d+(?:\.\d+)?)\b", text)


@pytest.mark.parametrize("package", ["torch", "triton"])
def test_every_version_the_readme_names_satisfies_pyproject(package):
    spec = requirements()[package].specifier
    assert spec and all(s.operator == ">=" for s in spec), f"pyproject.toml gives {package} no lower bound"
    named = named_versions((ROOT / "README.md").read_text(), package)
    assert named, f"the README names no {package} version"
    outside = [v for v in named if not spec.contains(Version(v))]
    assert not outside, f"the README names {package} {outside}, outside pyproject.toml's {package}{spec}"


def test_pyproject_lower_bounds_are_the_measured_versions():
    """The measurements ran torch 2.11 and triton 3.6: nothing older is claimed to work."""
    reqs = requirements()
    assert {str(s) for s in reqs["torch"].specifier} == {">=2.11"}
    assert {str(s) for s in reqs["triton"].specifier} == {">=3.6"}
