"""AITER's Triton kernels (runs on NVIDIA and ROCm): paged decode, the MoE experts (kernels.triton_moe), MLA's
varlen prefill (and the prefill on ROCm or at head sizes that are no power of two); our own Triton kernels
beside them: the varlen prefill on NVIDIA (triton_prefill), RMSNorm, SiLU * up, RoPE + KV store, the decode
reduce.

A bf16/fp16 cache's decode calls paged_attn_decode_v1 directly with float scales: AITER's wrapper
(paged_attention_decode) reads k_scale.item(), which a CUDA graph cannot capture. v1/v2 is chosen by
the wrapper's own rule, from static values only (batch, heads, max_seq_len), so a captured graph
replays the same kernels. The v2 path (decode_v2) launches AITER's partition kernel and our reduce
(triton_reduce): AITER's reduce spills (docs/design.md, "Local memory is memory"). An FP8 cache's decode is
our split-KV kernel (triton_decode): AITER's converts every FP8 element through fp32 and runs per query
head; ours reads each page once per GQA group and takes the scales as device tensors.
"""
from __future__ import annotations

import torch

from autoprofile import budget
from autoprofile.kernels import (launch_rules, triton_decode, triton_kv_gather, triton_mla_absorb,
                                 triton_prefill, triton_reduce, triton_rope)
from autoprofile.kernels.aiter_loader import is_rocm, load_aiter_triton
from autoprofile.layers import gdn
from autoprofile.layers.attention import (AttentionBackend, AttentionMetadata, KVLayer, output_rows,
                                          write_into)
from autoprofile.layers.moe import GroupedTopk, Routing
from autoprofile.layers.quant import Fp8Rows, Fp8Scheme

SEQ_PARTITION = launch_rules.TRITON_PARTITION  # pa_decode._SEQ_PARTITION_SIZE (checked at load)
MIN_PAGE_SIZE = 16  # pages of 1 token fail to compile
# No `waves_per_eu`: an AMD-only launch option that fails on NVIDIA.
PREFILL_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "PRELOAD_V": False, "num_warps": 4, "num_ctas": 1,
                  "num_stages": 2}
# Per NVIDIA compute capability, from scripts/tune_prefill.py on that GPU (T=8192 causal and a 2048-token
# chunk over a 32768-token prefix, each checked against torch SDPA). Others take PREFILL_CONFIG.
PREFILL_CONFIGS: dict[str, dict] = {
    # scripts/tune_prefill.py on an H100 (docs/measurements.md, "Kernel choices")
    "sm_90": {"BLOCK_M": 128, "BLOCK_N": 128, "PRELOAD_V": True, "num_warps": 8, "num_ctas": 1,
              "num_stages": 3},
}
# A call whose longest request reads at most SHORT_PREFILL_KEYS keys (a serving step of 1k prompts: 8 x 1,024
# tokens) takes the short entry where one exists (AITER's here, triton_prefill's on NVIDIA): scripts/
# tune_prefill.py's `batch` shape. The stress runs both: its corners of many short rows and of one long chunk.
SHORT_PREFILL_KEYS = triton_prefill.SHORT_KEYS
PREFILL_CONFIGS_SHORT: dict[str, dict] = {
    "sm_90": {"BLOCK_M": 64, "BLOCK_N": 64, "PRELOAD_V": False, "num_warps": 4, "num_ctas": 1,
              "num_stages": 2},
}


# heads wider than 128 channels (Qwen3.5's 256): the tuned tiles' shared memory exceeds an H100/H200's 227 KiB
# (BLOCK_M 128, BLOCK_N 128, 3 stages at head_dim 256 asked 448 KiB); these take 64 x 32 tiles in 2 stages
WIDE_HEAD_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 32, "PRELOAD_V": False, "num_warps": 4, "num_ctas": 1,
                    "num_stages": 2}


def for_head_dim(config: dict | None, head_dim: int) -> dict | None:
    """A prefill launch config that fits shared memory at this head width."""
    return dict(WIDE_HEAD_CONFIG) if head_dim > 128 else config


