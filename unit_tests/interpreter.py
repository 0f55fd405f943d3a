"""Runs a check script in a fresh Python: through Triton's interpreter on the CPU (TRITON_INTERPRET=1 is read
when a kernel module is imported, hence the subprocess), or compiled on a GPU. The script prints "ok" last."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, *args: str, interpret: bool = True, first_on_path: str | None = None) -> None:
    """first_on_path: a folder put before the project on PYTHONPATH (another Triton, installed with
    `pip install --target`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (first_on_path, str(ROOT)) if p)}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-3000:]
