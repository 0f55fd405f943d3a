"""DeepSeek-V2 (-Lite) and V3 / R1 / Kimi-K2: multi-head latent attention (MLA) over a latent cache, and MoE
layers with shared experts (the first `first_k_dense_replace` layers dense). V3 differs in its router only
(noaux_tc: sigmoid scores, a per-expert correction bias for the choice, layers.moe.biased_grouped_topk) and
in the multi-token-prediction layer its checkpoints carry, which is not built.

MLA. Per token and layer the cache holds one latent (kv_lora_rank + qk_rope_head_dim wide, 576 for
V2-Lite, shared by every head): c = RMSNorm(W_DKV x) and the rotated rope key k_pe.
  Prefill (expanded): each head's k_nope and v come from c through kv_b_proj; keys [k_nope | k_pe], queries
    [q_nope | q_pe]; attention as usual (a chunk over a cached prefix expands the prefix's latents too).
  Decode (absorbed): q_nope goes into the latent space through each head's k-part of kv_b_proj
    (q_lat = W_UK^T q_nope), so scores = [q_lat | q_pe] . [c | k_pe] read the cache directly, as one shared
    head; the output o_lat = sum p c leaves through each head's v-part (o = W_UV o_lat).
The rope part rotates channel pairs (2i, 2i + 1) (DeepSeek's complex product) with YaRN frequencies; the
softmax scale is qk_head_dim^-0.5 times YaRN's mscale(factor, mscale_all_dim)^2.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from autoprofile.layers.attention import AttentionBackend, AttentionMetadata, KVLayer
from autoprofile.layers.moe import FusedMoE, GroupedTopk, Routing
from autoprofile.layers.parallel import TP, ColumnParallelLinear, RowParallelLinear, new_param
from autoprofile.layers.quant import dequantize_weight
from autoprofile.model_config import Fp8Scheme, ModelConfig
from models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel, RMSNorm, yarn_mscale

log = logging.getLogger(__name__)


def mla_softmax_scale(mc: ModelConfig) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim) squared when the config has one."""
    scale = (mc.qk_nope_head_dim + mc.qk_rope_head_dim) ** -0.5
    s = mc.rope_scaling or {}
    if s.get("rope_type", s.get("type")) == "yarn" and s.get("mscale_all_dim"):
        scale *= yarn_mscale(s["factor"], s["mscale_all_dim"]) ** 2
    return scale


