"""Where a model's non-KV memory goes: the probe's build, then each stress corner one at a time, with the
caching allocator's figures after each (allocated, reserved, the corner's own allocation peak, NVML's
per-process use and the non-torch part, segments). The profiler sees only the peak reserved of them all;
this says which corner set it and how much of it is fragmentation (reserved beyond the allocation peak).

    PYTHONPATH=. python3 scripts/memory_by_corner.py llama-3.1-8b-fp8

Random weights; one model per process (run it once per model to compare them).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autoprofile import budget, memory  # noqa: E402
from autoprofile.config import ServerConfig, validate  # noqa: E402
from autoprofile.engine import stress  # noqa: E402
from autoprofile.engine.runner import ModelRunner  # noqa: E402

GiB = 1 << 30


def line(tag: str) -> str:
    torch.cuda.synchronize()
    s, ms = memory.snapshot(0), torch.cuda.memory_stats()
    used = s.process_used or 0
    return (f"{tag:40.40s} alloc {s.allocated / GiB:7.3f} reserved {s.reserved / GiB:7.3f} "
            f"corner peak alloc {ms['allocated_bytes.all.peak'] / GiB:7.3f} peak reserved "
            f"{s.peak_reserved / GiB:7.3f} nvml {used / GiB:7.3f} non-torch {(used - s.reserved) / GiB:6.3f} "
            f"segments {ms.get('segment.all.current', 0)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("memory_by_corner needs a CUDA GPU")
    cfg = validate(ServerConfig(model=args.model))
    start = time.perf_counter()
    runner = ModelRunner(cfg)
    print(line(f"loaded ({time.perf_counter() - start:.0f} s)"), flush=True)
    tokens = budget.probe_tokens(cfg.batch_max_tokens, cfg.graph_max_batch_size, cfg.page_size)
    memory.reset_peak(0)
    runner.build(tokens)
    print(line(f"built at {tokens} KV tokens ({runner.kv_bytes / GiB:.2f} GiB)"), flush=True)
    runner.stressing = True
    try:
        for kind, steps in (("prefill", stress.prefill_steps), ("decode", stress.decode_steps)):
            for step in runner.corners(steps):
                torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                runner.execute(step)
                shape = step.shape(runner.envelope.graph_rows)
                print(line(f"{kind} {shape.decode_rows} decode rows, {shape.mixed_tokens} mixed tokens"),
                      flush=True)
                print(f"    {stress.corner_label(shape, step.routing)}: {time.perf_counter() - start:.2f} s",
                      flush=True)
    finally:
        runner.stressing = False
        runner.teardown()


if __name__ == "__main__":
    main()