def prefill_config(short: bool = False) -> dict | None:
    """AITER's varlen prefill launch config for the current GPU (a copy: its launcher may consume it); short:
    the one for calls of at most SHORT_PREFILL_KEYS keys a request, None where none is tuned."""
    key = triton_prefill.capability()
    if short:
        return dict(PREFILL_CONFIGS_SHORT[key]) if key in PREFILL_CONFIGS_SHORT else None
    return dict(PREFILL_CONFIGS.get(key, PREFILL_CONFIG))


def use_v1(num_seqs: int, num_q_heads: int, max_seq_len: int, partition: int = SEQ_PARTITION) -> bool:
    """AITER's rule (launch_rules.triton_decode_uses_v1: plan needs it without torch)."""
    return launch_rules.triton_decode_uses_v1(num_seqs, num_q_heads, max_seq_len, partition)


def decode_v2(pa, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, compute_type,
              num_kv_heads: int, scale: float, partition: int) -> None:
    """AITER's v2 partition kernel (module `pa`: aiter.ops.triton._triton_kernels.pa_decode) in partitions of
    `partition` tokens, then triton_reduce. Allocates what AITER's paged_attn_decode_v2 allocates
    (budget.triton_decode_scratch_bytes), in its layout; k/v scales 1.0, no ALiBi."""
    import triton

    rows, q_heads, head_dim = q.shape
    group = q_heads // num_kv_heads
    parts = -(-max_seq_len // partition)
    page = k_cache.shape[2]
    shape = (rows, num_kv_heads, parts, group) if group > 1 else (rows, q_heads, parts)
    max_logits = torch.empty(shape, dtype=torch.float32, device=q.device)
    exp_sums = torch.empty(shape, dtype=torch.float32, device=q.device)
    partials = torch.empty((*shape, head_dim), dtype=out.dtype, device=q.device)
    common = dict(compute_type=compute_type, HEAD_SZ=head_dim, HEAD_SZ_POW2=triton.next_power_of_2(head_dim),
                  QUERY_GRP_SZ=group, KV_BLK_SZ=page, KV_BLK_SZ_POW2=triton.next_power_of_2(page),
                  SEQ_PARTITION_SZ=partition)
    if group > 1:
        pa._paged_attn_decode_v2_w_dot_kernel[(rows, num_kv_heads, parts)](
            exp_sums, max_logits, partials, q, k_cache, v_cache, block_tables, seq_lens, scale, 1.0, 1.0,
            None, *exp_sums.stride()[:3], *partials.stride()[:4], *q.stride()[:2], *k_cache.stride()[:3],
            block_tables.stride(0),
            QUERY_GRP_SZ_POW2=max(16, triton.next_power_of_2(group)), **common)  # tl.dot needs >= 16 rows
    else:
        pa._paged_attn_decode_v2_wo_dot_kernel[(q_heads, rows, parts)](
            exp_sums, max_logits, partials, q, k_cache, v_cache, block_tables, seq_lens, scale, 1.0, 1.0,
            None, *exp_sums.stride()[:2], *partials.stride()[:3], *q.stride()[:2], *k_cache.stride()[:3],
            *block_tables.stride()[:2],
            MAX_NUM_BLKS_PER_SEQ=block_tables.shape[1], MAX_SEQ_LEN_POW2=max_seq_len, **common)
    triton_reduce.reduce_partitions(out, exp_sums, max_logits, partials, seq_lens, partition)


class AiterTritonBackend(AttentionBackend):
    """--deterministic: every attention call (prefill chunks over their cached prefix, decode rows, graphs
    and eager) is AITER's unified kernel at one config (triton_unified), every linear layer our fixed-tile
    GEMM (kernels.triton_matmul); RMSNorm, SiLU * up, RoPE and the sampler are one program per row already."""

    name = "aiter_triton"
    moe_capturable = True
    batch_invariant_on_gpu = True
    # bf16/fp16 caches through our split decode (triton_decode) at up to this many rows, AITER's v1/v2 past
    # them (a benchmark's 0: AITER at every row count); FP8 caches always take it
    split_decode_rows = launch_rules.SPLIT_DECODE_ROWS

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, deterministic: bool = False):
        super().__init__(num_q_heads, num_kv_heads, head_dim, page_size, dtype, device, deterministic)
        if dtype not in (torch.bfloat16, torch.float16):  # the model's dtype; the cache may be FP8
            raise ValueError(f"aiter_triton runs bfloat16/float16, not {dtype}; "
                             "try --attention_backend torch")
        if page_size < MIN_PAGE_SIZE:
            raise ValueError(f"aiter_triton needs pages of >= {MIN_PAGE_SIZE} tokens, got {page_size}")
        self.aiter = load_aiter_triton()
        if self.aiter.seq_partition_size != SEQ_PARTITION:
            raise RuntimeError(f"this amd-aiter decodes in partitions of {self.aiter.seq_partition_size} "
                               f"tokens, autoprofile's workspace arithmetic assumes {SEQ_PARTITION}")
        import triton.language as tl

        self.compute_type = tl.bfloat16 if dtype == torch.bfloat16 else tl.float16
        self.triton_prefill = triton_prefill if triton_prefill.serves(head_dim, is_rocm()) else None
        # the prefill kernel's (long, short) launch configs on this GPU; each call picks by its longest row
        self.prefill_config, self.prefill_config_short = (
            triton_prefill.configs(triton_prefill.capability()) if self.triton_prefill is not None
            else (prefill_config(), prefill_config(short=True)))
        self.triton_rope = triton_rope if head_dim & (head_dim - 1) == 0 else None  # tl.arange: powers of two
        from autoprofile.kernels import triton_act, triton_mla, triton_moe, triton_norm, triton_route

        self.triton_act, self.triton_norm = triton_act, triton_norm
        self.triton_mla, self.triton_moe, self.triton_route = triton_mla, triton_moe, triton_route
        self.max_decode_rows = self.graph_rows = 0  # set by build: MLA's compiled row counts
        from autoprofile.kernels import triton_fp8, triton_gemv, triton_matmul, triton_unified

        self.triton_gemv, self.triton_matmul, self.triton_unified = triton_gemv, triton_matmul, triton_unified
        self.triton_fp8 = triton_fp8
        from autoprofile.kernels import triton_gdn

        self.triton_gdn = triton_gdn

    @property
    def paged_prefill(self) -> bool:
        return self.deterministic

    @property
    def gemm(self):
        """--deterministic: the fixed-tile GEMM; else one row through our GEMV (the batch-1 decode: cuBLAS
        leaves bandwidth behind there), more through cuBLAS."""
        return self.triton_matmul.linear if self.deterministic else self.triton_gemv.linear

    @property
    def gemm_add(self):
        """One row: the residual added in our GEMV's epilogue; more: cuBLAS's addmm_. None under
        --deterministic (its GEMM)."""
        return None if self.deterministic else self.triton_gemv.linear_add

    @property
    def router_gemm(self):
        """One row through our GEMV (fp32 out, no fp32 copy of x); None under --deterministic (its GEMM)."""
        return None if self.deterministic else self.triton_gemv.router_linear

    @property
    def fp8_gemm(self):
        """FP8 weights (TP.fp8_matmul, kernels.triton_fp8): one row through our W8A16 GEMV (one byte a
        weight), more rows quantized, then cuBLASLt's row-wise _scaled_mm ("channel") or our block-scaled
        GEMM ("block")."""
        return self.triton_fp8.linear

    def unified(self, q: torch.Tensor, kv: KVLayer, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                cu_seqlens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """--deterministic's attention (triton_unified): q's tokens split by cu_seqlens over the cache."""
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = output_rows(out, q)
        return self.triton_unified.attention(out, q, kv.k, kv.v, block_tables, seq_lens, cu_seqlens,
                                             self.scale, kv.scales)

    def build(self, max_decode_rows: int, max_context_len: int, graph_rows: int = 0) -> None:
        self.max_decode_rows, self.graph_rows = max_decode_rows, graph_rows  # MLA's compiled row counts

    def mla_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
        """AITER's varlen flash attention with MLA's widths (q/k nope + rope, v narrower), its default launch
        config (the tuned ones are for head_dim 128)."""
        cu_k, max_k = meta.keys()
        return self.aiter.flash_attn_varlen_func(q, k, v, meta.cu_seqlens, cu_k, meta.max_seqlen, max_k,
                                               softmax_scale=scale, causal=True, config=dict(PREFILL_CONFIG))

    def mla_decode(self, q: torch.Tensor, kv: KVLayer, meta: AttentionMetadata, scale: float,
                   v_dim: int) -> torch.Tensor:
        """Our MLA decode over the paged latent cache (kernels.triton_mla), its splits at the padded row
        count. --deterministic: a fixed split count, and a paged prefill's token rows
        (MLAttention._paged_prefill) in groups of the envelope's most decode rows, so every launch holds a
        decode's scratch at most."""
        mla = self.triton_mla
        if not self.deterministic:
            rows = mla.padded_rows(q.shape[0], self.graph_rows, self.max_decode_rows)
            return mla.mla_decode(q, kv.k, meta.block_tables, meta.seq_lens, scale, v_dim, rows)
        group = self.max_decode_rows or q.shape[0]
        launch = (mla.INVARIANT_SPLITS, mla.CONFIG)
        parts = [mla.mla_decode(q[a:a + group], kv.k, meta.block_tables[a:a + group],
                                meta.seq_lens[a:a + group], scale, v_dim,
                                mla.padded_rows(min(group, q.shape[0] - a), self.graph_rows,
                                                self.max_decode_rows), launch)
                 for a in range(0, q.shape[0], group)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, quant=None, add: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """AITER's Triton MoE kernels (kernels.triton_moe): sizes follow the tokens, never the routing. quant
        (layers.quant.MoeQuant): FP8 experts, their inputs quantized per token or per 128-group. The addends
        join the top-k sum's one kernel (moe_sum)."""
        return self.triton_moe.fused_moe(x, w13, w2, weights, ids, quant, self.deterministic, add)

    def route_experts(self, logits: torch.Tensor, top_k: int, renormalize: bool, scale: float,
                      routing: Routing,
                      grouped: GroupedTopk | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One Triton launch (triton_route) instead of ~12 torch ops: the top-k and the forced routing; the
        greedy router's (route_topk) or noaux_tc's when grouped (biased_grouped_topk)."""
        if grouped is not None:
            return self.triton_route.biased_grouped_topk(
                logits, grouped.e_score_correction_bias, top_k, grouped.num_expert_group, grouped.topk_group,
                renormalize, scale, routing.mode)
        return self.triton_route.route_topk(logits, top_k, renormalize, scale, routing.mode)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """One Triton kernel (triton_act) instead of silu, a [T, I] temporary and the product."""
        return self.triton_act.silu_mul(x)

    def silu_mul_quant(self, x: torch.Tensor, scheme: Fp8Scheme) -> Fp8Rows:
        """One Triton kernel: SiLU-mul's rows quantized in it (triton_fp8), no [T, I] bf16 tensor."""
        return self.triton_fp8.silu_mul_quant(x, scheme)

    def gather_kv(self, kv: KVLayer, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One Triton launch for K and V (triton_kv_gather) instead of two advanced-indexing kernels."""
        return self.dequantize_kv(kv, *triton_kv_gather.gather(kv.k, kv.v, slots))

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer,
                   slot_mapping: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One fused Triton kernel (triton_rope) instead of ~15 torch ops per layer. A calibrating step
        (an FP8 cache's scales set from its K/V) takes the torch ops: the rotated K must be seen whole."""
        if self.triton_rope is None or self.calibrating:
            return super().rope_store(qkv, cos, sin, kv, slot_mapping)
        return self.triton_rope.rope_store(qkv, cos, sin, kv.k, kv.v, slot_mapping, self.num_q_heads,
                                           self.num_kv_heads, self.head_dim, kv.scales)

    def norm_rope_store(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
                        cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer,
                        slot_mapping: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Qwen3's q/k norm, RoPE and the KV store in the one rope_store kernel (two norms, ~20 torch ops and
        two index_puts per layer before); q, k, v are views of qkv, normed and rotated in place."""
        if self.triton_rope is None or self.calibrating:
            return super().norm_rope_store(qkv, q_norm, k_norm, eps, cos, sin, kv, slot_mapping)
        return self.triton_rope.rope_store(qkv, cos, sin, kv.k, kv.v, slot_mapping, self.num_q_heads,
                                           self.num_kv_heads, self.head_dim, kv.scales, (q_norm, k_norm, eps))

    def gated_norm_rope_store(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
                              cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer, slot_mapping: torch.Tensor,
                              rotary_dim: int) -> tuple[torch.Tensor, ...]:
        """Qwen3.5's q/k norm, partial RoPE and the KV store in the one rope_store kernel (two norms, ~20
        torch ops and two index_puts per layer before); q a new tensor, k and v views of qkv."""
        if self.triton_rope is None or self.calibrating:
            return super().gated_norm_rope_store(qkv, q_norm, k_norm, eps, cos, sin, kv, slot_mapping,
                                                 rotary_dim)
        return self.triton_rope.rope_store(qkv, cos, sin, kv.k, kv.v, slot_mapping, self.num_q_heads,
                                           self.num_kv_heads, self.head_dim, kv.scales, (q_norm, k_norm, eps),
                                           rotary_dim, gated=True)

    def mla_absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """Up to triton_mla_absorb.MAX_ROWS rows: one kernel (the weights read once, q_pe copied beside);
        more: the einsum and the cat."""
        if self.deterministic or not triton_mla_absorb.absorb_serves(q_nope, q_pe, w_uk):
            return super().mla_absorb(q_nope, q_pe, w_uk)
        return triton_mla_absorb.absorb(q_nope, q_pe, w_uk)

    def mla_unabsorb(self, o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        if self.deterministic or not triton_mla_absorb.unabsorb_serves(o_lat, w_uv):
            return super().mla_unabsorb(o_lat, w_uv)
        return triton_mla_absorb.unabsorb(o_lat, w_uv)

    def mla_rope_store(self, q: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer, slot_mapping: torch.Tensor,
                       nope: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One Triton kernel (triton_rope.mla_rope_store) instead of the rope ops, the norm, the cat and the
        latent's index_put (~25 small kernels per layer); in place: views of q and kv_a."""
        rope = q.shape[-1] - nope
        if (rope & (rope - 1) or kv.k.dtype != kv_a.dtype or q.stride(-1) != 1 or kv_a.stride(-1) != 1
                or kv_a.stride(0) != kv_a.shape[1]):
            return super().mla_rope_store(q, kv_a, norm_weight, eps, cos, sin, kv, slot_mapping, nope)
        return triton_rope.mla_rope_store(q, kv_a, norm_weight, eps, cos, sin, kv.k, slot_mapping, nope)

    @staticmethod
    def per_call_workspace_bytes(num_seqs: int, q_heads: int, head_dim: int, max_seq_len: int,
                                 out_bytes: int, partition: int = SEQ_PARTITION) -> int:
        """Scratch one decode call allocates (v2 only: partial outputs, exp-sums and max-logits);
        inside a CUDA graph it stays in the graph's pool. Not declared to the solver: the probe
        captures graphs at the serving max_seq_len and measures it."""
        return budget.triton_decode_scratch_bytes(num_seqs, q_heads, head_dim, max_seq_len, out_bytes,
                                                  partition)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv: KVLayer | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """With a cached prefix, cu_seqlens_k differs from cu_seqlens: the causal mask is aligned bottom-right
        (both triton_prefill's and AITER's: offs_n + seqlen_q - seqlen_k), which is what a chunk over its
        prefix needs. --deterministic: the unified kernel over the cache (the chunk's K/V stored before)."""
        if self.deterministic:
            return self.unified(q, kv, meta.block_tables, meta.seq_lens, meta.cu_seqlens, out)
        cu_k, max_k = meta.keys()
        config = for_head_dim(triton_prefill.pick_config(max_k, self.prefill_config, self.prefill_config_short),
                              self.head_dim)
        if self.triton_prefill is not None:
            return self.triton_prefill.prefill(output_rows(out, q), q, k, v, meta.cu_seqlens, cu_k,
                                               meta.max_seqlen, max_k, self.scale, config)
        return write_into(out, self.aiter.flash_attn_varlen_func(
            q, k, v, meta.cu_seqlens, cu_k, meta.max_seqlen, max_k, softmax_scale=self.scale, causal=True,
            config=config))

    def decode(self, q: torch.Tensor, kv: KVLayer, meta: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Requires seq_lens >= 1 (a 0-length row divides by a zero exp-sum) and max_seq_len >=
        every seq_len; max_seq_len must be static (--max_req_total_len) for graphs.

        An FP8 cache, a bf16 one at up to split_decode_rows rows, or one whose layer view passes
        budget.INDEX_LIMIT elements (AITER's kernels offset pages in 32 bits; ours in 64): our split decode
        (triton_decode), which reads the scales, device values that the first batch may set after capture,
        inside the kernel. Else AITER's v1 or v2."""
        if meta.max_seq_len < 1:
            raise ValueError(f"decode needs a static max_seq_len >= 1, got {meta.max_seq_len}")
        if self.deterministic:  # one query token per row: the same kernel and tiles as a prefill chunk
            return self.unified(q, kv, meta.block_tables, meta.seq_lens, meta.query_starts(), out)
        k_cache, v_cache = kv.k, kv.v
        # q may be a view of the packed projection: the kernels take its row and head strides (unit dim
        # stride)
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = output_rows(out, q)
        if (kv.scales is not None or q.shape[0] <= self.split_decode_rows
                or k_cache.numel() > budget.INDEX_LIMIT):  # AITER's page offsets would wrap there
            scales = (kv.scales[0], kv.scales[1]) if kv.scales is not None else (None, None)
            return triton_decode.decode(out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                        meta.max_seq_len, self.scale, *scales)
        args = (out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len,
                self.compute_type, self.num_kv_heads, self.scale, None, 1.0, 1.0)
        if use_v1(q.shape[0], self.num_q_heads, meta.max_seq_len):
            self.aiter.paged_attn_decode_v1(*args)
        else:
            partition = self.decode_partition(q.shape[0],
                                              meta.max_seq_len) if meta.captured else SEQ_PARTITION
            decode_v2(self.aiter.pa_kernels, out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                      meta.max_seq_len, self.compute_type, self.num_kv_heads, self.scale, partition)
        return out

    def decode_partition(self, num_seqs: int, max_seq_len: int) -> int:
        return launch_rules.triton_decode_partition(num_seqs, self.num_q_heads, max_seq_len, self.page_size)

    def delta_rule_decode(self, q, k, v, g, beta, ssm, slots) -> torch.Tensor:
        """Our kernel (triton_gdn): each row's state tile read and written once, in place by slot."""
        return self.triton_gdn.decode(q, k, v, g, beta, ssm, slots)

    def gdn_decode(self, *args, out: torch.Tensor | None = None) -> torch.Tensor:
        """triton_gdn.decode_layer: conv, gates, rule and norm in 1 to 3 launches (launch_rules)."""
        return self.triton_gdn.decode_layer(*args, out=out)

    def gdn_prefill(self, qkv, z, ba, conv_weight, a_log, dt_bias, norm_weight, eps, conv, ssm,
                    meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Our conv (two launches: the rows' outputs as fla takes them, the windows moved on; each token's
        row found once a forward), our gates (one launch), fla's chunked rule over the rows' states (key
        heads not repeated: fla groups the value heads), our gated norm: in place of
        layers.gdn.prefill_layer's torch ops (~460 ms of a 1,055 ms mixed step of qwen3.5-27b on an H100: 8 x
        1,024 fresh tokens, scripts/profile_decode.py --prefill 8)."""
        t, hv, kd, vd = qkv.shape[0], ssm.shape[1], ssm.shape[2], ssm.shape[3]
        hk = (qkv.shape[1] - hv * vd) // (2 * kd)
        slots, cu = meta.state_slots, meta.cu_seqlens
        rows = meta.once("gdn_token_rows", lambda: self.triton_gdn.token_rows(cu, t))
        q, k, v = self.triton_gdn.conv_prefill(qkv, conv_weight, conv, slots, cu, hk, kd, hv, vd, rows)
        # fla's int64 cu_seqlens once a forward and its chunk indices from the step's upload (the runner's):
        # derived by fla in each layer they cost a host sync a layer (48 a step of qwen3.5-27b)
        cu64 = meta.once("gdn_cu_seqlens", cu.long)
        g, beta = self.triton_gdn.gates(ba, a_log, dt_bias)
        o = gdn.delta_rule_prefill(q, k, v, g, beta, ssm, slots, cu64, meta.gdn_chunk_indices)
        return self.triton_gdn.gated_rms_norm(o, z, norm_weight, eps, out)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Our one-program-per-row kernel (triton_norm): one compile serves every row count."""
        return self.triton_norm.rms_norm(x, weight, eps)

    def rms_norm_quant(self, x: torch.Tensor, weight: torch.Tensor, eps: float, scheme: Fp8Scheme) -> Fp8Rows:
        """One Triton kernel: the norm's rows quantized in it (triton_fp8)."""
        return self.triton_fp8.rms_norm_quant(x, weight, eps, scheme)
