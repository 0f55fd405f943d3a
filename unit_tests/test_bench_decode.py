"""scripts/bench_decode.py's KV sizing: batches whose KV does not fit the card beside the weights are skipped with
a note, and a run where none fits stops with a message naming the flags (qwen3-30b-a3b's 256 rows x 1024
tokens OOMed building the KV on an H100)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from autoprofile import budget, plan
from autoprofile.model_config import load_model_config

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
spec = importlib.util.spec_from_file_location("bench_decode", SCRIPTS / "bench_decode.py")
bench_decode = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_decode)
GIB = 1 << 30


def test_qwen3_moe_on_an_80gb_card_skips_256_rows_and_keeps_the_rest():
    mc = load_model_config("qwen3-30b-a3b")
    cell, weights = budget.cell_bytes_for(mc, 2), plan.weight_bytes(mc, 2, 1)
    fits, tokens, note = bench_decode.fit_batches([1, 64, 256], 1024, 16, cell, int(79.1 * GIB), weights,
                                                  8 * GIB)
    assert fits == [1, 64] and tokens == 64 * 1040 + 64
    assert tokens * cell + weights + 8 * GIB <= 79.1 * GIB
    assert "skipping batches [256]" in note and "the largest that fits" in note


def test_everything_fits_without_a_note():
    fits, tokens, note = bench_decode.fit_batches([1, 256], 1024, 16, 1000, 80 * GIB, 16 * GIB, 8 * GIB)
    assert fits == [1, 256] and tokens == 256 * 1040 + 64 and note is None


def test_nothing_fits_is_a_clear_error_naming_the_flags():
    with pytest.raises(SystemExit, match="--ctx .*--kv_headroom_gib"):
        bench_decode.fit_batches([4, 8], 100_000, 16, 100_000, 80 * GIB, 70 * GIB, 8 * GIB)
