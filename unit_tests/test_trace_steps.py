"""scripts/trace_steps.py on a Chrome trace written the way torch.profiler writes a served step's: "engine
step N" GPU ranges, kernels inside them (one overlapping another), a memset, a kernel of the next step outside
the range; the groups' times, the idle inside each step and the long/short split are those of the events."""
from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
spec = importlib.util.spec_from_file_location("trace_steps", SCRIPTS / "trace_steps.py")
trace_steps = sys.modules["trace_steps"] = importlib.util.module_from_spec(spec)  # (its dataclasses)
spec.loader.exec_module(trace_steps)


def kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def step(n: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "gpu_user_annotation", "name": f"engine step {n}", "ts": ts, "dur": dur}


EVENTS = [
    step(1, 1000.0, 100_000.0),  # a long step: 100 ms
    kernel("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", 1000.0, 80_000.0),
    kernel("_prefill_kernel_tma", 81_000.0, 5_000.0),
    kernel("_silu_mul_kernel", 85_000.0, 3_000.0),  # overlaps the one before by 1 ms
    kernel("void at::native::index_elementwise_kernel<128, 4>", 90_000.0, 2_000.0),
    kernel("Memset (Device)", 92_000.0, 500.0, cat="gpu_memset"),
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1000.0, "dur": 50.0},  # host side: not counted
    step(2, 110_000.0, 10_000.0),  # a short step: 10 ms
    kernel("_paged_attn_decode_v1_w_dot_kernel", 110_000.0, 6_000.0),
    kernel("_rms_norm_kernel", 116_500.0, 1_000.0),
    kernel("nvjet_sm90_tst_128x64", 119_000.0, 2_000.0),  # runs past the range: 1 ms of it inside
    kernel("_argmax_kernel", 130_000.0, 10.0),  # after every step: in none
]


def test_groups_idle_and_split(tmp_path, capsys):
    steps = trace_steps.steps_of(EVENTS)
    assert [s.name for s in steps] == ["engine step 1", "engine step 2"]
    long, short = steps
    assert long.groups == {"gemm": 80_000.0, "attn_prefill": 5_000.0, "act": 3_000.0, "other": 2_000.0,
                           "copy": 500.0}
    assert long.busy == 80_000.0 + 5_000.0 + 2_000.0 + 2_000.0 + 500.0  # the overlap counted once
    assert long.idle == 100_000.0 - long.busy
    # the idle by where it falls: after the SiLU (its end, not the attention's), and after the last work
    assert long.gaps == {("act", "other"): 2_000.0, ("copy", "end"): 8_500.0}
    assert sum(long.gaps.values()) == long.idle
    assert short.groups == {"attn_decode": 6_000.0, "norm": 1_000.0, "gemm": 1_000.0}
    assert short.idle == 2_000.0 and short.gaps == {("attn_decode", "norm"): 500.0, ("norm", "gemm"): 1_500.0}

    path = tmp_path / "engine.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    trace_steps.main([str(path), "--long_ms", "50"])
    out = capsys.readouterr().out
    assert "long steps (>= 50 ms): 1 steps, span 100.00 ms (idle inside 10.50 ms, 10.5%)" in out
    assert "short steps: 1 steps, span 10.00 ms (idle inside 2.00 ms, 20.0%)" in out
    assert "  gemm               80.00   80.0%" in out
    assert "  idle most between: copy -> end 8.50 ms; act -> other 2.00 ms" in out


def test_a_trace_without_steps_and_a_bad_flag(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps([kernel("aten::mm", 0.0, 1.0, cat="cpu_op")]))
    with pytest.raises(SystemExit, match="no 'engine step N' GPU ranges"):
        trace_steps.main([str(path)])
    with pytest.raises(SystemExit):
        trace_steps.main([str(path), "--long_ms", "0"])
