"""The kernels' launch rules have one home (autoprofile.kernels.launch_rules, torch-free): the kernels import
it and never the budget, the budget defines none of its rules, and plan, the budget and the rules import
with torch and triton blocked. FP8's largest value is written once (layers.quant)."""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autoprofile.kernels import launch_rules

ROOT = Path(__file__).resolve().parents[1]
KERNELS = sorted((ROOT / "autoprofile" / "kernels").glob("*.py"))


def imported(path: Path) -> set[str]:
    """Every module `path` imports, with `from a import b` as both a and a.b."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def defined(path: Path) -> set[str]:
    """Top-level functions and constants of a module."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def test_the_kernels_import_the_launch_rules_and_not_the_budget():
    users = {p.stem for p in KERNELS if "autoprofile.kernels.launch_rules" in imported(p)}
    assert {"triton_decode", "triton_mla", "triton_moe", "triton_moe_sort"} <= users
    assert [p.stem for p in KERNELS if "autoprofile.budget" in imported(p)] == []


def test_the_budget_defines_no_launch_rule_and_imports_the_ones_it_counts_with():
    rules = defined(ROOT / "autoprofile" / "kernels" / "launch_rules.py")
    assert {"split_decode_splits", "moe_block_m", "mla_kv_splits", "triton_decode_partition",
            "SPLIT_DECODE_PROGRAMS", "SPLIT_DECODE_ROWS", "MLA_SPLIT_PROGRAMS", "MOE_SMALL_BLOCK_M",
            "MOE_LARGE_BLOCK_M", "AITER_PARTITION", "batch_ladder"} <= rules
    budget = ROOT / "autoprofile" / "budget.py"
    assert defined(budget) & rules == set()
    assert "autoprofile.kernels.launch_rules.split_decode_splits" in imported(budget)


BLOCKED = """
import importlib.abc, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "triton"):
            raise ImportError(f"{name} is blocked")

sys.meta_path.insert(0, Blocked())
import {module}
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton")))
"""


@pytest.mark.parametrize("module", ["autoprofile.kernels.launch_rules", "autoprofile.budget",
                                    "autoprofile.plan"])
def test_the_rules_the_budget_and_plan_import_without_torch_or_triton(module):
    code = textwrap.dedent(BLOCKED).replace("{module}", module)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_rules_keep_their_values():
    assert launch_rules.split_decode_splits(1, 8, 1024) == 8  # 1,024 keys in parts of at least 128
    assert launch_rules.split_decode_splits(64, 8, 131072) == 1  # 512 programs from the rows alone
    assert launch_rules.moe_block_m(96, 8, 64) == 16 and launch_rules.moe_block_m(97, 8, 64) == 64
    assert [launch_rules.mla_kv_splits(n) for n in (1, 16, 64, 256)] == [32, 9, 3, 1]
    assert launch_rules.triton_decode_partition(1, 32, 1024) == 128
    assert launch_rules.batch_ladder(40) == [1, 2, 4, 8, 16, 24, 32, 40]


def test_fp8_max_is_written_once():
    """layers.quant holds the value; every other FP8_MAX is that one (imported, or wrapped for Triton)."""
    from autoprofile.kernels import triton_fp8
    from autoprofile.layers import attention, quant
    assert quant.FP8_MAX == 448.0 and attention.FP8_MAX is quant.FP8_MAX and triton_fp8.FP8_MAX.value == 448.0
    written = []
    for path in sorted((ROOT / "autoprofile").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FP8_MAX"
                                                    for t in node.targets):
                value = ast.walk(node.value)
                if not any(isinstance(n, ast.Attribute) and n.attr == "FP8_MAX" for n in value):
                    written.append(str(path.relative_to(ROOT)))
    assert written == ["autoprofile/layers/quant.py"]


