"""Decode CUDA graphs: one capture loop over (batch size, max_seq_len bucket), one memory pool, static
buffers.

AITER's Triton decode launches one program per 1024-token partition of max_seq_len and reduces over a
power-of-two tile of them, so its cost follows max_seq_len, not the rows' real lengths (H100, batch 256
at ~150 tokens: 67.4 ms per step at max_seq_len 131072, 12.4 ms at 4096). So each batch size of the
ladder is captured at a few max_seq_len buckets (budget.decode_buckets: 4096, x4 ..., context_len), and
a step replays the smallest bucket that holds its longest row (known on the host: start + 1).

Memory: every graph shares ONE pool, captured largest scratch first (longest bucket, largest batch), so
later captures reuse its blocks; the static block tables are sized for context_len and a bucket's graph
reads its first ceil(bucket/page) columns. The build is the same in the probe and at the target, so the
probe captures (and measures) every graph serving replays, and replaying one allocates nothing.
Logits are captured too; sampling runs outside the graph.

Inputs: a step's rows come as one host tensor [b, 5] (token id, position, request slot, 1, rope delta), copied
into the static `inputs` in one transfer; the graph derives its metadata itself (slot mapping, seq_lens and
block tables, from the request table: ReqTable.decode_metadata, which eager decode uses too) and feeds a
PENDING token id from the request table's last_tokens (the overlapped engine), so a replay is two or three
launches. Padding rows carry 0 in the last column: they write to PAD_PAGE and read one token of it.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from autoprofile.kernels import compile_ahead
from autoprofile.kernels.launch_rules import batch_ladder  # noqa: F401 - the ladder's one owner (no torch)
from autoprofile.budget import decode_bucket, decode_buckets, decode_graph_keys
from autoprofile.layers.attention import AttentionMetadata
from autoprofile.engine.kv_cache import PAD_PAGE, ReqTable

log = logging.getLogger(__name__)

# (input_ids, positions, metadata, out) -> logits, written into out ([rows, vocab]) when it is given
DecodeStep = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None], torch.Tensor]


class DecodeGraphs:
    """Owns the graphs, their shared pool and every static buffer: teardown() drops them all."""

    def __init__(self, max_bs: int, req_table: ReqTable, max_seq_len: int, rope_delta: bool = False,
                 state_pad: int | None = None):
        """req_table: the runner's; every replay reads its page table (drop the graphs before it).
        rope_delta: the model's rope positions are position + the rows' delta column (M-RoPE models).
        state_pad: a hybrid model's pad state slot (engine.state_cache): padding rows read and write it."""
        device = req_table.page_table.device
        pages_per_req, page_size = req_table.pages_per_req, req_table.page_size
        self.keys = decode_graph_keys(max_bs, max_seq_len)  # capture order
        self.buckets = decode_buckets(max_seq_len)
        self.ladders = {bucket: sorted(bs for bs, b in self.keys if b == bucket) for bucket in self.buckets}
        self.max_bs, self.max_seq_len, self.page_size = max_bs, max_seq_len, page_size
        self.req_table = req_table
        # id, position, slot, real row, rope delta (M-RoPE: a VL request's later tokens sit at position +
        # delta)
        self.inputs = torch.zeros(max_bs, 5, dtype=torch.int64, device=device)
        self.input_ids, self.positions = self.inputs[:, 0], self.inputs[:, 1]
        self.rope_positions = torch.zeros(max_bs, dtype=torch.int64,
                                          device=device) if rope_delta else self.positions
        self.slot_mapping = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.block_tables = torch.full((max_bs, pages_per_req), PAD_PAGE, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        # decode rows as one-token varlen queries (--deterministic's unified attention): static, as a
        # captured graph must read memory that outlives the capture
        self.query_starts = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.state_pad = state_pad
        self.state_slots = (torch.zeros(max_bs, dtype=torch.int64, device=device) if state_pad is not None
                            else None)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [max_bs, vocab]: the one static output of every graph
        self.pool = None

    @property
    def sizes(self) -> list[int]:
        """The full batch ladder (the first bucket's)."""
        return self.ladders[self.buckets[0]]

    def columns(self, bucket: int) -> int:
        """Block-table columns a row of at most `bucket` tokens can use."""
        return min(math.ceil(bucket / self.page_size), self.block_tables.shape[1])

    def pick(self, b: int, longest: int) -> tuple[int, int]:
        """(batch size, bucket) of the graph that replays b rows whose longest seq_len is `longest`."""
        bucket = decode_bucket(self.buckets, longest)
        return next(s for s in self.ladders[bucket] if s >= b), bucket

    def meta(self, bs: int, bucket: int) -> AttentionMetadata:
        # NOTE: query_start_loc is given, not derived lazily: a tensor the eager warm-up made would be freed after
        # the capture and its memory reused under the graph (a crowd test on the H100 caught exactly that)
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping[:bs],
                                 block_tables=self.block_tables[:bs, :self.columns(bucket)],
                                 seq_lens=self.seq_lens[:bs], max_seq_len=bucket, captured=True,
                                 query_start_loc=self.query_starts[:bs + 1],
                                 state_slots=self.state_slots[:bs] if self.state_slots is not None else None)

    def capture(self, step: DecodeStep, before_first: Callable[[], None] | None = None,
                show_progress: bool = True) -> None:
        """In self.keys order (largest scratch first), so later graphs reuse the pool's blocks. `step` is
        not kept. A failure inside a capture (a real OOM: a peer grew after measure) ends that capture
        cleanly and propagates like any other build failure.
        One eager warm-up, before the first graph, in every build: it makes the static logits buffer and
        cuBLAS's workspace on the capture stream (which every teardown releases). Each other graph's first
        launches (a Triton kernel's module load, cuBLAS's pick for its rows) run inside its capture; the one
        kernel that keeps scratch made at its first launch (the split FP8 skinny GEMM's tile counters) has it
        made by the runner's build first (runner.keep_scratch). A warm-up a batch size, as vLLM and SGLang
        run, cost a warm llama-3.1-8b boot 1.3-1.7 s (35 of its 62 graphs, H200)."""
        capture_stream(torch.cuda.current_device())
        t0 = time.perf_counter()
        ahead = compile_ahead.active()
        # a boot's first build: every graph's Triton kernels compile in its pool at once (the rebuild's and a
        # retry's graphs are the same: their kernels are compiled by then); not on a warm Triton cache, where
        # the dry pass is host time that saves nothing
        if ahead is not None and ahead.once("decode graphs"):
            if ahead.cache_warm():
                log.info("compile ahead: no dry capture of the decode graphs: the boot's compiles so far "
                         "were all in Triton's cache")
            else:
                ahead.dry(self._capture_dry, step)
        warming = 0.0
        order = tqdm(self.keys, desc="capturing decode graphs", unit="graph", disable=not show_progress)
        for bs, bucket in order:
            args = (self.input_ids[:bs], self.rope_positions[:bs], self.meta(bs, bucket))
            t_warm = time.perf_counter()
            self._derive(bs, bucket)
            if self.logits is None:
                # the warm-up, outside the capture, of the first graph (the largest batch): it makes the
                # static logits buffer [max_bs, vocab] that every graph writes
                self.logits = step(*args, None)
            warming += time.perf_counter() - t_warm
            if before_first is not None:
                before_first()
                before_first = None
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()  # our own id: a failed capture can give it back
            graph = torch.cuda.CUDAGraph()

            def body(bs=bs, args=args):
                # NOTE: a graph's own output would stay allocated in the pool for good (one logits tensor
                # per graph, ~1 GiB for an 8B model at 256); all graphs write the one static buffer, the
                # lm_head's GEMM into it (ParallelLMHead: no temporary, no copy)
                self._derive(bs, bucket)
                out = step(*args, self.logits[:bs])
                assert out.data_ptr() == self.logits.data_ptr(), "a decode step must write the static logits"

            capture_graph(graph, self.pool, body)
            self.graphs[bs, bucket] = graph
        torch.cuda.synchronize()
        log.info("captured %d decode graphs in %.1f s (%.1f s of it the warm-up steps' host time)",
                 len(self.graphs), time.perf_counter() - t0, warming)

    def _capture_dry(self, step: DecodeStep) -> None:
        """Every graph's step, in capture order, inside one capture that is then dropped, under
        kernels.compile_ahead's `dry` (Triton launches compile-only): the compiles of all batch sizes and
        buckets start at once, and nothing runs on the GPU (a skipped kernel's output is never read, not even
        by a torch op). Relaxed capture mode: no warm-up ran before it, so cuBLAS creates its handle inside
        the capture (cublasCreate allocates: refused in the global mode, CUBLAS_STATUS_NOT_INITIALIZED on the
        H100). A failure is logged by `dry`; the real captures compile what it did not reach."""
        def steps() -> None:
            for bs, bucket in self.keys:
                self._derive(bs, bucket)
                step(self.input_ids[:bs], self.rope_positions[:bs], self.meta(bs, bucket), None)
        dry_capture(torch.cuda.current_device(), steps)

    def _derive(self, bs: int, bucket: int) -> None:
        """The metadata of rows inputs[:bs] into the static buffers (captured: every replay recomputes it)."""
        cols = self.columns(bucket)
        # a PENDING id (the overlapped engine) is the token the row's slot sampled last
        self.input_ids[:bs].copy_(self.req_table.feed(self.input_ids[:bs], self.inputs[:bs, 2]))
        tables, slot_mapping, seq_lens = self.req_table.decode_metadata(
            self.positions[:bs], self.inputs[:bs, 2], cols, real=self.inputs[:bs, 3] != 0)
        self.block_tables[:bs, :cols].copy_(tables)
        self.slot_mapping[:bs].copy_(slot_mapping)
        self.seq_lens[:bs].copy_(seq_lens)
        if self.state_slots is not None:
            real = self.inputs[:bs, 3] != 0
            self.state_slots[:bs].copy_(torch.where(real, self.inputs[:bs, 2], self.state_pad))
        if self.rope_positions is not self.positions:
            torch.add(self.positions[:bs], self.inputs[:bs, 4], out=self.rope_positions[:bs])

    def replay(self, rows: torch.Tensor, longest: int) -> torch.Tensor:
        """Logits [b, vocab] of one decode step for rows [b, 5] int64 (token id, position, request slot, 1,
        rope delta;
        pinned host memory: one non-blocking copy), b <= max_bs, whose longest seq_len is `longest`."""
        b = rows.shape[0]
        bs, bucket = self.pick(b, longest)
        self.inputs[:b].copy_(rows, non_blocking=True)
        if bs > b:  # rows of an earlier, larger batch must not leak into the padding
            self.inputs[b:bs].zero_()
        self.graphs[bs, bucket].replay()
        return self.logits[:b]

    def teardown(self) -> None:
        """Drop graphs, pool and buffers (one owner: after this nothing of them is reachable)."""
        if self.graphs:
            torch.cuda.synchronize()
        self.graphs.clear()
        self.logits = self.pool = None
        self.inputs = self.input_ids = self.positions = self.rope_positions = self.req_table = None
        self.slot_mapping = self.block_tables = self.seq_lens = self.state_slots = None
        release_cublas_workspaces()


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}
# NOTE: graphs whose capture failed are never freed: the CUDA host allocator may still hold a filter pointing
# at the C++ graph object, and ~CUDAGraph of a failed capture_begin throws from a destructor (capture_graph).
# Each one is a small host object (reset: it holds no GPU memory); its Python reference count is raised
# once, so not even the interpreter's exit frees it.
_ABANDONED: list = []


