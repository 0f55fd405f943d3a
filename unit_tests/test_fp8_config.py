"""FP8 checkpoints' config.json (`quantization_config`), --quantization fp8, and the bad inputs refused before
any GPU allocation: each error names the file and key (or the flag, or the tensor) and what would work."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from autoprofile.config import ConfigError, ServerConfig, validate
from autoprofile.engine.attention import get_backend_class
from autoprofile.engine.weights import load_weights
from autoprofile.layers.quant import fp8_capability_problem, quantize_weight
from autoprofile.model_config import (CONFIG_DIR, Fp8Scheme, ModelConfigError, from_hf_dict, ignored,
                                      load_model_config, with_runtime_fp8)
from models import model_class

TINY = json.loads((CONFIG_DIR / "tiny" / "config.json").read_text())
HF_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
      "config_groups": {"group_0": {"targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                          "dynamic": True}}}}


def with_quant(q: dict, base: dict = TINY):
    return from_hf_dict({**base, "quantization_config": q}, source="m/config.json")


def ct(weights: str, acts: dict) -> dict:
    out = copy.deepcopy(CT)
    out["config_groups"]["group_0"]["weights"]["strategy"] = weights
    out["config_groups"]["group_0"]["input_activations"] = acts
    return out


def test_checkpoint_formats_become_schemes():
    assert with_quant(HF_BLOCK).quant == Fp8Scheme("block", (128, 128), "group")
    assert with_quant(HF_BLOCK).quant_ignore == ("lm_head",)
    assert with_quant({"quant_method": "fp8", "activation_scheme": "dynamic"}).quant == Fp8Scheme("channel")
    assert with_quant(CT).quant == Fp8Scheme("channel", None, "token")
    static = ct("tensor", {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False})
    assert with_quant(static).quant == Fp8Scheme("channel", None, "static")
    assert from_hf_dict(TINY).quant is None and from_hf_dict(TINY).weight_format == "bf16"


def test_builtin_fp8_models_and_their_weight_format():
    assert load_model_config("qwen3-30b-a3b-fp8").weight_format == \
        "fp8_e4m3 (block 128x128, dynamic per-group activations)"
    assert load_model_config("llama-3.1-8b-fp8").weight_format == \
        "fp8_e4m3 (per-channel, dynamic per-token activations)"
    v2 = load_model_config("deepseek-v2-lite-fp8")  # its dense first MLP is 10,944 rows: not whole blocks
    assert v2.quant_for("mlp.gate_proj", 0) is None and v2.quant_for("mlp.experts", 1) == v2.quant
    assert v2.quant_for("self_attn.kv_b_proj") == v2.quant
    for name in ("tiny-fp8", "tiny-moe-fp8", "tiny-mla-fp8"):
        assert load_model_config(name).quant.block == (32, 32)


def test_unconverted_modules_match_names_parts_and_patterns():
    assert ignored("lm_head", ("lm_head",))
    assert ignored("model.layers.0.mlp.gate_proj", ("model.layers.0.mlp",))
    assert not ignored("model.layers.10.mlp.gate_proj", ("model.layers.1.mlp",))
    assert not ignored("model.layers.1.mlp.gate_proj", ("mlp.gate",))  # the router, not gate_proj
    assert ignored("model.layers.3.self_attn.kv_a_proj_with_mqa", ("re:.*kv_a_proj.*",))
    mc = with_quant({**HF_BLOCK, "modules_to_not_convert": ["re:.*self_attn.o_proj"]})
    assert mc.quant_for("self_attn.o_proj") is None and mc.quant_for("self_attn.q_proj") == mc.quant


@pytest.mark.parametrize("q,says", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq', which is not served; supported: fp8, "
                                         "compressed-tensors"),
    ({"quant_method": "gptq"}, "'gptq'"),
    ({"load_in_4bit": True}, "quant_method None"),  # bitsandbytes' older spelling
    ({**HF_BLOCK, "weight_block_size": [128]}, "weight_block_size \\[128\\]; it must be two integers"),
    ({**HF_BLOCK, "activation_scheme": "static"}, "activation_scheme 'static'"),
    (ct("group", CT["config_groups"]["group_0"]["input_activations"]), "strategy 'tensor' or 'channel'"),
    ({**CT, "config_groups": {}}, "exactly one entry in 'config_groups'"),
    (ct("channel", {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}),
     "strategy 'token' dynamic, or 'tensor' static"),
])
def test_unsupported_quantization_configs_name_the_file_and_key(q, says):
    with pytest.raises(ModelConfigError, match=f"m/config.json: key 'quantization_config' .*{says}"):
        with_quant(q)


def test_static_activations_are_refused_for_experts():
    moe = json.loads((CONFIG_DIR / "tiny-moe" / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="static input scales.*dynamic"):
        with_quant(ct("tensor", {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
                   moe)


def test_quantization_flag():
    cfg = validate(ServerConfig(model="tiny", quantization="fp8", attention_backend="torch"))
    assert cfg.model_config.quant == Fp8Scheme("channel", None, "token")
    assert cfg.model_config.quant_method == "runtime"
    with pytest.raises(ConfigError, match="--quantization: unknown 'awq'; choose one of fp8"):
        validate(ServerConfig(model="tiny", quantization="awq"))
    with pytest.raises(ConfigError,
                       match="--quantization: tiny-fp8 is quantized already .*leave --quantization unset"):
        validate(ServerConfig(model="tiny-fp8", quantization="fp8"))
    with pytest.raises(ModelConfigError, match="already quantized"):
        with_runtime_fp8(load_model_config("tiny-fp8"))


def test_deterministic_has_no_fp8_gemm_yet():
    with pytest.raises(ConfigError, match="--deterministic: tiny-fp8's FP8 weights .*no batch-invariant"):
        validate(ServerConfig(model="tiny-fp8", deterministic=True, attention_backend="torch"))
    with pytest.raises(ConfigError, match="--deterministic: tiny's FP8 weights"):
        validate(ServerConfig(model="tiny", quantization="fp8", deterministic=True,
                              attention_backend="torch"))


def test_a_block_that_tp_would_split_is_refused_in_validation():
    """vLLM refuses these too: Qwen3-30B-A3B-FP8's experts (768 rows) in 4 shards are 192 rows, not whole
    128-row blocks; the error names the layer, the block and the largest --tp that works."""
    with pytest.raises(ConfigError, match=r"--tp: qwen3-30b-a3b-fp8's FP8 block scales .*layers.0.mlp."
                                          r"experts: output rows per part and rank \[192, 192\] .*block_n "
                                          r"128; try --tp 2"):
        validate(ServerConfig(model="qwen3-30b-a3b-fp8", tp=4), serving=False)
    validate(ServerConfig(model="qwen3-30b-a3b-fp8", tp=2), serving=False)
    with pytest.raises(ConfigError, match="--tp: deepseek-v2-lite-fp8's .*704.*try --tp 1"):
        validate(ServerConfig(model="deepseek-v2-lite-fp8", tp=2), serving=False)


def test_compute_capability_below_8_9_is_refused():
    assert fp8_capability_problem((9, 0), "--model") is None
    assert fp8_capability_problem((8, 9), "--model") is None
    why = fp8_capability_problem((8, 0), "--quantization")
    assert "compute capability >= 8.9" in why and "this one is 8.0" in why and "without --quantization" in why


def tiny_checkpoint(folder, drop: str | None = None, bf16: str | None = None, fp8_in: str | None = None):
    """tiny-fp8-shaped HF block checkpoint ([32, 32] blocks) of random weights; drop a tensor, keep one
    weight in bf16, or mark one module unconverted in config.json."""
    mc = load_model_config("tiny-fp8")
    backend = get_backend_class("torch")(mc.num_heads, mc.num_kv_heads, mc.head_dim, 16, torch.float32,
                                         torch.device("cpu"))
    model = model_class(load_model_config("tiny"))(load_model_config("tiny"), backend, dtype=torch.float32)
    load_weights(model, [], seed=0, show_progress=False)
    tensors = {}
    q, kv, i = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.intermediate_size
    for name, p in model.named_parameters():
        if "qkv_proj" in name:
            parts = dict(zip(("q_proj", "k_proj", "v_proj"), p.split([q, kv, kv])))
        elif "gate_up_proj" in name:
            parts = dict(zip(("gate_proj", "up_proj"), p.split([i, i])))
        else:
            tensors[name] = p.detach()
            continue
        for proj, w in parts.items():
            tensors[name.replace(name.split(".")[-2], proj)] = w.detach()
    out = {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight") and name != bf16:
            out[name], out[name + "_scale_inv"] = quantize_weight(w, mc.quant)
        else:
            out[name] = w.bfloat16()
    out.pop(drop, None)
    save_file({k: v.contiguous() for k, v in out.items()}, str(folder / "model.safetensors"))
    config = json.loads((CONFIG_DIR / "tiny-fp8" / "config.json").read_text())
    if fp8_in:
        config["quantization_config"]["modules_to_not_convert"].append(fp8_in)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def load(folder):
    mc = load_model_config(str(folder))
    backend = get_backend_class("torch")(mc.num_heads, mc.num_kv_heads, mc.head_dim, 16, torch.float32,
                                         torch.device("cpu"))
    model = model_class(mc)(mc, backend, dtype=torch.float32)
    load_weights(model, mc.checkpoint_files, seed=0, show_progress=False)
    return model


def test_a_written_tiny_fp8_checkpoint_loads(tmp_path):
    model = load(tiny_checkpoint(tmp_path))
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("kw,says", [
    ({"drop": "model.layers.1.self_attn.o_proj.weight_scale_inv"},
     "lacks tensors for: model.layers.1.self_attn.o_proj.weight_scale .*needs its scale"),
    ({"drop": "model.layers.0.mlp.up_proj.weight_scale_inv"},
     "lacks tensors for: model.layers.0.mlp.gate_up_proj"),
    ({"bf16": "model.layers.2.mlp.down_proj.weight"},
     "tensor 'model.layers.2.mlp.down_proj.weight' is BF16, not FP8, .*list the module in "
     "modules_to_not_convert"),
    ({"fp8_in": "re:.*o_proj"}, "tensor 'model.layers.0.self_attn.o_proj.weight' is FP8 but config.json's "
                                "quantization_config leaves it unconverted"),
])
def test_a_checkpoint_that_disagrees_with_its_config_is_refused_naming_the_tensor(kw, says, tmp_path):
    with pytest.raises(ValueError, match=says):
        load(tiny_checkpoint(tmp_path, **kw))
