"""Qwen3.5 (dense and MoE), the text model of its ConditionalGeneration checkpoints: a hybrid of Gated
DeltaNet layers (linear attention over a recurrent state per request: autoprofile.layers.gdn) and gated
attention layers (Qwen3's attention with a sigmoid output gate from q_proj, q/k RMSNorm, RoPE on the first
rotary_dim channels of each head). Norms weigh 1 + weight (zero-centred), folded into the weight at load; MoE
layers add a shared expert scaled by a sigmoid gate.

The model takes one cache per layer (`forward`'s caches): a KVLayer for an attention layer, a gdn.StateLayer
for a linear one. AttentionMetadata.state_slots gives each row's state slot (a mixed step's decode rows in
meta.decode.state_slots). Text only: a checkpoint's vision tower and multi-token-prediction layers are skipped
at load, with one log line each."""
from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn

from autoprofile.layers import gdn
from autoprofile.layers.attention import AttentionBackend, AttentionMetadata, KVLayer
from autoprofile.layers.moe import Routing
from autoprofile.layers.parallel import (TP, ColumnParallelLinear, RowParallelLinear, copy_checked,
                                         load_column, new_param, read_rows, source_shape)
from autoprofile.model_config import ModelConfig
from models.llama import (LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, RMSNorm, SparseMoeBlock,
                          packed_quant, reader_quant)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- loaders
def load_plus_one(param: nn.Parameter, src, part: int = 0) -> None:
    """A zero-centred norm's weight w, kept as 1 + w (computed in fp32, as HF's forward does)."""
    weight = src if isinstance(src, torch.Tensor) else src[:]
    copy_checked(param.data, (weight.float() + 1.0).to(param.dtype))


def load_packed_source(param: nn.Parameter, src, part: int = 0, *, inner, sizes: list[int]) -> None:
    """One checkpoint tensor holding packed parts' rows (Qwen3.5's in_proj_qkv: q | k | v, its conv1d, an FP8
    weight's scales): each part's rows to the parameter's own per-part loader `inner` (which takes this rank's
    shard). A scale's rows follow the weight's (block scales: a block row per block_n weight rows); a
    per-tensor scale serves every part."""
    shape = source_shape(src)
    n = shape[0] if shape else 1
    if n == 1:
        for i in range(len(sizes)):
            inner(param, src, i)
        return
    offset = 0
    for i, size in enumerate(sizes):
        rows = size * n // sum(sizes)
        inner(param, read_rows(src, offset, rows, 0), i)
        offset += rows


def load_grouped(param: nn.Parameter, src, part: int = 0, *, sizes: list[int], groups: int,
                 rank: int) -> None:
    """Qwen3-Next's in_proj_qkvz / in_proj_ba: rows grouped by key head ([q_g | k_g | v_g | z_g] for each key
    head g) -> this rank's `groups` key heads, each part's rows of every group together ([q | k | v | z])."""
    width = sum(sizes)
    rows = read_rows(src, rank * groups * width, groups * width, 0)
    parts = rows.reshape(groups, width, -1).split(sizes, dim=1)
    copy_checked(param.data, torch.cat([p.reshape(-1, rows.shape[-1]) for p in parts]))


def packed_source(linear: nn.Module, sizes: list[int]) -> None:
    """A packed linear layer whose parts come in one checkpoint tensor: its weight and FP8 scales read it."""
    for name in ("weight", "weight_scale", "input_scale"):
        param = getattr(linear, name, None)
        if param is not None:
            param.weight_loader = partial(load_packed_source, inner=param.weight_loader, sizes=sizes)
            param.num_parts = 1