def _keep_forever(graph) -> None:
    import ctypes
    _ABANDONED.append(graph)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(graph))


def dry_capture(device: int, body: Callable[[], None]) -> None:
    """body() inside one capture on the capture stream that is then dropped: nothing it launches runs on the
    GPU (under kernels.compile_ahead's `dry`, its Triton launches start their compiles). Relaxed capture
    mode: a cuBLAS handle may be created inside it (see DecodeGraphs._capture_dry). The cuBLAS workspaces
    made inside the dropped pool are released after."""
    graph, pool = torch.cuda.CUDAGraph(keep_graph=True), torch.cuda.graph_pool_handle()
    torch.cuda.synchronize()
    try:
        with torch.cuda.stream(capture_stream(device)):
            begin_capture(graph, pool, device, mode="relaxed")
            try:
                body()
            finally:
                abandon_capture(graph, pool, device)
    finally:
        release_cublas_workspaces()  # the capture stream's, made inside the dropped pool


def capture_stream(device: int) -> torch.cuda.Stream:
    """The side stream graphs are captured on, one per device (as torch.cuda.graph keeps one). NOTE: made
    before anything fills the card: creating a stream on a full GPU fails with a CUDA error that is not an
    OutOfMemoryError (H100), which no retry would catch."""
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def capture_graph(graph, pool, body: Callable[[], None]) -> None:
    """torch.cuda.graph(graph, pool) around body(), but a body that raises (a real OOM inside the capture)
    leaves no capture behind. torch.cuda.graph's __exit__ calls capture_end(), which raises on an
    invalidated capture BEFORE it tells the caching allocator that the capture is over and BEFORE it
    restores the current stream: the allocator then believes a capture is underway forever (the next
    empty_cache trips TORCH_INTERNAL_ASSERT(captures_underway.empty())), its filter points at the graph
    being freed, and later work runs on the capture stream. The process aborted in teardown (H100,
    torch 2.11). Here the capture is ended, the allocator's bookkeeping undone, the graph reset and the
    device synchronised before the error propagates; nothing is freed before that."""
    device = torch.cuda.current_device()
    stream = capture_stream(device)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # as torch.cuda.graph does: the capture gets every cached byte
    with torch.cuda.stream(stream):
        begin_capture(graph, pool, device)
        try:
            body()
        except BaseException:
            abandon_capture(graph, pool, device)
            raise
        graph.capture_end()


