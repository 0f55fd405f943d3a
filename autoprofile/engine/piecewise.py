"""Piecewise CUDA graphs for small prefill and mixed steps (vLLM's and SGLang's piecewise cudagraphs, with
the attention call as the split point).

An eager step pays the host's launch time for every kernel: a llama-3.1-8b step of one 80-token chunk beside
200 decode rows ran 11.5 ms of kernels in 22.3 ms of wall time on an H100 (host-bound: ~0.6 ms of Python and
launches a layer, most of it Triton's launcher), so a step that admits a request costs twice a decode step.
Here such a step replays graphs: for each token bucket T, the forward is captured in L + 1 pieces (L
layers whose mixing part runs eagerly), each from one such part to the next (embedding, norms, projections,
RoPE and the K/V store, the output projection, the MLP or experts, and the next layer's projections). Between
two pieces the eager part runs with the step's own metadata: an attention layer's varlen prefill and its
decode rows' paged decode, a Gated DeltaNet layer's conv, gates, delta rule over the rows' states and gated
norm (shapes and states that vary per step; vLLM splits Qwen3-Next's graphs at the same two ops). It reads
its inputs (q, k, v; the linear layer's projections) from one static input buffer and writes one static
output buffer, which the next piece reads. A step of n <= T tokens copies its ids, positions and slots into
the static inputs; the T - n padded tokens write their K/V into the pad page and their rows of every buffer
are never read (a linear layer's eager part reads only the step's n rows: pads never touch a state).

Memory: the pieces of every bucket share one pool (captured largest first, replayed in capture order, so
what one piece frees a later one reuses), plus the static buffers (T_max x the widest eager part's inputs
and output, sized by the largest bucket's warm-up); the profile measures them with the decode graphs' pools
("graph_capture" to the end of the build). A step's eager part is the attention (or rule) of its own rows,
which an eager step of the same rows also runs; the stress runs the largest bucket with the most decode rows
(stress.mixed_corners).

Which models: a decoder of LlamaAttention layers (llama, Qwen2/3 dense and Qwen3-MoE: the fused experts'
sizes follow the bucket, the routing is a device tensor) or of Qwen3.5's gated attention and Gated DeltaNet
layers (dense or MoE), bf16 or FP8 weights and cache, on one rank without --deterministic (its GEMMs must see
the step's own rows); MLA and vision-language models and a step that calibrates an FP8 cache's scales run
eagerly (ModelRunner.piecewise_ok, config.piecewise_max_tokens).
`autoprofile plan` charges the pool (plan.pieces_row: llama-3.1-8b 76 MiB at 512 tokens, 68.0 measured)."""
from __future__ import annotations

import logging
import math
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
    """t (base itself or a view of it: q, k or v of the packed QKV projection) as the same view of `static`,
    a copy of base in another storage."""
    assert t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), "t must be a view of base"
    return static.as_strided(t.shape, t.stride(), static.storage_offset() + t.storage_offset()
                             - base.storage_offset())


def splits_pieces(model: torch.nn.Module) -> bool:
    """Whether every decoder layer's attention or linear attention hands its eager part to split(): a
    `piecewise_split` in its class's own namespace (a subclass that runs another forward says so itself)."""
    mixers = [getattr(layer, "self_attn", None) or getattr(layer, "linear_attn", None)
              for layer in model.model.layers]
    return all("piecewise_split" in type(m).__dict__ for m in mixers)


def root_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor t is a view of (torch keeps the root of a chain of views), or t itself; under
    torch.inference_mode, where views keep no root, the whole of t's storage (flat) unless t is all of it."""
    if t._base is not None:
        return t._base
    if t.is_contiguous() and t.storage_offset() == 0 and t.nbytes == t.untyped_storage().nbytes():
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())


def warm_ups_due(buckets: list[int], warmed: set[int]) -> set[int]:
    """The buckets (in capture order) whose capture an eager warm-up precedes: every bucket an earlier build
    of this process did not warm (a cold boot's rebuild after its probe: the same buckets ran the same
    kernels eagerly), and the first always (it makes cuBLAS's workspace on the capture stream, which every
    teardown releases)."""
    return (set(buckets) - warmed) | set(buckets[:1])


