"""ModelRunner: loads the model once; builds and tears down everything sized from the KV token count
(KV pool, request table, attention-backend state, decode graphs); runs the worst-case stresses and
generation. The profiler drives it: build(probe) -> stress -> teardown -> build(target) -> stress.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence

import torch

from autoprofile import budget
from autoprofile.budget import gib
from autoprofile.config import ServerConfig
from autoprofile.engine.attention import get_backend_class
from autoprofile.engine.attention.base import AttentionMetadata
from autoprofile.engine.cuda_graph import DecodeGraphs, release_cublas_workspaces
from autoprofile.engine.kv_cache import PAD_PAGE, KVCache, PageAllocator, ReqTable
from autoprofile.engine.parallel import TP
from autoprofile.engine.sampling import GREEDY, STRESS, SamplingBatch, SamplingParams, make_generator, sample
from autoprofile.engine.weights import load_weights
from models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
STRESS_DECODE_STEPS = 3


def runner_device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")


class ModelRunner:
    def __init__(self, cfg: ServerConfig, rank: int = 0, world_size: int = 1, group=None):
        self.cfg, self.rank = cfg, rank
        self.device = runner_device(rank)
        self.tp = TP(rank, world_size, group)
        mc = self.model_config = cfg.model_config
        self.dtype, self.kv_dtype = TORCH_DTYPES[cfg.dtype], TORCH_DTYPES[cfg.kv_dtype_name]
        self.num_q_heads, self.num_kv_heads = mc.num_heads // world_size, mc.num_kv_heads // world_size
        self.backend_cls = get_backend_class(cfg.attention_backend)
        self.backend = self.backend_cls(self.num_q_heads, self.num_kv_heads, mc.head_dim, cfg.page_size,
                                        self.dtype, self.device)
        with torch.device(self.device):
            self.model = LlamaForCausalLM(mc, self.backend, self.tp, self.dtype, cfg.context_len)
        load_weights(self.model, mc.checkpoint_files, cfg.seed, show_progress=rank == 0)
        self.weight_bytes = sum(t.nbytes for t in (*self.model.parameters(), *self.model.buffers()))
        self.use_graphs = self.device.type == "cuda" and not cfg.disable_cudagraph
        self.generator = make_generator(cfg.seed, self.device)  # serving draws; stresses use their own
        # built by build(), dropped by teardown()
        self.kv: KVCache | None = None
        self.allocator: PageAllocator | None = None
        self.req_table: ReqTable | None = None
        self.graphs: DecodeGraphs | None = None
        self.built_tokens: int | None = None

    # ------------------------------------------------------------ sizing
    @property
    def sizing(self) -> budget.Sizing:
        mc, cfg, cls = self.model_config, self.cfg, self.backend_cls
        q_heads, head_dim = self.num_q_heads, mc.head_dim
        return budget.Sizing(
            cell_bytes=budget.kv_cell_bytes(mc.num_layers, mc.num_kv_heads, head_dim, cfg.kv_dtype_bytes,
                                            self.tp.size),
            context_len=cfg.context_len, page_size=cfg.page_size,
            running_max_req_size=cfg.running_max_req_size,
            workspace=lambda reqs, longest: cls.workspace_bytes(reqs, longest, q_heads, head_dim))

    @property
    def kv_bytes(self) -> int:
        return self.kv.nbytes if self.kv is not None else 0

    @property
    def kv_buffer(self) -> torch.Tensor | None:
        return self.kv.buffer if self.kv is not None else None

    # ------------------------------------------------------------ build / teardown
    def build(self, kv_tokens: int, checkpoint: Callable[[str], None] | None = None) -> None:
        """KV pool, request table, attention-backend state, decode graphs, in that order.

        kv_tokens is rounded down to whole pages: the KV buffer is exactly kv_tokens * cell_bytes (what
        the budget solved for). Its PAD_PAGE absorbs padded writes, so requests can hold one page less.
        Anything raised tears down what was built before it propagates."""
        checkpoint = checkpoint or (lambda point: None)
        cfg, mc = self.cfg, self.model_config
        if self.kv is not None:
            raise RuntimeError("build() called twice: teardown() first")
        pages = kv_tokens // cfg.page_size
        if pages < 2:
            raise ValueError(f"{kv_tokens} KV tokens is less than two pages of {cfg.page_size} tokens")
        max_reqs = self.sizing.max_reqs(pages * cfg.page_size)
        try:
            checkpoint("kv_alloc")
            self.kv = KVCache(mc.num_layers, pages, self.num_kv_heads, cfg.page_size, mc.head_dim,
                              self.kv_dtype, self.device)
            self.allocator = PageAllocator(pages)
            self.req_table = ReqTable(max_reqs, cfg.context_len, cfg.page_size, self.device)
            self.backend.build(max_reqs, min(cfg.context_len, pages * cfg.page_size))
            if self.use_graphs:
                self.graphs = DecodeGraphs(cfg.graph_max_batch_size, self.req_table.pages_per_req,
                                           cfg.context_len, cfg.page_size, self.device)
                self.graphs.capture(self._decode_logits, lambda: checkpoint("graph_capture"),
                                    show_progress=self.rank == 0)
        except BaseException:
            self.teardown()
            raise
        self.built_tokens = pages * cfg.page_size
        decode = f"{len(self.graphs.sizes)} decode graphs" if self.graphs else "eager decode"
        log.info("built: %d KV tokens (%.2f GiB), %d request slots, %s", self.built_tokens,
                 gib(self.kv_bytes), max_reqs, decode)

    def teardown(self) -> None:
        """Graphs, attention state, request table, KV; idempotent. Weights stay."""
        if self.graphs is not None:
            self.graphs.teardown()
        self.graphs = None
        self.backend.teardown()
        self.req_table = self.allocator = self.kv = None
        self.built_tokens = None
        if self.device.type == "cuda":
            release_cublas_workspaces()

    def _require_built(self) -> None:
        if self.kv is None:
            raise RuntimeError("the engine is not built: call build(kv_tokens) first")

    # ------------------------------------------------------------ forward steps
    def _decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, meta, self.kv.layers))

    def _prefill(self, prompts: Sequence[Sequence[int]], slot_mapping: torch.Tensor) -> torch.Tensor:
        """Logits [len(prompts), vocab] of each prompt's last token; K/V written at slot_mapping."""
        lens = [len(p) for p in prompts]
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(self.device)
        cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        meta = AttentionMetadata(is_prefill=True, slot_mapping=slot_mapping, cu_seqlens=cu.to(self.device),
                                 max_seqlen=max(lens))
        hidden = self.model(ids, positions, meta, self.kv.layers)
        return self.model.compute_logits(hidden[(cu[1:] - 1).to(self.device)])

    def _request_slots(self, slots: torch.Tensor, lens: Sequence[int]) -> torch.Tensor:
        """slot_mapping of tokens 0..len-1 of each request slot (from the request table's pages)."""
        rows = torch.repeat_interleave(slots, torch.tensor(lens, device=self.device))
        pos = torch.cat([torch.arange(n, device=self.device) for n in lens])
        return self._slot_of(rows, pos)

    def _slot_of(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ps = self.cfg.page_size
        return self.req_table.page_table[rows, pos // ps].long() * ps + pos % ps

    def _decode(self, slots: torch.Tensor) -> torch.Tensor:
        """One decode step of the requests in `slots` (inputs: their last_tokens); logits [b, vocab]."""
        rt = self.req_table
        pos = rt.seq_lens[slots].long()
        slot_mapping = self._slot_of(slots, pos)
        seq_lens = (pos + 1).to(torch.int32)
        rt.seq_lens[slots] = seq_lens
        ids, tables = rt.last_tokens[slots].long(), rt.page_table[slots]
        if self.graphs is not None:
            g = self.graphs.max_bs
            if slots.shape[0] <= g:
                return self.graphs.replay(ids, pos, slot_mapping, tables, seq_lens)
            # NOTE: replay returns a view of the graph's static logits: copy before the next replay
            parts = [self.graphs.replay(ids[i:i + g], pos[i:i + g], slot_mapping[i:i + g], tables[i:i + g],
                                        seq_lens[i:i + g]).clone() for i in range(0, slots.shape[0], g)]
            return torch.cat(parts)
        meta = AttentionMetadata(is_prefill=False, slot_mapping=slot_mapping, block_tables=tables,
                                 seq_lens=seq_lens, max_seq_len=self.cfg.context_len)
        return self._decode_logits(ids, pos, meta)

    # ------------------------------------------------------------ request slots
    def _admit(self, total_len: int) -> tuple[int, list[int]]:
        pages = self.allocator.alloc(math.ceil(total_len / self.cfg.page_size))
        try:
            return self.req_table.alloc(pages), pages
        except BaseException:
            self.allocator.free(pages)
            raise

    def _release(self, held: Sequence[tuple[int, list[int]]]) -> None:
        for slot, pages in held:
            self.req_table.free(slot)
            self.allocator.free(pages)

    # ------------------------------------------------------------ worst-case stresses
    def stress_prefill(self) -> None:
        """(a) one request of min(batch_max_tokens, context_len) tokens; (b) graph_max_batch_size requests
        sharing batch_max_tokens tokens. Every last token sampled with temperature + top-k + top-p."""
        self._require_built()
        cfg = self.cfg
        gen = make_generator(cfg.seed + 1, self.device)
        n = min(cfg.graph_max_batch_size, cfg.batch_max_tokens)
        share, extra = divmod(cfg.batch_max_tokens, n)
        batches = [[min(cfg.batch_max_tokens, cfg.context_len)],
                   [min(share + (i < extra), cfg.context_len) for i in range(n)]]
        for lens in batches:
            # The requests' K/V only need somewhere to go: one run of pages, token-granular, no per-request
            # page rounding, PAD_PAGE included (scratch by definition): batch_max_tokens fit in as many.
            held = self.allocator.alloc(math.ceil(sum(lens) / cfg.page_size) - 1)
            try:
                page_ids = torch.tensor([PAD_PAGE, *held], dtype=torch.int64, device=self.device)
                tok = torch.arange(sum(lens), device=self.device)
                slot_mapping = page_ids[tok // cfg.page_size] * cfg.page_size + tok % cfg.page_size
                ids = torch.randint(0, self.model_config.vocab_size, (sum(lens),), generator=gen,
                                    device=self.device).tolist()
                prompts, start = [], 0
                for length in lens:
                    prompts.append(ids[start:start + length])
                    start += length
                logits = self._prefill(prompts, slot_mapping)
                sample(logits, SamplingBatch.from_params([STRESS] * len(lens), self.device), gen)
                self._sync()
            finally:
                self.allocator.free(held)

    def stress_decode(self) -> None:
        """graph_max_batch_size requests, each as long as the cache allows (capped at context_len), run
        STRESS_DECODE_STEPS decode steps (through the graphs when captured), sampled. K/V contents are
        whatever the cache holds: no prefill is needed to exercise the memory."""
        self._require_built()
        cfg, ps = self.cfg, self.cfg.page_size
        gen = make_generator(cfg.seed + 2, self.device)
        n = cfg.graph_max_batch_size
        pages_each = min(self.allocator.num_free // n, self.req_table.pages_per_req)
        if pages_each < 1:
            raise RuntimeError(f"a cache of {self.built_tokens} tokens cannot give each of the {n} decode "
                               f"requests a page: build with >= {n * ps} tokens")
        total = min(pages_each * ps, cfg.context_len)
        steps = min(STRESS_DECODE_STEPS, total - 1)
        held = []
        try:
            for _ in range(n):
                held.append(self._admit(total))
            slots = torch.tensor([s for s, _ in held], dtype=torch.int64, device=self.device)
            self.req_table.seq_lens[slots] = total - steps
            self.req_table.last_tokens[slots] = torch.randint(0, self.model_config.vocab_size, (n,),
                                                              generator=gen, device=self.device,
                                                              dtype=torch.int32)
            batch = SamplingBatch.from_params([STRESS] * n, self.device)
            for _ in range(steps):
                self.req_table.last_tokens[slots] = sample(self._decode(slots), batch, gen).to(torch.int32)
            self._sync()
        finally:
            self._release(held)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 sampling: SamplingParams | Sequence[SamplingParams] = GREEDY) -> list[list[int]]:
        """max_new_tokens tokens per prompt (no stop tokens). Requests run in waves of what the cache
        and the request table hold; each prefill batch holds at most batch_max_tokens tokens."""
        self._require_built()
        cfg = self.cfg
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        vocab = self.model_config.vocab_size
        for p in prompts:
            if any(not 0 <= t < vocab for t in p):
                raise ValueError(f"token ids must be in [0, {vocab}), got {min(p)}..{max(p)}")
            if not 1 <= len(p) <= cfg.batch_max_tokens or len(p) + max_new_tokens > cfg.context_len:
                raise ValueError(f"a prompt of {len(p)} tokens + {max_new_tokens} new tokens does not fit: "
                                 f"prompts need 1..{cfg.batch_max_tokens} tokens (--batch_max_tokens) and "
                                 f"prompt + output <= {cfg.context_len} (--max_req_total_len)")
        if max_new_tokens < 1:
            return [[] for _ in prompts]
        # NOTE: the current CUDA device is per thread (a server may call from a worker thread); Triton
        # launches on the current device's stream
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            return self._generate(prompts, max_new_tokens, params)

    def _generate(self, prompts: list[list[int]], max_new_tokens: int,
                  params: list[SamplingParams]) -> list[list[int]]:
        out: list[list[int]] = []
        todo = list(range(len(prompts)))
        while todo:
            wave = self._admit_wave([len(prompts[i]) + max_new_tokens for i in todo])
            if not wave:
                need = len(prompts[todo[0]]) + max_new_tokens
                raise RuntimeError(f"one request of {need} tokens does not fit "
                                   f"in the KV cache of {self.built_tokens} tokens")
            try:
                idx = todo[: len(wave)]
                out += self._run_wave(wave, [prompts[i] for i in idx], [params[i] for i in idx],
                                      max_new_tokens)
            finally:
                self._release(wave)
            todo = todo[len(wave):]
        return out

    def _admit_wave(self, totals: list[int]) -> list[tuple[int, list[int]]]:
        """Admit requests in order while pages and slots last (all pages reserved up front)."""
        held, ps = [], self.cfg.page_size
        for total in totals:
            if self.allocator.num_free < math.ceil(total / ps) or self.req_table.num_free == 0:
                break
            held.append(self._admit(total))
        return held

    def _run_wave(self, held: list[tuple[int, list[int]]], prompts: list[list[int]],
                  params: list[SamplingParams], max_new_tokens: int) -> list[list[int]]:
        batch = SamplingBatch.from_params(params, self.device)
        slots = torch.tensor([s for s, _ in held], dtype=torch.int64, device=self.device)
        rt = self.req_table
        for lo, hi in self._prefill_chunks([len(p) for p in prompts]):
            lens = [len(p) for p in prompts[lo:hi]]
            logits = self._prefill(prompts[lo:hi], self._request_slots(slots[lo:hi], lens))
            rt.seq_lens[slots[lo:hi]] = torch.tensor(lens, dtype=torch.int32, device=self.device)
            rt.last_tokens[slots[lo:hi]] = sample(logits, batch.rows(lo, hi), self.generator).to(torch.int32)
        steps = [rt.last_tokens[slots].clone()]
        for _ in range(max_new_tokens - 1):
            rt.last_tokens[slots] = sample(self._decode(slots), batch, self.generator).to(torch.int32)
            steps.append(rt.last_tokens[slots].clone())
        return torch.stack(steps, dim=1).tolist()

    def _prefill_chunks(self, lens: list[int]) -> list[tuple[int, int]]:
        """Consecutive [lo, hi) ranges of at most batch_max_tokens tokens and graph_max_batch_size
        requests each: the worst case stress_prefill measured, never more."""
        chunks, lo, used = [], 0, 0
        for i, n in enumerate(lens):
            full = used + n > self.cfg.batch_max_tokens or i - lo >= self.cfg.graph_max_batch_size
            if full and i > lo:
                chunks.append((lo, i))
                lo, used = i, 0
            used += n
        chunks.append((lo, len(lens)))
        return chunks
