"""HF-style `config.json` -> ModelConfig: the fields the runtime and the budget need."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"
# Architectures the engine can run; others (MoE) are known to the budget planner only.
RUNNABLE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def builtin_models() -> list[str]:
    return sorted(p.name for p in CONFIG_DIR.iterdir() if (p / "config.json").is_file())


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
    # MoE (planner only)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # MLA (planner only): per-token latent cache is kv_lora_rank + qk_rope_head_dim
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    path: str | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def runnable(self) -> bool:
        return self.architecture in RUNNABLE_ARCHITECTURES

    @property
    def checkpoint_files(self) -> list[Path]:
        """Safetensors files next to the config (empty: random weights)."""
        return sorted(Path(self.path).glob("*.safetensors")) if self.path else []

    def num_params(self) -> int:
        """Parameter count (exact for the dense decoders; MoE counts all experts)."""
        h, L = self.hidden_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        if self.num_experts:
            mlp = self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
        else:
            mlp = 3 * h * self.intermediate_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * (attn + mlp + 2 * h) + embed + h


def resolve_model_dir(name_or_path: str) -> Path | None:
    """A folder holding config.json: a built-in name or a path. None if neither exists."""
    p = Path(name_or_path)
    if (p / "config.json").is_file():
        return p
    builtin = CONFIG_DIR / name_or_path.lower()
    return builtin if (builtin / "config.json").is_file() else None


def from_hf_dict(d: dict, name: str = "custom", path: str | None = None) -> ModelConfig:
    arch = (d.get("architectures") or ["LlamaForCausalLM"])[0]
    heads = d["num_attention_heads"]
    model_type = d.get("model_type", "llama")
    rope = d.get("rope_parameters") or {}  # transformers v5 nests rope_theta/rope_scaling here
    return ModelConfig(
        name=name,
        architecture=arch,
        model_type=model_type,
        hidden_size=d["hidden_size"],
        intermediate_size=d.get("intermediate_size", 0),
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        vocab_size=d["vocab_size"],
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=d.get("rope_theta") or rope.get("rope_theta", 10000.0),
        rope_scaling=d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None),
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        # Qwen2 always has q/k/v biases; Llama and Qwen3 say so in attention_bias.
        attention_bias=d.get("attention_bias", model_type == "qwen2"),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        torch_dtype=d.get("torch_dtype") or d.get("dtype") or "bfloat16",
        num_experts=d.get("num_experts", 0) or d.get("n_routed_experts", 0) or 0,
        num_experts_per_tok=d.get("num_experts_per_tok", 0) or 0,
        moe_intermediate_size=d.get("moe_intermediate_size", 0) or 0,
        kv_lora_rank=d.get("kv_lora_rank", 0) or 0,
        qk_rope_head_dim=d.get("qk_rope_head_dim", 0) or 0,
        path=path,
        raw=d,
    )


def load_model_config(name_or_path: str) -> ModelConfig:
    """Load a built-in config by name or an HF-style folder; ValueError naming the choices otherwise."""
    folder = resolve_model_dir(name_or_path)
    if folder is None:
        raise ValueError(
            f"no config.json at '{name_or_path}'; use a folder holding an HF-style config.json "
            f"or a built-in name: {', '.join(builtin_models())}"
        )
    with open(folder / "config.json") as f:
        d = json.load(f)
    is_builtin = folder.parent == CONFIG_DIR
    return from_hf_dict(d, name=folder.name, path=None if is_builtin else str(folder))
