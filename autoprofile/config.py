"""The one configuration dataclass, its CLI flags (parent systems' names) and its validation.

Validation runs on the CPU before any GPU work: every bad value or inconsistent combination raises
ConfigError naming the flag and a value that would work.

Above the house's 500 lines on purpose: the one config dataclass, each flag's check beside its flag, so that
a flag is declared, validated and explained in one place.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import logging
import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from autoprofile.budget import (cache_shape, context_that_fits, max_indexable_tokens, min_usable_tokens,
                                round_up, running_reqs, wide_offsets)
from autoprofile.model_config import (FIRST_FOLDED, LOAD_FORMATS, ModelConfig, ModelConfigError,
                                      builtin_models, find_weights, load_model_config,
                                      unsupported_architecture, with_runtime_fp8)
from autoprofile.profile_cache import default_folder
from autoprofile.resize import max_resized_pixels

ATTENTION_BACKENDS = ("auto", "aiter", "aiter_triton", "torch")
KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8_e4m3")
KV_SCALES = ("auto", "first_batch", "unit")
QUANTIZATIONS = ("fp8",)  # --quantization: vLLM's flag; fp8 = per-channel weights, dynamic per-token acts
MODEL_DTYPES = ("bfloat16", "float16", "float32")
DEVICES = ("cuda", "cpu")  # --device: SGLang's names; cuda covers ROCm (torch's "cuda" device)
CPU_MODEL = "tiny"
# --device cpu's defaults of flags left unset: a model that answers at once, and float32 (bf16 matmuls are
# several times slower on most CPUs: 16 tokens of the tiny model in 1.8-4.4 s against 0.1-0.4 s)
DEVICE_DEFAULTS = {"model": CPU_MODEL, "dtype": "float32"}
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # --reasoning_parser: vLLM's names (serving.reasoning)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8_e4m3": 1}
MAX_GRAPH_BATCH = 1024
MAX_PIECEWISE_TOKENS = 8192  # piecewise graphs hold their largest bucket's activations for good
# --piecewise_cuda_graph_max_tokens unset: a dense model's prefill steps of 1k tokens and more are GPU-bound
# eagerly; a hybrid MoE's stay host-bound to 4k tokens and past (qwen3.5-35b-a3b-fp8 on an H200: 4,032 tokens
# 128 ms eager against 82 ms through the pieces; docs/measurements.md, "Piecewise graphs for hybrids"). Not
# a dense hybrid's: its large steps are its GEMMs', and the pool of an 8,192-token bucket would cost
# qwen3.5-27b a quarter of its KV on an H100 (plan)
DEFAULT_PIECEWISE_TOKENS, HYBRID_MOE_PIECEWISE_TOKENS = 512, MAX_PIECEWISE_TOKENS
MAX_BATCH_TOKENS = 1 << 20  # one prefill of a million tokens: beyond any card's activation memory
MAX_CANARY_MB = 1 << 16  # 64 GiB of headroom is already more than a card's slack
API_KEY_ENV = "AUTOPROFILE_API_KEY"  # vLLM's VLLM_API_KEY
README_REPRODUCIBLE = "Reproducible output"  # the README section --deterministic's help points to
MAX_SEED = 1 << 62  # torch generators take a 64-bit seed; the stresses add small offsets to it

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A bad flag value: names the flag and a value that would work."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"--{flag}: {message}")


@dataclass(frozen=True)
class ServerConfig:
    model: str = "llama-3.1-8b"
    tp: int = 1
    # TP across hosts (SGLang's flags): every host runs tp / nnodes ranks; host 0 hosts the rendezvous at
    # dist_init_addr (HOST:PORT) and its first rank serves HTTP; dist_timeout bounds the wait for every host
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: float = 300.0
    max_total_token_num: int | None = None
    mem_fraction: float = 1.0
    batch_max_tokens: int = 8192
    running_max_req_size: int | None = None
    max_req_total_len: int | None = None
    graph_max_batch_size: int = 256
    disable_cudagraph: bool = False
    # prefill and mixed steps of at most this many tokens replay piecewise CUDA graphs (engine.piecewise;
    # SGLang's --piecewise-cuda-graph-max-tokens); 0: every such step eager; None: DEFAULT_PIECEWISE_TOKENS,
    # a hybrid MoE's HYBRID_MOE_PIECEWISE_TOKENS (piecewise_max_tokens)
    piecewise_cuda_graph_max_tokens: int | None = None
    disable_prefix_caching: bool = False
    state_checkpoints: int | None = None  # a hybrid's prefix-cache state rows; None: budget.state_checkpoints
    disable_overlap_schedule: bool = False
    # when waiting requests join running decode rows (engine.admission.admit_now, TGI's rule)
    max_waiting_steps: int = 8
    waiting_served_ratio: float = 0.3
    # the prefix cache's host-memory tier (autoprofile.engine.host_kv), per rank: off, auto or GiB. Off by
    # default: no measurement of the tier's gain on a GPU yet (scripts/bench_serving.py --multi_turn)
    host_kv: str = "off"
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    kv_scales: str = "auto"
    dtype: str = "bfloat16"
    # quantize a bf16 checkpoint's (or random) weights at load: None, or "fp8" (a checkpoint quantized already
    # serves its own scheme, from config.json's quantization_config)
    quantization: str | None = None
    page_size: int = 16
    canary_mb: int = 256
    shrink_ratio: float = 0.95
    max_retries: int = 3
    host: str = "127.0.0.1"
    port: int = 8000
    max_waiting_requests: int = 1024
    # a stream's outputs reach its reader every this many tokens (its first token and its end at once):
    # SGLang's and vLLM's --stream-interval
    stream_interval: int = 1
    # the engine loop in a process of its own (serving.engine_process): a GIL apart from the HTTP server's;
    # None: in one with a single CUDA GPU (--tp 1), on a thread of the server's process otherwise (the CPU
    # device, tensor-parallel ranks). uses_engine_process says which
    engine_process: bool | None = None
    seed: int = 0
    # batch-invariant kernels: a request's tokens do not depend on the requests beside it (the README section
    # README_REPRODUCIBLE names)
    deterministic: bool = False
    report_dir: str | None = "autoprofile_report"
    profile_dir: str | None = None  # serve: traces of the engine's steps (POST /start_profile); None: off
    # a folder of earlier probes' measurements (autoprofile.profile_cache); None: always probe (the CLI's
    # default is the user's cache folder)
    profile_cache: str | None = None
    # images (vision-language models)
    visual_batch_size: int = 4
    min_image_pixels: int = 56 * 56
    max_image_pixels: int = 1280 * 28 * 28
    max_images_per_request: int = 4
    allowed_media_domains: tuple[str, ...] = ()
    # where the weights come from (vLLM's --load_format): auto (safetensors, else .bin), safetensors, pt, or
    # dummy (seeded random weights); a folder whose tokenizer.json serves text (default: the model folder's)
    load_format: str = "auto"
    tokenizer: str | None = None
    # the OpenAI API: the name /v1/models lists (default: --model); a key every /v1/* and /generate request
    # must send as "Authorization: Bearer <key>" (None: no key). NOTE: never logged, never in the cache key
    served_model_name: str | None = None
    api_key: str | None = field(default=None, repr=False)
    # where the engine runs: cuda (a GPU, measured by the profiler) or cpu (autoprofile.cpu: no probe)
    device: str = "cuda"
    # the chat reply's <think>...</think> as reasoning_content (serving.reasoning); None: all of it is content
    reasoning_parser: str | None = None

    @cached_property
    def model_config(self) -> ModelConfig:
        mc = load_model_config(self.model)
        return with_runtime_fp8(mc) if self.quantization == "fp8" else mc

    @property
    def uses_engine_process(self) -> bool:
        """Whether `serve` runs its engine loop in a process of its own (--engine_process; unset: with a
        single CUDA GPU, as vLLM's EngineCore runs apart from its API server)."""
        if self.engine_process is not None:
            return self.engine_process
        return self.device == "cuda" and self.tp == 1

    @property
    def random_weights(self) -> bool:
        """Seeded random weights: --load_format dummy, or a built-in config (which has no weights)."""
        return self.load_format == "dummy" or self.model_config.path is None

    @cached_property
    def checkpoint_files(self) -> list[Path]:
        """The weight files to load (model_config.find_weights); empty for random weights."""
        return [] if self.random_weights else find_weights(Path(self.model_config.path), self.load_format)

    @property
    def tokenizer_dir(self) -> Path | None:
        """The folder whose tokenizer.json serves text: --tokenizer's, else the model folder's; None if it
        holds none."""
        folder = self.tokenizer or self.model_config.path
        return Path(folder) if folder and os.path.isfile(os.path.join(folder, "tokenizer.json")) else None

    @property
    def context_len(self) -> int:
        """The resolved --max_req_total_len: the longest request (prompt + output) in tokens, the flag's
        value or the model's maximum. Read this, never the raw field (None means the model's maximum)."""
        return self.max_req_total_len or self.model_config.max_position_embeddings

    @property
    def kv_dtype_name(self) -> str:
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def kv_dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.kv_dtype_name]

    @property
    def min_usable_tokens(self) -> int:
        """The smallest cache that serves this config (budget.min_usable_tokens)."""
        return min_usable_tokens(self.context_len, self.page_size, self.batch_max_tokens,
                                 running_reqs(self.running_max_req_size, self.graph_max_batch_size))

    @property
    def canary_bytes(self) -> int:
        return self.canary_mb << 20

    def replace(self, **changes) -> ServerConfig:
        return dataclasses.replace(self, **changes)


