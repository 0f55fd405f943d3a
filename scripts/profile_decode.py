"""Where one decode step's GPU time goes: the kernels of a llama-3.1-8b decode step under torch.profiler.

    PYTHONPATH=. python3 scripts/profile_decode.py [--batch 1] [--ctx 1024] [--top 20] [--eager]
        [--kv_cache_dtype fp8_e4m3]
    PYTHONPATH=. python3 scripts/profile_decode.py --prefill 7 [--prefill_len 1024] --batch 240

--prefill N profiles a mixed step instead: N fresh requests of --prefill_len tokens, then --batch decode
rows at --ctx (a serving prefill step at concurrency 256 of 1k prompts); through the piecewise graphs where
it has at most --piecewise_cuda_graph_max_tokens tokens (then also its wall time eager), eager with --eager.

--host N: also where the step's host time goes (cProfile over --steps steps: the N functions with the most
time of their own, then by cumulative time) and each call that synchronizes with the GPU inside one step
(torch.cuda.set_sync_debug_mode), with the line that made it.

By default the step replays its CUDA graph, as serving does (CUPTI reports the kernels of a graph launch);
--eager runs it eagerly, where the decode attention keeps AITER's own partitions
(AttentionMetadata.captured).

Random weights; prints the kernels by total CUDA time (name, calls, total and mean us), the step's kernel
count, and its wall time with the host (above the GPU time: host-bound). The sampler is timed by
scripts/bench_sampler.py.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import decode_step  # noqa: E402

from autoprofile.config import ServerConfig, validate  # noqa: E402
from autoprofile.engine import stress  # noqa: E402
from autoprofile.engine.runner import ModelRunner  # noqa: E402
from autoprofile.engine.sampling import GREEDY  # noqa: E402


def kernel_table(prof, steps: int, top: int) -> str:
    total, calls = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            calls[e.name] += 1
    step_us = sum(total.values()) / steps
    lines = [f"GPU time per step {step_us / 1e3:.3f} ms in {sum(calls.values()) // steps} kernels",
             f"{'us/step':>9}{'share':>7}{'calls':>7}{'us/call':>9}  kernel"]
    for name, t in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{t / steps:>9.1f}{t / steps / step_us:>7.1%}{calls[name] // steps:>7}"
                     f"{t / calls[name]:>9.1f}  {name[:110]}")
    return "\n".join(lines)


def step_wall_ms(runner: ModelRunner, step, steps: int) -> float:
    """Wall time of one step from its launch to the GPU's end, host included: above the kernels' GPU time,
    the gap is the GPU waiting for the host (a host-bound step)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.execute(step)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps


def host_profile(runner: ModelRunner, step, steps: int, top: int) -> str:
    """cProfile of `steps` executions (host time by function) and the synchronizing calls of one."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        runner.execute(step)
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner.execute(step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [f"{w.filename}:{w.lineno}: {str(w.message)[:80]}" for w in caught
             if "synchroniz" in str(w.message)]
    return "\n".join([f"host profile of {steps} steps (cProfile):", text.getvalue(),
                      f"synchronizing calls in one step: {len(syncs)}", *syncs])


def mixed_step(runner: ModelRunner, args: argparse.Namespace):
    """args.prefill fresh rows of args.prefill_len tokens, then args.batch decode rows at args.ctx."""
    rows = [(0, args.prefill_len)] * args.prefill + [(args.ctx - 1, 1)] * args.batch
    step = stress.corner_step(runner.envelope, True, rows, runner.kv.num_pages - 1,
                              runner.model_config.vocab_size, seed=1)
    step.rows, step.decode = step.rows[:args.prefill], step.rows[args.prefill:]
    for row in step.all_rows:
        row.params = GREEDY
    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--eager", action="store_true", help="run the step without its CUDA graph")
    p.add_argument("--prefill", type=int, default=0, help="fresh requests of a mixed step (0: a decode step)")
    p.add_argument("--prefill_len", type=int, default=1024)
    p.add_argument("--kv_cache_dtype", default="auto", help="auto or fp8_e4m3")
    p.add_argument("--host", type=int, default=0, help="also the N functions with the most host time")
    p.add_argument("--piecewise_cuda_graph_max_tokens", type=int, default=None,
                   help="the server's flag (unset: its default, 512 or a hybrid MoE's 8192)")
    args = p.parse_args(argv)
    fresh = args.prefill * args.prefill_len
    cfg = validate(ServerConfig(model=args.model, dtype="bfloat16", max_req_total_len=4096,
                                graph_max_batch_size=max(args.batch, 1), disable_cudagraph=args.eager,
                                batch_max_tokens=max(fresh + args.batch, 8192),
                                running_max_req_size=max(args.prefill + args.batch, 1),
                                kv_cache_dtype=args.kv_cache_dtype, report_dir=None,
                                piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens))
    runner = ModelRunner(cfg)
    runner.build((args.batch + args.prefill) * (max(args.ctx, args.prefill_len) + cfg.page_size)
                 + 4 * cfg.page_size)
    step = mixed_step(runner, args) if args.prefill else decode_step(runner, args.batch, args.ctx, GREEDY)
    runner.execute(step)
    step.page_writes = []
    for _ in range(3):
        runner.execute(step)
    torch.cuda.synchronize()
    wall_ms = step_wall_ms(runner, step, args.steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            runner.execute(step)
        torch.cuda.synchronize()
    how = "eager" if args.eager else "graph replay of the"
    what = f"mixed step: {args.prefill} x {args.prefill_len} fresh tokens and" if args.prefill else \
        f"{how} decode step:"
    print(f"{torch.cuda.get_device_name()}: {what} {args.batch} decode rows at {args.ctx} tokens of context")
    print(kernel_table(prof, args.steps, args.top))
    print(f"wall time per step {wall_ms:.3f} ms (host and GPU, {args.steps} steps without the profiler)")
    if args.prefill and runner.pieces is not None:  # the same step eager: the pieces' gain
        pieces, runner.pieces = runner.pieces, None
        for _ in range(3):  # its own warm-up: Triton compiles for the step's row count, not the bucket's
            runner.execute(step)
        eager_ms = step_wall_ms(runner, step, args.steps)
        runner.pieces = pieces
        print(f"the same step eager (no piecewise graphs): {eager_ms:.3f} ms wall")
    if args.host:
        print(host_profile(runner, step, args.steps, args.host))
    runner.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
