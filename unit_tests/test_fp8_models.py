"""FP8 checkpoints end to end on CPU (torch backend): tiny dense, MoE and MLA models written in each format
(HF `quant_method: fp8` with block scales, compressed-tensors per-channel / per-tensor with dynamic per-token
or static activations), served against the SAME model with its weights dequantized (bf16 semantics, fp32
here): the logits differ only by the activation quantization. Corrupted checkpoints (scales transposed,
per input column, inverted, a static scale dropped or wrong) must be refused or disagree: each is a mistake
a loader can make, applied to the file."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from autoprofile.engine.attention import get_backend_class
from autoprofile.engine.kv_cache import KVCache
from autoprofile.engine.weights import load_weights
from autoprofile.config import ConfigError, ServerConfig, validate
from autoprofile.layers.parallel import TP
from autoprofile.layers.quant import FP8, FP8_MAX, Fp8Scheme, dequantize_weight, quantize_weight
from autoprofile.model_config import load_model_config
from models import model_class
from unit_tests.test_moe import PAGE, TINY, logits, perturb

transformers = pytest.importorskip("transformers", minversion="5.0")

DENSE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
MLA = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
           n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=None,
           max_position_embeddings=512,
           bos_token_id=1, eos_token_id=2)
IDS = [5, 17, 250, 3, 3, 3, 99, 140, 7, 8, 299, 42, 0, 12, 77, 78, 79, 80, 81, 150, 151, 9]
# name -> (scheme, config.json's quantization_config); the weight format each writer produces
FORMATS = {
    "hf-block": Fp8Scheme("block", (32, 32), "group"),
    "hf-block-tail": Fp8Scheme("block", (32, 48), "group"),  # K of 64 / 96: a short last block column
    "ct-channel-token": Fp8Scheme("channel", None, "token"),
    "ct-tensor-static": Fp8Scheme("channel", None, "static"),  # per-tensor weights, static activations
    "hf-block16": Fp8Scheme("block", (16, 16), "group"),  # whole blocks on each of 2 TP ranks
}
# logits relative error of W8A8 against the dequantized weights: measured 0.036-0.056 here; each corrupted
# checkpoint that loads measured 1.0-1.24. Greedy agreement on decisive positions: one MoE position of 17
# flips (a routing near-tie)
TOLERANCE = 0.08


def hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "dense":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DENSE))
    elif kind == "moe":
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY))
    else:
        hf = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**MLA))
    hf = hf.float().eval()
    perturb(hf)
    with torch.no_grad():  # rows growing, columns shrinking, each tensor its own size: every block, row,
        for name, p in hf.named_parameters():  # column and packed part its own scale
            if quantizable(name):
                n, k = p.shape
                p.mul_(torch.linspace(-1, 1, n).exp()[:, None] * torch.linspace(1, -1, k).exp()[None, :]
                       * torch.empty(()).uniform_(-1, 1).exp())
    return hf


def quantizable(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def quant_config(fmt: str, block: tuple[int, int] | None) -> dict:
    if fmt.startswith("hf-"):
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    static = fmt.endswith("static")
    acts = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False} if static else
            {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True})
    weights = {"num_bits": 8, "type": "float", "strategy": "tensor" if static else "channel"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}}}


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight fp8, the scale as the format stores it: HF [N/bn, K/bk]; channel [N, 1]; tensor [1])."""
    scheme = FORMATS[fmt]
    if fmt == "ct-tensor-static":
        scale = (w.abs().amax() / FP8_MAX).reshape(1)
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    q, s = quantize_weight(w, scheme)
    return q, (s[:, None] if scheme.weight == "channel" else s)


def dequantize(q: torch.Tensor, s: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "ct-tensor-static":
        return q.float() * s
    scheme = FORMATS[fmt]
    return dequantize_weight(q, s.reshape(-1) if scheme.weight == "channel" else s, scheme)


def input_amax(hf, folder: Path) -> dict[str, float]:
    """Calibration for static activations: each linear's largest |input| over IDS (the model loaded back
    from `folder`, its dequantized weights)."""
    model = type(hf).from_pretrained(str(folder)).float().eval()
    amax: dict[str, float] = {}

    def hook(name):
        def record(module, args):
            amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())
        return record
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and quantizable(name + ".weight"):
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        model(input_ids=torch.tensor([IDS]))
    return amax


