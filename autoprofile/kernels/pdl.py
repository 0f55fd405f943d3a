"""Programmatic dependent launch (PDL) for the kernels of a decode step, on Hopper and later GPUs.

A batch-1 decode step is ~350 small kernels in one CUDA graph; between two of them the GPU drains the first
grid, then launches the next, and the SMs wait. Launched with PDL (`launch_pdl`), a kernel's programs may be
scheduled while the kernel before it still runs; each one first waits (`griddepcontrol.wait`, `gdc_wait`)
until that kernel has completed and its writes are visible, so the launch's latency overlaps the tail of the
kernel before instead of following it.

Rule for a kernel that takes `PDL`: `begin(PDL)` before its first read of anything an earlier kernel writes
and before its first write, in every program (a program that skips its work still waits: the kernel's end must
follow the one before's). Only constant data (weights) may be read before it: the FP8 GEMV loads its first
weight tile there, while the kernel before still runs. begin() also signals (`gdc_launch_dependents`) at once:
the next kernel's programs are scheduled once every program of this one has passed its wait, and they wait
in their own begin() for this one to complete, so one kernel at most waits ahead of the one computing.
(Signalled after the main loop instead, the next kernel's prologue overlapped only this one's epilogue:
llama-3.1-8b-fp8's batch-1 replay 3.553 ms, against 3.497 with the early signal and the FP8 GEMV's first tile
loaded before the wait, on an H100; bf16's unchanged.) A kernel launched without PDL (torch's, NCCL's) waits
for the whole kernel before it as always.

`AUTOPROFILE_PDL=0` turns it off (a benchmark's side-by-side, a driver that mishandles it); off on the CPU
and in Triton's interpreter.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
import triton.language.extra.cuda  # noqa: F401  (gdc_wait, gdc_launch_dependents)


def interpreted() -> bool:
    """Kernels run through Triton's interpreter (TRITON_INTERPRET=1, read when a kernel module is imported):
    no PTX, inline or griddepcontrol."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def enabled() -> bool:
    if os.environ.get("AUTOPROFILE_PDL", "1") == "0" or interpreted():
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def launch() -> dict:
    """A launch's keyword arguments: the kernel's PDL constexpr, and launch_pdl where it is on."""
    return {"PDL": True, "launch_pdl": True} if enabled() else {"PDL": False}


@triton.jit
def begin(PDL: tl.constexpr):
    """A PDL kernel's first step in every program: wait until the kernel before has completed (its writes
    visible), then let the next kernel's programs be scheduled. Nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
