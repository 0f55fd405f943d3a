"""ModelRunner: loads the model once; builds and tears down everything sized from the KV token count
(KV pool, request table, attention-backend state, decode graphs, the envelope); executes the steps the
scheduler builds (`execute`), refusing any step outside the envelope; runs the stress corners through
the same `execute`. The profiler drives it: build(probe) -> stress -> teardown -> build(target) -> stress.

Above the house's 500 lines on purpose: the runner is the one owner of the model's GPU state. Logits to tokens
(grammar mask, logits processors, logprobs, the sample) is one call to the Sampler (engine.sampler); the step
inputs live in step_inputs.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import itertools
import logging
import math
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from autoprofile import budget
from autoprofile.budget import gib
from autoprofile.config import (ConfigError, ServerConfig, not_invariant_on_gpu, piecewise_max_tokens,
                                weights_source)
from autoprofile.engine.attention import get_backend_class
from autoprofile.layers import gdn
from autoprofile.layers.attention import AttentionMetadata
from autoprofile.engine.cuda_graph import DecodeGraphs, dry_capture, release_cublas_workspaces
from autoprofile.engine.grammar import TokenBitmask
from autoprofile.engine.envelope import Envelope, StepShape, VisionLimits
from autoprofile.engine.host_kv import host_tier
from autoprofile.engine.kv_cache import PAD_PAGE, KV_SCALE_TEXT, KVCache, ReqTable, kv_scale_source, to_device
from autoprofile.layers.parallel import TP
from autoprofile.engine import stress
from autoprofile.engine.logprobs import PromptLogprobs
from autoprofile.engine.sampler import (NO_TOKENS, SampledTokens, Sampler, SamplerOutput, SamplingMetadata,
                                        StepTokens)
from autoprofile.engine.sampling import make_generator
from autoprofile.engine.multimodal import ImageInput
from autoprofile.engine.piecewise import PiecewiseGraphs, splits_pieces
from autoprofile.engine.scheduler import Step, StepRow
from autoprofile.engine.state_cache import StateCache, layer_caches
from autoprofile.engine.step_clock import StepClock
from autoprofile.engine.step_inputs import Staging, prefill_inputs, upload
from autoprofile.engine.weights import load_weights
from autoprofile.kernels import compile_ahead
from autoprofile.layers.quant import fp8_capability_problem
from models import model_class

log = logging.getLogger(__name__)


TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "fp8_e4m3": torch.float8_e4m3fn}


def keep_scratch(mc, device: torch.device) -> None:
    """The kernels' scratch kept for the process, made by a build before its graphs: FP8 linear layers' split
    skinny GEMM tile counters (256 KiB). Its first launch would make them, and that launch is inside a
    capture (the decode graphs' dry one in a boot, or a graph that no warm-up precedes:
    DecodeGraphs.capture), where they may not be made (the dry capture failed on qwen3.5-35b-a3b-fp8's
    cold boots, its compiles one by one)."""
    if mc.quant is not None:
        from autoprofile.kernels import triton_fp8_skinny
        triton_fp8_skinny.tile_counters(device)


def runner_device(rank: int, device: str = "cuda") -> torch.device:
    """This rank's GPU: LOCAL_RANK (its index on its host, set by the launcher, as torchrun does), else rank."""
    local = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local) if device == "cuda" and torch.cuda.is_available() else torch.device("cpu")


