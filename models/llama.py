"""One decoder for Llama 3.x, Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k RMSNorm) and Qwen3-MoE (Qwen3
with a sparse block of experts in place of the MLP: autoprofile.layers.moe).

GQA, RoPE (default, linear, Llama-3 `rope_scaling`), RMSNorm from the backend's kernel ops, SwiGLU, tied or
untied embeddings. The model holds no KV cache and no per-step state: `forward` takes the token ids,
their positions, the step's AttentionMetadata and the per-layer KVLayer (cache views, FP8 scales).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import torch
from torch import nn

from autoprofile.layers.attention import AttentionBackend, AttentionMetadata, KVLayer
from autoprofile.layers.moe import FusedMoE, Routing
from autoprofile.layers.ops import KernelOps
from autoprofile.layers.quant import Fp8Rows, fused_input_quant
from autoprofile.layers.parallel import (TP, ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                         VocabParallelEmbedding, new_param)
from autoprofile.model_config import Fp8Scheme, ModelConfig


def packed_quant(mc: ModelConfig, prefix: str, parts: tuple[str, ...],
                 layer: int | None = None) -> Fp8Scheme | None:
    """The FP8 scheme of a packed projection (q/k/v, gate/up): its parts' (a checkpoint converts all or
    none of them)."""
    schemes = {mc.quant_for(f"{prefix}.{p}", layer) for p in parts}
    if len(schemes) > 1:
        raise ValueError(f"{mc.name}: quantization_config leaves some of {prefix}.{{{','.join(parts)}}} "
                         "unconverted but not all; they are packed into one FP8 or bf16 weight")
    return schemes.pop()


# ---------------------------------------------------------------- RoPE
def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (fp32, on the CPU as HF computes them) for rope_type default,
    linear or llama3."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / theta ** exponents
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    raise NotImplementedError(f"rope_scaling type '{kind}' is not supported (default, linear, llama3, yarn "
                              "are)")


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated
    (divided by factor), those past beta_fast kept, a linear ramp between (HF's _compute_yarn_parameters)."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    span = high - low if high > low else 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / span).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor YaRN applies to cos and sin (1 for the other types)."""
    s = scaling or {}
    if s.get("rope_type", s.get("type")) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(s["factor"], s["mscale"]) / yarn_mscale(s["factor"], s["mscale_all_dim"])
    return yarn_mscale(s["factor"])


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, out)


