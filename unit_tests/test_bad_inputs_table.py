"""scripts/bad_inputs.py, the table of bad CLI inputs and config.json files, stays true: every entry exits 2
naming its flag (or file and key), with no traceback, and every suggested value passes validation."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_bad_input_of_the_table_is_refused_naming_what_to_change():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bad_inputs.py")], cwd=ROOT, text=True,
                         capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 tracebacks" in out.stdout
