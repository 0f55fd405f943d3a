"""HF-style `config.json` -> ModelConfig: the fields the runtime and the budget need (SGLang's model_config).

At the config floor, torch-free: autoprofile.config validates flags against it, the layers, models, engine and
planner read it. Above the house's 500 lines on purpose: one owner of a model's shape, the schema
(ModelConfig, its FP8 and vision parts), its reading from config.json with each field's check, and the
discovery of the checkpoint files beside it (config validation checks they are there).
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_DIR = Path(__file__).parents[1] / "models" / "configs"  # the built-in configs (package data of models)
# The architectures the engine serves, by family; `autoprofile plan` also plans any other Llama-shaped one.
ARCHITECTURE_FAMILIES = {
    "LlamaForCausalLM": "dense", "Qwen2ForCausalLM": "dense", "Qwen3ForCausalLM": "dense",
    "Qwen3MoeForCausalLM": "MoE", "DeepseekV2ForCausalLM": "MLA + MoE",
    "Qwen2_5_VLForConditionalGeneration": "vision-language",
    "DeepseekV3ForCausalLM": "MLA + MoE (noaux_tc router)",
    "Qwen3_5ForCausalLM": "hybrid (Gated DeltaNet + attention)",
    "Qwen3_5MoeForCausalLM": "hybrid MoE (Gated DeltaNet + attention)",
    "Qwen3_5ForConditionalGeneration": "hybrid (its text model)",
    "Qwen3_5MoeForConditionalGeneration": "hybrid MoE (its text model)",
    "Qwen3NextForCausalLM": "hybrid MoE (Gated DeltaNet + attention)",
}
RUNNABLE_ARCHITECTURES = tuple(ARCHITECTURE_FAMILIES)
MLA_ARCHITECTURES = (  # models.deepseek_v2: MLA attention, its MoE (an fp32 router)
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)
# models.qwen3_5: Gated DeltaNet layers (a recurrent state per request) beside gated attention layers
HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
                        "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM")
HYBRID_LAYER_TYPES = ("linear_attention", "full_attention")
STATE_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}  # mamba_ssm_dtype -> bytes

# The byte-level tokenizer every model without a tokenizer.json gets (autoprofile.serving.tokenizer): ids 0,
# 1, 2 are specials (pad, bos, eos in ByT5's numbering and in the tiny model's), then the 256 bytes. Here,
# below the serving layer, because config validation checks a model's vocabulary against it.
BYTE_OFFSET = 3
FIRST_FOLDED = BYTE_OFFSET + 256


def builtin_models() -> list[str]:
    return sorted(p.name for p in CONFIG_DIR.iterdir() if (p / "config.json").is_file())


def unsupported_architecture(architecture: str) -> str:
    """Why a model of `architecture` cannot be served, and what can: the supported architectures by family."""
    supported = ", ".join(f"{a} ({family})" for a, family in ARCHITECTURE_FAMILIES.items())
    return (f"architecture {architecture} is not one the engine serves (`autoprofile plan` can still plan "
            f"it); the supported architectures are {supported}; try a built-in config such as llama-3.1-8b, "
            f"qwen3-30b-a3b, deepseek-v2-lite or qwen2.5-vl-7b, or a folder of one of these architectures")


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 (e4m3) weights (autoprofile.layers.quant holds the arithmetic; this is torch-free for the planner).

    weight: "channel" (one fp32 scale per output row; per-tensor checkpoint scales are expanded to it) or
    "block" (one per [block_n, block_k] tile). activation: "token" (dynamic per token), "group" (dynamic per
    token and block_k group, with "block") or "static" (the checkpoint's input_scale per layer)."""

    weight: str
    block: tuple[int, int] | None = None
    activation: str = "token"

    @property
    def dynamic(self) -> bool:
        """Activations quantized per step ("token", "group"), not by the checkpoint's scale ("static")."""
        return self.activation != "static"

    def describe(self) -> str:
        """e.g. 'fp8_e4m3 (block 128x128, dynamic per-group activations)' (report, /health)."""
        layout = f"block {self.block[0]}x{self.block[1]}" if self.weight == "block" else "per-channel"
        acts = {"token": "dynamic per-token", "group": "dynamic per-group", "static": "static per-tensor"}
        return f"fp8_e4m3 ({layout}, {acts[self.activation]} activations)"


