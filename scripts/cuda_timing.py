"""The benchmarks' one timer: CUDA events around each call, the median of `iters` calls after a warm-up; and
the one graph capture they time (graphed, graph_median_ms) and the GPU tests replay (capture).

cuda_median_ms around an eager call on an idle GPU measures the host too: a Triton launch takes tens of
microseconds on the host, longer than a small kernel runs. graph_median_ms is the GPU's time: calls captured
back to back in one graph, launched by one replay."""
from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_median_ms(fn: Callable[[], object], iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def capture(call: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """call() run once on a side stream (compiles, allocates its workspaces outside the capture), then
    captured: (the graph, what the captured call returned: its output buffers, which each replay writes)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured in a CUDA graph (capture): the replay."""
    return capture(fn)[0].replay


def graph_median_ms(fn: Callable[[], object], iters: int, calls: int = 20, warmup: int = 3) -> float:
    """The GPU's time of one fn() call: `calls` calls captured in one graph (capture), the median of `iters`
    replays timed by CUDA events, / calls."""
    replay = graphed(lambda: [fn() for _ in range(calls)])
    return cuda_median_ms(replay, iters, warmup) / calls
