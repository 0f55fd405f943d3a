"""scripts/tp_local_memory.py's pure parts on the CPU: cuobjdump -res-usage parsing (per arch) and the report
that names the stage where a rank's stack limit rose."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "tp_local_memory", Path(__file__).resolve().parents[1] / "scripts" / "tp_local_memory.py")
tlm = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(tlm)

DUMP = """
Fatbin elf code:
================
arch = sm_80
code version = [1,7]
host = linux
compile_size = 64bit

Resource usage:
 Common:
  GLOBAL:0 CONSTANT[3]:12
 Function ncclDevKernel_Generic:
  REG:96 STACK:2048 SHARED:0 LOCAL:0 CONSTANT[0]:1224 TEXTURE:0 SURFACE:0 SAMPLER:0

Fatbin elf code:
================
arch = sm_90
code version = [1,7]
host = linux
compile_size = 64bit

Resource usage:
 Common:
  GLOBAL:0
 Function ncclDevKernel_Generic:
  REG:96 STACK:1744 SHARED:0 LOCAL:0 CONSTANT[0]:1224 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function ncclDevKernel_AllReduce_Sum_bf16_RING_LL:
  REG:80 STACK:0 SHARED:0 LOCAL:16 CONSTANT[0]:1224 TEXTURE:0 SURFACE:0 SAMPLER:0

Fatbin ptx code:
================
arch = sm_90
"""


def test_res_usage_of_one_arch():
    rows = tlm.parse_res_usage(DUMP, "sm_90")
    assert [(r["kernel"], r["stack"], r["local"], r["regs"]) for r in rows] == [
        ("ncclDevKernel_Generic", 1744, 0, 96), ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 0, 16, 80)]
    assert len(tlm.parse_res_usage(DUMP, None)) == 3


def test_the_report_marks_the_stage_that_raised_the_stack_limit():
    def stage(name: str, stack: int) -> dict:
        return {"stage": name, "stack": stack, "local_gib": stack * 270336 / 2**30, "non_torch_gib": 1.0,
                "torch_reserved_gib": 0.0}
    outcome = {"rank": 0, "arch": "sm_90", "profile_stack_limit": 1744, "profile_non_torch_gib": 2.49,
               "stages": [stage("CUDA context + NCCL communicator", 1024), stage("first all-reduce", 1744),
                          stage("validated", 1744)],
               "triton": [{"kernel": "_gemv_kernel", "module": "autoprofile.kernels.triton_gemv", "regs": 40,
                           "spills": 0, "local": 0, "stack": 0}],
               "nccl": {"version": "2.27.5", "library": "libnccl.so.2", "settings": {"NCCL_NVLS_ENABLE": "0"},
                        "defaults": tlm.NCCL_DEFAULTS,
                        "kernels": {"count": 2, "max_stack": 1744, "max_local": 16, "over_bound": 1,
                                    "largest": tlm.parse_res_usage(DUMP, "sm_90")}}}
    text = tlm.report([outcome])
    lines = text.splitlines()
    raised = [line for line in lines if "<- stack raised" in line]
    assert len(raised) == 1 and raised[0].startswith("first all-reduce"), text
    assert "max STACK 1744 B" in text and "over 1024 B per thread: 0" in text
