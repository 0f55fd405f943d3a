"""The budget report's PNG: drawn from the JSON, in a process of its own when a server boots (plot_later), and
that process imports no torch (a profile run against a simulated GPU: only the CUDA memory API is faked)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from autoprofile import report
from unit_tests.test_profiler import gpu, make  # noqa: F401 - gpu: the simulated GPU fixture

ROOT = Path(__file__).resolve().parents[1]


def test_a_servers_report_png_is_drawn_by_another_process_from_the_json(gpu, tmp_path):  # noqa: F811
    result = make(gpu)[1].run()
    js, png = report.write_report(result, tmp_path / "now")
    assert png.stat().st_size > 10_000  # drawn before write_report returned
    timeline = json.loads(js.read_text())["timeline"]
    assert len(timeline) == len(result.samples) and timeline[0]["label"] == result.samples[0].label
    js2 = tmp_path / "later.json"
    js2.write_text(js.read_text())
    proc = report.plot_apart(js2, tmp_path / "later.png")
    assert proc.pid != os.getpid() and proc.wait(timeout=120) == 0
    assert (tmp_path / "later.png").stat().st_size > 10_000
    _, png3 = report.write_report(result, tmp_path / "served", plot_later=True)  # a server's boot
    deadline = time.monotonic() + 120
    while not (png3.exists() and png3.stat().st_size > 10_000):
        assert time.monotonic() < deadline, "the PNG was never drawn"
        time.sleep(0.1)


def test_the_plotting_process_imports_no_torch(gpu, tmp_path):  # noqa: F811
    js, _ = report.write_report(make(gpu)[1].run(), tmp_path)
    code = ("import sys; from autoprofile import timeline_plot; timeline_plot.main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code, str(js), str(tmp_path / "p.png")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "p.png").stat().st_size > 10_000