MUTATIONS = ("transposed", "transposed-where-it-fits", "per-input-column", "inverse", "input-scale-dropped",
             "input-scale-wrong")


def write(hf, fmt: str, folder: Path, mutation: str | None = None) -> tuple[Path, Path]:
    """(the FP8 checkpoint, the same weights dequantized) as two model folders. mutation: a loader's mistake
    written into the FP8 file."""
    src = folder / "src"
    if not src.exists():
        hf.save_pretrained(str(src))
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    fp8, deq = {}, {}
    scale_name = "weight_scale_inv" if fmt.startswith("hf-") else "weight_scale"
    for name, w in tensors.items():
        if not quantizable(name):
            fp8[name] = deq[name] = w
            continue
        q, s = quantize(w.float(), fmt)
        deq[name] = dequantize(q, s, fmt)
        prefix = name[:-len("weight")]
        fp8[name], fp8[prefix + scale_name] = q, corrupt(s, w, fmt, mutation)
    out, ref = folder / f"{fmt}-{mutation}", folder / f"{fmt}-dequantized"
    for d, sd in ((out, fp8), (ref, deq)):
        d.mkdir(exist_ok=True)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
        shutil.copy(src / "config.json", d / "config.json")
    if fmt.endswith("static"):
        scales = {f"{n}.input_scale": torch.tensor([a / FP8_MAX]) for n, a in input_amax(hf, ref).items()}
        for name in scales:  # packed parts' scales differ: the loader must take their largest (k's, up's)
            if name.endswith(("q_proj.input_scale", "v_proj.input_scale", "gate_proj.input_scale")):
                scales[name] = scales[name] / 16
        if mutation == "input-scale-wrong":  # 64x too fine: the larger activations clamp at 448
            scales = {k: v / 64 for k, v in scales.items()}
        if mutation != "input-scale-dropped":
            save_file({**fp8, **scales}, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quant_config(fmt, FORMATS[fmt].block)
    (out / "config.json").write_text(json.dumps(config))
    return out, ref


def corrupt(s: torch.Tensor, w: torch.Tensor, fmt: str, mutation: str | None) -> torch.Tensor:
    if mutation == "transposed" and fmt == "ct-channel-token":  # [N, 1] -> [1, N]
        return s.t().contiguous()
    if mutation == "transposed" or (mutation == "transposed-where-it-fits" and s.shape[0] == s.shape[-1]):
        return s.t().contiguous() if s.dim() == 2 and s.shape[1] != 1 else s
    if mutation == "per-input-column" and w.shape[0] == w.shape[1]:  # the scale of each input column
        return (w.float().abs().amax(dim=0) / FP8_MAX)[:, None]
    if mutation == "inverse":
        return 1 / s
    return s


def ours(folder: Path, tp: TP = TP()):
    mc = load_model_config(str(folder))
    backend = get_backend_class("torch")(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE, torch.float32,
                                         torch.device("cpu"))
    model = model_class(mc)(mc, backend, tp, dtype=torch.float32)
    load_weights(model, mc.checkpoint_files, seed=0, show_progress=False)
    return model


def prefill_logits(model) -> torch.Tensor:
    mc = model.config
    if mc.is_mla:
        kv = KVCache(mc.num_layers, 32, 1, PAGE, mc.kv_lora_rank + mc.qk_rope_head_dim, torch.float32,
                     torch.device("cpu"), latent=True)
    else:
        kv = KVCache(mc.num_layers, 32, mc.num_kv_heads, PAGE, mc.head_dim, torch.float32,
                     torch.device("cpu"))
    return logits(model, IDS, kv)


def compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(relative error of the logits a against b, share of b's decisive positions where a picks the same
    greedy token). Decisive: b's top-2 margin above 3x the RMS difference of that position's logits (a tiny
    random model's logits are nearly flat, and its near-ties flip under any noise)."""
    err = ((a - b).norm() / b.norm()).item()
    top2 = b.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 3 * (a - b).pow(2).mean(dim=-1).sqrt()
    same = a.argmax(-1) == b.argmax(-1)
    return err, same[decisive].float().mean().item() if decisive.sum() >= 3 else 0.0


CASES = [("dense", f) for f in FORMATS] + [("moe", "hf-block"), ("moe", "ct-channel-token"),
                                            ("mla", "hf-block"), ("mla", "ct-channel-token")]


@pytest.fixture(scope="module")
def hf_models():
    return {kind: hf_model(kind) for kind in ("dense", "moe", "mla")}


@pytest.mark.parametrize("kind,fmt", CASES)
def test_fp8_checkpoint_matches_its_dequantized_weights(kind, fmt, hf_models, tmp_path):
    fp8, ref = write(hf_models[kind], fmt, tmp_path)
    model = ours(fp8)
    assert model.config.quant == FORMATS[fmt]
    err, agree = compare(prefill_logits(model), prefill_logits(ours(ref)))
    assert err < TOLERANCE and agree >= 0.9, (err, agree)


@pytest.mark.parametrize("kind", ["dense", "moe", "mla"])
@pytest.mark.parametrize("fmt,tp", [("hf-block", 1), ("hf-block-tail", 1), ("hf-block16", 2),
                                    ("ct-channel-token", 2), ("ct-tensor-static", 2)])
def test_every_rank_s_fp8_shard_dequantizes_to_its_reference_shard(kind, fmt, tp, hf_models, tmp_path):
    """The loader's layout, weight by weight: on each TP rank every FP8 parameter (packed q/k/v and gate/up
    parts, experts, MLA's projections) times its scales is exactly that rank's shard of the dequantized
    checkpoint; every other parameter is the same."""
    if kind != "dense" and fmt in ("hf-block-tail", "ct-tensor-static"):
        pytest.skip("tails need a dense layer's sizes; static activations are refused for experts")
    fp8, ref = write(hf_models[kind], fmt, tmp_path)
    for rank in range(tp):
        model, plain = ours(fp8, TP(rank, tp)), dict(ours(ref, TP(rank, tp)).named_parameters())
        quantized = 0
        for name, p in model.named_parameters():
            if p.dtype == FP8:
                quant = model.get_submodule(name.rpartition(".")[0]).quant
                got = dequantize_weight(p, dict(model.named_parameters())[name + "_scale"], quant)
                assert torch.equal(got, plain[name]), name
                quantized += 1
            elif not name.endswith("_scale"):
                assert torch.equal(p, plain[name]), name
        assert quantized >= 2 * model.config.num_layers


def test_a_block_split_by_tp_is_refused_before_loading(hf_models, tmp_path):
    fp8, _ = write(hf_models["dense"], "hf-block", tmp_path)  # k/v: 2 heads x 16 = 32 rows, 16 per rank
    with pytest.raises(ConfigError, match=r"--tp: .*self_attn.q_proj: output rows .*block_n 32"):
        validate(ServerConfig(model=str(fp8), tp=2, attention_backend="torch"))


@pytest.mark.parametrize("kind,fmt,mutation", [
    ("dense", "hf-block", "transposed-where-it-fits"), ("moe", "hf-block", "transposed-where-it-fits"),
    ("mla", "hf-block", "transposed-where-it-fits"), ("dense", "hf-block", "inverse"),
    ("moe", "hf-block", "inverse"), ("dense", "ct-channel-token", "per-input-column"),
    ("dense", "ct-channel-token", "inverse"), ("dense", "ct-tensor-static", "input-scale-wrong")])
def test_a_corrupted_scale_that_loads_gives_other_logits(kind, fmt, mutation, hf_models, tmp_path):
    """Scales of the right shape but the wrong meaning load; the model they make must not pass for the
    original (were the loader making that mistake itself, the test above would fail the same way)."""
    fp8, ref = write(hf_models[kind], fmt, tmp_path, mutation)
    err, _ = compare(prefill_logits(ours(fp8)), prefill_logits(ours(ref)))
    assert err > 4 * TOLERANCE, err


@pytest.mark.parametrize("kind,fmt,mutation,says", [
    ("dense", "hf-block", "transposed", "block scale of shape"),
    ("moe", "hf-block", "transposed", "block scale of shape"),
    ("mla", "hf-block", "transposed", "block scale of shape"),
    ("dense", "ct-channel-token", "transposed", r"per-channel weight scale of shape \(1, "),  # [1, N]
    ("dense", "ct-tensor-static", "input-scale-dropped", "input_scale")])
def test_a_scale_whose_shape_or_absence_reveals_the_mistake_is_refused(kind, fmt, mutation, says, hf_models,
                                                                       tmp_path):
    fp8, _ = write(hf_models[kind], fmt, tmp_path, mutation)
    with pytest.raises(ValueError, match=says) as e:
        ours(fp8)
    assert "model.layers." in str(e.value)


def test_transformers_reads_our_block_checkpoint_as_we_do(hf_models, tmp_path):
    """transformers' FineGrainedFP8 loader (on CPU: it dequantizes the FP8 checkpoint to full precision) is
    an independent reader of the layout: its model equals our dequantized reference."""
    pytest.importorskip("accelerate")
    fp8, ref = write(hf_models["dense"], "hf-block", tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(fp8)).float().eval()
    with torch.no_grad():
        them = theirs(input_ids=torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(them, prefill_logits(ours(ref)), rtol=2e-3, atol=2e-3)
    err, agree = compare(prefill_logits(ours(fp8)), them)
    assert err < TOLERANCE and agree >= 0.9


def test_runtime_quantization_of_a_bf16_checkpoint(hf_models, tmp_path):
    """--quantization fp8: the bf16 checkpoint quantized per channel at load, activations per token."""
    from autoprofile.model_config import with_runtime_fp8
    hf = hf_models["moe"]
    hf.save_pretrained(str(tmp_path))
    mc = with_runtime_fp8(load_model_config(str(tmp_path)))
    backend = get_backend_class("torch")(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE, torch.float32,
                                         torch.device("cpu"))
    model = model_class(mc)(mc, backend, dtype=torch.float32)
    load_weights(model, mc.checkpoint_files, seed=0, show_progress=False)
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    plain = ours(tmp_path)
    err, agree = compare(prefill_logits(model), prefill_logits(plain))
    assert err < TOLERANCE and agree >= 0.9, (err, agree)


def test_a_layer_read_by_one_producer_takes_its_rows_quantized_by_that_producer():
    """models.llama.reader_quant: a dense layer's norms quantize for qkv_proj and gate_up_proj, SiLU-mul for
    down_proj (dynamic activations); a norm read by more than one layer (MLA's projections, an MoE layer's
    router and experts) passes its bf16 rows, and static activations keep the layer's own quantization."""
    def built(name: str):
        mc = load_model_config(name)
        backend = get_backend_class("torch")(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE,
                                             torch.float32, torch.device("meta"))
        with torch.device("meta"):
            return model_class(mc)(mc, backend, dtype=torch.float32), mc

    model, mc = built("tiny-fp8")
    for layer in model.model.layers:
        assert layer.input_layernorm.quant == mc.quant == layer.post_attention_layernorm.quant
        assert layer.mlp.down_quant == mc.quant
    model, mc = built("tiny-moe-fp8")
    kinds = [(layer.post_attention_layernorm.quant, getattr(layer.mlp, "down_quant", "experts"))
             for layer in model.model.layers]
    assert all(layer.input_layernorm.quant == mc.quant for layer in model.model.layers)
    assert kinds == [(mc.quant, mc.quant) if mc.is_moe_layer(i) is False else (None, "experts")
                     for i in range(mc.num_layers)]
    model, mc = built("tiny-mla-fp8")
    assert all(layer.input_layernorm.quant is None for layer in model.model.layers)
    static = Fp8Scheme("channel", None, "static")
    from autoprofile.layers.quant import fused_input_quant
    assert fused_input_quant(static) is None and fused_input_quant(None) is None


def test_the_gpu_accuracy_script_compares_an_fp8_model_with_its_dequantized_twin():
    """scripts/fp8_accuracy.py (issue 31's check on llama-3.1-8b on the GPU) on tiny-fp8 on the CPU: the twin
    holds the FP8 weights dequantized, so prompt and one-row logits differ only by activation quantization."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "scripts" / "fp8_accuracy.py"), "--model", "tiny-fp8",
                          "--backend", "torch", "--device", "cpu", "--prompts", "1", "--prompt_len", "48",
                          "--steps", "4"], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["prompt_logits_rel_err"] < TOLERANCE and got["decode_logits_rel_err"] < TOLERANCE, got
    assert got["prompt_decisive_agree"] >= 0.9 and got["decode_decisive_agree"] >= 0.9, got
