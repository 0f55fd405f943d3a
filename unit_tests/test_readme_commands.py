"""Every command in the README's bash blocks runs as written, or is skipped saying why (installs, downloads,
a GPU). `autoprofile serve --device cpu` is started as written plus `--port 0` (a free port: tests share the
machine), and the README's curl requests are sent to it. Its Python examples run in test_server_requests.py."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from unit_tests.cpu_server import bound_url

ROOT = Path(__file__).resolve().parents[1]
README_URL = "http://127.0.0.1:8000"

# (how a command starts, why it is skipped); None: it runs here. Every README command must match one.
RULES: tuple[tuple[str, str | None], ...] = (
    ("pip install ", "installs packages: the environment running the tests is that install"),
    ("hf download ", "downloads a checkpoint: tests never download weights"),
    ("autoprofile serve --model ~/", "needs a GPU and the downloaded checkpoint"),
    ("autoprofile serve --device cpu", None),
    ("autoprofile plan ", None),
    ("curl ", None),
)


def readme_commands() -> list[str]:
    """The commands of every ```bash block of the README, continuation lines joined, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    lines = [line.split("  #")[0].strip() for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def rule(command: str) -> tuple[str, str | None] | None:
    return next(((start, why) for start, why in RULES if command.startswith(start)), None)


def argv(command: str) -> list[str]:
    """The command's words; `autoprofile` as installed, else this Python's module of it."""
    words = shlex.split(command)
    if words[0] == "autoprofile" and shutil.which("autoprofile") is None:
        words[:1] = [sys.executable, "-m", "autoprofile.cli"]
    return words


def test_every_readme_command_is_run_or_skipped_with_a_reason():
    commands = readme_commands()
    assert any(c.startswith("autoprofile serve --device cpu") for c in commands)
    unknown = [c for c in commands if rule(c) is None]
    assert not unknown, f"add these README commands to RULES (run them, or say why not): {unknown}"


@pytest.mark.parametrize("command", [c for c in readme_commands() if (r := rule(c)) and r[1]])
def test_readme_commands_that_cannot_run_here(command):
    pytest.skip(rule(command)[1])


@pytest.mark.parametrize("command", [c for c in readme_commands() if c.startswith("autoprofile plan ")])
def test_readme_plan_commands_run_as_written(command):
    out = subprocess.run(argv(command), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "KV" in out.stdout


@pytest.fixture(scope="module")
def cpu_server():
    """The README's `autoprofile serve --device cpu`, on a free port; its URL."""
    command = next(c for c in readme_commands() if c.startswith("autoprofile serve --device cpu"))
    proc = subprocess.Popen([*argv(command), "--port", "0", "--report_dir", "", "--profile_cache", ""],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines = iter(proc.stdout.readline, "")
    try:
        url = bound_url(lines)
        ready = next((line for line in lines if "ready:" in line or "Error" in line), "")
        assert url and "ready:" in ready, ready
        threading.Thread(target=lambda: [None for _ in lines], daemon=True).start()  # drain the log
        yield url
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl command")
@pytest.mark.parametrize("command", [c for c in readme_commands() if c.startswith("curl ")])
def test_readme_curl_commands_answer_the_cpu_server(command, cpu_server):
    words = [w.replace(README_URL, cpu_server) for w in argv(command)]
    out = subprocess.run([*words, "-w", "\n%{http_code}"], capture_output=True, text=True, timeout=120)
    body, status = out.stdout.rsplit("\n", 1)
    assert status == "200", (command, body)
    assert '"data"' in body or '"choices"' in body, body