class ReplicatedLinear(ColumnParallelLinear):
    """y = x W^T (+ b), the whole weight on every rank (FP8: through the model's TP.linear_fp8)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, tp: TP = TP(),
                 quant: Fp8Scheme | None = None):
        super().__init__(in_features, [out_features], bias, TP(), dtype, quant)
        self.tp = tp  # the model's GEMMs (no shard: built with one rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.tp.linear_fp8(x, self, self.bias)
        return self.tp.linear(x, self.weight, self.bias)


class MLAttention(nn.Module):
    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP, dtype: torch.dtype):
        super().__init__()
        self.backend, self.tp = backend, tp
        self.heads = mc.num_heads // tp.size
        self.nope, self.rope, self.v_dim = mc.qk_nope_head_dim, mc.qk_rope_head_dim, mc.v_head_dim
        self.rank = mc.kv_lora_rank
        self.scale = mla_softmax_scale(mc)
        qk = mc.num_heads * (self.nope + self.rope)
        self.q_lora = mc.q_lora_rank > 0
        quant = mc.quant_for
        if self.q_lora:
            self.q_a_proj = ReplicatedLinear(mc.hidden_size, mc.q_lora_rank, mc.attention_bias, dtype, tp,
                                             quant("self_attn.q_a_proj"))
            self.q_a_layernorm = RMSNorm(mc.q_lora_rank, mc.rms_norm_eps, backend, dtype)
            self.q_b_proj = ColumnParallelLinear(mc.q_lora_rank, [qk], False, tp, dtype,
                                                 quant("self_attn.q_b_proj"))
        else:
            self.q_proj = ColumnParallelLinear(mc.hidden_size, [qk], False, tp, dtype,
                                               quant("self_attn.q_proj"))
        bias = mc.attention_bias
        self.kv_a_proj_with_mqa = ReplicatedLinear(mc.hidden_size, self.rank + self.rope, bias, dtype, tp,
                                                   quant("self_attn.kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(self.rank, mc.rms_norm_eps, backend, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.rank, [mc.num_heads * (self.nope + self.v_dim)], False, tp,
                                              dtype, quant("self_attn.kv_b_proj"))
        self.o_proj = RowParallelLinear(mc.num_heads * self.v_dim, mc.hidden_size, bias, tp, dtype,
                                        quant("self_attn.o_proj"))

    def forward(self, x: torch.Tensor, rope, meta: AttentionMetadata, kv: KVLayer,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(-1, self.heads, self.nope + self.rope)
        q_nope = q[..., :self.nope]
        q_pe, latent = self.backend.mla_rope_store(q, self.kv_a_proj_with_mqa(x), self.kv_a_layernorm.weight,
                                                   self.kv_a_layernorm.eps, *rope, kv, meta.slot_mapping,
                                                   self.nope)
        if not meta.is_prefill:
            return self.o_proj(self._decode(q_nope, q_pe, kv, meta), residual)
        if self.backend.paged_prefill:  # --deterministic: every new token a decode row over the cache
            return self.o_proj(self._paged_prefill(q_nope, q_pe, kv, meta), residual)
        o_decode = None
        if meta.decode is not None:  # a mixed step: its decode rows' tokens come last
            n = q.shape[0] - meta.decode.slot_mapping.shape[0]
            o_decode = self._decode(q_nope[n:], q_pe[n:], kv, meta.decode)
            q_nope, q_pe, latent = q_nope[:n], q_pe[:n], latent[:n]
        if meta.kv_slots is not None:  # chunks over cached prefixes: the prefix's latents too
            latent = self.backend.gather_latent(kv, meta.kv_slots)
        o = self._prefill(q_nope, q_pe, latent, meta)
        if o_decode is not None:
            o = torch.cat([o, o_decode])
        return self.o_proj(o, residual)

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """Expanded: every key's k_nope and v decompressed per head."""
        c, k_pe = latent.split([self.rank, self.rope], dim=-1)
        kv = self.kv_b_proj(c).view(-1, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.heads, -1)], dim=-1)
        o = self.backend.mla_prefill(q, k, v, meta, self.scale)
        return o.reshape(-1, self.heads * self.v_dim)

    def _paged_prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: KVLayer,
                       meta: AttentionMetadata) -> torch.Tensor:
        """--deterministic (the backend's paged_prefill): the prefill tokens absorbed, each a decode row over
        its own prefix in the latent cache (their latents are stored), so a token's attention is the same
        kernel and splits whatever chunk or step it comes in, a decode step and a preemption's recompute
        included. A mixed step's decode rows (last) follow as decode rows."""
        n = q_nope.shape[0] - (0 if meta.decode is None else meta.decode.slot_mapping.shape[0])
        o = self._decode(q_nope[:n], q_pe[:n], kv, meta.token_rows())
        if meta.decode is None:
            return o
        return torch.cat([o, self._decode(q_nope[n:], q_pe[n:], kv, meta.decode)])

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: KVLayer,
                meta: AttentionMetadata) -> torch.Tensor:
        """Absorbed: the query into the latent space, the output out of it, per head."""
        w = dense_weight(self.kv_b_proj, q_nope.dtype).view(self.heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)  # [H, nope, rank], [H, v, rank]
        if self.backend.deterministic:
            return self._decode_per_head(q_nope, q_pe, kv, meta, w_uk, w_uv)
        o_lat = self.backend.mla_decode(self.backend.mla_absorb(q_nope, q_pe, w_uk), kv, meta, self.scale,
                                        self.rank)
        return self.backend.mla_unabsorb(o_lat, w_uv)

    def _decode_per_head(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: KVLayer, meta: AttentionMetadata,
                         w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """_decode with each head's absorption through the batch-invariant GEMM (a batched einsum's cuBLAS
        kernel follows the row count): 2 x heads GEMMs."""
        w_ku = w_uk.transpose(1, 2).contiguous()  # [H, rank, nope]: the GEMM's [N, K] weight
        q_lat = torch.stack([self.tp.linear(q_nope[:, h], w_ku[h]) for h in range(self.heads)], dim=1)
        o_lat = self.backend.mla_decode(torch.cat([q_lat, q_pe], dim=-1), kv, meta, self.scale, self.rank)
        o = torch.stack([self.tp.linear(o_lat[:, h], w_uv[h]) for h in range(self.heads)], dim=1)
        return o.reshape(-1, self.heads * self.v_dim)


def dense_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's W in dtype (an FP8 one dequantized: MLA's absorbed decode multiplies by its parts)."""
    if getattr(layer, "quant", None) is None:
        return layer.weight
    return dequantize_weight(layer.weight, layer.weight_scale, layer.quant, dtype)


def route_group_limited(logits: torch.Tensor, mc: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's group-limited router on fp32 logits: softmax, the top-k within the topk_group best of
    n_group expert groups, times routed_scaling_factor; no renormalisation. (fp32 weights, int32 ids). The
    greedy one is layers.moe.route, through the backend (FusedMoE.select)."""
    scores = logits.softmax(dim=-1)
    groups = scores.view(-1, mc.n_group, mc.num_experts // mc.n_group).amax(dim=-1)
    keep = torch.zeros_like(groups).scatter_(1, torch.topk(groups, mc.topk_group, dim=-1)[1], 1.0)
    scores = scores.masked_fill(~keep.repeat_interleave(mc.num_experts // mc.n_group, 1).bool(), 0.0)
    weights, ids = torch.topk(scores, mc.num_experts_per_tok, dim=-1)
    return weights * mc.routed_scaling_factor, ids.to(torch.int32)


class DeepseekV2MoE(nn.Module):
    """Routed experts (an fp32 router, as HF keeps it) plus shared experts (one dense MLP of
    n_shared_experts x moe_intermediate_size) on every token. noaux_tc (V3): the router's
    e_score_correction_bias [E] (fp32) beside its weight."""

    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP, dtype: torch.dtype,
                 routing: Routing, layer: int | None = None):
        super().__init__()
        self.config, self.tp = mc, tp
        self.gate = nn.Module()
        self.gate.weight = new_param((mc.num_experts, mc.hidden_size), torch.float32)
        if mc.topk_method == "noaux_tc":
            self.gate.e_score_correction_bias = new_param((mc.num_experts,), torch.float32)
        self.experts = FusedMoE(mc.num_experts, mc.num_experts_per_tok, mc.hidden_size,
                                mc.moe_intermediate_size, tp, dtype, backend, routing,
                                mc.quant_for("mlp.experts", layer))
        shared = mc.moe_intermediate_size * mc.n_shared_experts
        self.shared_experts = LlamaMLP(mc, backend, tp, dtype, shared, "mlp.shared_experts",
                                       layer) if shared else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        mc, logits = self.config, self.tp.router_logits(x, self.gate.weight)
        if mc.topk_method == "greedy":
            weights, ids = self.experts.select(logits, False, mc.routed_scaling_factor)
        elif mc.topk_method == "noaux_tc":  # the backend's router, the forced routing after it
            grouped = GroupedTopk(self.gate.e_score_correction_bias, mc.n_group, mc.topk_group)
            weights, ids = self.experts.select(logits, mc.norm_topk_prob, mc.routed_scaling_factor, grouped)
        else:
            weights, ids = route_group_limited(logits, mc)
            ids = self.experts.force(ids)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        return self.experts(x, weights, ids, add=(shared, residual))  # one sum on aiter_triton (moe_sum)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    attention_cls, moe_cls = MLAttention, DeepseekV2MoE


class DeepseekV2Model(LlamaModel):
    layer_cls = DeepseekV2DecoderLayer

    @staticmethod
    def rope_dim(mc: ModelConfig) -> int:
        return mc.qk_rope_head_dim


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """HF's parameter names; the dense MLPs' gate/up (shared experts too) are packed, the routed experts
    packed per layer (layers.moe)."""

    model_cls = DeepseekV2Model
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 / Kimi-K2: V2's model with the noaux_tc router (config.topk_method). The checkpoint's
    multi-token-prediction layers (model.layers.<num_layers + i>, num_nextn_predict_layers of them) serve
    speculative decoding, which this runtime does not do: not built, their tensors skipped at load."""

    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP = TP(),
                 dtype: torch.dtype = torch.bfloat16, max_positions: int | None = None):
        super().__init__(mc, backend, tp, dtype, max_positions)
        if mc.num_nextn_predict_layers:
            log.info("%s: its %d multi-token-prediction layer(s) (num_nextn_predict_layers) are not built; "
                     "their checkpoint tensors (model.layers.%d.*) are skipped", mc.name,
                     mc.num_nextn_predict_layers, mc.num_layers)

    def checkpoint_skip(self, name: str) -> bool:
        """An MTP layer's tensor: a decoder layer's index past the last one."""
        head, sep, rest = name.partition("model.layers.")
        index = rest.partition(".")[0]
        return not head and bool(sep) and index.isdigit() and int(index) >= self.config.num_layers