def begin_capture(graph, pool, device: int, mode: str = "global") -> None:
    """graph.capture_begin(pool) on the current (capture) stream; one that raises leaves no capture behind and
    its graph is never freed. mode: CUDA's capture mode (the dry capture's "relaxed": see _capture_dry).
    NOTE: the generator allocates two 8-byte tensors when its first graph registers, inside capture_begin,
    after the graph recorded the generator and before the generator recorded the graph. With the card full
    (the rebuild's first capture, no graph registered) that allocation fails and ~CUDAGraph throws from a
    destructor ("The graph should be registered to the state": std::terminate, H100 and H200, torch 2.11)."""
    try:
        if mode == "global":  # torch's default
            graph.capture_begin(pool)
        else:
            graph.capture_begin(pool, capture_error_mode=mode)
    except BaseException:
        _keep_forever(graph)
        if torch.cuda.is_current_stream_capturing():
            abandon_capture(graph, pool, device)
        raise


def abandon_capture(graph, pool, device: int) -> None:
    """End a capture whose body raised, as if it had never begun (see capture_graph). Never raises: the
    body's error is the one that propagates."""
    _keep_forever(graph)  # NOTE: first: whatever fails below, the graph's destructor never runs
    try:
        graph.capture_end()  # a still-valid capture ends normally (and instantiates the partial graph)
    except Exception as e:  # noqa: BLE001 - invalidated: CUDA ended it, torch's bookkeeping did not
        log.warning("ending a failed CUDA graph capture: %s", _first_line(e))
    try:
        graph.pool()  # only a capture that ended has a pool: its reset() gives the pool back
        ended = True
    except RuntimeError:
        ended = False
    steps = []
    if not ended:
        end = getattr(torch._C, "_cuda_endAllocateToPool",
                      None) or torch._C._cuda_endAllocateCurrentStreamToPool
        steps += [lambda: end(device, pool),  # raises if capture_end got that far already
                  lambda: torch._C._cuda_releasePool(device, pool)]  # the use count capture_begin took
    steps += [graph.reset, torch.cuda.synchronize]
    for step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - logged; the body's error propagates
            log.warning("cleaning up a failed CUDA graph capture: %s", _first_line(e))


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def release_cublas_workspaces() -> None:
    """NOTE: cuBLAS keeps a workspace per (handle, stream) in the caching allocator for good. The capture
    stream's one is allocated inside the graph pool and pins that pool's segment after the graphs are
    gone; the others keep reserved memory above its pre-build level. They are re-made on the next matmul."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        clear()