@dataclass(frozen=True)
class QuantLinear:
    """One FP8 linear layer of a TP rank: its packed parts' output rows, input columns, whether it is
    row-parallel (its input split), and its expert count (0: a dense layer)."""

    name: str
    parts: tuple[int, ...]
    in_features: int
    row_parallel: bool
    experts: int
    scheme: Fp8Scheme
    split: bool = True  # False: replicated on every rank (MLA's q_a_proj, kv_a_proj_with_mqa)
    # its one producer (the RMSNorm before a dense qkv_proj or gate_up_proj, SiLU-mul before down_proj)
    # quantizes its input in its own kernel, for dynamic activations (models.llama.reader_quant)
    fused: bool = False

    @property
    def input_fused(self) -> bool:
        return self.fused and self.scheme.dynamic

    def input_bytes(self, tokens: int) -> int:
        """Its quantized input x_q [T, K] (1 byte each) and the fp32 scales ([T, K / block_k] per group,
        [T, 1] per token, none static)."""
        s, k = self.scheme, self.in_features
        groups = {"group": -(-k // s.block[1]) if s.block else 1, "token": 1, "static": 0}[s.activation]
        return tokens * (k + 4 * groups)

    @property
    def weight_elements(self) -> int:
        return max(self.experts, 1) * sum(self.parts) * self.in_features

    @property
    def scale_elements(self) -> int:
        """weight_scale's fp32 values (layers.parallel / layers.moe); + input_scale for static activations."""
        s = self.scheme
        if s.weight == "channel":
            n = sum(self.parts)
        else:
            n = sum(-(-p // s.block[0]) for p in self.parts) * -(-self.in_features // s.block[1])
        return max(self.experts, 1) * n + (s.activation == "static" and not self.experts)

    def block_problem(self, tp: int) -> str | None:
        """A block scale straddling a TP shard or a packed part (layers.parallel.check_block_shards)."""
        s = self.scheme
        if s.weight != "block":
            return None
        bn, bk = s.block
        tp = tp if self.split else 1
        if (len(self.parts) > 1 or tp > 1) and not self.row_parallel and any(p % bn for p in self.parts):
            return (f"{self.name}: output rows per part and rank {list(self.parts)} are not multiples of "
                    f"block_n {bn}")
        if tp > 1 and self.row_parallel and self.in_features % bk:
            return (f"{self.name}: input columns per rank ({self.in_features}) are not a multiple of block_k "
                    f"{bk}")
        return None


# --quantization fp8 on a bf16 checkpoint (vLLM's): per-channel weights, dynamic per-token activations
RUNTIME_FP8 = Fp8Scheme("channel", None, "token")
QUANT_METHODS = ("fp8", "compressed-tensors")


@dataclass(frozen=True)
class VisionConfig:
    """A Qwen2.5-VL vision tower (HF `vision_config`): ViT over 14-px patches of 2 frames, window attention
    except in `fullatt_block_indexes`, a 2x2 patch merger into the decoder's hidden size."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    in_channels: int = 3
    rope_theta: float = 10000.0
    tokens_per_second: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one patch in pixel_values: channels x frames x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def num_params(self) -> int:
        d, i = self.hidden_size, self.intermediate_size
        merged = d * self.spatial_merge_size ** 2
        block = 3 * d * d + 3 * d + d * d + d + 2 * d * i + 2 * i + i * d + d + 2 * d
        merger = d + merged * merged + merged + merged * self.out_hidden_size + self.out_hidden_size
        return self.patch_dim * d + self.depth * block + merger


@dataclass(frozen=True)
class ModelConfig:
    name: str
    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    torch_dtype: str = "bfloat16"
    # MoE (Qwen3-MoE): a softmax router picks num_experts_per_tok experts per token (their weights
    # renormalised to sum 1 when norm_topk_prob); every decoder_sparse_step-th layer but mlp_only_layers
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # DeepSeek-V2's MoE: shared experts beside the routed ones, routing weights times routed_scaling_factor,
    # topk_method greedy or group_limited_greedy (the top topk_group of n_group expert groups first)
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int = 0
    topk_group: int = 0
    # DeepSeek-V3's noaux_tc: sigmoid scores; the layer's e_score_correction_bias is added for the choice of
    # groups and experts only, the weights are the plain scores (layers.moe.biased_grouped_topk)
    scoring_func: str = "softmax"
    # DeepSeek-V3's multi-token-prediction layers (after the last decoder layer): not built, weights skipped
    num_nextn_predict_layers: int = 0
    # MLA (DeepSeek-V2): the cache holds one latent of kv_lora_rank + qk_rope_head_dim per token and layer;
    # queries of qk_nope_head_dim + qk_rope_head_dim per head (through a q_lora_rank bottleneck when > 0)
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0
    # vision-language (Qwen2.5-VL): the tower, M-RoPE sections (t, h, w) and the special token ids
    vision: VisionConfig | None = None
    mrope_section: tuple[int, ...] | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    # hybrid (Qwen3.5): layer_types[i] is "linear_attention" (Gated DeltaNet: a causal conv1d over q|k|v,
    # the gated delta rule over a [v_heads, k_dim, v_dim] state in state_dtype, a gated RMSNorm) or
    # "full_attention" (gated attention: q_proj also gives a sigmoid output gate; RoPE on rotary_dim
    # channels); norms weigh 1 + weight (zero_centered_norm); MoE layers add a sigmoid-gated shared expert
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    state_dtype: str = "float32"
    rotary_dim: int = 0  # 0: head_dim
    attn_output_gate: bool = False
    zero_centered_norm: bool = False
    shared_expert_intermediate_size: int = 0
    # Qwen3-Next: a Gated DeltaNet layer's q, k, v, z (and b, a) in one projection, grouped by key head
    grouped_projections: bool = False
    # FP8 weights: the scheme, where it came from ("fp8": HF's quantization_config, "compressed-tensors",
    # "runtime": --quantization fp8 on bf16 weights) and the checkpoint's modules left unconverted (names
    # or "re:" patterns, HF's modules_to_not_convert / compressed-tensors' ignore)
    quant: Fp8Scheme | None = None
    quant_method: str | None = None
    quant_ignore: tuple[str, ...] = ()
    path: str | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    def quant_for(self, module: str, layer: int | None = None) -> Fp8Scheme | None:
        """The scheme of a linear module, named as HF's inside decoder layer `layer` ("self_attn.q_proj",
        "mlp.experts"; layer None: the module of every layer): None if the model is not quantized or the
        checkpoint leaves it unconverted (in any of those layers)."""
        if self.quant is None:
            return None
        layers = range(self.num_layers) if layer is None else (layer,)
        names = [f"model.layers.{i}.{module}" for i in layers]
        return None if any(ignored(n, self.quant_ignore) for n in names) else self.quant

    def quantized_linears(self, tp: int = 1) -> list[QuantLinear]:
        """Every FP8 linear layer of one TP rank as the models build it (models.llama, models.deepseek_v2):
        the planner counts their bytes and scales from it, config validation their block alignment."""
        h, out = self.hidden_size, []

        def add(layer: int, names: tuple[str, ...], parts: list[int], k: int, row: bool = False,
                experts: int = 0, split: bool = True, every_layer: bool = False, fused: bool = False) -> None:
            """every_layer: the model asks quant_for about all layers at once (attention)."""
            schemes = {self.quant_for(n, None if every_layer else layer) for n in names}
            if schemes != {None}:
                out.append(QuantLinear(f"model.layers.{layer}.{names[0]}", tuple(parts), k, row, experts,
                                       self.quant, split, fused))

        for i in range(self.num_layers):
            if self.is_linear_layer(i):  # Gated DeltaNet (models.qwen3_5): q|k|v in one tensor, z, b|a, out
                kd, vd = self.linear_key_dim // tp, self.linear_value_dim // tp
                hv = self.linear_num_value_heads // tp
                add(i, ("linear_attn.in_proj_qkv",), [kd, kd, vd], h)
                add(i, ("linear_attn.in_proj_z",), [vd], h)
                add(i, ("linear_attn.in_proj_b", "linear_attn.in_proj_a"), [hv, hv], h)
                add(i, ("linear_attn.out_proj",), [h], vd, row=True)
            elif self.is_mla:
                heads, qk = self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
                if self.q_lora_rank:
                    add(i, ("self_attn.q_a_proj",), [self.q_lora_rank], h, split=False, every_layer=True)
                    add(i, ("self_attn.q_b_proj",), [heads * qk // tp], self.q_lora_rank, every_layer=True)
                else:
                    add(i, ("self_attn.q_proj",), [heads * qk // tp], h, every_layer=True)
                add(i, ("self_attn.kv_a_proj_with_mqa",), [self.kv_lora_rank + self.qk_rope_head_dim], h,
                    split=False, every_layer=True)
                add(i, ("self_attn.kv_b_proj",), [heads * (self.qk_nope_head_dim + self.v_head_dim) // tp],
                    self.kv_lora_rank, every_layer=True)
                add(i, ("self_attn.o_proj",), [h], heads * self.v_head_dim // tp, row=True, every_layer=True)
            else:
                q, kv = self.num_heads * self.head_dim // tp, self.num_kv_heads * self.head_dim // tp
                gate = q if self.attn_output_gate else 0  # a gated attention's q_proj gives its gate too
                add(i, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), [q + gate, kv, kv], h,
                    every_layer=True, fused=True)
                add(i, ("self_attn.o_proj",), [h], q, row=True, every_layer=True)
            if self.is_moe_layer(i):
                inter = self.moe_intermediate_size // tp
                add(i, ("mlp.experts",), [inter, inter], h, experts=self.num_experts)
                add(i, ("mlp.experts",), [h], inter, row=True, experts=self.num_experts)
                mlps = [("mlp.shared_experts", self.moe_intermediate_size * self.n_shared_experts)]
                if self.shared_expert_intermediate_size:  # Qwen3.5's (its sigmoid gate stays unconverted)
                    mlps = [("mlp.shared_expert", self.shared_expert_intermediate_size)]
            else:
                mlps = [("mlp", self.intermediate_size)]
            for prefix, size in mlps:
                if size:  # a dense MLP's norm feeds gate_up alone (an MoE layer's: router and experts too)
                    add(i, (f"{prefix}.gate_proj", f"{prefix}.up_proj"), [size // tp] * 2, h,
                        fused=not self.is_moe_layer(i))
                    add(i, (f"{prefix}.down_proj",), [h], size // tp, row=True, fused=True)
        return out

    def fp8_activation_bytes(self, tokens: int, tp: int = 1) -> int:
        """A step's activation quantization temporaries on one rank beside the model-dtype live set: the
        widest FP8 layer input that a kernel of its own quantizes (QuantLinear.input_bytes). An input its
        producer quantizes replaces that producer's model-dtype output (dense_mlp_fp8_act)."""
        own = [q.input_bytes(tokens) for q in self.quantized_linears(tp) if not q.input_fused]
        return max(own, default=0)

    def dense_mlp_fp8_act(self, tokens: int, tp: int = 1) -> int | None:
        """A dense MLP's activation as SiLU-mul's kernel leaves it for an FP8 down_proj with dynamic
        activations (x_q and scales, in place of [T, I] in the model dtype); None: in the model dtype."""
        downs = [q for q in self.quantized_linears(tp) if q.input_fused and q.row_parallel and not q.experts
                 and q.name.endswith("mlp.down_proj")]
        return max((q.input_bytes(tokens) for q in downs), default=None)

    @property
    def weight_format(self) -> str:
        """The weights' dtype and scale layout, for the report and /health."""
        return "bf16" if self.quant is None else self.quant.describe()

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_hybrid(self) -> bool:
        return bool(self.layer_types)

    def is_linear_layer(self, layer: int) -> bool:
        """A Gated DeltaNet layer (a recurrent state per request, no KV)."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def attention_layers(self) -> int:
        """Layers with a KV cache (every layer of a model that is not hybrid)."""
        return self.num_layers - self.linear_layers

    @property
    def linear_layers(self) -> int:
        return sum(map(self.is_linear_layer, range(self.num_layers)))

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of a Gated DeltaNet layer's causal conv1d: q | k | v."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def conv_state_bytes(self, tp: int = 1, dtype_bytes: int = 2) -> int:
        """One request's conv window in one linear layer on one TP rank: kernel - 1 inputs of conv_dim
        channels, in the model dtype."""
        return self.conv_dim // tp * (self.linear_conv_kernel_dim - 1) * dtype_bytes

    def ssm_state_bytes(self, tp: int = 1) -> int:
        """One request's delta-rule matrices in one linear layer on one TP rank: [v_heads, k_dim, v_dim] in
        state_dtype."""
        return (self.linear_num_value_heads // tp * self.linear_key_head_dim * self.linear_value_head_dim
                * STATE_DTYPES[self.state_dtype])

    def state_bytes(self, tp: int = 1, dtype_bytes: int = 2) -> int:
        """One request's state on one TP rank, over every linear layer (0 without any)."""
        return self.linear_layers * (self.conv_state_bytes(tp, dtype_bytes) + self.ssm_state_bytes(tp))

    def is_moe_layer(self, layer: int) -> bool:
        """HF Qwen3-MoE's rule: experts in every decoder_sparse_step-th layer except mlp_only_layers."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> int:
        return sum(map(self.is_moe_layer, range(self.num_layers)))

    @property
    def runnable(self) -> bool:
        return self.architecture in RUNNABLE_ARCHITECTURES

    @property
    def checkpoint_files(self) -> list[Path]:
        """The weight files next to the config, found as --load_format auto finds them (find_weights); empty
        for a built-in config (random weights)."""
        return find_weights(Path(self.path)) if self.path else []

    def attention_params(self) -> int:
        """One layer's attention parameters (MLA: the query, the latent's projections down and up, its
        norm)."""
        h = self.hidden_size
        if self.is_mla:
            heads, qk = self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
            rank = self.kv_lora_rank
            qr = self.q_lora_rank
            query = h * qr + qr + qr * heads * qk if qr else h * heads * qk
            latent = h * (rank + self.qk_rope_head_dim) + rank + rank * heads * (self.qk_nope_head_dim
                                                                                + self.v_head_dim)
            return query + latent + heads * self.v_head_dim * h
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        gate = q if self.attn_output_gate else 0
        attn = h * (q + gate) + 2 * h * kv + q * h + (q + gate + 2 * kv if self.attention_bias else 0)
        return attn + (2 * self.head_dim if self.qk_norm else 0)

    def linear_attention_params(self) -> int:
        """One Gated DeltaNet layer's parameters: in_proj_qkv, in_proj_z, in_proj_b and _a, the conv1d,
        dt_bias, A_log, the gated norm and out_proj."""
        h, hv = self.hidden_size, self.linear_num_value_heads
        conv = self.conv_dim * self.linear_conv_kernel_dim
        return (h * (self.conv_dim + self.linear_value_dim + 2 * hv) + conv + 2 * hv
                + self.linear_value_head_dim + self.linear_value_dim * h)

    def routed_expert_params(self) -> int:
        """Every MoE layer's routed experts (gate, up and down projections): a token reaches top_k of them."""
        return self.moe_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def params_per_token(self) -> float:
        """Parameters one token computes with: all but the routed experts it does not reach."""
        routed = self.routed_expert_params()
        unreached = routed * (1 - self.num_experts_per_tok / self.num_experts) if routed else 0
        return self.num_params() - unreached

    def unreached_expert_share(self, tokens: int) -> float:
        """The expected share of routed experts that no token of a step reaches, the router spreading them:
        each is missed by all `tokens` with probability (1 - k/E)^tokens (0 without experts)."""
        if not self.num_experts:
            return 0.0
        return (1 - self.num_experts_per_tok / self.num_experts) ** tokens

    def params_read(self, tokens: int) -> float:
        """Parameters a step of `tokens` tokens reads: all but the routed experts none of them reaches."""
        return self.num_params() - self.routed_expert_params() * self.unreached_expert_share(tokens)

    def attention_dims(self) -> tuple[int, int]:
        """(query-key, value) widths of one head as attention computes them (MLA's expanded form: nope + rope
        and v_head_dim)."""
        if self.is_mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        return self.head_dim, self.head_dim

    def num_params(self) -> int:
        """Parameter count (exact for the supported decoders; MoE counts all experts)."""
        h, L = self.hidden_size, self.num_layers
        mixers = self.attention_layers * self.attention_params()
        mixers += self.linear_layers * self.linear_attention_params() if self.linear_layers else 0
        experts = (self.num_experts + self.n_shared_experts) * 3 * h * self.moe_intermediate_size
        experts += h * self.num_experts + (self.num_experts if self.topk_method == "noaux_tc" else 0)  # bias
        if self.shared_expert_intermediate_size:  # Qwen3.5's shared expert and its sigmoid gate
            experts += 3 * h * self.shared_expert_intermediate_size + h
        moe = self.moe_layers
        mlp = moe * experts + (L - moe) * 3 * h * self.intermediate_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return mixers + L * 2 * h + mlp + embed + h


def ignored(name: str, patterns: tuple[str, ...]) -> bool:
    """A module name against compressed-tensors' ignore / HF's modules_to_not_convert: "re:<regex>" matches
    the whole name; a plain entry matches the name or any dotted part of it ("lm_head", "mlp.gate")."""
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], name):
                return True
        elif name == p or name.endswith("." + p) or f".{p}." in f".{name}.":
            return True
    return False