class RotaryEmbedding(nn.Module):
    """cos/sin table [max_positions, head_dim] (fp32), built once on the ambient device."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling).to(torch.get_default_device())
        positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(positions, inv_freq)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * rope_attention_factor(scaling)
        self.register_buffer("cos_sin", table, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
        return cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D/2]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x [T, H, D] (halves, as in HF's rotate_half), computed in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


# ---------------------------------------------------------------- layers
def reader_quant(layer: nn.Module | None) -> Fp8Scheme | None:
    """What a producer read by `layer` alone quantizes its rows with (None: nothing, it passes bf16)."""
    return None if layer is None else fused_input_quant(layer.quant)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelOps, dtype: torch.dtype):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = new_param((size,), dtype)
        # the FP8 scheme of the one layer that reads this norm (layers.quant.fused_input_quant), set by the
        # decoder layer: past one row the norm's kernel quantizes its rows for it (one row: the W8A16 GEMV
        # reads them as they are)
        self.quant: Fp8Scheme | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor | Fp8Rows:
        if self.quant is not None and x.shape[0] > 1:
            return self.ops.rms_norm_quant(x, self.weight, self.eps, self.quant)
        return self.ops.rms_norm(x, self.weight, self.eps)


class LlamaAttention(nn.Module):
    # its attention is where piecewise graphs split (engine.piecewise; ModelRunner.piecewise_ok reads this in
    # a class's own namespace: a subclass that runs another forward says so itself)
    piecewise_split = True

    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP, dtype: torch.dtype):
        super().__init__()
        self.backend, self.head_dim = backend, mc.head_dim
        self.num_heads, self.num_kv_heads = mc.num_heads // tp.size, mc.num_kv_heads // tp.size
        q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
        self.q_size, self.kv_size = q // tp.size, kv // tp.size
        self.qkv_proj = ColumnParallelLinear(mc.hidden_size, [q, kv, kv], mc.attention_bias, tp, dtype,
                                             packed_quant(mc, "self_attn", ("q_proj", "k_proj", "v_proj")))
        self.o_proj = RowParallelLinear(q, mc.hidden_size, False, tp, dtype, mc.quant_for("self_attn.o_proj"))
        self.q_norm = RMSNorm(mc.head_dim, mc.rms_norm_eps, backend, dtype) if mc.qk_norm else None
        self.k_norm = RMSNorm(mc.head_dim, mc.rms_norm_eps, backend, dtype) if mc.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kv: KVLayer, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The attention block's output, or residual + it (the decoder layer's; possibly in place)."""
        qkv = self.qkv_proj(x)
        if self.q_norm is None:  # RoPE in place on the packed projection, K/V to the cache: q, k, v are views
            q, k, v = self.backend.rope_store(qkv, *rope, kv, meta.slot_mapping)
        else:  # Qwen3: per-head RMSNorm before RoPE
            q, k, v = self.backend.norm_rope_store(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                                   *rope, kv, meta.slot_mapping)
        if meta.pieces is not None:  # piecewise graphs: the piece ends here, attention runs between
            o = meta.pieces.split(partial(self.attend, kv=kv), (q, k, v), q.shape[1:])
        else:
            o = self.attend(q, k, v, meta, kv)
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim), residual)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               kv: KVLayer, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [T, H, D] over the new k, v (in the cache already) and the cached prefixes: prefill
        rows, a mixed step's decode rows after them, or decode rows alone. out (q's shape): written there
        (a prefill or mixed step; the piecewise graphs' static output)."""
        if meta.is_prefill:
            o, o_prefill = out, out
            if meta.decode is not None:  # a mixed step: decode rows last, one output for both
                n = q.shape[0] - meta.decode.slot_mapping.shape[0]
                o = q.new_empty(q.shape) if out is None else out
                self.backend.decode(q[n:], kv, meta.decode, out=o[n:])
                q, k, v, o_prefill = q[:n], k[:n], v[:n], o[:n]
            if meta.kv_slots is not None:  # chunks over cached prefixes: read prefix + new from the cache
                k, v = self.backend.gather_kv(kv, meta.kv_slots)
            o_prefill = self.backend.prefill(q, k, v, meta, kv, out=o_prefill)
            o = o_prefill if o is None else o
        else:
            o = self.backend.decode(q, kv, meta)
        return o


class LlamaMLP(nn.Module):
    def __init__(self, mc: ModelConfig, ops: KernelOps, tp: TP, dtype: torch.dtype,
                 intermediate_size: int | None = None, prefix: str = "mlp", layer: int | None = None):
        """prefix, layer: HF's name of this MLP (FP8 checkpoints may leave some unconverted)."""
        super().__init__()
        i = intermediate_size or mc.intermediate_size
        self.ops = ops
        self.gate_up_proj = ColumnParallelLinear(mc.hidden_size, [i, i], False, tp, dtype,
                                                 packed_quant(mc, prefix, ("gate_proj", "up_proj"), layer))
        self.down_proj = RowParallelLinear(i, mc.hidden_size, False, tp, dtype,
                                           mc.quant_for(f"{prefix}.down_proj", layer))
        self.down_quant = fused_input_quant(self.down_proj.quant)  # SiLU-mul's kernel quantizes for it

    def forward(self, x: torch.Tensor | Fp8Rows, residual: torch.Tensor | None = None) -> torch.Tensor:
        # gate_up [T, 2I] is a temporary of the call: freed before down_proj runs
        return self.down_proj(self.activation(self.gate_up_proj(x)), residual)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor | Fp8Rows:
        """SiLU(gate) * up; past one row quantized in SiLU-mul's kernel for an FP8 down_proj."""
        if self.down_quant is not None and gate_up.shape[0] > 1:
            return self.ops.silu_mul_quant(gate_up, self.down_quant)
        return self.ops.silu_mul(gate_up)


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's MLP: a router (`gate`, replicated: every rank routes every token) and the experts."""

    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP, dtype: torch.dtype,
                 routing: Routing, layer: int | None = None):
        super().__init__()
        self.top_k, self.renormalize, self.tp = mc.num_experts_per_tok, mc.norm_topk_prob, tp
        self.gate = nn.Module()
        self.gate.weight = new_param((mc.num_experts, mc.hidden_size), dtype)
        self.experts = FusedMoE(mc.num_experts, mc.num_experts_per_tok, mc.hidden_size,
                                mc.moe_intermediate_size, tp, dtype, backend, routing,
                                mc.quant_for("mlp.experts", layer))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.tp.linear(x, self.gate.weight)
        return self.experts(x, *self.experts.select(logits, self.renormalize), add=(residual,))


