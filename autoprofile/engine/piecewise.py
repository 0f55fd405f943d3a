"""Piecewise CUDA graphs for small prefill and mixed steps (vLLM's and SGLang's piecewise cudagraphs, with
the attention call as the split point).

An eager step pays the host's launch time for every kernel: a llama-3.1-8b step of one 80-token chunk beside
200 decode rows ran 11.5 ms of kernels in 22.3 ms of wall time on an H100 (host-bound: ~0.6 ms of Python and
launches a layer, most of it Triton's launcher), so a step that admits a request costs twice a decode step.
Here such a step replays graphs: for each token bucket T, the forward is captured in L + 1 pieces (L
attention layers), each from one attention call to the next (embedding, norms, QKV projection, RoPE and the
K/V store, O projection, MLP, and the next layer's QKV). Between two pieces the layer's attention runs
eagerly with the step's own metadata (varlen prefill, the decode rows' paged decode: shapes that vary per
step), reading q/k/v from one static QKV buffer and writing one static output buffer, which the next piece
reads. A step of n <= T tokens copies its ids, positions and slots into the static inputs; the T - n padded
tokens write their K/V into the pad page and their rows of every buffer are never read.

Memory: the pieces of every bucket share one pool (captured largest first, replayed in capture order, so
what one piece frees a later one reuses), plus the static buffers (T_max x (QKV + O) widths); the profile
measures them with the decode graphs' pools ("graph_capture" to the end of the build). A step's eager part
is the attention of its own rows, which an eager step of the same rows also runs; the stress runs the
largest bucket with the most decode rows (stress.mixed_corners).

Which models: a decoder of LlamaAttention layers (llama, Qwen2/3 dense and Qwen3-MoE: the fused experts'
sizes follow the bucket, the routing is a device tensor), bf16 or FP8 weights and cache, on one rank without
--deterministic (its GEMMs must see the step's own rows); MLA, hybrid and vision-language models and a step
that calibrates an FP8 cache's scales run eagerly (ModelRunner.piecewise_ok, config.piecewise_max_tokens).
`autoprofile plan` charges the pool (plan.pieces_row: llama-3.1-8b 76 MiB at 512 tokens, 68.0 measured)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from autoprofile.engine.cuda_graph import abandon_capture, begin_capture, capture_stream
from autoprofile.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)

# (input_ids, positions, metadata) -> final-normed hidden states [T, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def piece_buckets(max_tokens: int) -> list[int]:
    """Token buckets up to max_tokens, ascending: 16, 32, then multiples of 32 at most a quarter apart (64,
    96, ..., 256, 320, 384, 480, ...), so a step past 128 tokens pads by at most a quarter (its GEMMs run at
    the bucket's rows: 281 tokens at bucket 384 took 12.8 ms of GPU against the eager step's 11.5);
    max_tokens last."""
    out, b = [], 16
    while b < max_tokens:
        out.append(b)
        b += 16 if b < 32 else max(32, b // 4 // 32 * 32)
    return out + [max_tokens] if max_tokens >= 1 else []


def static_view(base: torch.Tensor, static: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """t (a view of base: q, k or v of the packed QKV projection) as the same view of `static`, a buffer of
    base's row width."""
    assert t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), "q, k, v must be views of qkv"
    return static.as_strided(t.shape, t.stride(), static.storage_offset() + t.storage_offset()
                             - base.storage_offset())


