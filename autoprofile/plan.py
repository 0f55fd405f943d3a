"""`autoprofile plan`: the memory budget on paper, without a GPU.

The same solver as the profiler (budget.solve_target_tokens with a budget.Sizing), fed with exact
terms where the arithmetic is exact (weights, KV per token, declared workspaces, request table) and
ESTIMATES where only a GPU can tell (activation peak, graph pools, CUDA context). On the GPU the
profiler measures the estimated rows instead; each row says which it is.

Above the house's 500 lines on purpose: one owner of the budget on paper, one function a row (weights,
KV, workspaces, state slots, estimates) beside the table and report that show them.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from types import MappingProxyType

from autoprofile import budget
from autoprofile.budget import GiB, MiB, gib, running_reqs
from autoprofile.config import (DTYPE_BYTES, ConfigError, ServerConfig, context_cut, decode_rows_text,
                                piecewise_max_tokens, validate)
from autoprofile.kernels import launch_rules
from autoprofile.model_config import MLA_ARCHITECTURES, ModelConfig, unsupported_architecture

# Non-torch memory of one process: the CUDA context plus the driver's local-memory reservation (1 KiB of stack
# per thread: no kernel of the serving path spills). Measured on an H100 (torch 2.11, CUDA 13, 2026-11-23):
# 0.81 GiB llama-3.1-8b, 0.79 qwen2.5-7b, 0.80 qwen2.5-vl-7b, 1.00 qwen3-8b; plan assumes the largest. (Before
# the spilling v2 reduce was replaced it was 1.63-5.25 GiB.)
CUDA_CONTEXT_ESTIMATE = 1024 * MiB
# The profiler measured llama-3.1-8b's activations + graph pools (non-KV peak - weights) at 2.00x the live-set
# estimates below, on H100 and on H200 (2026-11, defaults: caching-allocator segments and sampler temporaries
# the estimates do not model). Plan charges 2.0x: at or below every measurement of docs/measured_kv_tokens.csv
# and within 2% of it (H100: llama-3.1-8b 1.9% below, qwen2.5-7b 1.1%, qwen3-8b 0.4%; FP8 KV 0.9%, 1.1%, 0.4%;
# H200: within 0.8%, qwen2.5-7b's FP8 cache equal at the 32-bit offset cap).
ACTIVATION_FACTOR = 2.0
# A hybrid model's graph pool and decode scratch are charged once, not at ACTIVATION_FACTOR: measured pools
# (incl. warmup) 0.79 GiB qwen3.5-27b H200, 0.54 qwen3.5-35b-a3b-fp8 H100, 0.21 qwen3.5-27b H100, against
# these rows' 0.95, 0.69 and 0.29 GiB unmargined (2026-11-27). Doubled, plan fell 2.8% and 3.6% below two of
# them: the declared v2 partials at 262,144 tokens (0.51-0.76 GiB) counted twice.
HYBRID_POOL_FACTOR = 1.0
# What the CUDA context holds when a hybrid's state slots are chosen (profiler.choose_state_slots: after the
# weights, before the stress reserves local memory): the measured non-torch less that reservation, 0.63 GiB
# (qwen3.5-27b, H100: 0.89 - 0.26) to 0.71 (H200: 0.97 - 0.26); from the free memory the profiler logged
# (28.25 GiB after 50.16 GiB of weights on an H100) 0.77 GiB. At least that, so plan never gives more slots.
CONTEXT_BEFORE_STRESS = 800 * MiB
# What --tp > 1 adds to the context before the stress: NCCL's communicators, set up before the weights.
# qwen3.5-122b-a10b-fp8 --tp 2 on 2 x H100 measured 20.45 GiB free after its 57.71 GiB of weights
# (2026-11-27): 1.02 GiB of context, against 0.77 at --tp 1.
TP_CONTEXT_BEFORE_STRESS = 384 * MiB
# NCCL's communicator buffers and what --tp adds beside them (non-torch, per rank, beyond the CUDA context
# row): 0.84 GiB per rank on 2xH200 at --tp 2 (NVLink multicast off); on 2 x H100 the measured non-torch was
# 2.49 GiB (deepseek-v2-lite) and 2.56 GiB (qwen3.5-122b-a10b-fp8), 0.44 GiB of it local memory for a kernel
# that spills only at --tp 2 (a stack of 1,744 B a thread): 1.56 GiB beyond the context row's 1.0. Larger TP
# degrees were not measured: a ring/tree all-reduce keeps two neighbours per channel, so the same is assumed.
NCCL_ESTIMATE = 1600 * MiB
# The prefill's live set at --tp > 1 measured 2.2x its estimate (qwen3.5-122b-a10b-fp8 --tp 2, H100: 2.68 GiB
# of prefill peak over the 1.22 GiB estimate; 2.0x at --tp 1): one measurement, so a factor of its own
ACTIVATION_FACTOR_TP = 2.2


@dataclass(frozen=True)
class Card:
    name: str
    total: int  # bytes, as the driver reports the whole card
    vendor: str  # "nvidia" | "amd" | "unknown"
    source: str


# Totals as the driver reports them (nvidia-smi / rocm-smi), not the marketing GB.
GPUS = MappingProxyType({
    "h100": Card("h100", 85_017_493_504, "nvidia", "torch.cuda.mem_get_info on an H100 80GB HBM3"),
    "h200": Card("h200", 150_109_880_320, "nvidia", "torch.cuda.mem_get_info on an H200"),
    "a100-80g": Card("a100-80g", 81920 * MiB, "nvidia", "nvidia-smi, A100-SXM4-80GB"),
    "a100-40g": Card("a100-40g", 40960 * MiB, "nvidia", "nvidia-smi, A100-SXM4-40GB"),
    "l40s": Card("l40s", 46068 * MiB, "nvidia", "nvidia-smi, L40S"),
    "mi300x": Card("mi300x", 205822885888, "amd", "rocm-smi VRAM Total Memory, MI300X"),
    "mi325x": Card("mi325x", 262128 * MiB, "amd", "PyTorch 'total capacity of 255.98 GiB', 256 GB Instinct"),
    "mi355x": Card("mi355x", 288 * GiB, "amd", "nominal 288 GiB HBM3E (no driver reading at hand)"),
})


def card_for(gpu: str | None, gpu_memory_gib: float | None) -> Card:
    """A known card by name, or a card of the given size (vendor unknown). Exactly one must be given."""
    if gpu is not None:
        return GPUS[gpu]
    assert gpu_memory_gib is not None and gpu_memory_gib > 0
    return Card(f"{gpu_memory_gib:g} GiB", int(gpu_memory_gib * GiB), "unknown", "--gpu_memory_gib")


@dataclass(frozen=True)
class Row:
    term: str
    bytes: int
    how: str  # input | exact | declared | ESTIMATED | assumed
    on_gpu: str  # how the profiler gets this term on the GPU
    note: str = ""


@dataclass(frozen=True)
class Plan:
    model: str
    architecture: str
    gpu: str
    gpu_source: str
    total: int
    tp: int
    attention_backend: str
    dtype: str
    kv_cache_dtype: str
    context_len: int
    page_size: int
    batch_max_tokens: int
    graph_max_batch_size: int
    mem_fraction: float
    cell_bytes: int
    fixed: tuple[Row, ...]  # subtracted from total before solving
    available: int  # total - fixed: what the T-sized terms share (before mem_fraction)
    tokens: int  # predicted max_total_token_num
    max_num_reqs: int
    sized: tuple[Row, ...]  # KV, workspace, request table at `tokens`
    slack: int  # available - sized: what mem_fraction and page rounding leave unused
    min_tokens: int  # budget.min_usable_tokens: the profiler refuses a target below this
    pinned_tokens: int | None
    warnings: tuple[str, ...]
    problem_flag: str | None = None  # set when the model cannot be served as configured on this card
    problem: str | None = None  # ... and why, with a value of that flag that works
    nnodes: int = 1  # hosts the ranks span (--nnodes), tp // nnodes GPUs each; every figure is per rank
    dp_attention: bool = False  # the layout: SGLang's --enable-dp-attention (plan only), else TP attention
    layouts: tuple[Layout, ...] = ()  # with dp_attention: both layouts' figures, side by side

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


@dataclass(frozen=True)
class Layout:
    """One layout's headline figures. The MLA latent is one shared head: under TP every rank caches every
    token's latent (the model holds a rank's tokens), under DP attention each rank its own requests' (the
    model holds ranks x a rank's tokens)."""

    name: str  # "tp" | "dp_attention"
    weights: int  # bytes per rank
    tokens: int  # KV tokens per rank
    model_tokens: int  # distinct KV tokens of the model
    prefill_tokens: int  # tokens one rank's attention runs in a prefill step
    decode_rows: int  # rows one rank's attention runs in a decode step
    context_len: int  # the longest request (cut when a rank's cache cannot hold the model's)


