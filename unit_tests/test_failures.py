"""Issue 11: every failure ends in a clear message and a suggestion that works (CPU, mocked CUDA)."""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from autoprofile.engine import cuda_graph

DEV, POOL = 0, (0, 7)


# ---------------------------------------------------------------- an OOM inside CUDA graph capture
class FakeGraph:
    """torch.cuda.CUDAGraph's contract as CUDAGraph.cpp implements it: capture_end() on an invalidated
    capture raises before the allocator hears the capture ended; pool() needs an ended capture."""

    def __init__(self, log: list, invalidated: bool = True):
        self.log, self.invalidated, self.ended = log, invalidated, False

    def capture_begin(self, pool):
        self.log.append(("begin", pool))

    def capture_end(self):
        self.log.append(("capture_end",))
        if self.invalidated:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.ended = True

    def pool(self):
        if not self.ended:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return POOL

    def reset(self):
        self.log.append(("reset",))


@pytest.fixture
def cuda_log():
    """The CUDA calls capture_graph makes, recorded in order."""
    log: list = []

    @contextlib.contextmanager
    def stream(s):
        log.append(("stream_enter",))
        try:
            yield
        finally:
            log.append(("stream_exit",))

    with contextlib.ExitStack() as st:
        p = lambda target, **kw: st.enter_context(mock.patch(target, **kw))  # noqa: E731
        p("torch.cuda.current_device", return_value=DEV)
        p("torch.cuda.Stream", return_value="side-stream")
        p("torch.cuda.stream", side_effect=stream)
        p("torch.cuda.synchronize", side_effect=lambda *a: log.append(("synchronize",)))
        p("torch.cuda.empty_cache", side_effect=lambda: log.append(("empty_cache",)))
        p("torch._C._cuda_endAllocateToPool", create=True,
          side_effect=lambda dev, pool: log.append(("endAllocateToPool", dev, pool)))
        p("torch._C._cuda_releasePool", create=True,
          side_effect=lambda dev, pool: log.append(("releasePool", dev, pool)))
        st.enter_context(mock.patch.object(cuda_graph, "_ABANDONED", []))
        st.enter_context(mock.patch.object(cuda_graph, "_CAPTURE_STREAMS", {}))
        yield log


def oom():
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_oom_in_an_invalidated_capture_is_undone_before_it_propagates(cuda_log):
    graph = FakeGraph(cuda_log, invalidated=True)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):  # the OOM, not capture_end's error
        cuda_graph.capture_graph(graph, POOL, oom)
    i = cuda_log.index(("begin", POOL))
    assert cuda_log[i + 1:] == [("capture_end",), ("endAllocateToPool", DEV, POOL), ("releasePool", DEV, POOL),
                                ("reset",), ("synchronize",), ("stream_exit",)]
    assert cuda_graph._ABANDONED == [graph]  # kept: the host allocator may still point at it


def test_oom_in_a_still_valid_capture_ends_it_normally(cuda_log):
    graph = FakeGraph(cuda_log, invalidated=False)
    with pytest.raises(torch.OutOfMemoryError):
        cuda_graph.capture_graph(graph, POOL, oom)
    tail = cuda_log[cuda_log.index(("begin", POOL)) + 1:]
    assert tail == [("capture_end",), ("reset",), ("synchronize",), ("stream_exit",)]  # reset gives the pool back


def test_successful_capture_is_plain(cuda_log):
    graph = FakeGraph(cuda_log, invalidated=False)
    ran = []
    cuda_graph.capture_graph(graph, POOL, lambda: ran.append(1))
    assert ran == [1]
    assert cuda_log == [("synchronize",), ("empty_cache",), ("stream_enter",), ("begin", POOL), ("capture_end",),
                        ("stream_exit",)]


def test_decode_graphs_capture_failure_propagates_and_keeps_only_ended_graphs(cuda_log):
    """The ladder's second capture OOMs: the error reaches the runner's build (which tears down), the
    first graph stays owned by DecodeGraphs (its teardown resets it), the failed one is not kept there."""
    g = cuda_graph.DecodeGraphs.__new__(cuda_graph.DecodeGraphs)
    g.sizes, g.max_bs, g.max_seq_len, g.page_size = [1, 2], 2, 64, 16
    g.input_ids = g.positions = g.slot_mapping = torch.zeros(2, dtype=torch.int64)
    g.block_tables, g.seq_lens = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    g.graphs, g.logits, g.pool = {}, None, None
    made = iter([FakeGraph(cuda_log, invalidated=False), FakeGraph(cuda_log, invalidated=True)])
    calls = []

    def step(ids, pos, meta):
        calls.append(ids.shape[0])
        if len(calls) == 4:  # warm 2, capture 2, warm 1, capture 1 <- OOM inside the capture
            oom()
        return torch.zeros(ids.shape[0], 8)

    with mock.patch("torch.cuda.CUDAGraph", side_effect=lambda: next(made)), \
            mock.patch("torch.cuda.graph_pool_handle", return_value=POOL):
        with pytest.raises(torch.OutOfMemoryError):
            g.capture(step, show_progress=False)
    assert list(g.graphs) == [2] and g.pool == POOL
    assert ("releasePool", DEV, POOL) in cuda_log