def _block_size(f: _Fields, q: dict) -> tuple[int, int] | None:
    block = q.get("weight_block_size")
    if block is None:
        return None
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        f.fail("quantization_config", f"has weight_block_size {block!r}; it must be two integers >= 1, "
                                      "e.g. [128, 128]")
    return block[0], block[1]


def _hf_fp8(f: _Fields, q: dict) -> tuple[Fp8Scheme, tuple[str, ...]]:
    """HF's FineGrainedFP8 / DeepSeek-V3 style: `weight_block_size` tiles with `weight_scale_inv`, dynamic
    activations per (token, block_k group); without a block size, per-channel weights."""
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":
        f.fail("quantization_config", f"has activation_scheme {act!r}; quant_method 'fp8' is served with "
                                      "'dynamic' (static input scales: a compressed-tensors checkpoint)")
    block = _block_size(f, q)
    ignore = q.get("modules_to_not_convert") or q.get("ignored_layers") or []
    scheme = Fp8Scheme("block", block, "group") if block else Fp8Scheme("channel", None, "token")
    return scheme, tuple(ignore)


def _compressed_fp8(f: _Fields, q: dict) -> tuple[Fp8Scheme, tuple[str, ...]]:
    """compressed-tensors' float-quantized FP8: one config group of 8-bit float weights (strategy tensor or
    channel; tensor scales become per-channel at load) and activations (token dynamic, or tensor static)."""
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        f.fail("quantization_config", f"needs exactly one entry in 'config_groups' for compressed-tensors "
                                      f"FP8, got {groups!r}")
    group = next(iter(groups.values()))
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    if w.get("num_bits") != 8 or w.get("type") != "float" or w.get("strategy") not in ("tensor", "channel"):
        f.fail("quantization_config", f"has weights {w!r}; supported: num_bits 8, type 'float', strategy "
                                      "'tensor' or 'channel' (FP8 e4m3)")
    if a.get("num_bits", 8) != 8 or a.get("type", "float") != "float":
        f.fail("quantization_config", f"has input_activations {a!r}; supported: 8-bit float")
    if a.get("strategy") == "token" and a.get("dynamic", True):
        act = "token"
    elif a.get("strategy") == "tensor" and not a.get("dynamic", False):
        act = "static"
    else:
        f.fail("quantization_config", f"has input_activations {a!r}; supported: strategy 'token' dynamic, "
                                      "or 'tensor' static (with input_scale tensors)")
    return Fp8Scheme("channel", None, act), tuple(q.get("ignore") or [])