class LlamaDecoderLayer(nn.Module):
    attention_cls, moe_cls = LlamaAttention, SparseMoeBlock  # a family's attention and MoE block

    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP, dtype: torch.dtype,
                 layer: int = 0, routing: Routing | None = None):
        super().__init__()
        self.self_attn = self.attention_cls(mc, backend, tp, dtype)
        if mc.is_moe_layer(layer):
            self.mlp = self.moe_cls(mc, backend, tp, dtype, routing, layer)
        else:
            self.mlp = LlamaMLP(mc, backend, tp, dtype, layer=layer)
        self.input_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, backend, dtype)
        self.post_attention_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, backend, dtype)
        # an FP8 layer that alone reads a norm takes its rows quantized by the norm's kernel
        self.input_layernorm.quant = reader_quant(getattr(self.self_attn, "qkv_proj", None))
        if isinstance(self.mlp, LlamaMLP):  # (experts and MLA's projections: more than one reader)
            self.post_attention_layernorm.quant = reader_quant(self.mlp.gate_up_proj)

    def forward(self, x: torch.Tensor, rope, meta: AttentionMetadata, kv: KVLayer) -> torch.Tensor:
        """x + attention, then + MLP: each sum may be made in place in x (TP.linear_add), which the layer owns
        (the embedding's output or the layer before's)."""
        x = self.self_attn(self.input_layernorm(x), rope, meta, kv, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP, dtype: torch.dtype,
                 max_positions: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(mc.vocab_size, mc.hidden_size, tp, dtype)
        self.routing = Routing()  # the MoE layers' (none in a dense model); the runner sets it per step
        self.layers = nn.ModuleList(self.layer_cls(mc, backend, tp, dtype, i, self.routing)
                                    for i in range(mc.num_layers))
        self.norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, backend, dtype)
        self.rotary_emb = RotaryEmbedding(self.rope_dim(mc), max_positions, mc.rope_theta, mc.rope_scaling)

    @staticmethod
    def rope_dim(mc: ModelConfig) -> int:
        """The channels RoPE rotates per head."""
        return mc.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_layers: Sequence[KVLayer]) -> torch.Tensor:
        return self.decode_layers(self.embed_tokens(input_ids), self.rotary_emb(positions), meta, kv_layers)

    def decode_layers(self, x: torch.Tensor, rope, meta: AttentionMetadata,
                      kv_layers: Sequence[KVLayer]) -> torch.Tensor:
        """The decoder layers and the final norm."""
        meta.new_forward()
        for layer, kv in zip(self.layers, kv_layers, strict=True):
            x = layer(x, rope, meta, kv)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF's; the loader maps q/k/v and gate/up into the packed projections."""

    model_cls = LlamaModel

    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP = TP(),
                 dtype: torch.dtype = torch.bfloat16, max_positions: int | None = None):
        super().__init__()
        self.config = mc
        self.model = self.model_cls(mc, backend, tp, dtype, max_positions or mc.max_position_embeddings)
        tied = self.model.embed_tokens.weight if mc.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(mc.vocab_size, mc.hidden_size, tp, dtype, weight=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_layers: Sequence[KVLayer]) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of every input token."""
        return self.model(input_ids, positions, meta, kv_layers)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, vocab] for the rows that are sampled (select them before calling); out: written there
        (ParallelLMHead)."""
        return self.lm_head(hidden, out)
