"""scripts/tune_moe.py's reading of its runs. --gemv: launch_rules.MOE_GEMV_MAX_PAIRS is the most (token,
slot) pairs timed below the fewest where the experts' GEMVs did not beat AITER's blocked kernels, on any model
or dtype (a refused GEMV counts as a loss). --gemv_configs: triton_moe_gemv.CONFIGS, each dtype's and kernel's
candidate of the least geometric mean over the shipped time."""
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
            row("deepseek-v2-lite", 4, 67.0, 65.0),  # 24 pairs: won
            row("deepseek-v2-lite", 8, 91.0, 116.0)]  # 48 pairs: lost
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


def config_row(fp8: bool, shipped: float, **candidates: float | None) -> dict:
    us = {"shipped": shipped}
    us.update({name.replace("__", " "): t for name, t in candidates.items()})
    return {"fp8": fp8, "us": us}


def test_the_gemv_config_pick_is_each_dtype_and_kernels_least_geometric_mean_below_the_shipped():
    """--gemv_configs' rows: per dtype and kernel, the candidate whose time over the shipped configs' has the
    least geometric mean across that dtype's rows; none below 1.0 (or none timed in every row): keep."""
    a, b = "gate_up__(8, 256, 2)", "down__(16, 256, 2)"
    rows = [config_row(True, 10.0, **{a: 9.0, b: 8.0, "down__(4, 256, 1)": 7.0}),
            config_row(True, 20.0, **{a: 19.0, b: 17.0, "down__(4, 256, 1)": 24.0}),
            config_row(False, 10.0, **{a: 10.0, b: 9.0}), config_row(False, 12.0, **{a: 12.0, b: None})]
    pick = tune_moe.gemv_config_pick(rows)
    assert pick["fp8"]["gate_up"] == {"config": "(8, 256, 2)", "ratio": round((0.9 * 0.95) ** 0.5, 3)}
    # (4, 256, 1) is faster in one row, slower in the other: its geometric mean 0.917 loses to 0.824
    assert pick["fp8"]["down"] == {"config": "(16, 256, 2)", "ratio": round((0.8 * 0.85) ** 0.5, 3)}
    # bf16: gate_up exactly the shipped time (1.0: no gain); down faster in one row, refused in the other
    assert pick["bf16"] == {"gate_up": None, "down": None}