class PiecewiseGraphs:
    """Owns the pieces of every bucket, their pool and the static buffers: teardown() drops them all."""

    def __init__(self, max_tokens: int, qkv_width: int, o_width: int, dtype: torch.dtype,
                 device: torch.device, pad_slot: int):
        self.buckets = piece_buckets(max_tokens)
        self.max_tokens = max_tokens
        self.ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slots = torch.full((max_tokens,), pad_slot, dtype=torch.int64, device=device)
        self.qkv = torch.zeros(max_tokens, qkv_width, dtype=dtype, device=device)
        self.o = torch.zeros(max_tokens, o_width, dtype=dtype, device=device)
        self.pad_slot = pad_slot
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.splits: dict[int, list[tuple]] = {}  # per bucket, per layer: (attention module, q, k, v, kv)
        self.hidden: dict[int, torch.Tensor] = {}  # per bucket: the last piece's output
        self.pool = None
        self._taking: list | None = None  # the bucket being captured: its graphs so far
        self._splits: list | None = None
        self._capturing = False  # the last of _taking is capturing (begun, not ended)

    def pick(self, tokens: int) -> int | None:
        """The bucket that runs a step of `tokens` tokens; None: more than the largest (eager)."""
        return next((b for b in self.buckets if b >= tokens), None)

    def meta(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(is_prefill=True, slot_mapping=self.slots[:bucket], pieces=self)

    # ------------------------------------------------------------ capture
    def capture(self, forward: Forward, show_progress: bool = True) -> None:
        """Every bucket, the largest first: an eager warm-up (Triton compiles, cuBLAS picks its kernels),
        then the capture of its pieces. A failure inside a capture (a real OOM) ends it cleanly, keeps the
        pieces captured before (teardown() drops them) and propagates."""
        device = torch.cuda.current_device()
        stream = capture_stream(device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        for bucket in reversed(self.buckets):
            torch.cuda.synchronize()  # the static buffers (made or last written on the current stream)
            with torch.cuda.stream(stream):
                forward(self.ids[:bucket], self.positions[:bucket], self.meta(bucket))  # warm-up
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # as torch.cuda.graph does: the capture gets every cached byte
            self.graphs[bucket], self.splits[bucket] = [], []
            self._taking, self._splits = self.graphs[bucket], self.splits[bucket]
            try:
                with torch.cuda.stream(stream):
                    self._begin(device)
                    try:
                        self.hidden[bucket] = forward(self.ids[:bucket], self.positions[:bucket],
                                                      self.meta(bucket))
                        self._end()
                    except BaseException:
                        if self._capturing:  # (a piece whose begin raised was given up by begin_capture)
                            self._capturing = False
                            abandon_capture(self._taking.pop(), self.pool, device)
                        raise
            finally:
                self._taking = self._splits = None
        torch.cuda.synchronize()
        if show_progress:
            log.info("captured the pieces of %d prefill buckets (%d graphs, up to %d tokens) in %.1f s, "
                     "pool %.1f MiB", len(self.graphs), sum(len(g) for g in self.graphs.values()),
                     self.max_tokens, time.perf_counter() - t0, self.pool_bytes() / 2**20)

    def pool_bytes(self) -> int:
        """The caching allocator's segments in the pieces' pool (what `autoprofile plan` estimates)."""
        pool = tuple(self.pool)
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                   if tuple(s["segment_pool_id"]) == pool)

    def _begin(self, device: int) -> None:
        graph = torch.cuda.CUDAGraph()
        begin_capture(graph, self.pool, device)
        self._taking.append(graph)
        self._capturing = True

    def _end(self) -> None:
        self._taking[-1].capture_end()
        self._capturing = False

    def split(self, attention, qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              kv) -> torch.Tensor:
        """Called by an attention layer in place of its attention (AttentionMetadata.pieces): q, k, v (views
        of qkv, rotated, K/V stored) copied into the static QKV buffer; while capturing, the piece ends here
        and the next begins. Returns the static output's rows, shaped as q, which the next piece reads."""
        rows = qkv.shape[0]
        assert qkv.is_contiguous() and qkv.shape[1] == self.qkv.shape[1], (qkv.shape, self.qkv.shape)
        static = self.qkv[:rows]
        static.copy_(qkv)
        views = tuple(static_view(qkv, static, t) for t in (q, k, v))
        if self._taking is not None:
            self._end()
            self._splits.append((attention, *views, kv))
            self._begin(torch.cuda.current_device())
        return self.o[:rows].view(q.shape)

    # ------------------------------------------------------------ replay
    def stage(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """A step's n tokens into the static inputs, the bucket's other rows padding; returns the bucket."""
        n = ids.shape[0]
        bucket = self.pick(n)
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        if bucket > n:  # the rows of an earlier, larger step must not write their K/V again
            self.slots[n:bucket].fill_(self.pad_slot)
        meta.new_forward()
        return bucket

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states [n, hidden] of a prefill or mixed step of n <= max_tokens tokens (ids,
        positions, meta.slot_mapping: [n] on the device; meta: the step's own attention metadata)."""
        n = ids.shape[0]
        bucket = self.stage(ids, positions, meta)
        graphs = self.graphs[bucket]
        graphs[0].replay()
        for (attention, q, k, v, kv), graph in zip(self.splits[bucket], graphs[1:], strict=True):
            attention.attend(q[:n], k[:n], v[:n], meta, kv, out=self.o[:n].view(q[:n].shape))
            graph.replay()
        return self.hidden[bucket][:n]

    def teardown(self) -> None:
        """Drop pieces, pool and buffers (one owner: after this nothing of them is reachable)."""
        if self.graphs:
            torch.cuda.synchronize()
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.reset()
        self.graphs.clear()
        self.splits.clear()
        self.hidden.clear()
        self.pool = None
        self.ids = self.positions = self.slots = self.qkv = self.o = None
