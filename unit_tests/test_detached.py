"""scripts/detached.sh: a device job that outlives one call runs from a copy outside the checkout (a call
replaces the checkout; a server started from it died in its probe, its current folder gone), and later calls
wait for it, returning as soon as it ends, saying whether it ended, runs or died."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "detached.sh"
pytestmark = pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid")


def detached(root: Path, *args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ROOT": str(root)})


def test_a_job_outlives_the_checkout_it_was_started_from(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, checkout / "scripts")
    (checkout / "marker.txt").write_text("from the tree\n")
    root = tmp_path / "jobs"
    job = "sleep 1; cat marker.txt > $OUT/seen; echo bye; exit 4"
    started = detached(root, "start", "j", "bash", "-c", job, script=checkout / "scripts" / "detached.sh")
    assert started.returncode == 0, started.stderr
    shutil.rmtree(checkout)  # the next device call replaces the checkout
    waited = detached(root, "wait", "j", "30")
    assert waited.returncode == 0 and "ended, status 4" in waited.stdout and "bye" in waited.stdout
    assert (root / "j" / "out" / "seen").read_text() == "from the tree\n"  # ran in its own copy of the tree
    dest = tmp_path / "collected"
    assert detached(root, "collect", "j", str(dest)).returncode == 0
    assert (dest / "seen").exists() and "bye" in (dest / "j.log").read_text()


def test_wait_returns_early_says_running_and_a_killed_job_died(tmp_path):
    root = tmp_path / "jobs"
    assert detached(root, "start", "slow", "sleep", "60").returncode == 0
    t0 = time.monotonic()
    running = detached(root, "wait", "slow", "1")
    assert running.returncode == 3 and "still running" in running.stdout
    assert time.monotonic() - t0 < 20
    os.kill(int((root / "slow" / "pid").read_text()), signal.SIGKILL)
    dead = detached(root, "wait", "slow", "30")
    assert dead.returncode == 1 and "died without a status" in dead.stdout
    assert detached(root, "start", "slow", "true").returncode == 2  # a name in use is refused
    assert detached(root, "wait", "nothing", "1").returncode == 1
