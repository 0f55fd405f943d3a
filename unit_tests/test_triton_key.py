"""kernels.triton_key: Triton's process-wide cache key hashed on a thread (each case in a fresh interpreter:
the key is kept for the process)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASE = r'''
import sys
from autoprofile.kernels import triton_key
assert "triton" not in sys.modules and "torch" not in sys.modules, "imported at the module's import"
if sys.argv[1] == "start":
    triton_key.start()
    triton_key.start()  # once a process
triton_key.wait()
from triton.runtime.cache import triton_key as key
print(key.cache_info().currsize, "torch" in sys.modules)
'''


def _run(arg: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CASE, arg], env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_start_hashes_the_key_without_importing_torch():
    assert _run("start") == ["1", "False"]


def test_without_start_the_key_waits_for_the_first_compile():
    assert _run("none") == ["0", "False"]