class PiecewiseGraphs:
    """Owns the pieces of every bucket, their pool and the static buffers: teardown() drops them all."""

    def __init__(self, max_tokens: int, dtype: torch.dtype, device: torch.device, pad_slot: int):
        self.buckets = piece_buckets(max_tokens)
        self.max_tokens = max_tokens
        self.dtype, self.device = dtype, device
        self.ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slots = torch.full((max_tokens,), pad_slot, dtype=torch.int64, device=device)
        # the eager parts' inputs and outputs, flat: sized by the largest bucket's warm-up (static_inputs)
        self.inputs = torch.empty(0, dtype=dtype, device=device)
        self.outputs = torch.empty(0, dtype=dtype, device=device)
        self.pad_slot = pad_slot
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.splits: dict[int, list[tuple]] = {}  # per bucket, per layer: (eager part, its inputs, output)
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
    def capture(self, forward: Forward, show_progress: bool = True, warmed: set[int] | None = None) -> None:
        """Every bucket, the largest first: an eager warm-up (Triton compiles, cuBLAS picks its kernels),
        then the capture of its pieces. A failure inside a capture (a real OOM) ends it cleanly, keeps the
        pieces captured before (teardown() drops them) and propagates. warmed: the buckets an earlier build of
        this process warmed up, whose warm-up is skipped but for the first bucket's (warm_ups_due); the ones
        warmed here are added to it."""
        device = torch.cuda.current_device()
        stream = capture_stream(device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        order, warmed = list(reversed(self.buckets)), set() if warmed is None else warmed
        warm_ups = warm_ups_due(order, warmed)
        for bucket in order:
            torch.cuda.synchronize()  # the static buffers (made or last written on the current stream)
            if bucket in warm_ups:
                with torch.cuda.stream(stream):
                    forward(self.ids[:bucket], self.positions[:bucket], self.meta(bucket))  # warm-up
                warmed.add(bucket)
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

    def split(self, run: Callable, views: tuple[torch.Tensor, ...],
              out_shape: tuple[int, ...]) -> torch.Tensor:
        """Called by a layer in place of its eager part (AttentionMetadata.pieces): `views` (what run reads,
        each [rows, ...]: a tensor of the piece or a view of one, as q, k, v of the packed projection) copied
        into the static inputs; while capturing, the piece ends here and the next begins, and a replay calls
        run(*views[:n] of those copies, meta, out=the static output's first n rows) between the two. Returns
        the static output [rows, *out_shape], which the next piece reads."""
        static, out = self.static_inputs(views, out_shape)
        if self._taking is not None:
            self._end()
            self._splits.append((run, static, out))
            self._begin(torch.cuda.current_device())
        return out

    def static_inputs(self, views: tuple[torch.Tensor, ...], out_shape: tuple[int, ...]
                      ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """views' roots (each contiguous, once) copied one after the other into the static inputs -> (views as
        the same views of the copies, the static output [rows, *out_shape]). Outside a capture the buffers
        grow to fit (the largest bucket's warm-up sizes them); inside one they must fit already."""
        rows = views[0].shape[0]
        roots: dict[int, torch.Tensor] = {}  # by storage: views of one root share its copy
        for t in views:
            root = root_of(t)
            assert t.shape[0] == rows and root.is_contiguous() and root.dtype == self.dtype, (t.shape, rows)
            roots.setdefault(root.untyped_storage().data_ptr(), root)
        starts = [0]
        for r in roots.values():  # each copy 128-byte aligned, as an allocation is (kernels specialize on it)
            starts.append(starts[-1] + -(-r.numel() * r.element_size() // 128) * 128 // r.element_size())
        out_size = rows * math.prod(out_shape)
        if starts[-1] > self.inputs.numel() or out_size > self.outputs.numel():
            assert self._taking is None, "the static buffers grow in a warm-up, never inside a capture"
            self.inputs = torch.empty(max(starts[-1], self.inputs.numel()), dtype=self.dtype,
                                      device=self.device)
            self.outputs = torch.empty(max(out_size, self.outputs.numel()), dtype=self.dtype,
                                       device=self.device)
        copies = {}
        for (key, root), start in zip(roots.items(), starts):
            copy = self.inputs[start:start + root.numel()].view(root.shape)
            copy.copy_(root)
            copies[key] = (root, copy)
        static = tuple(static_view(*copies[t.untyped_storage().data_ptr()], t) for t in views)
        return static, self.outputs[:out_size].view(rows, *out_shape)

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
        for (run, views, out), graph in zip(self.splits[bucket], graphs[1:], strict=True):
            run(*(v[:n] for v in views), meta, out=out[:n])
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
        self.ids = self.positions = self.slots = self.inputs = self.outputs = None