def _quant_fields(f: _Fields, num_experts: int) -> dict:
    """quantization_config -> ModelConfig's quant fields; {} without one."""
    q = f.dict("quantization_config")
    if q is None:
        return {}
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        f.fail("quantization_config", f"has quant_method {method!r}, which is not served; supported: "
                                      f"{', '.join(QUANT_METHODS)} (FP8 e4m3 weights), or a bf16 checkpoint "
                                      "(with --quantization fp8 to quantize it at load)")
    scheme, ignore = (_hf_fp8 if method == "fp8" else _compressed_fp8)(f, q)
    if not all(isinstance(i, str) for i in ignore):
        f.fail("quantization_config", f"lists modules to leave unconverted that are not names: {ignore!r}")
    if num_experts and scheme.activation == "static":
        f.fail("quantization_config", "has static input scales, which the FP8 experts do not take; "
                                      "an MoE checkpoint needs dynamic activations")
    return {"quant": scheme, "quant_method": method, "quant_ignore": ignore}


def with_runtime_fp8(mc: ModelConfig) -> ModelConfig:
    """--quantization fp8: a bf16 model quantized at load (RUNTIME_FP8); a checkpoint quantized already is a
    ConfigError-worthy ValueError naming its method."""
    if mc.quant is not None:
        raise ModelConfigError(f"{mc.name} is already quantized ({mc.quant_method}: {mc.weight_format}); "
                               "leave --quantization unset to serve its own scheme")
    return dataclasses.replace(mc, quant=RUNTIME_FP8, quant_method="runtime")