def test_the_fp8_skinny_rule_follows_each_layouts_measured_table():
    from autoprofile.kernels.launch_rules import SkinnyLaunch, fp8_skinny_launch, skinny_block_m
    # the measured tables: 2-64 rows take the skinny GEMM with split-K, one row the GEMV, 65 and more today's
    for block in (False, True):
        got = [fp8_skinny_launch(m, 14336, 4096, block=block) for m in range(1, 300)]
        assert got[0] is None and all(g is not None for g in got[1:64]) and not any(got[64:]), block
        assert all(g.split_k == 2 and g.block_n == 64 for g in got[1:64]), block
        # o_proj and down (N = 4096) keep block_n 64 and split K toward 256 programs: 4 splits; gate_up none
        for n, k, splits in ((4096, 4096, 4), (4096, 14336, 4), (6144, 4096, 3), (28672, 4096, 1)):
            assert fp8_skinny_launch(8, n, k, block=block)[:5] == (64, 128 if block else 256, 4, 3, splits)
    assert fp8_skinny_launch(8, 14336, 4096).block_k == 256  # per-channel scales: K steps of 256
    assert fp8_skinny_launch(8, 14336, 4096, block=True).block_k == 128  # within a 128-wide block scale
    table = ((8, SkinnyLaunch(64, 256, 4, 3)), (32, None), (64, SkinnyLaunch(32, 128, 8, 2)))
    got = [fp8_skinny_launch(m, 28672, 4096, table) for m in (1, 2, 8, 9, 32, 33, 64, 65)]
    assert got == [None, SkinnyLaunch(64, 256, 4, 3), SkinnyLaunch(64, 256, 4, 3), None, None,
                   SkinnyLaunch(32, 128, 8, 2), SkinnyLaunch(32, 128, 8, 2), None]
    # a narrow N halves block_n toward 256 programs (not below 16); a short K caps the K step
    assert fp8_skinny_launch(2, 4096, 4096, table).block_n == 16
    assert fp8_skinny_launch(2, 16384, 4096, table).block_n == 64
    assert fp8_skinny_launch(2, 6144, 4096, table).block_n == 16
    assert fp8_skinny_launch(2, 100, 100, table) == SkinnyLaunch(16, 128, 4, 3)
    assert [skinny_block_m(m) for m in (1, 2, 16, 17, 32, 33, 64)] == [16, 16, 16, 32, 32, 64, 64]


def test_the_fp8_multi_row_gemv_rule_takes_2_to_its_rows_and_leaves_the_rest_to_the_skinny_rule():
    from autoprofile.kernels.launch_rules import (GEMV_ROWS_MAX, GemvRowsLaunch, fp8_gemv_rows_launch,
                                                  gemv_rows_padded)
    # the tables: one row is the one-row GEMV's, 2 up to the last entry the multi-row GEMV's, none past 16
    for block in (False, True):
        got = [fp8_gemv_rows_launch(m, 14336, 4096, block=block) for m in range(1, 40)]
        last = max(m for m in range(1, 40) if got[m - 1] is not None)
        assert got[0] is None and all(got[1:last]) and not any(got[last:]) and last <= GEMV_ROWS_MAX, block
    table = ((4, GemvRowsLaunch(8, 512, 16, 2)), (8, None), (16, GemvRowsLaunch(2, 256, 256, 1)))
    got = [fp8_gemv_rows_launch(m, 28672, 4096, table) for m in (1, 2, 4, 5, 8, 9, 16, 17)]
    assert got == [None, table[0][1], table[0][1], None, None, table[2][1], table[2][1], None]
    # a narrow N halves block_n toward min_programs programs (not below 1); a short K caps the step, the sum
    assert fp8_gemv_rows_launch(2, 4096, 4096, table).block_n == 2  # 2,048 programs
    assert fp8_gemv_rows_launch(2, 28672, 4096, table).block_n == 8
    assert fp8_gemv_rows_launch(9, 100, 100, table) == GemvRowsLaunch(1, 128, 128, 1)
    assert [gemv_rows_padded(m) for m in (2, 3, 4, 5, 8, 9, 16)] == [2, 4, 4, 8, 8, 16, 16]


def test_the_fp8_skinny_rule_splits_k_for_a_narrow_n_where_a_launch_allows_it():
    from autoprofile.kernels.launch_rules import SkinnyLaunch, fp8_skinny_launch
    split = SkinnyLaunch(64, 256, 4, 3, split_k=8)
    table = ((64, split),)
    # block_n kept; splits for 256 programs: o_proj 64 tiles -> 4, qkv 96 -> 3, gate_up 448 -> 1 (no split)
    assert fp8_skinny_launch(8, 4096, 4096, table) == split._replace(split_k=4)
    assert fp8_skinny_launch(8, 6144, 4096, table) == split._replace(split_k=3)
    assert fp8_skinny_launch(8, 28672, 4096, table) == split._replace(split_k=1)
    assert fp8_skinny_launch(8, 512, 4096, table).split_k == 8  # capped by the launch's split_k
    assert fp8_skinny_launch(8, 512, 300, table).split_k == 2  # a split at least a K step
    # the default (split_k 1) is the launch of before: block_n narrowed for a narrow N
    narrow = fp8_skinny_launch(8, 4096, 4096, ((64, SkinnyLaunch(64, 256, 4, 3)),))
    assert narrow == SkinnyLaunch(16, 256, 4, 3)