# ---------------------------------------------------------------- gated attention
class GatedAttention(LlamaAttention):
    """q_proj gives each head's query and its output gate ([q_h | gate_h] per head); o = attention * sigmoid
    (gate) before o_proj."""

    piecewise_split = True  # (engine.piecewise: q a new tensor, k and v views of qkv)

    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.backend, self.head_dim, self.rotary_dim = backend, mc.head_dim, mc.rotary_dim
        self.num_heads, self.num_kv_heads = mc.num_heads // tp.size, mc.num_kv_heads // tp.size
        q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
        self.qkv_proj = ColumnParallelLinear(mc.hidden_size, [2 * q, kv, kv], mc.attention_bias, tp, dtype,
                                             packed_quant(mc, "self_attn", ("q_proj", "k_proj", "v_proj")))
        self.o_proj = RowParallelLinear(q, mc.hidden_size, False, tp, dtype,
                                        mc.quant_for("self_attn.o_proj"))
        self.q_norm = RMSNorm(mc.head_dim, mc.rms_norm_eps, backend, dtype)
        self.k_norm = RMSNorm(mc.head_dim, mc.rms_norm_eps, backend, dtype)
        for norm in (self.q_norm, self.k_norm):
            norm.weight.weight_loader = load_plus_one

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kv: KVLayer, residual: torch.Tensor | None = None) -> torch.Tensor:
        d, h = self.head_dim, self.num_heads
        qkv = self.qkv_proj(x)  # x: rows, or rows the norm quantized for an FP8 qkv_proj (Fp8Rows)
        t = qkv.shape[0]
        q, k, v = self.backend.gated_norm_rope_store(qkv, self.q_norm.weight, self.k_norm.weight,
                                                     self.q_norm.eps, *rope, kv, meta.slot_mapping,
                                                     self.rotary_dim)
        if meta.pieces is not None:  # piecewise graphs: the piece ends here, attention runs between
            o = meta.pieces.split(partial(self.attend, kv=kv), (q, k, v), q.shape[1:])
        else:
            o = self.attend(q, k, v, meta, kv)
        o = o.reshape(t, h, d)
        gate = qkv[:, :2 * h * d].view(t, h, 2, d)[:, :, 1]
        o = o * torch.sigmoid(gate)  # in fp32 inside, rounded once: one kernel, not three
        return self.o_proj(o.reshape(t, h * d), residual)