def resolve_model_dir(name_or_path: str) -> Path | None:
    """A folder holding config.json: a built-in name or a path. None if neither exists."""
    p = Path(name_or_path)
    if (p / "config.json").is_file():
        return p
    builtin = CONFIG_DIR / name_or_path.lower()
    return builtin if (builtin / "config.json").is_file() else None


class ModelConfigError(ValueError):
    """A config.json that cannot be used: names the file and the key."""


# ---------------------------------------------------------------- checkpoint discovery
# vLLM's --load_format values: auto (safetensors, else PyTorch .bin), one format only, or dummy (random)
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
# each format's index (HF's sharded checkpoints: weight_map names the files) and its files
WEIGHT_FILES = {"safetensors": ("model.safetensors.index.json", "*.safetensors"),
                "pt": ("pytorch_model.bin.index.json", "*.bin")}
NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "scheduler.bin", "scaler.bin")  # trainer outputs


def find_weights(folder: Path, load_format: str = "auto") -> list[Path]:
    """The checkpoint files of `folder` in `load_format` (auto: safetensors, else pt): those its index lists,
    else every file of the format. ModelConfigError naming the files looked for if there are none."""
    formats = ("safetensors", "pt") if load_format == "auto" else (load_format,)
    for fmt in formats:
        if files := format_files(folder, fmt):
            return files
    looked = " or ".join(f"{index} / {pattern}" for index, pattern in map(WEIGHT_FILES.get, formats))
    raise ModelConfigError(f"{folder}: holds no weights (looked for {looked})")


def format_files(folder: Path, fmt: str) -> list[Path]:
    index, pattern = WEIGHT_FILES[fmt]
    if (folder / index).is_file():
        return indexed_files(folder / index)
    return sorted(p for p in folder.glob(pattern) if p.name not in NOT_WEIGHTS and p.is_file())


