"""scripts/tune_moe.py's reading of a --gemv run: launch_rules.MOE_GEMV_MAX_PAIRS is the most (token, slot)
pairs timed below the fewest where the experts' GEMVs did not beat AITER's blocked kernels, on any model or
dtype (a refused GEMV counts as a loss)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
spec = importlib.util.spec_from_file_location("tune_moe", SCRIPTS / "tune_moe.py")
tune_moe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tune_moe)


def row(model: str, tokens: int, blocked: float | None, gemv: float | None) -> dict:
    experts, _, _, top_k = tune_moe.SHAPES[model]
    return {"model": model, "tokens": tokens, "pairs_per_expert": tokens * top_k / experts,
            "us": {"blocked": blocked, "gemv": gemv}}


def test_the_threshold_stops_below_the_fewest_pairs_any_model_lost_at():
    rows = [row("qwen3-30b-a3b", 1, 31.0, 20.0), row("qwen3-30b-a3b", 4, 55.0, 50.0),  # 8, 32 pairs: won
            row("qwen3-30b-a3b", 8, 80.0, 88.0),  # 64 pairs: lost
            row("deepseek-v2-lite", 4, 67.0, 65.0), row("deepseek-v2-lite", 8, 91.0, 116.0)]  # 24 won, 48 lost
    assert tune_moe.gemv_max_pairs(rows) == 32
    rows.append(row("deepseek-v2-lite", 2, 41.0, 41.0))  # 12 pairs: a tie is not a win
    assert tune_moe.gemv_max_pairs(rows) == 8
    rows.append(row("qwen3-30b-a3b", 1, 31.0, None))  # 8 pairs refused (off the reference): never
    assert tune_moe.gemv_max_pairs(rows) == 0


def test_a_gemv_that_always_won_takes_every_count_timed_and_a_refused_blocked_path_is_its_loss():
    rows = [row("qwen3.5-35b-a3b", t, 30.0 * t, 20.0 * t) for t in (1, 2, 4, 8)]
    assert tune_moe.gemv_max_pairs(rows) == 64
    rows.append(row("qwen3.5-35b-a3b", 16, None, 150.0))  # the blocked path refused: the GEMVs won
    assert tune_moe.gemv_max_pairs(rows) == 128