class ModelRunner:
    overlaps = True  # engine.step_runner.StepRunner: launch() returns before the GPU is done

    def __init__(self, cfg: ServerConfig, rank: int = 0, world_size: int = 1, group=None):
        self.cfg, self.rank = cfg, rank
        self.boot_steps: list[tuple[str, float]] = []  # (graphs / stress prefill / stress decode, seconds)
        self.warmed_pieces: set[int] = set()  # piecewise buckets warmed up by a build (piecewise)
        self.device = runner_device(rank, cfg.device)
        self.tp = TP(rank, world_size, group)
        mc = self.model_config = cfg.model_config
        self.dtype, self.kv_cache_dtype = TORCH_DTYPES[cfg.dtype], TORCH_DTYPES[cfg.kv_dtype_name]
        self.num_q_heads, self.num_kv_heads = mc.num_heads // world_size, mc.num_kv_heads // world_size
        self.cache_heads, self.cache_width = budget.cache_shape(mc, world_size)
        self.backend_cls = get_backend_class(cfg.attention_backend)
        if cfg.deterministic and self.device.type == "cuda" and not self.backend_cls.batch_invariant_on_gpu:
            raise ConfigError("deterministic", not_invariant_on_gpu(self.backend_cls.name))
        if mc.quant is not None and self.device.type == "cuda":  # before any allocation
            flag = "quantization" if mc.quant_method == "runtime" else "model"
            problem = fp8_capability_problem(torch.cuda.get_device_capability(self.device), f"--{flag}")
            if problem:
                raise ConfigError(flag, problem)
        # the prefix cache's host tier (--host_kv): sized and pinned before any GPU allocation; kept through
        # teardown (a page's layout does not depend on the KV size); the host's memory is split over this
        # host's ranks (--tp / --nnodes)
        self.host_kv = host_tier(cfg, world_size // cfg.nnodes, self.cache_heads, self.cache_width,
                                 self.kv_cache_dtype, pin=self.device.type == "cuda")
        self.backend = self.backend_cls(self.num_q_heads, self.num_kv_heads, mc.head_dim, cfg.page_size,
                                        self.dtype, self.device, deterministic=cfg.deterministic)
        # every linear layer's GEMM (--deterministic: batch-invariant, and so is the all-reduce:
        # layers.parallel.TP)
        self.tp.matmul, self.tp.ordered_reduce = self.backend.gemm, cfg.deterministic
        self.tp.fp8_matmul, self.tp.router_matmul = self.backend.fp8_gemm, self.backend.router_gemm
        self.tp.matmul_add = self.backend.gemm_add
        self.tp.add_in_gemm = not cfg.deterministic  # residual adds in cuBLAS's epilogue (TP.linear_add)
        self.is_vl = mc.vision is not None  # a vision-language model: images in, M-RoPE positions
        with torch.device(self.device):
            self.model = model_class(mc)(mc, self.backend, self.tp, self.dtype, cfg.context_len)
        if rank == 0:
            log.info("weights: %s", weights_source(cfg))
        self.checkpoint_kv_scales = load_weights(self.model, cfg.checkpoint_files, cfg.seed,
                                                 show_progress=rank == 0)
        self.kv_scale_source = kv_scale_source(cfg.kv_dtype_name, cfg.kv_scales,
                                               self.checkpoint_kv_scales is not None)
        if self.kv_scale_source is not None and rank == 0:
            log.info("FP8 KV cache: per-layer K/V scales from %s", KV_SCALE_TEXT[self.kv_scale_source])
        self.kv_scales_pending = False  # first_batch: set by build, cleared by the first real prefill
        self.stressing = False
        self.clock = StepClock(self.device)  # where serving's time goes (the engine resets it at its start)
        self.weight_bytes = sum(t.nbytes for t in (*self.model.parameters(), *self.model.buffers()))
        visual = getattr(self.model, "visual", None)
        self.vision_weight_bytes = sum(t.nbytes for t in visual.parameters()) if visual is not None else 0
        self.routing = self.model.model.routing  # an MoE model's: each step sets it (the stress forces it)
        # NOTE: a backend whose experts sync with the host (the torch reference) decodes an MoE model eagerly
        self.use_graphs = (self.device.type == "cuda" and not cfg.disable_cudagraph
                           and (not mc.num_experts or self.backend.moe_capturable))
        # max_seq_len of decode steps (eager and graphs)
        self.buckets = budget.decode_buckets(cfg.context_len)
        self.generator = make_generator(cfg.seed, self.device)  # serving draws; stresses use their own
        # built by build(), dropped by teardown()
        self.kv: KVCache | None = None
        self.state: StateCache | None = None  # a hybrid model's state slots (beside the KV)
        self.caches: list | None = None  # one per model layer: its KVLayer, or a hybrid's StateLayer
        self.envelope: Envelope | None = None
        self.req_table: ReqTable | None = None
        self.sampler: Sampler | None = None  # logits to tokens, with structured output's per-row token mask
        self.graphs: DecodeGraphs | None = None
        self.pieces: PiecewiseGraphs | None = None  # small prefill and mixed steps (engine.piecewise)
        # [encoder_images, image_tokens, hidden]: images awaiting prefill
        self.mm_buffer: torch.Tensor | None = None
        self.built_tokens: int | None = None
        self.step_log: list[StepShape] | None = None  # tests: set to a list to record every step's shape
        self.staging = Staging() if self.device.type == "cuda" else None  # pinned buffers of step inputs
        self._loads: dict[int, torch.cuda.Event] = {}  # the host tier's loads in flight, by load id

    # ------------------------------------------------------------ sizing
    def cut_context(self, cfg: ServerConfig) -> None:
        """Serve cfg's shorter --max_req_total_len (config.with_context_cut) from the next build on; the
        model's rope table keeps the longer length it was loaded with."""
        if self.kv is not None:
            raise RuntimeError("cut_context() on a built runner: teardown() first")
        if cfg.context_len > self.cfg.context_len:
            raise ValueError(f"a context cut only shortens requests: {cfg.context_len} > "
                             f"{self.cfg.context_len}")
        self.cfg = cfg
        self.buckets = budget.decode_buckets(cfg.context_len)

    def envelope_for(self, kv_pages: int) -> Envelope:
        cfg = self.cfg
        return Envelope.build(kv_pages=kv_pages, page_size=cfg.page_size, context_len=cfg.context_len,
                              batch_max_tokens=cfg.batch_max_tokens,
                              running_max_req_size=cfg.running_max_req_size,
                              graph_max_batch_size=cfg.graph_max_batch_size, use_graphs=self.use_graphs,
                              vision=self.vision_limits,
                              piecewise_tokens=self.piecewise_tokens if self.piecewise_ok else 0)

    @property
    def vision_limits(self) -> VisionLimits | None:
        cfg = self.cfg
        return VisionLimits(cfg.visual_batch_size, cfg.min_image_pixels, cfg.max_image_pixels,
                            cfg.max_images_per_request) if self.is_vl else None

    @property
    def sizing(self) -> budget.Sizing:
        mc, cfg, cls = self.model_config, self.cfg, self.backend_cls
        q_heads, head_dim = self.num_q_heads, mc.head_dim
        env = self.envelope_for(kv_pages=2)  # the rows do not depend on the cache size
        return budget.Sizing(
            cell_bytes=budget.cell_bytes_for(mc, cfg.kv_dtype_bytes, self.tp.size),
            context_len=cfg.context_len, page_size=cfg.page_size,
            running_reqs=env.running_reqs, decode_rows=env.decode_rows,
            workspace=lambda rows, longest: cls.workspace_bytes(rows, longest, q_heads, head_dim),
            max_tokens=self.max_cache_tokens,
            state=budget.state_cache_bytes(mc, env.running_reqs, self.dtype.itemsize, self.tp.size,
                                           self.state_checkpoints(env)) if mc.is_hybrid else (0, 0))

    @property
    def max_cache_tokens(self) -> int:
        """The most KV tokens this backend's kernels address in one layer's view
        (budget.max_indexable_tokens)."""
        wide = budget.wide_offsets(self.backend_cls.name, self.cfg.deterministic)
        return budget.max_indexable_tokens(self.cache_heads, self.cache_width, self.cfg.page_size, wide)

    def state_checkpoints(self, env: Envelope) -> int:
        """A hybrid model's state checkpoint rows (its prefix cache's resumable points; none without it)."""
        return budget.state_checkpoints(env.running_reqs, not self.cfg.disable_prefix_caching,
                                        self.cfg.state_checkpoints)

    def fingerprint(self) -> dict | None:
        """What a probe's measurement depends on besides the code, model and flags
        (autoprofile.profile_cache):
        the GPU and the versions of what runs on it. None on CPU (no cache)."""
        if self.device.type != "cuda":
            return None
        props = torch.cuda.get_device_properties(self.device)
        out = {"gpu": props.name, "total_memory": props.total_memory,
               "capability": [props.major, props.minor],
               "sms": props.multi_processor_count, "torch": torch.__version__, "cuda": torch.version.cuda,
               "hip": torch.version.hip}
        for package in ("triton", "amd-aiter"):
            try:
                out[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                out[package] = None
        return out

    @property
    def kv_bytes(self) -> int:
        return self.kv.nbytes if self.kv is not None else 0

    @property
    def kv_buffer(self) -> torch.Tensor | None:
        return self.kv.buffer if self.kv is not None else None

    # ------------------------------------------------------------ build / teardown
    def build(self, kv_tokens: int, checkpoint: Callable[[str], None] | None = None) -> None:
        """KV pool, envelope, request table, attention-backend state, decode graphs, in that order.

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
        if kv_tokens > self.max_cache_tokens:  # config's check of a pin assumed "auto" is aiter_triton
            raise ConfigError("max_total_token_num",
                              f"{kv_tokens} KV tokens is past what the {self.backend_cls.name} backend's "
                              f"kernels address in one layer's cache; try --max_total_token_num "
                              f"{self.max_cache_tokens}")
        env = self.envelope_for(pages)
        try:
            checkpoint("kv_alloc")
            self.kv = KVCache(mc.attention_layers, pages, self.cache_heads, cfg.page_size, self.cache_width,
                              self.kv_cache_dtype, self.device, latent=mc.is_mla)
            self.caches = self.kv.layers
            if mc.is_hybrid:
                self.state = StateCache(mc, env.running_reqs, self.tp.size, self.dtype, self.device,
                                        self.state_checkpoints(env))
                self.caches = layer_caches(mc, self.kv.layers, self.state.layers)
            self.kv.set_scales(self.checkpoint_kv_scales if self.kv_scale_source == "checkpoint" else None)
            self.kv_scales_pending = self.kv_scale_source == "first_batch"
            self.envelope = env
            self.req_table = ReqTable(env.running_reqs, cfg.context_len, cfg.page_size, self.device)
            self.sampler = Sampler(TokenBitmask(env.sampled_rows, mc.vocab_size, self.device), self.generator,
                                   self.req_table.last_tokens, self.staging)
            if env.encoder_images:
                self.mm_buffer = torch.empty(env.encoder_images, env.image_tokens, mc.hidden_size,
                                             dtype=self.dtype,
                                             device=self.device)
            self.backend.build(env.decode_rows, min(cfg.context_len, pages * cfg.page_size), env.graph_rows)
            if self.device.type == "cuda":
                keep_scratch(mc, self.device)
            ahead = compile_ahead.active()
            if (ahead is not None and self.dry_prefill_ok and ahead.once("prefill corners")
                    and not ahead.cache_warm()):
                ahead.dry(self._prefill_dry)
            if env.graph_rows:
                self.graphs = DecodeGraphs(env.graph_rows, self.req_table, cfg.context_len,
                                           rope_delta=self.is_vl,
                                           state_pad=self.state.pad if self.state is not None else None)
                t0 = time.perf_counter()
                self.graphs.capture(self._decode_logits, lambda: checkpoint("graph_capture"),
                                    show_progress=self.rank == 0)
                self.boot_steps.append(("graphs", time.perf_counter() - t0))
            if self.piecewise_ok:  # (decode graphs too: piecewise_ok needs use_graphs)
                t0 = time.perf_counter()
                self.pieces = self._piecewise_graphs()
                self.pieces.capture(self._hidden, show_progress=self.rank == 0, warmed=self.warmed_pieces)
                self.boot_steps.append(("pieces", time.perf_counter() - t0))
            self.backend.seal()
        except BaseException:
            self.teardown()
            raise
        self.built_tokens = pages * cfg.page_size
        decode = f"{len(self.graphs.graphs)} decode graphs" if self.graphs else "eager decode"
        if self.pieces is not None:
            decode += f", piecewise prefill graphs up to {self.pieces.max_tokens} tokens"
        state = ("" if self.state is None else f" with their state and {self.state.checkpoints} state "
                 f"checkpoints ({gib(self.state.nbytes):.2f} GiB; {gib(self.state.checkpoint_bytes()):.2f} GiB "
                 "the checkpoints)")
        log.info("built: %d KV tokens (%.2f GiB), %d request slots%s, %s", self.built_tokens,
                 gib(self.kv_bytes), env.running_reqs, state, decode)

    def forget_warm_ups(self) -> None:
        """The next build warms up every piecewise bucket again (piecewise.warm_ups_due; the decode graphs
        warm their first graph in every build). The profiler calls it on every rank after an attempt failed
        anywhere: a capture cut short leaves a rank's warm-ups partial, and under --tp one rank's extra eager
        warm-up would all-reduce with none on the others."""
        self.warmed_pieces.clear()

    def teardown(self) -> None:
        """Graphs, attention state, request table, KV; idempotent. Weights stay (and the host tier's pool).
        Host tier loads still writing into the KV pages are waited for first: the allocator only knows the
        compute stream's use of the pages."""
        for event in self._loads.values():
            event.synchronize()
        self._loads.clear()
        if self.pieces is not None:
            self.pieces.teardown()
        self.pieces = None
        if self.graphs is not None:
            self.graphs.teardown()
        self.graphs = None
        self.backend.teardown()
        self.req_table = self.kv = self.envelope = self.mm_buffer = self.sampler = None
        self.state = self.caches = None
        self.built_tokens = None
        if self.device.type == "cuda":
            release_cublas_workspaces()

    def _require_built(self) -> None:
        if self.kv is None:
            raise RuntimeError("the engine is not built: call build(kv_tokens) first")

    # ------------------------------------------------------------ one step
    def execute(self, step: Step) -> SampledTokens:
        """Run one step the scheduler (or a stress corner) built; return the sampled token of every
        row with `sample`, in row order, and their logprobs. A step outside the envelope raises EnvelopeError,
        unrun."""
        return self.launch(step).result()

    def launch(self, step: Step) -> StepTokens:
        """execute() without the wait: enqueue the step's GPU work (nothing in it waits for the GPU) and
        return its tokens in flight. A decode row's PENDING id is the token its request's slot sampled last,
        fed on the device (ReqTable.feed): the step before may still be running. A step with grammar rows
        (engine.engine.has_grammar) enqueues its forward only: its sample waits for StepTokens.sample(), which
        the overlapped engine calls once the step before is read back and the matchers hold its tokens (the
        mask is filled on the host while the GPU runs this forward)."""
        self._require_built()
        shape = step.shape(self.envelope.graph_rows)
        self.envelope.check(shape)
        if self.step_log is not None:
            self.step_log.append(shape)
        with self._on_device():
            if not step.all_rows:  # the host tier's copies and the page writes of requests loading
                self._copy_pages(step)
                self.req_table.write(step.page_writes)
                return StepTokens(SamplerOutput(NO_TOKENS))
            self.clock.begin("prefill" if step.is_prefill else "decode",
                             sum(len(r.ids) for r in step.rows) + len(step.decode))
            self._copy_pages(step)
            self.req_table.write(step.page_writes)
            self.routing.set(step.routing)
            if self.state is not None:  # requests resuming a cached prefix start from its checkpoint
                self.state.load(step.state_loads)
            if step.encode:
                self._encode(step.encode)
            calibrate = self._calibrates(step)
            self.backend.calibrating = calibrate
            try:
                logits, sample_slots, prompt = (self._prefill(step.rows, step.decode) if step.is_prefill
                                                else (*self._decode(step.rows), None))
            finally:
                self.backend.calibrating = False
            if self.state is not None:  # chunks that end at a checkpoint stop: their state, for the cache
                self.state.save(step.state_saves)
            if calibrate and not self.stressing:
                self.kv_scales_pending = False
                k, v = self.kv.scales.unbind(1)
                log.info("FP8 KV scales set from the first batch (%d tokens): k %.3g..%.3g, v %.3g..%.3g",
                         sum(len(r.ids) for r in step.rows), k.min(), k.max(), v.min(), v.max())
            rows = [r for r in step.all_rows if r.sample]
            if not rows:
                self.clock.ended()
                return StepTokens(SamplerOutput(NO_TOKENS, prompt_logprobs=prompt))
            meta = SamplingMetadata.from_rows(rows, self.stressing)
            sample = functools.partial(self._sample, logits, meta, rows, sample_slots, prompt)
            return StepTokens(sample=sample) if meta.grammars else StepTokens(sample())

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata, rows: list[StepRow],
                sample_slots: torch.Tensor, prompt: PromptLogprobs | None) -> SamplerOutput:
        """A launched forward's sample: the grammar mask (of the rows still running), processors, sampler;
        the tokens recorded in the request table, where the next step's PENDING ids read them."""
        with self._on_device():
            out = self.sampler(logits, meta.running(rows), prompt)
            self.req_table.record(sample_slots, out.tokens)
            self.clock.ended()
            return out

    def _on_device(self) -> contextlib.AbstractContextManager:
        # NOTE: the current CUDA device is per thread (the server's engine thread); Triton launches on it
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _copy_pages(self, step: Step) -> None:
        """The host tier's copies of a step: the forward waits for the loads it may read (kv_ready: done on
        rank 0, which polled them; a worker's own may still run) and for the saves, never for the loads it
        issues (their event, polled through loads_ready)."""
        compute = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for load_id in step.kv_ready:
            event = self._loads.pop(load_id, None)
            if event is not None:
                compute.wait_event(event)
        if step.kv_saves or step.kv_loads:
            event = self.host_kv.transfer(self.kv.buffer, step.kv_saves, step.kv_loads)
            if event is not None:
                self._loads[step.kv_load_id] = event

    def wait_load(self, load_id: int) -> None:
        """Until this host tier load has landed (its event; an id this rank never issued is done)."""
        event = self._loads.get(load_id)
        if event is not None:
            event.synchronize()

    def loads_ready(self, ids: list[int]) -> set[int]:
        """Which of these host tier loads have landed (an event query each, never a wait); an id this rank
        never issued (its step failed before the copies) is done."""
        return {i for i in ids if i not in self._loads or self._loads[i].query()}

    def _calibrates(self, step: Step) -> bool:
        """Whether this step sets an FP8 cache's scales from its own K/V (--kv_scales first_batch): the first
        real prefill does (the first step ever is a prefill of fresh rows). The stress calibrates at its
        corners of fresh rows (start 0), as that batch's rows are, so the profile measures that path (the
        torch RoPE ops: more temporaries than the fused kernel); _stress then resets the scales."""
        return (self.kv_scales_pending and step.is_prefill
                and (not self.stressing or all(r.start == 0 for r in step.rows)))

    @property
    def dry_prefill_ok(self) -> bool:
        """Whether a boot's first build runs the prefill corners' forwards dry (_prefill_dry): on one CUDA
        GPU, without images or a hybrid's linear layers (their inputs' host work: image embeddings, state
        resets)."""
        return (self.device.type == "cuda" and self.tp.size == 1 and not self.is_vl and self.state is None)

    @property
    def piecewise_ok(self) -> bool:
        """Whether small prefill and mixed steps replay piecewise graphs (engine.piecewise): where the
        configuration allows them (config.piecewise_max_tokens: decode graphs, one rank, aiter_triton, not
        --deterministic, no images or MLA layers), every layer's attention or linear attention splits the
        pieces (piecewise.splits_pieces: LlamaAttention, Qwen3.5's gated attention and Gated DeltaNet; dense
        or MoE: the fused experts' sizes follow the bucket, the routing is a device tensor; bf16 or FP8
        weights and cache) and the backend's RoPE kernel runs (aiter_triton's)."""
        return (self.use_graphs and self.piecewise_tokens > 0 and splits_pieces(self.model)
                and getattr(self.backend, "triton_rope", None) is not None)

    @property
    def piecewise_tokens(self) -> int:
        """The piecewise graphs' largest bucket as the configuration allows it (0: none; no step has more
        tokens than --batch_max_tokens)."""
        return piecewise_max_tokens(self.cfg, self.backend.name)

    def _piecewise_graphs(self) -> PiecewiseGraphs:
        return PiecewiseGraphs(self.piecewise_tokens, self.dtype, self.device, PAD_PAGE * self.cfg.page_size)

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor:
        return self.model(input_ids, positions, meta, self.caches)

    def _decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.compute_logits(self._hidden(input_ids, positions, meta), out)

    def _prefill(self, rows: list[StepRow], decode: list[StepRow] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, PromptLogprobs | None]:
        """Logits [sampled rows, vocab] of each sampled row's last token, those rows' request slots and the
        prompt logprobs the rows ask for (None: none); K/V written to the rows' pages.
        Rows with a cached prefix (start > 0) attend to it through the cache (AttentionMetadata.kv_slots).
        A mixed step's decode rows follow the prefill tokens in the same forward (meta.decode: the paged
        decode kernel, eager, at the smallest bucket that holds its longest row); all of them are sampled."""
        ids, positions, meta, host, parts = self._prefill_inputs(rows, decode)
        lens, decode = host["lens"], decode or []
        self.clock.launched()
        if self.is_vl:
            rope = to_device(torch.cat([self._mrope(r) for r in rows + decode], dim=1), self.device)
            hidden = self.model(ids, rope, meta, self.caches,
                                *self._image_embeds(rows + decode, lens.tolist() + [1] * len(decode)))
        elif (self.pieces is not None and ids.shape[0] <= self.pieces.max_tokens
              and not self.backend.calibrating):
            hidden = self.pieces.forward(ids, positions, meta)
        else:
            hidden = self.model(ids, positions, meta, self.caches)
        prompt = self.sampler.prompt_logprobs(rows, hidden, host["cu"], self.model.compute_logits)
        return self.model.compute_logits(hidden[parts["last"]]), parts["sample_slots"], prompt

    def _prefill_inputs(self, rows: list[StepRow], decode: list[StepRow] | None = None) -> tuple:
        """A prefill (or mixed) step's forward inputs on the device: (ids, positions, metadata, the host
        arrays, their device views); a hybrid's fresh rows' state reset."""
        dev, decode = self.device, decode or []
        host = prefill_inputs(rows, decode, with_keys=not self.backend.paged_prefill)
        if self.state is not None:  # a hybrid's linear layers: fla's chunk indices from the host's cu
            host["gdn_chunks"] = gdn.chunk_indices(host["cu"]).reshape(-1)
        parts = upload(host, dev, self.staging)  # one host-to-device copy of every index the step needs
        n, lens = int(host["cu"][-1]), host["lens"]
        positions = parts["positions"]
        meta = AttentionMetadata(is_prefill=True, cu_seqlens=parts["cu"].to(torch.int32),
                                 max_seqlen=int(lens.max()),
                                 slot_mapping=self._slot_of(parts["token_rows"], positions[:n]))
        if self.backend.paged_prefill:  # every key from the cache: the rows' pages and lengths
            cols = math.ceil(int(host["kv_lens"].max()) / self.cfg.page_size)
            meta.block_tables = self.req_table.page_table[parts["slots"], :cols]
            meta.seq_lens = parts["kv_lens"].to(torch.int32)
        elif "kv_rows" in parts:  # a cached prefix or an earlier chunk: gather its keys from the cache
            meta.kv_slots = self._slot_of(parts["kv_rows"], parts["kv_pos"])
            meta.cu_seqlens_k = parts["cu_k"].to(torch.int32)
            meta.max_seqlen_k = int(host["kv_lens"].max())
        if decode:
            meta.decode = self._decode_meta(positions[n:], parts["decode_slots"],
                                            int(host["positions"][n:].max()) + 1)
            meta.slot_mapping = torch.cat([meta.slot_mapping, meta.decode.slot_mapping])
        if self.state is not None:  # rows go on from their slot's state; a request's first chunk from zeros
            meta.state_slots = parts["slots"]
            meta.gdn_chunk_indices = parts["gdn_chunks"].view(-1, 2)
            fresh = torch.tensor([r.slot for r in rows if r.start == 0], dtype=torch.int64)
            self.state.reset(to_device(fresh, dev))
        ids = parts["ids"]
        if decode:
            ids = torch.cat([ids[:n], self.req_table.feed(ids[n:], parts["decode_slots"])])
        return ids, positions, meta, host, parts

    def _prefill_dry(self) -> None:
        """The stress's prefill corners' forwards, dry (kernels.compile_ahead): their inputs made for real,
        the forwards inside one capture that is dropped (cuda_graph.dry_capture), so that their Triton kernels
        (the prefill attention's launch configs, the prefix's K/V gather) compile in the pool while the decode
        graphs capture, not at the corners (a cold llama-3.1-8b probe waited 2 s there, H200). Each shape once
        (the forced routings' corners repeat the model's); its pool and cached blocks given back."""
        steps = [self._prefill_inputs(s.rows, s.decode)[:3] for s in self.corners(stress.prefill_steps)
                 if s.routing == "model"]

        def forwards() -> None:
            for ids, positions, meta in steps:
                self.model(ids, positions, meta, self.caches)
        with self._on_device():
            dry_capture(torch.cuda.current_device(), forwards)
        del steps
        torch.cuda.empty_cache()

    def _decode_meta(self, pos: torch.Tensor, slots: torch.Tensor, longest: int) -> AttentionMetadata:
        """Eager decode metadata of rows at positions `pos` of request slots `slots` (on the device), at the
        smallest max_seq_len bucket that holds `longest` tokens."""
        bucket = budget.decode_bucket(self.buckets, longest)
        cols = math.ceil(bucket / self.cfg.page_size)
        tables, slot_mapping, seq_lens = self.req_table.decode_metadata(pos, slots, cols)
        return AttentionMetadata(is_prefill=False, slot_mapping=slot_mapping, block_tables=tables,
                                 seq_lens=seq_lens, max_seq_len=bucket,
                                 state_slots=slots if self.state is not None else None)

    # ------------------------------------------------------------ images
    def _encode(self, encode: list[tuple[int, ImageInput]]) -> None:
        """Run the vision encoder on a step's new images (one call) into their encoder buffer slots. Stress
        images carry no pixels: random patches of their grid (the encoder's memory follows the shape).
        --deterministic: one call per image (its GEMMs and attention at that image's shapes alone, whatever
        else the step encodes); never more memory than the step's images together."""
        if self.cfg.deterministic and len(encode) > 1:
            for one in encode:
                self._encode([one])
            return
        dev, vis = self.device, self.model_config.vision
        pixels = [im.pixel_values if im.pixel_values is not None else
                  torch.randn(im.patches, vis.patch_dim, device=dev) for _, im in encode]
        pixel_values = torch.cat([to_device(p, dev) for p in pixels]).to(self.dtype)
        grid = torch.tensor([im.grid for _, im in encode], dtype=torch.int64)
        embeds = self.model.visual(pixel_values, grid)
        for (slot, im), part in zip(encode, embeds.split([im.num_tokens for _, im in encode])):
            self.mm_buffer[slot, :im.num_tokens].copy_(part)

    def _image_embeds(self, rows: list[StepRow], lens: list[int]) -> tuple[torch.Tensor | None,
                                                                           torch.Tensor | None]:
        """The step's image-token embeddings (from the encoder buffer) and the mask of their places."""
        spans = [(base + at, slot, first, n) for r, base in zip(rows, [0, *itertools.accumulate(lens)])
                 for at, slot, first, n in r.spans]
        if not spans:
            return None, None
        mask = torch.zeros(sum(lens), dtype=torch.bool)
        for at, _, _, n in spans:
            mask[at:at + n] = True
        embeds = torch.cat([self.mm_buffer[slot, first:first + n] for _, slot, first, n in spans])
        return embeds, to_device(mask, self.device)

    @staticmethod
    def _mrope(row: StepRow) -> torch.Tensor:
        """M-RoPE positions [3, n] of a row's tokens: the prompt's own (its images' 3-D places), then p +
        delta."""
        start, end = row.start, row.start + len(row.ids)
        mm = row.mm
        known = mm.positions.shape[1] if mm is not None and mm.positions is not None else start
        delta = mm.delta if mm is not None else 0
        head = mm.positions[:, start:min(end, known)] if start < known else torch.empty(3, 0,
                                                                                        dtype=torch.int64)
        tail = torch.arange(min(max(start, known), end), end).add(delta).expand(3, -1)
        return torch.cat([head, tail], dim=1)

    def _slot_of(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ps = self.cfg.page_size
        return self.req_table.page_table[rows, pos // ps].long() * ps + pos % ps

    def _decode(self, rows: list[StepRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row at position start; logits [rows, vocab] and the rows' request slots (a PENDING
        id is fed on the device: ReqTable.feed, captured in the graphs). Attention runs at the smallest
        max_seq_len bucket that holds the longest row (graphs and eager alike: the eager stress corner
        holds a row at --max_req_total_len, so it runs the largest bucket, the largest scratch)."""
        dev = self.device
        longest = max(r.start for r in rows) + 1
        # one host buffer (pinned on CUDA) and one copy: a graph derives the rest itself (DecodeGraphs). Built
        # through a flat numpy array: torch.tensor over a nested list took twice as long (host time a
        # synchronous step adds before its graph launches; docs/measurements.md, "Kernel choices")
        flat = [v for r in rows
                for v in (r.ids[0], r.start, r.slot, 1, r.mm.delta if r.mm is not None else 0)]
        host = torch.from_numpy(np.array(flat, dtype=np.int64)).view(len(rows), 5)
        if dev.type == "cuda":
            host = host.pin_memory()
        self.clock.launched()
        if self.graphs is not None and len(rows) <= self.graphs.max_bs:
            return self.graphs.replay(host, longest), self.graphs.inputs[:len(rows), 2]
        ids, pos, slots, _, delta = host.to(dev, non_blocking=True).unbind(1)
        meta = self._decode_meta(pos, slots, longest)
        ids = self.req_table.feed(ids, slots)
        return self._decode_logits(ids, pos + delta if self.is_vl else pos, meta), slots

    # ------------------------------------------------------------ the stress: the envelope's corners
    @property
    def forced_routings(self) -> tuple[str, ...]:
        """The routings the stress forces on an MoE model (layers.moe: worst and balanced); none if dense."""
        return ("worst", "balanced") if self.model_config.num_experts else ()

    def stress_prefill(self) -> list[StepShape]:
        """The prefill corners (autoprofile.engine.stress), executed as serving executes steps."""
        return self._stress(stress.prefill_steps)

    def stress_decode(self) -> list[StepShape]:
        """The decode corners (autoprofile.engine.stress), executed as serving executes steps."""
        return self._stress(stress.decode_steps)

    def corners(self, steps) -> list[Step]:
        """The corners a stress function (engine.stress.prefill_steps, decode_steps) gives for this build."""
        return steps(self.envelope, self.kv.num_pages - 1, self.model_config.vocab_size, self.cfg.seed,
                     self.forced_routings)

    def _stress(self, steps) -> list[StepShape]:
        self._require_built()
        self.stressing = True
        try:
            t0 = time.perf_counter()
            name = getattr(steps, "__name__", "stress").replace("_steps", "")
            shapes, corners = [], []
            for step in self.corners(steps):
                start = time.perf_counter()
                shapes.append(self._run_corner(step))
                corners.append((f"{stress.CORNER}{stress.corner_label(shapes[-1], step.routing)}",
                                time.perf_counter() - start))
            took = time.perf_counter() - t0
            log.info("stress: %d %s corners in %.2f s", len(shapes), name, took)
            self.boot_steps += [(f"stress {name}", took), *corners]
            return shapes
        finally:
            self.stressing = False
            self.routing.set("model")
            if self.kv_scales_pending:  # random K/V set them: the first real batch sets them again
                self.kv.set_scales(None)

    def take_boot_steps(self) -> list[tuple[str, float]]:
        """The timed steps (graph captures, stresses, and each stress corner: named CORNER + its label) since
        the last call, for the profiler's phases."""
        steps, self.boot_steps = self.boot_steps, []
        return steps

    def _run_corner(self, step: Step) -> StepShape:
        self.execute(step)
        self._sync()
        return step.shape(self.envelope.graph_rows)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