def indexed_files(index: Path) -> list[Path]:
    """The files an HF index's weight_map names (each once), every one present."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise ModelConfigError(f"{index}: cannot be read as an HF checkpoint index: {e}") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(f, str) for f in weight_map.values()):
        raise ModelConfigError(f"{index}: key 'weight_map' must map tensor names to file names, "
                               f"got {str(weight_map)[:80]}")
    files = sorted({index.parent / name for name in weight_map.values()})
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelConfigError(f"{index}: key 'weight_map' names {', '.join(missing[:4])}, not in "
                               f"{index.parent}")
    return files


_MISSING = object()
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
VL_TOKEN_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


class _Fields:
    """Reads config.json keys with their type and range checked; every error names the file and the key."""

    def __init__(self, d: dict, source: str):
        self.d, self.source = d, source

    def fail(self, key: str, why: str):
        raise ModelConfigError(f"{self.source}: key '{key}' {why}")

    def get(self, key: str, default=_MISSING):
        value = self.d.get(key)
        if value is None:
            if default is _MISSING:
                self.fail(key, "is missing (an HF-style config.json needs it)")
            return default
        return value

    def int(self, key: str, default=_MISSING, lo: int = 1) -> int:
        v = self.get(key, default)
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            self.fail(key, f"must be an integer >= {lo}, got {v!r}")
        return v

    def number(self, key: str, default=_MISSING) -> float:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            self.fail(key, f"must be a positive number, got {v!r}")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.get(key, default)
        if not isinstance(v, bool):
            self.fail(key, f"must be true or false, got {v!r}")
        return v

    def str(self, key: str, default=_MISSING) -> str:
        v = self.get(key, default)
        if not isinstance(v, str) or not v:
            self.fail(key, f"must be a non-empty string, got {v!r}")
        return v

    def dict(self, key: str) -> dict | None:
        v = self.d.get(key)
        if v is not None and not isinstance(v, dict):
            self.fail(key, f"must be an object or null, got {v!r}")
        return v


def _rope_scaling(f: _Fields) -> dict | None:
    rope = f.dict("rope_parameters") or {}  # transformers v5 nests rope_theta/rope_scaling here
    key = "rope_scaling" if f.d.get("rope_scaling") is not None else "rope_parameters"
    scaling = f.dict("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "mrope" or (kind == "default" and "mrope_section" in scaling):  # Qwen2.5-VL: unscaled
        return None
    if kind not in ROPE_TYPES:
        f.fail(key, f"has rope_type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    sub = _Fields(scaling, f"{f.source}: key '{key}'")
    if kind != "default":
        sub.number("factor")
    if kind == "yarn":
        sub.number("original_max_position_embeddings")
    if kind == "llama3":
        low, high = sub.number("low_freq_factor", 1.0), sub.number("high_freq_factor", 1.0)
        sub.number("original_max_position_embeddings")
        if low >= high:  # the smoothing between the two bands divides by high - low
            sub.fail("low_freq_factor", f"({low:g}) must be below high_freq_factor ({high:g}); "
                                        "Llama 3.1's are 1.0 and 4.0")
    return scaling


def _check_head_dim(f: _Fields, head_dim: int) -> None:
    """RoPE rotates pairs of channels: an odd head_dim cannot be served."""
    if head_dim % 2:
        given = f.d.get("head_dim") is not None
        derived = "" if given else " = hidden_size / num_attention_heads"
        f.fail("head_dim", f"({head_dim}{derived}) must be even (RoPE rotates pairs of channels); "
                           f"try 'head_dim': {head_dim + 1}")


def _check_special_ids(f: _Fields, vocab_size: int) -> None:
    """bos/eos/pad token ids index the vocabulary."""
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = f.d.get(key)
        ids = value if isinstance(value, list) else [value]
        big = max((i for i in ids if isinstance(i, int) and not isinstance(i, bool)), default=-1)
        if big >= vocab_size:
            f.fail("vocab_size", f"({vocab_size}) must exceed every special token id, and {key} is {big}; "
                                 f"try 'vocab_size': {big + 1} or more")


def from_hf_dict(d: dict, name: str = "custom", path: str | None = None,
                 source: str = "config.json") -> ModelConfig:
    """Every key the runtime reads is checked here; a bad one raises ModelConfigError naming source and
    key."""
    if not isinstance(d, dict):
        raise ModelConfigError(f"{source}: must hold a JSON object, got {type(d).__name__}")
    d = _with_text_config(d)
    f = _Fields(d, source)
    archs = f.get("architectures", ["LlamaForCausalLM"])
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) and a for a in archs):
        f.fail("architectures", f"must be a non-empty list of names, got {archs!r}")
    if archs[0] in HYBRID_ARCHITECTURES:  # Qwen3.5-MoE's router always renormalises its top-k
        d = f.d = {"norm_topk_prob": True, **d}
    model_type = f.str("model_type", "llama")
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    kv_heads = f.int("num_key_value_heads", heads)
    if heads % kv_heads:
        f.fail("num_key_value_heads", f"({kv_heads}) must divide num_attention_heads ({heads})")
    if f.d.get("head_dim") is None and hidden % heads:
        f.fail("hidden_size",
               f"({hidden}) is not a multiple of num_attention_heads ({heads}); give 'head_dim'")
    rope = f.dict("rope_parameters") or {}
    theta_default = rope.get("rope_theta", 10000.0)
    theta = f.number("rope_theta", None) if f.d.get("rope_theta") is not None else \
        _Fields(rope, f"{source}: key 'rope_parameters'").number("rope_theta", theta_default)
    _check_head_dim(f, f.int("head_dim", hidden // heads))
    _check_special_ids(f, f.int("vocab_size"))
    # transformers 5.x writes Qwen3-MoE's num_experts as num_local_experts; DeepSeek: n_routed_experts
    num_experts = (f.int("num_experts", 0, lo=0) or f.int("num_local_experts", 0, lo=0)
                   or f.int("n_routed_experts", 0, lo=0))
    per_tok = f.int("num_experts_per_tok", 0, lo=0)
    moe_inter = f.int("moe_intermediate_size", 0, lo=0)
    if num_experts and not 1 <= per_tok <= num_experts:
        f.fail("num_experts_per_tok",
               f"must be in [1, {num_experts}] for a model with {num_experts} experts, "
                                      f"got {per_tok}")
    if num_experts and not moe_inter:
        f.fail("moe_intermediate_size", f"must be >= 1 for a model with {num_experts} experts")
    return ModelConfig(
        name=name,
        architecture=archs[0],
        model_type=model_type,
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size", 0, lo=0 if num_experts else 1),
        num_layers=f.int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=f.int("head_dim", hidden // heads),
        vocab_size=f.int("vocab_size"),
        max_position_embeddings=f.int("max_position_embeddings", 4096, lo=2),
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=_rope_scaling(f),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        # Qwen2 always has q/k/v biases; Llama and Qwen3 say so in attention_bias.
        attention_bias=f.bool("attention_bias", model_type in ("qwen2", "qwen2_5_vl")),
        qk_norm=model_type in ("qwen3", "qwen3_moe") or archs[0] in HYBRID_ARCHITECTURES,
        torch_dtype=f.str("torch_dtype", None) if d.get("torch_dtype") is not None else f.str("dtype",
                                                                                              "bfloat16"),
        num_experts=num_experts,
        num_experts_per_tok=per_tok,
        moe_intermediate_size=moe_inter,
        **_moe_layout(f, num_experts, archs[0]),
        **_mla_fields(f, archs[0]),
        **_hybrid_fields(f, archs[0]),
        **({} if archs[0] in HYBRID_ARCHITECTURES else _vision_fields(f, heads, hidden)),
        **_quant_fields(f, num_experts),
        path=path,
        raw=d,
    )


def _hybrid_fields(f: _Fields, architecture: str) -> dict:
    """A hybrid model's layer types, Gated DeltaNet widths, state dtype and partial RoPE; {} for any other."""
    if architecture not in HYBRID_ARCHITECTURES:
        return {}
    layers = f.int("num_hidden_layers")
    interval = f.int("full_attention_interval", 4)
    types = f.get("layer_types", ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                  for i in range(layers)])
    if not isinstance(types, list) or len(types) != layers:
        f.fail("layer_types", f"must list one type per layer ({layers}), got {str(types)[:80]}")
    unknown = sorted({t for t in types if t not in HYBRID_LAYER_TYPES}, key=str)
    if unknown:
        f.fail("layer_types", f"holds {unknown[0]!r}, a layer type the engine does not serve; supported: "
                              f"{', '.join(HYBRID_LAYER_TYPES)}")
    state = f.str("mamba_ssm_dtype", "float32")
    if state not in STATE_DTYPES:
        f.fail("mamba_ssm_dtype", f"is {state!r}; supported: {', '.join(STATE_DTYPES)} (Qwen3.5: float32)")
    k_heads, v_heads = f.int("linear_num_key_heads"), f.int("linear_num_value_heads")
    if v_heads % k_heads:
        f.fail("linear_num_value_heads",
               f"({v_heads}) must be a multiple of linear_num_key_heads ({k_heads})")
    rope = {**(f.dict("rope_parameters") or {}), **(f.dict("rope_scaling") or {})}
    factor = f.d.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    head_dim = f.int("head_dim", f.int("hidden_size") // f.int("num_attention_heads"))
    rotary = int(head_dim * factor) if isinstance(factor, (int, float)) and 0 < factor <= 1 else 0
    if rotary < 2 or rotary % 2:
        f.fail("partial_rotary_factor", f"({factor!r}) must give an even number of rotary channels of the "
                                        f"{head_dim}-wide head; Qwen3.5's is 0.25")
    return {"layer_types": tuple(types), "linear_num_key_heads": k_heads, "linear_num_value_heads": v_heads,
            "linear_key_head_dim": f.int("linear_key_head_dim"),
            "linear_value_head_dim": f.int("linear_value_head_dim"),
            "linear_conv_kernel_dim": f.int("linear_conv_kernel_dim", 4, lo=2), "state_dtype": state,
            "rotary_dim": rotary, "attn_output_gate": f.bool("attn_output_gate", True),
            "zero_centered_norm": True, "grouped_projections": architecture == "Qwen3NextForCausalLM",
            "shared_expert_intermediate_size": f.int("shared_expert_intermediate_size", 0, lo=0)}


def _mla_fields(f: _Fields, architecture: str) -> dict:
    """MLA's widths, for a DeepSeek-V2 architecture (which needs them); {} for any other."""
    if architecture not in MLA_ARCHITECTURES:
        return {}
    rank = f.int("kv_lora_rank")
    rope = f.int("qk_rope_head_dim")
    if rope % 2:
        f.fail("qk_rope_head_dim", f"({rope}) must be even (RoPE rotates pairs of channels); try {rope + 1}")
    if not f.bool("rope_interleave", True):  # HF's DeepSeek-V3 key; V2 is always interleaved
        f.fail("rope_interleave", "is false; MLA's rope part is served interleaved (DeepSeek's checkpoints); "
                                  "try 'rope_interleave': true")
    return {"kv_lora_rank": rank, "qk_rope_head_dim": rope, "qk_nope_head_dim": f.int("qk_nope_head_dim"),
            "v_head_dim": f.int("v_head_dim"), "q_lora_rank": f.int("q_lora_rank", 0, lo=0),
            "num_nextn_predict_layers": f.int("num_nextn_predict_layers", 0, lo=0)}


def _moe_layout(f: _Fields, num_experts: int, architecture: str) -> dict:
    """Which layers hold experts and how their weights combine (checked only for an MoE config)."""
    if not num_experts:
        return {}
    layers = f.int("num_hidden_layers")
    dense = f.get("mlp_only_layers", list(range(f.int("first_k_dense_replace", 0, lo=0))))  # DeepSeek's
    if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < layers for i in dense):
        f.fail("mlp_only_layers", f"must be a list of layer indexes in [0, {layers}), got {dense!r}")
    method = _topk_method(f, architecture)
    groups = {}
    if method != "greedy":
        groups = {"n_group": f.int("n_group"), "topk_group": f.int("topk_group")}
        if num_experts % groups["n_group"] or groups["topk_group"] > groups["n_group"]:
            f.fail("n_group", f"({groups['n_group']}) must divide the {num_experts} experts and be at least "
                              f"topk_group ({groups['topk_group']})")
        reachable = groups["topk_group"] * num_experts // groups["n_group"]
        if reachable < f.int("num_experts_per_tok"):
            f.fail("topk_group", f"({groups['topk_group']}) groups of {num_experts // groups['n_group']} "
                                 f"experts hold {reachable}, fewer than num_experts_per_tok; try "
                                 f"'topk_group': {groups['n_group']}")
    return {"norm_topk_prob": f.bool("norm_topk_prob", False),
            "decoder_sparse_step": f.int("decoder_sparse_step", f.int("moe_layer_freq", 1)),
            "mlp_only_layers": tuple(dense), "n_shared_experts": f.int("n_shared_experts", 0, lo=0),
            "routed_scaling_factor": f.number("routed_scaling_factor", 1.0), "topk_method": method, **groups,
            **_noaux_fields(f, method)}