def rank_view(cfg: ServerConfig, dp_attention: bool) -> ServerConfig:
    """The config one rank's attention runs: cfg under TP; under DP attention (dp size = tp, as SGLang's
    `--tp N --dp N --enable-dp-attention`) every head on each rank (tp 1 for attention) and the step's
    prefill tokens and requests split over the ranks, as SGLang divides --chunked-prefill-size and
    --max-running-requests by dp. The MoE and dense layers still run every rank's tokens, gathered, at
    --tp."""
    if not dp_attention:
        return cfg
    reqs = cfg.running_max_req_size
    return cfg.replace(tp=1, nnodes=1, batch_max_tokens=max(cfg.batch_max_tokens // cfg.tp, 1),
                       graph_max_batch_size=max(cfg.graph_max_batch_size // cfg.tp, 1),
                       running_max_req_size=None if reqs is None else max(reqs // cfg.tp, 1))


def dp_attention_problem(cfg: ServerConfig) -> str | None:
    """Why --dp_attention does not apply to cfg (None when it does): a layout for MLA models under TP."""
    m = cfg.model_config
    if not m.is_mla:
        return (f"data-parallel attention is a layout for MLA models, whose one latent head TP replicates; "
                f"{m.name} ({m.architecture}) splits its KV heads under --tp already: drop "
                "--dp_attention, or try --model deepseek-v3")
    if cfg.tp == 1:
        return "needs --tp > 1 (one rank is both layouts); try --tp 8"
    return None


# ---------------------------------------------------------------- exact terms
@dataclass(frozen=True)
class WeightSplit:
    """Parameter counts by how tensor parallelism splits them (engine/parallel.py)."""

    layers: int  # attention and MLP linears (+ qkv bias): split by heads / intermediate columns
    vocab: int  # embedding (+ untied lm_head): vocab-parallel, ceil(vocab/tp) rows per rank
    replicated: int  # norms, q/k norms, MoE router, MLA's projections down: whole on every rank
    attention: int = 0  # of `layers`, the attention layers' split part

    def per_rank(self, m: ModelConfig, tp: int, dp_attention: bool = False) -> int:
        """Under DP attention (SGLang's layout): the attention layers and the embedding whole on every rank,
        lm_head vocab-parallel (the gathered tokens' logits), the MLP and experts split over tp."""
        tables = 1 if m.tie_word_embeddings else 2
        shard = math.ceil(m.vocab_size / tp) * m.hidden_size
        if not dp_attention:
            return self.layers // tp + tables * shard + self.replicated
        lm_head = 0 if m.tie_word_embeddings else shard
        return (self.attention + (self.layers - self.attention) // tp + m.vocab_size * m.hidden_size + lm_head
                + self.replicated)


def mla_replicated_params(m: ModelConfig) -> int:
    """One MLA layer's projections down and their norms (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa,
    kv_a_layernorm): whole on every rank (models.deepseek_v2.ReplicatedLinear)."""
    if not m.is_mla:
        return 0
    h, qr = m.hidden_size, m.q_lora_rank
    return (h * qr + qr if qr else 0) + h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank


def weight_split(m: ModelConfig) -> WeightSplit:
    h = m.hidden_size
    # norms and MLA's projections down: replicated
    attn = m.attention_params() - (2 * m.head_dim if m.qk_norm else 0) - mla_replicated_params(m)
    moe = m.moe_layers  # an MoE model's other layers are dense
    experts = (m.num_experts + m.n_shared_experts) * 3 * h * m.moe_intermediate_size
    experts += 3 * h * m.shared_expert_intermediate_size  # Qwen3.5's shared expert (its gate: replicated)
    mlp = moe * experts + (m.num_layers - moe) * 3 * h * m.intermediate_size
    # a hybrid's linear layers split by heads, but for the gated norm's weight (replicated)
    linear = m.linear_layers * (m.linear_attention_params() - m.linear_value_head_dim) if m.is_hybrid else 0
    layers = m.attention_layers * attn + linear + mlp
    vocab = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    return WeightSplit(layers, vocab, m.num_params() - layers - vocab, m.attention_layers * attn)


def rank_linears(m: ModelConfig, tp: int, dp_attention: bool = False) -> list:
    """One rank's FP8 linears: under DP attention the attention's whole (as at tp 1), the MLP's split."""
    if not dp_attention:
        return m.quantized_linears(tp)
    return ([q for q in m.quantized_linears(1) if ".self_attn." in q.name]
            + [q for q in m.quantized_linears(tp) if ".self_attn." not in q.name])


def weight_bytes(m: ModelConfig, dtype_bytes: int, tp: int, dp_attention: bool = False) -> int:
    """This rank's weights; DeepSeek's routers stay fp32 (as HF keeps them), replicated. FP8 linears: one
    byte a weight plus their fp32 scales (ModelConfig.quantized_linears); the rest (embeddings, lm_head,
    norms, routers, unconverted modules) in dtype. dp_attention: WeightSplit.per_rank's layout."""
    fp8 = rank_linears(m, tp, dp_attention)
    saved = sum(q.weight_elements for q in fp8) * (dtype_bytes - 1) - sum(q.scale_elements for q in fp8) * 4
    fp32 = fp32_router_params(m) + m.linear_layers * 2 * m.linear_num_value_heads // tp  # + A_log, dt_bias
    return weight_split(m).per_rank(m, tp, dp_attention) * dtype_bytes + fp32 * (4 - dtype_bytes) - saved


def fp8_text(m: ModelConfig, tp: int, dp_attention: bool = False) -> str:
    """The weights row's FP8 part: how many weights are one byte, and their scales."""
    fp8 = rank_linears(m, tp, dp_attention)
    if not fp8:
        return ""
    n, scales = sum(q.weight_elements for q in fp8), sum(q.scale_elements for q in fp8)
    return f"; {n:,} per rank in {m.weight_format} x 1 B + {scales:,} fp32 scales"


def fp32_router_params(m: ModelConfig) -> int:
    """DeepSeek's routers (models.deepseek_v2.DeepseekV2MoE) keep fp32 weights (V3: and its correction
    bias)."""
    if m.architecture not in MLA_ARCHITECTURES:
        return 0
    return m.moe_layers * m.num_experts * (m.hidden_size + (m.topk_method == "noaux_tc"))


def rope_dim(m: ModelConfig) -> int:
    """The channels RoPE rotates per head (MLA: its rope part; a hybrid's attention: its rotary_dim)."""
    return m.qk_rope_head_dim if m.is_mla else m.rotary_dim or m.head_dim


def rope_table_bytes(m: ModelConfig, context_len: int) -> int:
    """The model's cos/sin buffer: [max_req_total_len, rope dim] fp32."""
    return context_len * rope_dim(m) * 4


def resolve_backend(name: str, vendor: str) -> str:
    """What --attention_backend auto picks: native AITER on ROCm, AITER Triton elsewhere."""
    if name != "auto":
        return name
    return "aiter" if vendor == "amd" else "aiter_triton"


# ---------------------------------------------------------------- estimated terms
def layer_live_bytes(m: ModelConfig, tokens: int, tp: int, dtype_bytes: int, dp: int = 1) -> int:
    """Largest live set inside one decoder layer for `tokens` tokens on one rank: residual + normed input
    + fp32 RMSNorm temporary, then the larger of attention (qkv, attention output, o_proj output) and
    the MLP (gate_up, activation, down output; MoE: top-k copies of the hidden state in and out). FP8: the
    widest input a quantization kernel of its own makes, and a dense MLP's activation in FP8 where SiLU-mul's
    kernel quantizes it (ModelConfig.fp8_activation_bytes, dense_mlp_fp8_act).
    dp > 1 (DP attention): `tokens` are one rank's, its attention holds every head (tp // dp ranks split
    them), and the MLP runs the tokens of dp ranks gathered, with the gathered input live beside it."""
    h, attn_tp, gathered = m.hidden_size, tp // dp, tokens * dp
    q = m.num_heads * m.head_dim // attn_tp
    kv = max(m.num_kv_heads // attn_tp, 1) * m.head_dim
    attn = tokens * ((q + 2 * kv) + q + h) * dtype_bytes
    if m.num_experts:
        inter = m.num_experts_per_tok * m.moe_intermediate_size // tp
        mlp = gathered * (3 * inter + h + 2 * m.num_experts_per_tok * h) * dtype_bytes
    else:
        inter = m.intermediate_size // tp
        act = m.dense_mlp_fp8_act(gathered, tp)
        act = gathered * inter * dtype_bytes if act is None else act
        mlp = gathered * (2 * inter + h) * dtype_bytes + act
    mlp += gather_bytes(m, tokens, dp, dtype_bytes)
    mixer = max(attn, gdn_live_bytes(m, tokens, attn_tp, dtype_bytes))
    fp8 = max(m.fp8_activation_bytes(tokens, attn_tp), m.fp8_activation_bytes(gathered, tp))
    return tokens * (2 * h * dtype_bytes + 4 * h) + max(mixer, mlp) + fp8


def activation_margin(prefill: int, pools: int, hybrid: bool, tp: int = 1) -> int:
    """What plan adds to the activation rows (the prefill peak; the graph pools with the decode scratch):
    ACTIVATION_FACTOR x each (the prefill at ACTIVATION_FACTOR_TP under --tp), less the row itself; a
    hybrid's pools at HYBRID_POOL_FACTOR."""
    prefill_factor = ACTIVATION_FACTOR_TP if tp > 1 else ACTIVATION_FACTOR
    pool_factor = HYBRID_POOL_FACTOR if hybrid else ACTIVATION_FACTOR
    return int(prefill * (prefill_factor - 1) + pools * (pool_factor - 1))


def gather_bytes(m: ModelConfig, tokens: int, dp: int, dtype_bytes: int) -> int:
    """DP attention's all-gather before the MLP: the hidden states of dp ranks' `tokens` each (0 at dp 1)."""
    return tokens * dp * m.hidden_size * dtype_bytes if dp > 1 else 0


GDN_CHUNK = 64  # tokens of fla's chunked delta rule (layers.gdn.CHUNK)


def gdn_live_bytes(m: ModelConfig, tokens: int, tp: int, dtype_bytes: int) -> int:
    """A Gated DeltaNet layer's largest live set for `tokens` prefill tokens on one rank (0 without one): its
    projections (q|k|v, z) in the model dtype, then the larger of the conv (layers.gdn.conv_prefill: an fp32
    accumulator and a window input's gather, select and fp32 product, 14 B a channel) and the chunked delta
    rule (the conv's output, q and k expanded to the value heads, fla's fp32 [T, heads, dim] intermediates and
    one [heads, k, v] fp32 state per 64-token chunk). Three intermediates: fitted to the profiles of
    qwen3.5-27b and qwen3.5-35b-a3b on an H200 (docs/measured_kv_tokens.csv), plan 0.8% and 0.5% below."""
    if not m.is_hybrid:
        return 0
    c, vd, hv = m.conv_dim // tp, m.linear_value_dim // tp, m.linear_num_value_heads // tp
    width = max(m.linear_key_head_dim, m.linear_value_head_dim)
    projections = tokens * (c + vd) * dtype_bytes
    conv = tokens * c * (4 + 4 * dtype_bytes + 4)
    rule = (tokens * c * dtype_bytes + 2 * tokens * hv * m.linear_key_head_dim * dtype_bytes
            + 3 * tokens * hv * width * 4
            + -(-tokens // GDN_CHUNK) * hv * m.linear_key_head_dim * m.linear_value_head_dim * 4)
    return projections + max(conv, rule)


def sampling_bytes(rows: int, vocab: int, dtype_bytes: int) -> int:
    """Sampling `rows` requests on a GPU: the lm_head logits (dtype) and the one Triton kernel's 16 bytes per
    row (autoprofile.kernels.triton_sample: no scratch over the vocabulary, whatever the parameters)."""
    return rows * (vocab * dtype_bytes + 16)


def prefill_peak(m: ModelConfig, tokens: int, rows: int, tp: int, dtype_bytes: int, dp: int = 1) -> Row:
    """Layers run first, sampling after them (only the last hidden state is still live): the peak is the
    larger of the two, not their sum. dp > 1 (DP attention): `tokens` and `rows` are one rank's; the MLP and
    the vocab-parallel lm_head see every rank's, gathered (SGLang's default, without --enable-dp-lm-head)."""
    layers = layer_live_bytes(m, tokens, tp, dtype_bytes, dp)
    sample = sampling_bytes(rows * dp, m.vocab_size, dtype_bytes) + tokens * dp * m.hidden_size * dtype_bytes
    gather = gib(gather_bytes(m, tokens, dp, dtype_bytes))
    gathered = f"; the MLP's input gathered from {dp} ranks ({gather:.2f} GiB)" if dp > 1 else ""
    return Row("prefill activation peak", max(layers, sample), "ESTIMATED", "measured in the probe peak",
               f"max of one layer's live set for --batch_max_tokens {tokens} ({gib(layers):.2f} GiB: "
               "residual, normed input, fp32 norm temp, then qkv + attention output or gate_up + activation "
               f"+ down output{gathered}) and sampling {rows * dp} rows over vocab {m.vocab_size} "
               f"({gib(sample):.2f} GiB: logits in dtype, the fused Triton sampler's 16 bytes per row, final "
               "hidden states)")


def mla_expanded_prefix(cfg: ServerConfig, m: ModelConfig, prefill: Row) -> Row:
    """MLA's chunk over the longest cached prefix (the stress's corner: prefix + chunk = the context) expands
    every key inside its attention call, while no MLP temporary is live: the row is what that attention
    phase holds beyond the prefill peak row with its margin (exact arithmetic of the tensors
    models.deepseek_v2 makes, so no margin of its own)."""
    tp, db, h = cfg.tp, DTYPE_BYTES[cfg.dtype], m.hidden_size
    heads, chunk = m.num_heads // tp, cfg.batch_max_tokens
    keys = budget.mla_expanded_bytes(cfg.context_len, heads, m.kv_lora_rank, m.qk_rope_head_dim,
                                     m.qk_nope_head_dim, m.v_head_dim, db)
    # the chunk's own: residual, normed input, fp32 norm temp, queries, attention output, o_proj output
    width = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    own = chunk * ((2 * h + width + h) * db + 4 * h)
    return Row("MLA expanded prefix", max(keys + own - int(ACTIVATION_FACTOR * prefill.bytes), 0), "declared",
               "measured in the probe peak",
               f"a chunk over a {cfg.context_len}-token prefix expands {heads} heads' keys and values of "
               f"every latent ({gib(keys):.2f} GiB): what passes the prefill peak and its margin")


def graph_static_bytes(m: ModelConfig, gmbs: int, context_len: int, page_size: int, dtype_bytes: int) -> int:
    """Static graph inputs/outputs: ids, positions, slot mapping (int64), seq lens (int32), block tables
    [gmbs, ceil(context/page)] int32, output hidden states."""
    return gmbs * (3 * 8 + 4 + math.ceil(context_len / page_size) * 4 + m.hidden_size * dtype_bytes)


def pieces_row(cfg: ServerConfig, m: ModelConfig, backend: str, dtype_bytes: int) -> Row:
    """The piecewise graphs' pool (engine.piecewise): every bucket's pieces share one pool, the largest
    bucket's layer live set and final hidden states, beside the static inputs (ids, positions, slots: int64)
    and the input and output buffers the eager parts read and write between pieces (piece_widths). Charged
    without the activation margin: llama-3.1-8b's measured 68.0 MiB at 512 tokens (H100, 2026-11-28) against
    this row's 76.0 MiB."""
    tokens = piecewise_max_tokens(cfg, backend)
    if not tokens:
        return Row("piecewise graph pool", 0, "exact", "none",
                   "no piecewise graphs here (--piecewise_cuda_graph_max_tokens 0, --tp, an MLA or vision "
                   "model, --deterministic, or no decode graphs)")
    static = tokens * (3 * 8 + (sum(piece_widths(m)) + m.hidden_size) * dtype_bytes)
    return Row("piecewise graph pool", layer_live_bytes(m, tokens, 1, dtype_bytes) + static, "ESTIMATED",
               "measured in the probe peak", f"the pieces of every bucket up to {tokens} tokens share one "
               f"pool: the largest bucket's layer live set, its static inputs, QKV and attention output")


def piece_widths(m: ModelConfig) -> tuple[int, int]:
    """The widest eager part between two pieces, per token: (its inputs, its output) in elements. An
    attention layer reads q, k, v (packed; a gated attention's q is a tensor of its own beside the packed
    projection and its gate) and writes the heads' output; a Gated DeltaNet layer reads q|k|v, z and b|a
    and writes the value heads' output (engine.piecewise.PiecewiseGraphs.static_inputs)."""
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    attention = (3 * q + 2 * kv if m.attn_output_gate else q + 2 * kv, q)
    if not m.is_hybrid:
        return attention
    linear = (2 * m.linear_key_dim + 2 * m.linear_value_dim + 2 * m.linear_num_value_heads,
              m.linear_value_dim)
    return max(attention[0], linear[0]), max(attention[1], linear[1])


def decode_scratch(cfg: ServerConfig, m: ModelConfig, backend: str) -> Row:
    """Per-call decode scratch at graph_max_batch_size; inside graphs it stays in the pool for good."""
    gmbs, ctx, tp = cfg.graph_max_batch_size, cfg.context_len, cfg.tp
    q_heads = m.num_heads // tp
    where = "graph pool" if not cfg.disable_cudagraph else "eager decode peak"
    rows = max(running_reqs(cfg.running_max_req_size, gmbs), gmbs)  # the most decode rows
    if backend == "aiter_triton" and m.is_mla:
        if cfg.deterministic:  # a fixed split count for up to the most decode rows (and a paged prefill's
            # token rows in groups of them)
            splits = launch_rules.MLA_INVARIANT_SPLITS
            n = launch_rules.mla_partials_bytes(rows, q_heads, m.kv_lora_rank, splits)
            what = f"{splits} splits (--deterministic) of {rows} rows"
        else:
            n = launch_rules.mla_decode_scratch_bytes(rows, q_heads, m.kv_lora_rank)
            what = (f"the most of 1..{rows} rows ({launch_rules.MLA_SPLIT_PROGRAMS} programs: "
                    f"{launch_rules.mla_kv_splits(1)} splits at 1 row)")
        n += budget.mla_unmeasured_reserve_bytes(gmbs, ctx)
        return Row("decode attention scratch", n, "declared", f"measured in the probe ({where})",
                   f"MLA decode: the splits' partials, {what}, and the old kernel's token slots ({gmbs} x "
                   f"{ctx}) until re-measured")
    if backend == "aiter_triton":  # our split decode: FP8 pages at every row count, bf16 at SPLIT_DECODE_ROWS
        kv_heads = max(m.num_kv_heads // tp, 1)
        small = rows if cfg.kv_dtype_bytes == 1 else min(rows, launch_rules.SPLIT_DECODE_ROWS)
        n = budget.split_decode_peak_scratch_bytes(small, q_heads, kv_heads, m.head_dim, ctx)
        note = (f"split decode partials at the most of 1..{small} rows x {q_heads} heads (fewer rows split "
                "more)" if n else "split decode runs one split here: no scratch")
        if small < rows:  # AITER's v1/v2 past them (a cache past the 32-bit limit takes ours there too:
            # AiterTritonBackend.decode, measured by the validation)
            part = launch_rules.TRITON_PARTITION if cfg.disable_cudagraph else \
                launch_rules.triton_decode_partition(gmbs, q_heads, ctx, cfg.page_size)
            v2 = budget.triton_decode_scratch_bytes(gmbs, q_heads, m.head_dim, ctx, DTYPE_BYTES[cfg.dtype],
                                                    part)
            if v2 > n:
                n, note = v2, (f"AITER Triton v2 partials for {gmbs} seqs x {q_heads} heads x "
                               f"ceil({ctx}/{part}) partitions")
        return Row("decode attention scratch", n, "declared", f"measured in the probe ({where})", note)
    if backend == "torch":
        kv_heads = max(m.num_kv_heads // tp, 1)
        n = 2 * gmbs * budget.round_up(ctx, cfg.page_size) * kv_heads * m.head_dim * cfg.kv_dtype_bytes
        return Row("decode attention scratch", n, "ESTIMATED", f"measured in the probe ({where})",
                   f"torch SDPA reads dense K/V: pages of {gmbs} seqs x {ctx} tokens gathered per layer")
    return Row("decode attention scratch", 0, "declared", "none",
               "native AITER decode uses its persistent workspace (solved with T below)")


def nccl_row(tp: int, nnodes: int = 1) -> Row:
    if tp == 1:
        return Row("NCCL buffers", 0, "exact", "none", "")
    across = f"; across --nnodes {nnodes} hosts (network transport) not measured either" if nnodes > 1 else ""
    return Row("NCCL buffers", NCCL_ESTIMATE, "ESTIMATED", "measured: NVML per-process use - reserved",
               f"NCCL communicator buffers and what --tp adds per rank: {gib(NCCL_ESTIMATE):.2f} GiB "
               f"measured on 2 x H100 at --tp 2; assumed the same at larger --tp (not measured){across}")


# The vision tower's activation peak in one encoder step (Qwen2.5-VL 7B's tower, bf16), fitted to the H100
# measurements of tests/test_qwen2_5_vl_gpu.py (2026-11-23: 4 images of 448 / 1036 / 2044 px -> 245 / 4,662 /
# 64,510 MiB): a part per padded window slot and a part per (patches of the largest image)^2, from the
# full-attention layers' scores. Those measurements ran the full-attention layers through SDPA's math path
# (3-D calls; now 4-D, so flash or memory-efficient): the quadratic part should be gone, not re-measured yet,
# so the estimate errs on the safe side. At the default stress (4 images of 512 x 10 patches) it estimates 4.2
# GiB; the profile measured ~3.1 GiB above qwen2.5-7b's non-KV peak (math path).
ENCODER_BYTES_PER_SLOT = 21_500
ENCODER_BYTES_PER_SCORE = 145


def encoder_activation_bytes(images: int, grid: tuple[int, int, int], window: int = 8) -> int:
    """The tower's activation peak for `images` images of `grid` (t, h, w) patches in one encoder step."""
    t, h, w = grid
    slots = images * t * -(-h // window) * -(-w // window) * window * window
    return slots * ENCODER_BYTES_PER_SLOT + (h * w) ** 2 * ENCODER_BYTES_PER_SCORE


def vision_rows(cfg: ServerConfig, db: int) -> list[Row]:
    """A vision-language model's encoder: its weights (replicated on every rank), the declared output buffer
    (encoder_images slots of the largest image's tokens) and the activation peak of the stress's encoder
    step."""
    from autoprofile.engine.envelope import VisionLimits
    m = cfg.model_config
    v = VisionLimits(cfg.visual_batch_size, cfg.min_image_pixels, cfg.max_image_pixels,
                     cfg.max_images_per_request)
    rows_per_step = min(running_reqs(cfg.running_max_req_size, cfg.graph_max_batch_size),
                        cfg.batch_max_tokens)
    lim = v.limits(rows_per_step, cfg.batch_max_tokens)
    images, grid = lim["encoder_images"], v.worst_grid
    tokens = grid[0] * grid[1] * grid[2] // 4
    return [
        Row("vision encoder weights", m.vision.num_params() * db, "exact", "measured in the probe peak",
            f"{m.vision.num_params():,} params x {db} B, replicated on every rank"),
        Row("encoder output buffer", images * tokens * m.hidden_size * db, "declared",
            "measured in the probe peak",
            f"{images} images (--visual_batch_size) x {tokens} tokens x hidden"),
        Row("encoder activation peak", encoder_activation_bytes(images, grid), "ESTIMATED",
            "measured in the probe peak", f"{images} images of {grid[1]} x {grid[2]} patches (the stress's "
            "encoder step: the most patches, then the most windows); fitted to H100 measurements"),
    ]


def weights_row(cfg: ServerConfig, dp_attention: bool) -> Row:
    m, tp, db = cfg.model_config, cfg.tp, DTYPE_BYTES[cfg.dtype]
    split = weight_split(m)
    if dp_attention:
        return Row("weights", weight_bytes(m, db, tp, True), "exact", "measured in the probe peak",
                   f"{m.num_params():,} params x {db} B, DP attention: attention ({split.attention:,}), "
                   "embedding, norms, routers and MLA's projections down whole on every rank, MLP and "
                   f"experts ({split.layers - split.attention:,}) split over {tp} ranks, lm_head "
                   "vocab-parallel"
                   + fp8_text(m, tp, True))
    return Row("weights", weight_bytes(m, db, tp), "exact", "measured in the probe peak",
               f"{m.num_params():,} params x {db} B: layers ({split.layers:,}) split over {tp} rank(s), "
               f"embedding/lm_head ({split.vocab:,}) vocab-parallel, norms, routers, MLA's "
               f"projections down ({split.replicated:,}) replicated"
               + fp8_text(m, tp))


def fixed_rows(cfg: ServerConfig, backend: str, dp_attention: bool = False) -> tuple[Row, ...]:
    """What is subtracted before T is solved, per rank. dp_attention: one rank's attention runs
    rank_view(cfg) (every head, its share of the step's tokens and rows), its MLP the ranks' gathered."""
    m, tp, db = cfg.model_config, cfg.tp, DTYPE_BYTES[cfg.dtype]
    dp = tp if dp_attention else 1
    cfg, tp_cfg = rank_view(cfg, dp_attention), cfg
    gmbs, bmt = cfg.graph_max_batch_size, cfg.batch_max_tokens
    rows = [
        Row("CUDA context, non-torch", CUDA_CONTEXT_ESTIMATE, "ESTIMATED",
            "measured: NVML per-process use - reserved",
            "~1.0 GiB per process as measured on an H100 (torch 2.11, CUDA 13; no spilling kernel); "
            "NCCL's buffers are the next row"),
        nccl_row(tp, tp_cfg.nnodes),
        weights_row(tp_cfg, dp_attention),
        Row("rope table", rope_table_bytes(m, cfg.context_len), "exact", "measured in the probe peak",
            f"cos/sin [{cfg.context_len}, {rope_dim(m)}] fp32"),
        prefill_peak(m, bmt, min(gmbs, bmt), tp, db, dp),
    ]
    if cfg.disable_cudagraph:
        rows.append(Row("decode graph pools", 0, "exact", "none", "--disable_cudagraph"))
    else:
        graphs = budget.decode_graph_keys(gmbs, cfg.context_len)
        pool = (layer_live_bytes(m, gmbs, tp, db, dp) + gmbs * dp * m.vocab_size * db
                + graph_static_bytes(m, gmbs, cfg.context_len, cfg.page_size, db))
        rows.append(Row("decode graph pools", pool, "ESTIMATED", "measured in the probe peak",
                        f"{len(graphs)} graphs (batch x max_seq_len bucket) share one pool: the largest "
                        f"({gmbs} seqs) layer live set, ONE "
                        f"logits buffer [{gmbs}, vocab] that every graph writes, static buffers incl. block "
                        f"tables for {cfg.context_len} tokens"))
    rows.append(decode_scratch(cfg, m, backend))
    margin = activation_margin(rows[4].bytes, sum(r.bytes for r in rows[5:]), m.is_hybrid, tp)
    rows.append(pieces_row(tp_cfg, m, backend, db))  # no margin: the estimate is above the measured pool
    if m.is_mla:  # exact arithmetic: no margin on it
        rows.append(mla_expanded_prefix(cfg, m, rows[4]))
    if m.vision is not None:
        rows += vision_rows(cfg, db)
    rows += [
        Row("activation margin", margin, "assumed", "measured: the probe peak replaces the estimates",
            f"{(ACTIVATION_FACTOR_TP if tp > 1 else ACTIVATION_FACTOR) - 1:g} x the prefill peak, "
            + ("nothing on the graph pools and decode scratch (a hybrid's, measured within them)"
               if m.is_hybrid else f"{ACTIVATION_FACTOR - 1:g} x the graph pools and decode scratch")
            + ": the profiler measured 2.00x these estimates (llama-3.1-8b, H100 and H200), the prefill "
            "2.2x at --tp 2; plan stays at or below the measurement"),
        Row("canary", cfg.canary_bytes, "input", "allocated through validation",
            f"--canary_mb {cfg.canary_mb}"),
        Row("peers (other processes)", 0, "assumed", "measured: NVML / mem_get_info", "an idle card"),
        Row("driver reserve", budget.DRIVER_RESERVE, "exact", "never handed out",
            "the driver refuses the last MiBs of a card"),
    ]
    return tuple(rows)


# ---------------------------------------------------------------- the plan
def sizing_for(cfg: ServerConfig, backend: str) -> budget.Sizing:
    """The Sizing the engine uses: the backend's declared persistent workspace (native AITER's; 0 for the
    others) solved together with T."""
    m = cfg.model_config
    q_heads = m.num_heads // cfg.tp

    def workspace(rows: int, longest: int) -> int:
        return budget.persistent_workspace_bytes(backend, rows, longest, q_heads, m.head_dim)

    reqs = running_reqs(cfg.running_max_req_size, cfg.graph_max_batch_size)  # the envelope's rows
    wide = budget.wide_offsets(backend, cfg.deterministic)
    cap = budget.max_indexable_tokens(*budget.cache_shape(m, cfg.tp), cfg.page_size, wide)  # as the runner's
    checkpoints = budget.state_checkpoints(reqs, not cfg.disable_prefix_caching,
                                           cfg.state_checkpoints)  # as the runner builds them
    state = (budget.state_cache_bytes(m, reqs, DTYPE_BYTES[cfg.dtype], cfg.tp, checkpoints) if m.is_hybrid
             else (0, 0))
    return budget.Sizing(budget.cell_bytes_for(m, cfg.kv_dtype_bytes, cfg.tp), cfg.context_len, cfg.page_size,
                         running_reqs=reqs, decode_rows=reqs, workspace=workspace, max_tokens=cap,
                         state=state)


def with_state_slots(cfg: ServerConfig, card: Card) -> ServerConfig:
    """A hybrid model's request slots as the profiler chooses them (profiler.choose_state_slots): without
    --running_max_req_size, the envelope's decode rows unless their state would take more than
    budget.STATE_SHARE of what the card has free after the weights (its CUDA context and the weights on
    paper).
    Any other model, or slots given: cfg unchanged."""
    m = cfg.model_config
    if not m.is_hybrid or cfg.running_max_req_size is not None:
        return cfg
    db = DTYPE_BYTES[cfg.dtype]
    context = CONTEXT_BEFORE_STRESS + (TP_CONTEXT_BEFORE_STRESS if cfg.tp > 1 else 0)
    free = card.total - context - weight_bytes(m, db, cfg.tp)
    slots = budget.state_slots(running_reqs(None, cfg.graph_max_batch_size), free, m.state_bytes(cfg.tp, db))
    return cfg.replace(running_max_req_size=slots, graph_max_batch_size=min(cfg.graph_max_batch_size, slots))


def sized_rows(sizing: budget.Sizing, tokens: int, backend: str) -> tuple[Row, ...]:
    reqs = sizing.running_reqs
    table = sizing.table_reserved(tokens)
    workspace = sizing.workspace_reserved(tokens)
    ws_note = (f"{sizing.decode_rows} decode rows x q heads x ceil(min({sizing.context_len}, T)/256) "
               f"partitions x (4*head_dim + 8)"
               if backend == "aiter" else "none persistent for this backend")
    state = (Row("state slots", sum(map(budget.reserved_bytes, sizing.state)), "declared",
                 "allocated at the target (solved with T)",
                 f"({reqs} request slots + the pad slot + the prefix cache's state checkpoints) x (conv "
                 "window + delta-rule matrices) of every linear layer: a hybrid model's second cache"),
             ) if any(sizing.state) else ()
    return (
        Row("KV cache", tokens * sizing.cell_bytes, "exact", "allocated at the target",
            f"T x {sizing.cell_bytes:,} B/token"),
        *state,
        Row("attention workspace", workspace, "declared", "allocated at the target (solved with T)", ws_note),
        Row("request table", table, "declared", "allocated at the target (solved with T)",
            f"{reqs} reqs x ceil({sizing.context_len}/{sizing.page_size}) x int32"),
    )


def plan_warnings(cfg: ServerConfig, backend: str) -> tuple[str, ...]:
    if backend == "torch" and not cfg.disable_cudagraph:
        return ("the torch backend is the numerical reference: its decode gathers dense K/V at "
                "--max_req_total_len inside the graph pool; use aiter_triton for serving.",)
    return ()


def predicted_tokens(cfg: ServerConfig, card: Card) -> int:
    """The solver's T for cfg on card (what make_plan predicts), nothing else."""
    cfg = with_state_slots(cfg, card)
    backend = resolve_backend(cfg.attention_backend, card.vendor)
    available = card.total - sum(r.bytes for r in fixed_rows(cfg, backend))
    return budget.solve_target_tokens(available, sizing_for(cfg, backend), cfg.mem_fraction)


def _fits(cfg: ServerConfig, card: Card, **change) -> bool:
    try:
        c = validate(cfg.replace(**change), serving=False)
    except ConfigError:
        return False
    return predicted_tokens(c, card) >= c.min_usable_tokens


def _halvings(value: int, lowest: int) -> list[int]:
    out = []
    while value // 2 >= lowest:
        value //= 2
        out.append(value)
    return out


def _context_that_fits(cfg: ServerConfig, card: Card) -> int | None:
    """The longest --max_req_total_len (a page multiple) whose smallest usable cache fits."""
    lo, hi = 1, cfg.context_len // cfg.page_size - 1  # in pages
    if hi < lo or not _fits(cfg, card, max_req_total_len=lo * cfg.page_size):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _fits(cfg, card, max_req_total_len=mid * cfg.page_size) else (lo, mid - 1)
    return lo * cfg.page_size


def serving_problem(cfg: ServerConfig, card: Card, backend: str, tokens: int) -> tuple[str, str] | None:
    """(flag, message with a value of that flag that works) when the model cannot be served as
    configured on this card; None when it can. The flag blamed is the first one whose change fixes it."""
    m = cfg.model_config
    if not m.runnable:
        return "model", unsupported_architecture(m.architecture)
    if backend == "aiter" and card.vendor == "nvidia":
        return "attention_backend", (f"'aiter' is AITER's native ROCm kernel set and does not run on "
                                     f"{card.name} "
                                     "(NVIDIA); try --attention_backend aiter_triton")
    if backend == "aiter_triton" and DTYPE_BYTES[cfg.dtype] == 4:
        return "dtype", "aiter_triton runs bfloat16/float16; try --dtype bfloat16"
    floor = cfg.min_usable_tokens
    if cfg.max_total_token_num is not None and cfg.max_total_token_num > tokens:
        fix = (f"try --max_total_token_num {tokens}" if tokens >= floor else
               "no pinned size fits: leave it unset and see the other messages")
        return "max_total_token_num", (f"{cfg.max_total_token_num} tokens are above the {tokens} predicted "
                                       f"on "
                                       f"{card.name}: validation would fail; {fix}")
    if tokens >= floor:
        return None
    why = (f"the predicted cache on {card.name} is {tokens} tokens, below the smallest usable cache of "
           f"{floor} "
           f"(one request of --max_req_total_len {cfg.context_len}, one prefill batch of --batch_max_tokens "
           f"{cfg.batch_max_tokens}, a page for each of the {decode_rows_text(cfg)}, plus the pad page)")
    if cfg.mem_fraction < 1 and _fits(cfg, card, mem_fraction=1.0):
        return "mem_fraction", f"{cfg.mem_fraction} scales the budget down: {why}; try --mem_fraction 1.0"
    if cfg.canary_mb > 256 and _fits(cfg, card, canary_mb=256):
        return "canary_mb", f"a {cfg.canary_mb} MiB canary leaves too little: {why}; try --canary_mb 256"
    if cfg.running_max_req_size is not None:  # it sets the decode rows of the floor: blamed before the others
        for n in _halvings(cfg.running_max_req_size, cfg.graph_max_batch_size):
            if _fits(cfg, card, running_max_req_size=n):
                return "running_max_req_size", f"{why}; try --running_max_req_size {n}"
    for n in _halvings(cfg.batch_max_tokens, 256):
        if _fits(cfg, card, batch_max_tokens=n):
            return "batch_max_tokens", (f"its prefill activations are too large: {why}; "
                                        f"try --batch_max_tokens {n}")
    for n in _halvings(cfg.graph_max_batch_size, 1):
        if _fits(cfg, card, graph_max_batch_size=n):
            return "graph_max_batch_size", f"{why}; try --graph_max_batch_size {n}"
    ctx = _context_that_fits(cfg, card)
    if ctx is not None:
        return "max_req_total_len", f"{why}; try --max_req_total_len {ctx}"
    for tp in (2, 4, 8):
        if tp > cfg.tp and tp % cfg.nnodes == 0 and _fits(cfg, card, tp=tp):
            return "tp", f"{why}; try --tp {tp} (one GPU per rank)"
    return "model", (f"{m.name} does not fit on {card.name} with any single flag changed: {why}; "
                     "use a bigger card")


def make_plan(cfg: ServerConfig, card: Card, dp_attention: bool = False) -> Plan:
    """Pure: the budget breakdown and the predicted max_total_token_num for `cfg` on `card` (per TP rank),
    and, when it cannot be served so, the flag to change (Plan.problem_flag / Plan.problem). With
    --max_req_total_len auto, a context that does not fit is cut as the profiler cuts it (config.context_cut
    of the predicted or pinned size). dp_attention (an MLA model under TP; dp_attention_problem): the DP
    attention layout on paper, with both layouts' figures in Plan.layouts."""
    plan = _cut(cfg, card, dp_attention)
    if not dp_attention:
        return plan
    return dataclasses.replace(plan, layouts=(layout_of(_cut(cfg, card, False)), layout_of(plan)))


def _cut(cfg: ServerConfig, card: Card, dp_attention: bool) -> Plan:
    plan = _plan(cfg, card, dp_attention)
    rank = rank_view(cfg, dp_attention)
    fits = context_cut(rank, cfg.max_total_token_num or plan.tokens)
    if fits is None:
        return plan
    cut = _plan(cfg.replace(max_req_total_len=fits), card, dp_attention)
    why = (f"--max_req_total_len auto: one request of {cfg.context_len} tokens needs a cache of "
           f"{rank.min_usable_tokens} tokens; serving requests of at most {fits} tokens (set "
           f"--max_req_total_len to choose)")
    return dataclasses.replace(cut, warnings=(why, *cut.warnings))


def layout_of(p: Plan) -> Layout:
    weights = next(r.bytes for r in p.fixed if r.term == "weights")
    ranks = p.tp if p.dp_attention else 1
    return Layout("dp_attention" if p.dp_attention else "tp", weights, p.tokens, p.tokens * ranks,
                  p.batch_max_tokens, p.max_num_reqs, p.context_len)


def _plan(cfg: ServerConfig, card: Card, dp_attention: bool = False) -> Plan:
    cfg = with_state_slots(cfg, card)
    backend = resolve_backend(cfg.attention_backend, card.vendor)
    fixed = fixed_rows(cfg, backend, dp_attention)
    available = card.total - sum(r.bytes for r in fixed)
    rank = rank_view(cfg, dp_attention)
    sizing = sizing_for(rank, backend)
    tokens = budget.solve_target_tokens(available, sizing, cfg.mem_fraction)
    sized = sized_rows(sizing, tokens, backend)
    problem = dp_problem(rank, tokens) if dp_attention else serving_problem(cfg, card, backend, tokens)
    gpu = card.name if card.vendor != "unknown" or cfg.attention_backend != "auto" else \
        f"{card.name} (vendor unknown: auto = aiter_triton; pass --attention_backend aiter for ROCm)"
    return Plan(
        model=cfg.model_config.name, architecture=cfg.model_config.architecture, gpu=gpu,
        gpu_source=card.source,
        total=card.total, tp=cfg.tp, nnodes=cfg.nnodes, attention_backend=backend, dtype=cfg.dtype,
        kv_cache_dtype=cfg.kv_dtype_name,
        context_len=cfg.context_len, page_size=cfg.page_size, batch_max_tokens=rank.batch_max_tokens,
        graph_max_batch_size=rank.graph_max_batch_size, mem_fraction=cfg.mem_fraction,
        cell_bytes=sizing.cell_bytes, fixed=fixed, available=available, tokens=tokens,
        max_num_reqs=sizing.running_reqs, sized=sized, slack=available - sum(r.bytes for r in sized),
        min_tokens=rank.min_usable_tokens, pinned_tokens=cfg.max_total_token_num,
        warnings=plan_warnings(cfg, backend),
        problem_flag=problem[0] if problem else None, problem=problem[1] if problem else None,
        dp_attention=dp_attention,
    )


def dp_problem(rank: ServerConfig, tokens: int) -> tuple[str, str] | None:
    """The DP attention layout's one problem on paper: a rank's cache below its smallest usable cache."""
    if tokens >= rank.min_usable_tokens:
        return None
    why = (f"a rank's predicted cache is {tokens} tokens, below the smallest usable cache of "
           f"{rank.min_usable_tokens} (one request of {rank.context_len} tokens, a prefill of "
           f"{rank.batch_max_tokens}, a page for each of {decode_rows_text(rank)})")
    return "dp_attention", f"{why}; drop --dp_attention (the TP layout splits the attention weights)"


# ---------------------------------------------------------------- text
def _line(sign: str, r: Row) -> str:
    return f"  {sign} {r.term:<28} {gib(r.bytes):>9.2f} {r.bytes:>16,}  {r.how:<9}  {r.on_gpu}"


def mla_replication_lines(p: Plan) -> list[str]:
    """MLA under TP: the latent is one shared head, so every rank caches every token's whole latent."""
    if p.architecture not in MLA_ARCHITECTURES or p.tp == 1:
        return []
    return [f"  MLA latent replicated on all {p.tp} ranks (one shared head, not split by TP): "
            f"KV tokens per rank = KV tokens of the model ({p.tokens:,})"]


def hosts_text(p: Plan) -> str:
    dp = f", DP attention: each rank its own requests' latents, MoE and MLP at --tp {p.tp}" \
        if p.dp_attention else ""
    if p.nnodes == 1:
        return f"--tp {p.tp}{dp}"
    return f"--tp {p.tp} over --nnodes {p.nnodes}: {p.nnodes} hosts x {p.tp // p.nnodes} GPUs{dp}"


def layout_lines(p: Plan) -> list[str]:
    """Both layouts side by side (plan --dp_attention)."""
    if not p.layouts:
        return []
    lines = ["", f"  layouts on {p.tp} ranks (TP: every rank caches every token's latent; DP attention: each "
                 "rank its own requests', the model holds ranks x a rank's tokens):",
             f"    {'layout':<13} {'weights GiB':>11} {'KV tokens/rank':>15} {'KV tokens, model':>17} "
             f"{'prefill/rank':>12} {'decode rows/rank':>16} {'context':>8}"]
    return lines + [f"    {x.name:<13} {gib(x.weights):>11.2f} {x.tokens:>15,} {x.model_tokens:>17,} "
                    f"{x.prefill_tokens:>12,} {x.decode_rows:>16,} {x.context_len:>8,}" for x in p.layouts]


def format_plan(p: Plan) -> str:
    head = [
        f"autoprofile plan: {p.model} ({p.architecture}) on {p.gpu}, per TP rank ({hosts_text(p)})",
        f"  attention backend {p.attention_backend}, weights {p.dtype}, KV {p.kv_cache_dtype}, "
        f"context {p.context_len} tokens, page {p.page_size}, --batch_max_tokens {p.batch_max_tokens}, "
        f"--graph_max_batch_size {p.graph_max_batch_size}, --mem_fraction {p.mem_fraction}",
        "",
        f"    {'term':<28} {'GiB':>9} {'bytes':>16}  {'how':<9}  on the GPU",
        f"    {'GPU total':<28} {gib(p.total):>9.2f} {p.total:>16,}  {'input':<9}  measured: "
        f"mem_get_info ({p.gpu_source})",
    ]
    body = [_line("-", r) for r in p.fixed]
    body.append(f"  = {'available for T-sized terms':<28} {gib(p.available):>9.2f} {p.available:>16,}")
    body += [_line("-", r) for r in p.sized]
    body.append(f"  = {'slack (mem_fraction, pages)':<28} {gib(p.slack):>9.2f} {p.slack:>16,}")
    kv = p.sized[0].bytes
    tail = [
        "",
        f"  KV per token: {p.cell_bytes:,} B ({p.cell_bytes / 1024:.2f} KiB) over all layers, this rank",
        *([] if p.dp_attention else mla_replication_lines(p)),
        f"  predicted --max_total_token_num: {p.tokens:,} tokens ({gib(kv):.2f} GiB KV), "
        f"max_num_reqs {p.max_num_reqs}",
        "  solved as: largest page-aligned T with",
        "             T x cell <= (available - workspace(T) - table(T)) x mem_fraction",
        "  how: exact = arithmetic; declared = the allocation's own formula;",
        "       ESTIMATED = a guess the profiler replaces with a measurement on the GPU",
    ]
    tail += layout_lines(p)
    notes = ["", "  notes:"] + [f"    {r.term}: {r.note}" for r in (*p.fixed, *p.sized) if r.note]
    warns = [""] + [f"  WARNING: {w}" for w in p.warnings] if p.warnings else []
    problem = ["", f"  CANNOT SERVE AS CONFIGURED: --{p.problem_flag}: {p.problem}"] if p.problem else []
    return "\n".join(head + body + tail + notes + warns + problem)
