"""scripts/engine_host_profile.py runs the overlapped engine loop over its rows and reports the step clock's
host parts and a profile (on a CPU: the tiny model, a dry run of what it measures on a GPU)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "engine_host_profile.py"


def load():
    spec = importlib.util.spec_from_file_location("engine_host_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_times_every_row_decoding_and_names_the_engines_host_parts(capsys):
    module = load()
    assert module.main(["--rows", "4", "--prompt_len", "8", "--steps", "3", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "CPU: tiny, 4 rows decoding, top-p 0.9:" in out
    clock = out.split("step clock, ms a step:")[1].splitlines()[0]
    assert all(part in clock for part in ('"schedule"', '"execute"', '"update"'))
    assert "engine.py" in out and "(step)" in out  # the profile holds the engine's step


def test_fresh_prompts_make_every_timed_step_a_mixed_one(capsys):
    """--prefill_prompts 2: two fresh prompts before each timed step, each prefilled in the next step beside
    the decoding rows (no pacing): every timed step is a prefill step; without them none is."""
    module = load()
    assert module.main(["--rows", "4", "--prompt_len", "8", "--steps", "3", "--top", "5", "--prefill_prompts",
                        "2", "--fresh_len", "24"]) == 0
    out = capsys.readouterr().out
    assert "CPU: tiny, 4 rows decoding, 2 fresh 24-token prompts a step, top-p 0.9:" in out
    kinds = json.loads(out.split("steps timed, by kind, a timed step:")[1].splitlines()[0])
    assert kinds == {"prefill": 1.0}, kinds
    assert module.main(["--rows", "4", "--prompt_len", "8", "--steps", "3", "--top", "5"]) == 0
    out = capsys.readouterr().out
    kinds = json.loads(out.split("steps timed, by kind, a timed step:")[1].splitlines()[0])
    assert "prefill" not in kinds, kinds