def _topk_method(f: _Fields, architecture: str) -> str:
    """DeepSeek's router kind: greedy / group_limited_greedy (V2), noaux_tc (V3's, its default there)."""
    v3 = architecture == "DeepseekV3ForCausalLM"
    method = f.str("topk_method", "noaux_tc" if v3 else "greedy")
    supported = ("greedy", "group_limited_greedy") + (("noaux_tc",) if v3 else ())
    if method not in supported:
        hint = "; noaux_tc is DeepseekV3ForCausalLM's" if method == "noaux_tc" else ""
        f.fail("topk_method", f"is {method!r}; supported: {', '.join(supported)}{hint}")
    return method


def _noaux_fields(f: _Fields, method: str) -> dict:
    """noaux_tc's scoring function (sigmoid); {} for another router."""
    if method != "noaux_tc":
        return {}
    scoring = f.str("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        f.fail("scoring_func", f"is {scoring!r}; topk_method noaux_tc is served with 'sigmoid'")
    return {"scoring_func": scoring}


def _with_text_config(d: dict) -> dict:
    """transformers 5.x writes a VL model's decoder keys under `text_config`: read them as top-level keys
    (the top level wins: it holds the saved dtype and the token ids)."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        return d
    return {**text, **{k: v for k, v in d.items() if k != "text_config"}}


def _vision_fields(f: _Fields, heads: int, hidden: int) -> dict:
    """ModelConfig's vision-language fields from `vision_config`, the M-RoPE sections and the token ids;
    {} for a text-only config."""
    if f.d.get("vision_config") is None:
        return {}
    vf = _Fields(f.dict("vision_config"), f"{f.source}: key 'vision_config'")
    depth = vf.int("depth")
    full = vf.get("fullatt_block_indexes", [])
    if not isinstance(full, (list, tuple)) or not all(isinstance(i, int) and 0 <= i < depth for i in full):
        vf.fail("fullatt_block_indexes", f"must be a list of block indexes in [0, {depth}), got {full!r}")
    vrope = vf.dict("rope_parameters") or {}
    vision = VisionConfig(
        depth=depth, hidden_size=vf.int("hidden_size"), intermediate_size=vf.int("intermediate_size"),
        num_heads=vf.int("num_heads"), out_hidden_size=vf.int("out_hidden_size", hidden),
        fullatt_block_indexes=tuple(full), patch_size=vf.int("patch_size", 14),
        temporal_patch_size=vf.int("temporal_patch_size", 2),
        spatial_merge_size=vf.int("spatial_merge_size", 2),
        window_size=vf.int("window_size", 112), in_channels=vf.int("in_channels", vf.int("in_chans", 3)),
        rope_theta=float(vrope.get("rope_theta", 10000.0)), tokens_per_second=vf.int("tokens_per_second", 2))
    if vision.hidden_size % vision.num_heads or vision.head_dim % 4:
        vf.fail("num_heads", f"({vision.num_heads}) must split hidden_size ({vision.hidden_size}) into heads "
                             "of a multiple of 4 (2-D rotary)")
    if vision.out_hidden_size != hidden:
        vf.fail("out_hidden_size", f"({vision.out_hidden_size}) must equal the decoder's hidden_size "
                                   f"({hidden})")
    key = "rope_scaling" if f.d.get("rope_scaling") is not None else "rope_parameters"
    section = (f.dict(key) or {}).get("mrope_section")
    head_dim = f.int("head_dim", hidden // heads)
    if not isinstance(section, list) or len(section) != 3 or sum(section) != head_dim // 2:
        example = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]
        f.fail(key, f"needs 'mrope_section': 3 integers summing to head_dim / 2 ({head_dim // 2}), "
                    f"e.g. {example}; got {section!r}")
    return {"vision": vision, "mrope_section": tuple(section), **{k: f.int(k, lo=0) for k in VL_TOKEN_IDS}}


def load_model_config(name_or_path: str) -> ModelConfig:
    """Load a built-in config by name or an HF-style folder; ModelConfigError (a ValueError) naming the file
    and the key, or the choices, otherwise."""
    folder = resolve_model_dir(name_or_path)
    if folder is None:
        raise ModelConfigError(
            f"no config.json at '{name_or_path}'; use a folder holding an HF-style config.json "
            f"or a built-in name: {', '.join(builtin_models())}"
        )
    file = folder / "config.json"
    try:
        d = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        where = f"at line {e.lineno}, column {e.colno}"
        raise ModelConfigError(f"{file}: not valid JSON: {e.msg} {where}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{file}: cannot be read: {e}") from None
    is_builtin = folder.parent == CONFIG_DIR
    return from_hf_dict(d, name=folder.name, path=None if is_builtin else str(folder), source=str(file))