def _check(ok: bool, flag: str, message: str) -> None:
    if not ok:
        raise ConfigError(flag, message)


def api_key_ok(key: str) -> bool:
    return bool(key) and all("!" <= ch <= "~" for ch in key)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def parse_host_kv(text: str) -> float | str:
    """--host_kv: 'auto', 'off' or a positive number of GiB; ValueError otherwise."""
    if text in ("auto", "off"):
        return text
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(text)
    return value


def parse_dist_addr(text: str) -> tuple[str, int]:
    """--dist_init_addr: HOST:PORT (an IPv6 host in brackets: [::1]:29500); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not (sep and host.strip() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(text)
    return host, int(port)


def _validate_hosts(cfg: ServerConfig, serving: bool) -> None:
    """--nnodes, --node_rank, --dist_init_addr, --dist_timeout (plan takes --nnodes alone)."""
    _check(cfg.nnodes >= 1, "nnodes", f"must be >= 1 (hosts), got {cfg.nnodes}; try --nnodes 1")
    up = -(-cfg.tp // cfg.nnodes) * cfg.nnodes
    _check(cfg.tp % cfg.nnodes == 0, "tp",
           f"--tp {cfg.tp} does not split over --nnodes {cfg.nnodes} hosts (each host runs --tp / --nnodes "
           f"ranks, one per GPU); try --tp {up}")
    if not serving:
        return
    example = "--dist_init_addr 10.0.0.1:29500 (host 0's address and a free port, the same on every host)"
    _check(cfg.nnodes == 1 or cfg.dist_init_addr is not None, "dist_init_addr",
           f"--nnodes {cfg.nnodes} needs the address where host 0 (--node_rank 0) holds the rendezvous; try "
           f"{example}")
    _check(cfg.nnodes > 1 or cfg.dist_init_addr is None, "dist_init_addr",
           "is the rendezvous of several hosts and needs --nnodes > 1; drop it on one host, or add "
           "--nnodes 2 --node_rank R")
    _check(0 <= cfg.node_rank < cfg.nnodes, "node_rank",
           f"must be in [0, {cfg.nnodes - 1}] for --nnodes {cfg.nnodes} (0 is the host that serves HTTP), "
           f"got {cfg.node_rank}; try --node_rank {min(max(cfg.node_rank, 0), cfg.nnodes - 1)}")
    if cfg.dist_init_addr is not None:
        try:
            parse_dist_addr(cfg.dist_init_addr)
        except ValueError:
            raise ConfigError("dist_init_addr", f"must be HOST:PORT with a port in [1, 65535], got "
                              f"{cfg.dist_init_addr!r}; try {example}") from None
    _check(math.isfinite(cfg.dist_timeout) and cfg.dist_timeout > 0, "dist_timeout",
           f"must be a number of seconds > 0, got {cfg.dist_timeout}; try --dist_timeout 300")


def validate(cfg: ServerConfig, serving: bool = True) -> ServerConfig:
    """Check every flag and combination; return cfg unchanged or raise ConfigError. CPU only.

    serving=False (autoprofile plan) also accepts architectures the engine cannot run yet (MoE)."""
    _check(cfg.tp >= 1, "tp", f"must be >= 1, got {cfg.tp}; try --tp 1")
    _validate_device(cfg)
    _validate_hosts(cfg, serving)
    _check(0 < cfg.mem_fraction <= 1, "mem_fraction",
           f"is a multiplier on the measured budget and must be in (0, 1], got {cfg.mem_fraction}; "
           "try --mem_fraction 1.0")
    _check(1 <= cfg.batch_max_tokens <= MAX_BATCH_TOKENS, "batch_max_tokens",
           f"must be in [1, {MAX_BATCH_TOKENS}], got {cfg.batch_max_tokens}; try --batch_max_tokens 8192")
    _check(cfg.graph_max_batch_size >= 1, "graph_max_batch_size",
           f"must be >= 1, got {cfg.graph_max_batch_size}; try --graph_max_batch_size 256")
    _check(cfg.graph_max_batch_size <= MAX_GRAPH_BATCH, "graph_max_batch_size",
           f"must be <= {MAX_GRAPH_BATCH}, got {cfg.graph_max_batch_size}; try --graph_max_batch_size 256")
    pieces = cfg.piecewise_cuda_graph_max_tokens
    _check(pieces is None or 0 <= pieces <= MAX_PIECEWISE_TOKENS, "piecewise_cuda_graph_max_tokens",
           f"must be in [0, {MAX_PIECEWISE_TOKENS}], got {pieces}; try "
           "--piecewise_cuda_graph_max_tokens 512 (0: prefill steps eager)")
    _check(cfg.state_checkpoints is None or cfg.state_checkpoints >= 0, "state_checkpoints",
           f"must be >= 0, got {cfg.state_checkpoints}; try --state_checkpoints 16, or leave it unset (4 to 8)")
    _check(not cfg.state_checkpoints or not cfg.disable_prefix_caching, "state_checkpoints",
           f"{cfg.state_checkpoints} checkpoints keep a cached prefix's state, and --disable_prefix_caching "
           f"turns the cache off; drop one of them (or --state_checkpoints 0)")
    _check(cfg.stream_interval >= 1, "stream_interval",
           f"must be >= 1, got {cfg.stream_interval}; try --stream_interval 1 (every token)")
    _check(cfg.engine_process is not True or cfg.tp == 1, "engine_process",
           f"runs one GPU's engine apart from the HTTP server; under --tp {cfg.tp} rank 0's engine serves the "
           "ranks' step broadcast in the server's process: drop --engine_process (or serve --tp 1)")
    _check(cfg.max_waiting_steps >= 0, "max_waiting_steps",
           f"must be >= 0, got {cfg.max_waiting_steps}; try --max_waiting_steps 8 (0: admit at once)")
    _check(cfg.waiting_served_ratio >= 0, "waiting_served_ratio",
           f"must be >= 0, got {cfg.waiting_served_ratio}; try --waiting_served_ratio 0.3")
    _check(cfg.running_max_req_size is None or cfg.running_max_req_size >= 1, "running_max_req_size",
           f"must be >= 1, got {cfg.running_max_req_size}; try --running_max_req_size 1000 or leave it unset")
    _check(cfg.max_total_token_num is None or cfg.max_total_token_num >= 1, "max_total_token_num",
           f"must be >= 1, got {cfg.max_total_token_num}; leave it unset to auto-profile")
    _check(cfg.max_req_total_len is None or cfg.max_req_total_len >= 2, "max_req_total_len",
           f"must be >= 2, got {cfg.max_req_total_len}; try --max_req_total_len 4096")
    try:
        parse_host_kv(cfg.host_kv)
    except ValueError:
        raise ConfigError("host_kv", f"must be auto, off or a number of GiB > 0, got {cfg.host_kv!r}; try "
                          "--host_kv auto") from None
    _check(cfg.host_kv == "off" or not cfg.disable_prefix_caching, "host_kv",
           "the host tier keeps the prefix cache's evicted pages: it needs the prefix cache; drop "
           "--disable_prefix_caching or use --host_kv off")
    _check(cfg.attention_backend in ATTENTION_BACKENDS, "attention_backend",
           f"unknown backend '{cfg.attention_backend}'; choose one of {', '.join(ATTENTION_BACKENDS)}")
    _check(cfg.kv_cache_dtype in KV_DTYPES, "kv_cache_dtype",
           f"unknown '{cfg.kv_cache_dtype}'; choose one of {', '.join(KV_DTYPES)}")
    _check(cfg.dtype in MODEL_DTYPES, "dtype",
           f"unknown '{cfg.dtype}'; choose one of {', '.join(MODEL_DTYPES)}")
    _check(_pow2(cfg.page_size), "page_size",
           f"must be a power of two, got {cfg.page_size}; try --page_size 16")
    _check(cfg.page_size >= 16 or cfg.attention_backend == "torch", "page_size",
           f"AITER's paged decode needs pages of >= 16 tokens, got {cfg.page_size}; try --page_size 16 "
           "(or --attention_backend torch)")
    _check(cfg.page_size <= 256, "page_size", f"must be <= 256, got {cfg.page_size}; try --page_size 16")
    _check(0 <= cfg.canary_mb <= MAX_CANARY_MB, "canary_mb",
           f"must be in [0, {MAX_CANARY_MB}] MiB, got {cfg.canary_mb}; try --canary_mb 256")
    _check(0.5 <= cfg.shrink_ratio < 1, "shrink_ratio",
           f"must be in [0.5, 1), got {cfg.shrink_ratio}; try --shrink_ratio 0.95")
    _check(0 <= cfg.max_retries <= 20, "max_retries",
           f"must be in [0, 20], got {cfg.max_retries}; try --max_retries 3")
    _check(0 <= cfg.port <= 65535, "port",
           f"must be in [0, 65535] (0 = any free port), got {cfg.port}; try --port 8000")
    _check(bool(cfg.host.strip()), "host", "must not be empty; try --host 127.0.0.1")
    _check(cfg.served_model_name is None or (bool(cfg.served_model_name.strip())
                                             and cfg.served_model_name == cfg.served_model_name.strip()),
           "served_model_name", f"must be a name without leading or trailing spaces, got "
           f"{cfg.served_model_name!r}; try --served_model_name my-model (or leave it out: --model's)")
    _check(cfg.reasoning_parser in (None, *REASONING_PARSERS), "reasoning_parser",
           f"must be one of {', '.join(REASONING_PARSERS)}, got {cfg.reasoning_parser!r}; try "
           "--reasoning_parser qwen3 (Qwen3's <think> replies; deepseek_r1 for DeepSeek-R1 and its "
           "distills), or leave it out")
    _check(cfg.api_key is None or api_key_ok(cfg.api_key), "api_key",
           f"(or ${API_KEY_ENV}) must be printable ASCII characters without spaces, not empty: clients "
           "send it as 'Authorization: Bearer <key>'; try the output of `openssl rand -hex 32` (the key "
           "itself is not shown here)")
    _check(0 <= cfg.seed <= MAX_SEED, "seed",
           f"must be an integer in [0, 2**62] (a torch generator's seed), got {cfg.seed}; try --seed 0")
    _check(cfg.profile_cache is None or not os.path.isfile(cfg.profile_cache), "profile_cache",
           f"'{cfg.profile_cache}' is a file, not a folder; try --profile_cache auto (or '' to always probe)")
    problem = None if cfg.profile_dir is None else report_dir_problem(cfg.profile_dir)
    _check(problem is None, "profile_dir", f"'{cfg.profile_dir}' {problem}; try --profile_dir "
           "autoprofile_traces in a writable folder (or leave it unset: no traces)")
    problem = None if cfg.report_dir is None else report_dir_problem(cfg.report_dir)
    _check(problem is None, "report_dir", f"'{cfg.report_dir}' {problem}; try --report_dir "
           "autoprofile_report in a writable folder (or --report_dir '' for no report)")
    _check(cfg.max_waiting_requests >= 0, "max_waiting_requests",
           f"must be >= 0 (0 = no queue beyond the running requests), got {cfg.max_waiting_requests}; "
           "try --max_waiting_requests 1024")
    _check(cfg.dtype != "float32" or cfg.attention_backend == "torch", "dtype",
           "float32 weights are only supported by --attention_backend torch; try --dtype bfloat16")
    _check(cfg.kv_cache_dtype != "float32" or cfg.attention_backend == "torch", "kv_cache_dtype",
           "float32 KV is only supported by --attention_backend torch; try --kv_cache_dtype auto")
    _check(cfg.kv_cache_dtype != "fp8_e4m3" or cfg.attention_backend in ("auto", "aiter_triton", "torch"),
           "kv_cache_dtype", f"fp8_e4m3 KV is served by --attention_backend aiter_triton or torch, not "
                             f"{cfg.attention_backend}; try --attention_backend aiter_triton")
    _check(cfg.kv_scales in KV_SCALES, "kv_scales",
           f"unknown '{cfg.kv_scales}'; choose one of {', '.join(KV_SCALES)}")
    _check(not cfg.deterministic or cfg.attention_backend != "aiter", "deterministic",
           "the batch-invariant kernels are Triton ones, not the native AITER backend's; try "
           "--attention_backend aiter_triton with --deterministic")
    _check(cfg.load_format in LOAD_FORMATS, "load_format",
           f"unknown '{cfg.load_format}'; choose one of {', '.join(LOAD_FORMATS)} (dummy = random weights)")

    _check(cfg.quantization in (None, *QUANTIZATIONS), "quantization",
           f"unknown '{cfg.quantization}'; choose one of {', '.join(QUANTIZATIONS)} (or leave it unset)")
    try:
        m = load_model_config(cfg.model)
    except ValueError as e:
        raise ConfigError("model", f"{e}{did_you_mean(cfg.model)}") from None
    _check(cfg.quantization is None or m.quant is None, "quantization",
           f"{m.name} is quantized already ({m.quant_method}: {m.weight_format}); leave --quantization unset "
           "to serve its own scheme")
    m = cfg.model_config
    problem = fp8_block_problem(m, cfg.tp)
    fits = max(d for d in (1, 2, 4, 8) if d < cfg.tp and not fp8_block_problem(m, d)) if cfg.tp > 1 else 1
    _check(problem is None, "tp" if cfg.tp > 1 else "model",
           f"{m.name}'s FP8 block scales would straddle a shard or a packed part: {problem}; "
           + (f"try --tp {fits}" if cfg.tp > 1 else "list that module in quantization_config's "
              "modules_to_not_convert"))
    _check(m.runnable or not serving, "model", unsupported_architecture(m.architecture))
    _check(not m.is_mla or not serving or cfg.attention_backend != "aiter", "attention_backend",
           f"{m.name} uses MLA attention, which the native AITER backend does not serve here (its MLA "
           f"ops are not wired); try --attention_backend aiter_triton (or torch)")
    _check(not m.is_mla or cfg.kv_cache_dtype != "fp8_e4m3", "kv_cache_dtype",
           f"{m.name}'s MLA latent cache has no FP8 path yet; try --kv_cache_dtype auto")
    _check(not cfg.deterministic or m.quant is None, "deterministic",
           f"{m.name}'s FP8 weights ({m.weight_format}) have no batch-invariant GEMM yet; serve it without "
           "--deterministic (or a bf16 checkpoint without --quantization)")
    _check(m.moe_intermediate_size % cfg.tp == 0, "tp",
           f"{m.name}'s experts have moe_intermediate_size {m.moe_intermediate_size}, which --tp {cfg.tp} "
           f"does not divide (TP splits every expert's intermediate dimension); try --tp "
           f"{nearest_divisor(cfg.tp, m.moe_intermediate_size)}")
    if m.is_hybrid:
        _validate_hybrid(cfg, m, serving)
    heads = math.gcd(m.num_heads, m.num_kv_heads)
    _check(heads % cfg.tp == 0, "tp",
           f"{m.name} has {m.num_heads} query and {m.num_kv_heads} KV heads, which --tp {cfg.tp} does not "
           f"divide (TP splits the heads); try --tp {nearest_divisor(cfg.tp, heads)}")
    _check(cfg.tokenizer is None or cfg.tokenizer_dir is not None, "tokenizer",
           f"'{cfg.tokenizer}' holds no tokenizer.json; give a folder that does (an HF model folder)")
    if serving:
        need, why = tokenizer_ids(cfg)
        _check(m.vocab_size >= need, "model",
               f"{os.path.join(m.path or m.name, 'config.json')}: key 'vocab_size' ({m.vocab_size}) is below "
               f"the {need} ids {why}; set 'vocab_size' to {need} or more")
        _validate_weights(cfg)
    _check(cfg.context_len <= m.max_position_embeddings, "max_req_total_len",
           f"{cfg.context_len} exceeds {m.name}'s max_position_embeddings; "
           f"try --max_req_total_len {m.max_position_embeddings}")
    if cfg.max_total_token_num is not None:
        floor, n = cfg.min_usable_tokens, cfg.max_total_token_num
        _check(n >= floor or context_cut(cfg, n) is not None, "max_total_token_num",
               f"{n} tokens is below the smallest usable cache, {floor} tokens: one request of "
               f"--max_req_total_len {cfg.context_len} and one prefill batch of --batch_max_tokens "
               f"{cfg.batch_max_tokens} in whole pages of {cfg.page_size}, a page for each of the "
               f"{decode_rows_text(cfg)}, plus the pad page; try --max_total_token_num {floor} or lower "
               f"{floor_flag(cfg)}")
        heads, width = cache_shape(m, cfg.tp)
        # "auto" as on CUDA (aiter_triton); ROCm's native backend is checked again by the runner's build
        backend = "aiter_triton" if cfg.attention_backend == "auto" else cfg.attention_backend
        bound = max_indexable_tokens(heads, width, cfg.page_size, wide_offsets(backend, cfg.deterministic))
        _check(n <= bound, "max_total_token_num",
               f"{n} tokens is past what the {backend} backend's kernels address in one layer's cache "
               f"({heads} heads x {width}{', --deterministic' if cfg.deterministic else ''}); try "
               f"--max_total_token_num {bound}")
        # NOTE: pinned sizes are whole pages, so what is built is what is reported
        _check(n % cfg.page_size == 0, "max_total_token_num",
               f"{n} is not a multiple of --page_size {cfg.page_size}; "
               f"try --max_total_token_num {round_up(n, cfg.page_size)}")
    if m.vision is not None:
        _validate_images(cfg)
    if cfg.running_max_req_size is not None:
        _check(cfg.graph_max_batch_size <= cfg.running_max_req_size, "graph_max_batch_size",
               f"{cfg.graph_max_batch_size} exceeds --running_max_req_size {cfg.running_max_req_size}; "
               f"try --graph_max_batch_size {cfg.running_max_req_size}")
    return cfg


def _validate_device(cfg: ServerConfig) -> None:
    """--device cpu: one process, the torch backend, no host tier (the cache is in host memory already)."""
    _check(cfg.device in DEVICES, "device", f"unknown '{cfg.device}'; choose one of {', '.join(DEVICES)}")
    if cfg.device != "cpu":
        return
    _check(cfg.tp == 1, "tp", f"--device cpu runs one process, got --tp {cfg.tp}; try --tp 1")
    _check(cfg.attention_backend in ("auto", "torch"), "attention_backend",
           f"--device cpu runs the torch backend, not {cfg.attention_backend}; try --attention_backend torch")
    _check(cfg.host_kv == "off", "host_kv",
           "--device cpu keeps the KV cache in host memory already; use --host_kv off")


def _validate_hybrid(cfg: ServerConfig, m, serving: bool = True) -> None:
    """A hybrid model (Gated DeltaNet + attention): what its state cache does not serve yet, and fla-core's
    kernels on a GPU."""
    if serving and cfg.device == "cuda" and (problem := fla_problem(m.name)):
        raise ConfigError("model", problem)
    _check(cfg.host_kv == "off", "host_kv",
           f"{m.name} is a hybrid model: a cached prefix resumes from a state checkpoint on the GPU, and the "
           "host tier keeps K/V pages only; use --host_kv off")
    _check(not cfg.deterministic, "deterministic",
           f"{m.name} is a hybrid model: its Gated DeltaNet kernels are not batch-invariant yet; serve it "
           "without --deterministic")
    _check(m.quant is None or not m.grouped_projections, "model",
           f"{m.name} is a Qwen3-Next FP8 checkpoint: its grouped in_proj_qkvz / in_proj_ba scales are not "
           "read yet; serve its bf16 checkpoint (or a Qwen3.5 FP8 one)")
    _check(m.quant_method != "runtime", "quantization",
           f"{m.name} is a hybrid model: --quantization fp8 at load is not served for it yet; serve an FP8 "
           "checkpoint, or leave --quantization unset")
    heads = math.gcd(m.linear_num_key_heads, m.linear_num_value_heads)
    _check(heads % cfg.tp == 0, "tp",
           f"{m.name} has {m.linear_num_key_heads} key and {m.linear_num_value_heads} value heads in its "
           f"linear-attention layers, which --tp {cfg.tp} does not divide; try --tp "
           f"{nearest_divisor(cfg.tp, heads)}")


FLA_REQUIREMENT = "fla-core==0.6.0"  # pyproject's pin: the version the GPU measurements ran


def fla_problem(name: str) -> str | None:
    """Why a hybrid model's prefill cannot run at speed on a GPU here, or None: fla-core's chunked delta-rule
    kernels (layers.gdn.fla_ops) are not installed. Without them every row's prefill runs as torch ops, 64
    tokens at a time in a Python loop (an H200: a 4,101-token prefill step of qwen3.5-35b-a3b-fp8 took 2.5 s,
    a stress corner 7-13 s). Looked up without importing it (the server process spawns the engine's before
    it imports torch)."""
    if importlib.util.find_spec("fla") is not None:
        return None
    return (f"{name} is a hybrid model: its Gated DeltaNet prefill on a GPU runs fla-core's chunked "
            f"kernels, which are not installed here (without them each row's prefill would run as torch ops, "
            f"64 tokens at a time: tens of times slower); install them with `pip install {FLA_REQUIREMENT}` "
            f"(a dependency of autoprofile on Linux), or serve with --device cpu")


def nearest_divisor(n: int, of: int) -> int:
    """The divisor of `of` nearest to n (the smaller of two as near): the --tp that splits it evenly. Every n
    divides 0 (a dense model's moe_intermediate_size)."""
    return min((d for d in range(1, of + 1) if of % d == 0), key=lambda d: (abs(d - n), d), default=n)


def context_cut(cfg: ServerConfig, tokens: int) -> int | None:
    """--max_req_total_len auto (unset): the shorter request length a cache of `tokens` holds when one
    request of the model's context does not fit (budget.context_that_fits); None when there is nothing to
    cut (an explicit --max_req_total_len, the model's context fits) or no length helps."""
    if cfg.max_req_total_len is not None:
        return None
    rows = running_reqs(cfg.running_max_req_size, cfg.graph_max_batch_size)
    fits = context_that_fits(tokens, cfg.context_len, cfg.page_size, cfg.batch_max_tokens, rows)
    return fits if fits is not None and fits < cfg.context_len else None


def with_context_cut(cfg: ServerConfig, tokens: int) -> ServerConfig:
    """cfg serving the longest requests a cache of `tokens` holds (context_cut), validated again, and
    logged; cfg itself when nothing is cut. The envelope only shrinks: a measurement at the model's context
    bounds every step of the shorter one."""
    fits = context_cut(cfg, tokens)
    if fits is None:
        return cfg
    cut = validate(cfg.replace(max_req_total_len=fits), serving=cfg.model_config.runnable)
    log.warning("--max_req_total_len auto: one request of %s's context (%d tokens) needs a cache of %d "
                "tokens, and %d fit; serving requests of at most %d tokens (prompt + output). Set "
                "--max_req_total_len to choose the length yourself", cfg.model_config.name, cfg.context_len,
                cfg.min_usable_tokens, tokens, fits)
    return cut


def fp8_block_problem(m: ModelConfig, tp: int) -> str | None:
    """The first FP8 layer whose block scales --tp would split inside a block (ModelConfig.quantized_linears),
    or None."""
    return next((p for q in m.quantized_linears(tp) if (p := q.block_problem(tp))), None)


def piecewise_max_tokens(cfg: ServerConfig, backend: str) -> int:
    """The piecewise graphs' largest bucket where this configuration captures them (engine.piecewise), else 0:
    --piecewise_cuda_graph_max_tokens (unset: 512, a hybrid MoE's 8192) capped by --batch_max_tokens, with
    decode graphs, one rank, `backend` (the resolved attention backend) aiter_triton, not --deterministic, no
    images, no MLA layers.
    ModelRunner.piecewise_ok adds what only a built model tells (the RoPE kernel, the attention class)."""
    m = cfg.model_config
    ruled_out = (cfg.disable_cudagraph or cfg.tp > 1 or backend != "aiter_triton" or cfg.deterministic
                 or m.vision is not None or m.is_mla)
    wanted = cfg.piecewise_cuda_graph_max_tokens
    if wanted is None:
        wanted = HYBRID_MOE_PIECEWISE_TOKENS if m.is_hybrid and m.num_experts else DEFAULT_PIECEWISE_TOKENS
    return 0 if ruled_out else min(wanted, cfg.batch_max_tokens)


def decode_rows_text(cfg: ServerConfig) -> str:
    if cfg.running_max_req_size is not None:
        return f"--running_max_req_size {cfg.running_max_req_size} decode rows"
    return f"--graph_max_batch_size {cfg.graph_max_batch_size} decode rows (--running_max_req_size unset)"


def floor_flag(cfg: ServerConfig) -> str:
    """The flag whose term sets the smallest usable cache (budget.min_usable_tokens): lowering it lowers
    the floor."""
    rows = running_reqs(cfg.running_max_req_size, cfg.graph_max_batch_size)
    rows_flag = "--graph_max_batch_size" if cfg.running_max_req_size is None else "--running_max_req_size"
    terms = {"--max_req_total_len": -(-cfg.context_len // cfg.page_size),
             "--batch_max_tokens": -(-cfg.batch_max_tokens // cfg.page_size), rows_flag: rows}
    return max(terms, key=terms.get)


def report_dir_problem(path: str) -> str | None:
    """Why the report cannot be written to `path` (a folder, made if missing), or None. Nothing is created."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "exists and is not a folder"
        return None if os.access(path, os.W_OK | os.X_OK) else "is a folder this user cannot write to"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be made: '{parent}' is a file, not a folder"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot be made: '{parent}' is not writable"


def _validate_weights(cfg: ServerConfig) -> None:
    """Random weights only by choice (--load_format dummy) or for a built-in config; a folder's weights must
    be there. Reads no tensor."""
    m = cfg.model_config
    if m.path is None:
        _check(cfg.load_format in ("auto", "dummy"), "load_format",
               f"{m.name} is a built-in config without weights (served with random weights); try "
               f"--load_format auto, or --model a folder holding {cfg.load_format} weights")
        return
    try:
        cfg.checkpoint_files
    except ModelConfigError as e:
        other = " or --load_format auto" if cfg.load_format != "auto" else ""
        raise ConfigError("model" if cfg.load_format == "auto" else "load_format",
                          f"{e}; add the checkpoint's files, or try --load_format dummy (random weights)"
                          f"{other}") from None


def did_you_mean(model: str) -> str:
    """"; did you mean NAME?" for a --model that is neither a folder nor a built-in name but close to one."""
    if Path(model, "config.json").is_file():
        return ""
    near = difflib.get_close_matches(model.lower(), builtin_models(), n=1, cutoff=0.6)
    return f"; did you mean {near[0]}?" if near else ""


def weights_source(cfg: ServerConfig) -> str:
    """Where the weights come from, for the boot log."""
    if cfg.load_format == "dummy":
        return f"random (seed {cfg.seed}): --load_format dummy"
    if cfg.random_weights:
        return f"random (seed {cfg.seed}): {cfg.model_config.name} is a built-in config without weights"
    files = cfg.checkpoint_files
    kinds = "/".join(sorted({f.suffix for f in files}))
    return f"{len(files)} {kinds} file{'s' * (len(files) > 1)} in {files[0].parent}"


def tokenizer_problem(cfg: ServerConfig) -> str | None:
    """Why text cannot be served: a checkpoint without tokenizer.json and no --tokenizer; None if it can
    (random weights get the byte-level tokenizer)."""
    if cfg.tokenizer_dir is not None or cfg.random_weights:
        return None
    return (f"{cfg.model_config.path} has no tokenizer.json; give one with --tokenizer FOLDER (e.g. the HF "
            f"folder the checkpoint came from), or serve random weights with --load_format dummy (byte-level "
            f"tokenizer)")


def tokenizer_ids(cfg: ServerConfig) -> tuple[int, str]:
    """The fewest vocabulary ids the serving tokenizer needs (autoprofile.serving.tokenizer), and why."""
    if cfg.tokenizer_dir is not None:
        from tokenizers import Tokenizer
        file = str(cfg.tokenizer_dir / "tokenizer.json")
        try:
            n = Tokenizer.from_file(file).get_vocab_size(with_added_tokens=True)
        except Exception as e:  # noqa: BLE001 - the tokenizers library's own error text names the problem
            raise ConfigError("tokenizer" if cfg.tokenizer else "model",
                              f"{file}: cannot be read by `tokenizers`: {e}") from None
        where = f"{file} holds" if cfg.tokenizer else "its tokenizer.json holds"
        return n, f"{where} (special tokens included)"
    return FIRST_FOLDED, "the byte-level tokenizer needs (3 specials + 256 bytes; no tokenizer.json)"


def _validate_images(cfg: ServerConfig) -> None:
    side = 28 * 28  # Qwen's resize keeps sides multiples of 28 pixels: one LLM token per 28 x 28
    _check(1 <= cfg.visual_batch_size <= 64, "visual_batch_size",
           f"must be in [1, 64], got {cfg.visual_batch_size}; try --visual_batch_size 4")
    _check(1 <= cfg.max_images_per_request <= 64, "max_images_per_request",
           f"must be in [1, 64], got {cfg.max_images_per_request}; try --max_images_per_request 4")
    _check(side <= cfg.min_image_pixels, "min_image_pixels",
           f"must be >= {side} (one 28 x 28 block), got {cfg.min_image_pixels}; try --min_image_pixels 3136")
    _check(cfg.min_image_pixels <= cfg.max_image_pixels, "max_image_pixels",
           f"{cfg.max_image_pixels} is below --min_image_pixels {cfg.min_image_pixels}; "
           f"try --max_image_pixels {max(cfg.min_image_pixels, 1003520)}")
    longest = (cfg.context_len - 2) * side  # an image's tokens plus a token of text and one of output
    largest = max_resized_pixels(cfg.min_image_pixels, cfg.max_image_pixels)  # a thin image: past max
    if largest > longest:
        fits = next((n * side for n in range(min(1280, longest // side), 0, -1)
                     if n * side >= cfg.min_image_pixels
                     and max_resized_pixels(cfg.min_image_pixels, n * side) <= longest), None)
        hint = f"--max_image_pixels {fits}" if fits else "a larger --max_req_total_len"
        _check(False, "max_image_pixels",
               f"with --max_image_pixels {cfg.max_image_pixels} an image can resize to {largest} pixels, "
               f"{largest // side} tokens (a thin one keeps a 28-pixel side), more than a {cfg.context_len}-"
               f"token request (--max_req_total_len) holds; try {hint}")


# ---------------------------------------------------------------- CLI flags
def add_flag(p: argparse.ArgumentParser, name: str, **kw) -> None:
    """--name, plus --name-with-hyphens (the spelling vLLM and SGLang users type): one dest."""
    spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    p.add_argument(*spellings, dest=name, **kw)


COMMANDS = ("serve", "profile", "plan")


def add_server_args(p: argparse.ArgumentParser, command: str = "serve") -> None:
    """The flags `command` uses, in groups: the budget's (every command), loading and measuring (serve and
    profile), the HTTP server's (serve). argparse refuses a flag that `command` does not take."""
    d = ServerConfig()
    budget = p.add_argument_group("the model and its memory budget")
    add_flag(budget, "model", default=None,
             help=f"A Hugging Face style folder (config.json, plus *.safetensors weights to serve them) or "
                  f"the name of a built-in config: {', '.join(builtin_models())}. (default: {d.model}; "
                  f"{CPU_MODEL} with --device cpu)")
    add_flag(budget, "tp", type=int, default=d.tp,
             help="Tensor-parallel ranks, one process and one GPU each, over every host (--nnodes).")
    add_flag(budget, "nnodes", type=int, default=d.nnodes,
             help="Hosts the --tp ranks span, --tp / --nnodes on each; start `serve` (or `profile`) on every "
                  "host with the same flags and its own --node_rank.")
    add_flag(budget, "max_total_token_num", type=int, default=None,
             help="Pin the KV cache size in tokens (a multiple of --page_size). It skips the probe and is "
                  "still validated. Unset: the profile measures the largest cache that fits.")
    add_flag(budget, "mem_fraction", type=float, default=d.mem_fraction,
             help="A multiplier in (0, 1] on the measured KV budget, not a fraction of the GPU's memory.")
    add_flag(budget, "batch_max_tokens", type=int, default=d.batch_max_tokens,
             help="The most tokens one prefill step runs.")
    add_flag(budget, "running_max_req_size", type=int, default=None,
             help="The most concurrent requests. Each is a request slot and a decode row of the stress. "
                  "Unset: --graph_max_batch_size, so that every decode step replays a graph.")
    add_flag(budget, "max_req_total_len", type=_context_len, default=None, metavar="{auto,N}",
             help="The longest request in tokens, prompt plus output. auto (unset): the model's "
                  "max_position_embeddings when a request that long fits the measured KV cache, else the "
                  "longest that fits (logged, and reported by /health and /v1/models). A number is served "
                  "as given, or refused when it does not fit. (default: auto)")
    add_flag(budget, "graph_max_batch_size", type=int, default=d.graph_max_batch_size,
             help="The largest decode batch captured as a CUDA graph.")
    add_flag(budget, "disable_cudagraph", action="store_true",
             help="Run every step eagerly (no decode graphs, no piecewise graphs).")

    add_flag(budget, "attention_backend", choices=ATTENTION_BACKENDS, default=d.attention_backend,
             help="The attention and GEMM kernels. auto: aiter_triton on NVIDIA, aiter on ROCm; torch is "
                  "the reference (and the CPU's).")
    add_flag(budget, "kv_cache_dtype", choices=KV_DTYPES, default=d.kv_cache_dtype,
             help="The KV cache's dtype. auto: --dtype. fp8_e4m3 halves each cell and keeps per-layer K and "
                  "V scales (see --kv_scales).")
    add_flag(budget, "dtype", choices=MODEL_DTYPES, default=None,
             help=f"The weights' and activations' dtype. (default: {d.dtype}; float32 with --device cpu)")
    add_flag(budget, "quantization", choices=QUANTIZATIONS, default=None,
             help="Quantize a bf16 checkpoint's weights at load. fp8: e4m3 weights with a scale per output "
                  "channel and activations quantized per token as they run (compute capability 8.9 or "
                  "newer). A checkpoint quantized already needs no flag.")
    add_flag(budget, "page_size", type=int, default=d.page_size, help="Tokens per KV page.")
    add_flag(budget, "canary_mb", type=int, default=d.canary_mb,
             help="Headroom in MiB held free through the validation.")
    add_flag(budget, "disable_prefix_caching", action="store_true",
             help="Never reuse the K and V of full pages that an earlier request with the same prefix "
                  "computed. A hybrid model then keeps no state checkpoints (their memory goes to KV).")
    add_flag(budget, "state_checkpoints", type=int, default=None, metavar="N",
             help="A hybrid model (Qwen3.5, Qwen3-Next): state checkpoints the prefix cache keeps (each one "
                  "request's conv + delta-rule state, counted in the budget beside the KV cache); a cached "
                  "prefix resumes only from one. Unset: a quarter of the request slots, 4 to 8; 0: "
                  "prefix hits for hybrids off. Other models ignore it.")
    add_flag(budget, "deterministic", action="store_true",
             help="Batch-invariant kernels (the GEMMs, attention and the TP all-reduce): a request's tokens, "
                  "greedy or seeded, are the same alone and in any crowd, at a cost in throughput. See "
                  f"the README section \"{README_REPRODUCIBLE}\".")
    images = p.add_argument_group("images (vision-language models)")
    add_flag(images, "visual_batch_size", type=int, default=d.visual_batch_size,
             help="Images the vision encoder runs in one step. The stress runs this many at "
                  "--max_image_pixels.")
    add_flag(images, "min_image_pixels", type=int, default=d.min_image_pixels,
             help="Smaller images are scaled up to this many pixels (Qwen's min_pixels; sides are multiples "
                  "of 28).")
    add_flag(images, "max_image_pixels", type=int, default=d.max_image_pixels,
             help="Larger images are scaled down to this many pixels (Qwen's max_pixels); each 28 x 28 "
                  "block is one token.")
    add_flag(images, "max_images_per_request", type=int, default=d.max_images_per_request,
             help="The most images in one request; a request with more gets a 400.")
    if command == "plan":
        return
    run = p.add_argument_group("loading and measuring (serve, profile)")
    add_flag(run, "load_format", choices=LOAD_FORMATS, default=d.load_format,
             help="Where the weights come from. auto: the folder's *.safetensors (the files its index.json "
                  "names, if any), else its *.bin; safetensors; pt (.bin files); dummy: seeded random "
                  "weights, as the built-in configs always have.")
    add_flag(run, "device", choices=DEVICES, default=d.device,
             help="Where the engine runs. cuda: a GPU (NVIDIA, or AMD through ROCm), measured by the "
                  "profile; cpu: serve on the host's CPU to try the API (no profile: the cache holds the "
                  "model's context, checked against the host's memory; the torch backend, float32 unless "
                  "--dtype).")
    add_flag(run, "tokenizer", default=None,
             help="A folder holding tokenizer.json. Unset: the model folder's; a model with random weights "
                  "and no tokenizer.json gets a byte-level tokenizer.")
    add_flag(run, "seed", type=int, default=d.seed, help="The seed of random weights and of sampling.")
    add_flag(run, "kv_scales", choices=KV_SCALES, default=d.kv_scales,
             help="Where an FP8 cache's per-layer K and V scales come from. auto: the checkpoint's "
                  "k_scale and v_scale if it has them, else first_batch; first_batch: the first real "
                  "prefill's K and V; unit: 1.0.")
    add_flag(run, "piecewise_cuda_graph_max_tokens", type=int, default=d.piecewise_cuda_graph_max_tokens,
             help="Prefill and mixed steps of at most this many tokens (decode rows included) replay "
                  "piecewise CUDA graphs, attention eager between them: such steps are otherwise bound by "
                  "the host's kernel launches. One GPU with decode graphs, not MLA or vision models "
                  "(dense, MoE or hybrid; bf16 or FP8 weights and cache); 0: eager. Default: 512, a "
                  "hybrid MoE's 8192 (its experts and linear layers launch many small kernels at any "
                  "token count). The profile measures their pool (autoprofile plan estimates it).")
    add_flag(run, "disable_overlap_schedule", action="store_true",
             help="Run each step and read its tokens back before scheduling the next. Otherwise, on one "
                  "GPU, the engine schedules and launches the next step while the GPU computes (under --tp "
                  "it never does).")
    add_flag(run, "max_waiting_steps", type=int, default=d.max_waiting_steps, metavar="N",
             help="While requests decode, a new request may wait up to N steps to join them with others "
                  "(TGI's max_waiting_tokens): a step that admits runs eagerly, decode steps replay CUDA "
                  "graphs. 0: every request joins the next step.")
    add_flag(run, "waiting_served_ratio", type=float, default=d.waiting_served_ratio,
             help="Waiting requests join the decoding ones at once when they are at least this fraction of "
                  "them (TGI's waiting_served_ratio); else after --max_waiting_steps.")
    add_flag(run, "host_kv", default=d.host_kv,
             help="Pinned host memory per rank for the prefix cache's evicted pages, copied back on a hit: "
                  "off, a number of GiB, or auto (half the host's available memory less 8 GiB, split over "
                  "the host's GPUs).")
    add_flag(run, "node_rank", type=int, default=d.node_rank,
             help="This host's index in [0, --nnodes); host 0 holds the rendezvous and serves HTTP.")
    add_flag(run, "dist_init_addr", default=None, metavar="HOST:PORT",
             help="Host 0's address and a free port for the rendezvous of every host (--nnodes > 1).")
    add_flag(run, "dist_timeout", type=float, default=d.dist_timeout,
             help="Seconds to wait at the rendezvous for every host to join (or for host 0 to answer).")
    add_flag(run, "shrink_ratio", type=float, default=d.shrink_ratio,
             help="The KV size of each retry, as a fraction of the last one.")
    add_flag(run, "max_retries", type=int, default=d.max_retries,
             help="Rebuild and validate retries after the first attempt.")
    add_flag(run, "report_dir", default=d.report_dir,
             help="The folder of the budget report (JSON and PNG); '' writes none.")
    add_flag(run, "profile_cache", default="auto",
             help="A folder of earlier probes' measurements: a boot of the same code, model, flags and GPU "
                  "skips the probe, and still rebuilds and validates at the target. auto: "
                  "~/.cache/autoprofile/profiles; '' always probes.")
    if command != "serve":
        return
    http = p.add_argument_group("the HTTP server (serve)")
    add_flag(http, "host", default=d.host,
             help="The address the HTTP server binds: 0.0.0.0 for every interface.")
    add_flag(http, "port", type=int, default=d.port, help="The HTTP port; 0 picks a free one.")
    add_flag(http, "max_waiting_requests", type=int, default=d.max_waiting_requests,
             help="Requests queued beyond the running ones; past them the server answers 429.")
    add_flag(http, "stream_interval", type=int, default=d.stream_interval, metavar="N",
             help="A request's tokens reach its HTTP handler (a streamed chunk) every N tokens; the first "
                  "token and the last at once (SGLang's and vLLM's --stream-interval). Larger: fewer chunks "
                  "and less host time on the event loop's thread, which shares the GIL with the engine's.")
    engine = http.add_mutually_exclusive_group()
    add_flag(engine, "engine_process", action="store_const", const=True, default=None,
             help="Run the engine loop (scheduling, launching, sampling: the GPU's one owner) in a process of "
                  "its own, as vLLM's EngineCore and SGLang's scheduler run, so that it does not share a GIL "
                  "with the HTTP server's event loop. The boot runs there; the server process never touches "
                  "CUDA. One GPU (--tp 1). (default: on with one CUDA GPU; off with --device cpu or --tp > "
                  "1)")
    add_flag(engine, "engine_thread", action="store_true",
             help="Run the engine loop on a thread of the HTTP server's process instead (the default under "
                  "--tp > 1 and with --device cpu).")
    add_flag(http, "allowed_media_domains", type=_domains, default=d.allowed_media_domains,
             help="Comma-separated hosts whose http(s) image URLs the server may fetch; data: URLs always "
                  "work.")
    add_flag(http, "served_model_name", default=None,
             help="The model name /v1/models lists and responses carry; requests may name it or --model. "
                  "Unset: --model.")
    add_flag(http, "reasoning_parser", default=None,
             help=f"Chat replies' <think>...</think> as reasoning_content, apart from content (vLLM's flag): "
                  f"{' or '.join(REASONING_PARSERS)}. Unset: the whole reply is content.")
    add_flag(http, "profile_dir", default=None,
             help="A folder for torch.profiler traces of the engine's steps as served: POST /start_profile "
                  "(optional body {\"num_steps\": N}) then /stop_profile write a Chrome trace and a table "
                  "of the kernels there. Unset: those endpoints answer 400.")
    add_flag(http, "api_key", default=None,
             help=f"A key every /v1/* and /generate request must send as 'Authorization: Bearer <key>' "
                  f"(/health and /metrics stay open). Unset: ${API_KEY_ENV}, else no key. Prefer "
                  f"{API_KEY_ENV}: a flag shows in the process list.")


def _context_len(text: str) -> int | None:
    """--max_req_total_len: auto (None: config.with_context_cut decides) or a number of tokens."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto or a number of tokens, got '{text}'; try "
                                         "--max_req_total_len auto") from None


def _domains(text: str) -> tuple[str, ...]:
    return tuple(d.strip().lower() for d in text.split(",") if d.strip())


def config_from_args(ns: argparse.Namespace, serving: bool = True) -> ServerConfig:
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    given = {k: v for k, v in vars(ns).items() if k in names and not (k in DEVICE_DEFAULTS and v is None)}
    if getattr(ns, "engine_thread", False):  # --engine_thread: the engine_process switch, off
        given["engine_process"] = False
    cfg = on_device(ServerConfig(**given), given)
    if cfg.report_dir == "" or "report_dir" not in vars(ns):  # plan writes no report
        cfg = cfg.replace(report_dir=None)
    if "api_key" in vars(ns) and cfg.api_key is None and os.environ.get(API_KEY_ENV):  # plan takes no key
        cfg = cfg.replace(api_key=os.environ[API_KEY_ENV])
    if cfg.profile_cache in ("", "auto"):
        cfg = cfg.replace(profile_cache=None if cfg.profile_cache == "" else default_folder())
    cfg = validate(cfg, serving)
    # the CLI serves text (a library caller may drive the engine with token ids: load_tokenizer refuses then)
    _check(not serving or tokenizer_problem(cfg) is None, "tokenizer", tokenizer_problem(cfg) or "")
    # the CLI serves on a GPU, where the torch backend's cuBLAS and SDPA are not batch-invariant (the library
    # keeps it for the CPU, where its --deterministic path is)
    _check(not (serving and cfg.deterministic and cfg.attention_backend == "torch" and cfg.device != "cpu"),
           "deterministic",
           not_invariant_on_gpu("torch"))
    return cfg


def on_device(cfg: ServerConfig, given: dict) -> ServerConfig:
    """--device cpu's defaults for the flags not `given`: DEVICE_DEFAULTS, and the torch backend for auto."""
    if cfg.device != "cpu":
        return cfg
    backend = "torch" if cfg.attention_backend == "auto" else cfg.attention_backend
    defaults = {k: v for k, v in DEVICE_DEFAULTS.items() if k not in given}
    return cfg.replace(attention_backend=backend, **defaults)


def not_invariant_on_gpu(backend: str) -> str:
    """--deterministic's refusal of a backend without batch-invariant GPU kernels (the CLI's, and the
    runner's for a library caller on a GPU)."""
    return (f"the {backend} backend's GPU kernels (cuBLAS, SDPA) pick their tiling per shape; try "
            f"--attention_backend aiter_triton with --deterministic")