# ---------------------------------------------------------------- Gated DeltaNet
class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention: in_proj_qkv -> causal conv1d (SiLU) -> q, k, v; in_proj_z the output gate,
    in_proj_b (beta = sigmoid) and in_proj_a (g = -exp(A_log) softplus(a + dt_bias)); the gated delta rule
    over the row's state; the gated RMSNorm; out_proj. Heads split over TP ranks as attention heads."""

    piecewise_split = True  # (engine.piecewise: the graphs hold the projections, `mix` runs between)

    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP, dtype: torch.dtype,
                 layer: int = 0):
        super().__init__()
        self.backend = backend
        hk, hv = mc.linear_num_key_heads, mc.linear_num_value_heads
        if hk % tp.size or hv % tp.size:
            raise ValueError(f"linear_num_key_heads {hk} and linear_num_value_heads {hv} must be divisible "
                             f"by {tp.size} TP ranks")
        self.k_heads, self.v_heads = hk // tp.size, hv // tp.size
        self.k_dim, self.v_dim, self.eps = mc.linear_key_head_dim, mc.linear_value_head_dim, mc.rms_norm_eps
        kd, vd, h = mc.linear_key_dim, mc.linear_value_dim, mc.hidden_size
        parts = [kd, kd, vd]
        self.grouped = mc.grouped_projections
        ba_quant = packed_quant(mc, "linear_attn", ("in_proj_b", "in_proj_a"), layer)
        self.in_proj_ba = ColumnParallelLinear(h, [hv, hv], False, tp, dtype, ba_quant)
        if self.grouped:  # Qwen3-Next: one projection, its rows grouped by key head in the checkpoint
            self.in_proj_qkvz = ColumnParallelLinear(h, [kd, kd, vd, vd], False, tp, dtype)
            r, groups = hv // hk, self.k_heads
            sizes = [self.k_dim, self.k_dim, r * self.v_dim, r * self.v_dim]
            self.in_proj_qkvz.weight.weight_loader = partial(load_grouped, groups=groups, rank=tp.rank,
                                                             sizes=sizes)
            self.in_proj_ba.weight.weight_loader = partial(load_grouped, sizes=[r, r], groups=groups,
                                                           rank=tp.rank)
            self.in_proj_ba.weight.num_parts = self.in_proj_qkvz.weight.num_parts = 1
        else:
            self.in_proj_qkv = ColumnParallelLinear(h, parts, False, tp, dtype,
                                                    mc.quant_for("linear_attn.in_proj_qkv", layer))
            packed_source(self.in_proj_qkv, parts)
            self.in_proj_z = ColumnParallelLinear(h, [vd], False, tp, dtype,
                                                  mc.quant_for("linear_attn.in_proj_z", layer))
        self.conv1d = nn.Module()
        shards = [p // tp.size for p in parts]
        self.conv1d.weight = new_param((sum(shards), 1, mc.linear_conv_kernel_dim), dtype,
                                       partial(load_column, shard_sizes=shards, rank=tp.rank), len(parts))
        packed_source(self.conv1d, parts)
        heads = partial(load_column, shard_sizes=[self.v_heads], rank=tp.rank)
        self.A_log = new_param((self.v_heads,), torch.float32, heads)
        self.dt_bias = new_param((self.v_heads,), torch.float32, heads)
        self.norm = nn.Module()
        self.norm.weight = new_param((self.v_dim,), dtype)
        self.out_proj = RowParallelLinear(vd, h, False, tp, dtype,
                                          mc.quant_for("linear_attn.out_proj", layer))

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: gdn.StateLayer,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.grouped:
            qkv, z = self.in_proj_qkvz(x).split([2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim,
                                                 self.v_heads * self.v_dim], dim=-1)
        else:
            qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
        ba = self.in_proj_ba(x)
        if meta.pieces is not None:  # piecewise graphs: the piece ends here, the rule runs between
            o = meta.pieces.split(partial(self.mix, state=state), (qkv, z, ba), (self.v_heads * self.v_dim,))
        else:
            o = self.mix(qkv, z, ba, meta, state)
        return self.out_proj(o, residual)

    def mix(self, qkv: torch.Tensor, z: torch.Tensor, ba: torch.Tensor, meta: AttentionMetadata,
            state: gdn.StateLayer, out: torch.Tensor | None = None) -> torch.Tensor:
        """The step's rows from their projections to out_proj's input [T, Hv Dv] (prefill rows, then a mixed
        step's decode rows): conv, gates, the delta rule over each row's state (moved on in place), the
        gated norm; written into `out` where given (the piecewise graphs' static output)."""
        t = qkv.shape[0]
        weight = self.conv1d.weight.view(self.conv1d.weight.shape[0], -1)
        decode = meta if not meta.is_prefill else meta.decode  # the decode rows, after n prefill tokens
        n = t - (decode.state_slots.shape[0] if decode is not None else 0)
        if out is None:
            out = qkv.new_empty(t, self.v_heads * self.v_dim)
        if decode is not None:  # conv, gates, rule and norm: one to three kernels on a GPU backend
            self.backend.gdn_decode(qkv[n:], z[n:], ba[n:], weight, self.A_log, self.dt_bias,
                                    self.norm.weight, self.eps, state.conv, state.ssm, decode.state_slots,
                                    out=out[n:])
        if n:
            self.backend.gdn_prefill(qkv[:n], z[:n], ba[:n], weight, self.A_log, self.dt_bias,
                                     self.norm.weight, self.eps, state.conv, state.ssm, meta, out=out[:n])
        return out


# ---------------------------------------------------------------- MoE with a gated shared expert
class SharedExpertMoe(SparseMoeBlock):
    """Qwen3.5-MoE's block: the routed experts (renormalised top-k) plus a shared expert whose output is
    scaled by sigmoid(shared_expert_gate x)."""

    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP, dtype: torch.dtype,
                 routing: Routing, layer: int | None = None):
        super().__init__(mc, backend, tp, dtype, routing, layer)
        self.shared_expert = LlamaMLP(mc, backend, tp, dtype, mc.shared_expert_intermediate_size,
                                      "mlp.shared_expert", layer)
        self.shared_expert_gate = nn.Module()
        self.shared_expert_gate.weight = new_param((1, mc.hidden_size), dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.tp.linear(x, self.gate.weight)
        gate = torch.sigmoid(self.tp.linear(x, self.shared_expert_gate.weight))  # fp32 inside, as HF
        shared = self.shared_expert(x) * gate
        return self.experts(x, *self.experts.select(logits, self.renormalize), add=(shared, residual))


# ---------------------------------------------------------------- the decoder
class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP, dtype: torch.dtype,
                 layer: int = 0, routing: Routing | None = None):
        super().__init__()
        self.linear = mc.is_linear_layer(layer)
        if self.linear:
            self.linear_attn = GatedDeltaNet(mc, backend, tp, dtype, layer)
        else:
            self.self_attn = GatedAttention(mc, backend, tp, dtype)
        if mc.is_moe_layer(layer):
            self.mlp = SharedExpertMoe(mc, backend, tp, dtype, routing, layer)
        else:
            self.mlp = LlamaMLP(mc, backend, tp, dtype, layer=layer)
        self.input_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, backend, dtype)
        self.post_attention_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, backend, dtype)
        for norm in (self.input_layernorm, self.post_attention_layernorm):
            norm.weight.weight_loader = load_plus_one
        # an FP8 layer that alone reads a norm takes its rows quantized by the norm's kernel (models.llama)
        if not self.linear:  # (a linear layer's norm feeds three projections)
            self.input_layernorm.quant = reader_quant(self.self_attn.qkv_proj)
        if isinstance(self.mlp, LlamaMLP):
            self.post_attention_layernorm.quant = reader_quant(self.mlp.gate_up_proj)

    def forward(self, x: torch.Tensor, rope, meta: AttentionMetadata, cache) -> torch.Tensor:
        if self.linear:
            x = self.linear_attn(self.input_layernorm(x), meta, cache, residual=x)
        else:
            x = self.self_attn(self.input_layernorm(x), rope, meta, cache, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class Qwen3_5Model(LlamaModel):
    layer_cls = Qwen3_5DecoderLayer

    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP, dtype: torch.dtype,
                 max_positions: int):
        super().__init__(mc, backend, tp, dtype, max_positions)
        self.norm.weight.weight_loader = load_plus_one

    @staticmethod
    def rope_dim(mc: ModelConfig) -> int:
        return mc.rotary_dim


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """HF's names; q_proj (with its gate) / k / v and gate / up are packed, in_proj_b / in_proj_a too. A
    ConditionalGeneration checkpoint's `model.language_model.` is `model.`; its `model.visual.` and `mtp.`
    tensors are skipped."""

    model_cls = Qwen3_5Model
    packed_modules = {**LlamaForCausalLM.packed_modules,
                      "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1)}
    checkpoint_renames = (("model.language_model.", "model."),)
    SKIPPED = {"model.visual.": "its vision tower (images are not served for this family yet)",
               "mtp.": "its multi-token-prediction layer (no speculative decoding)"}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._skipped: set[str] = set()

    def checkpoint_skip(self, name: str) -> bool:
        """The loader's question: a tensor of a part not built (one log line per part)."""
        prefix = next((p for p in self.SKIPPED if name.startswith(p)), None)
        if prefix is not None and prefix not in self._skipped:
            self._skipped.add(prefix)
            log.info("checkpoint: %s tensors skipped: %s", prefix, self.SKIPPED[prefix])
        return prefix is not None
