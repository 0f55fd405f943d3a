"""FP8 (e4m3) hybrid checkpoints on the CPU: a Qwen3.5 dense and MoE checkpoint quantized the way block-FP8
checkpoints ship (Gated DeltaNet's in_proj_qkv, in_proj_z and out_proj, the attention's q/k/v/o, the MLPs
and experts; in_proj_b/a, the routers and the shared expert's gate left in bf16) loads and gives the logits
of the same weights dequantized, on one rank and sharded over two (in_proj_qkv's one tensor and its block
scales split part by part)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from autoprofile.config import ConfigError, ServerConfig, validate
from autoprofile.layers.parallel import TP
from autoprofile.layers.quant import dequantize_weight, quantize_weight
from autoprofile.model_config import Fp8Scheme, load_model_config
from unit_tests import test_qwen3_5 as hybrid
from unit_tests.test_fp8_models import compare, ours

SCHEME = Fp8Scheme("block", (8, 8), "group")
UNCONVERTED = ["lm_head", "in_proj_b", "in_proj_a", "shared_expert_gate", "mlp.gate"]


def quantizable(name: str) -> bool:
    return (name.startswith("model.layers.") and name.endswith(".weight") and name.count(".") >= 4
            and any(p in name for p in ("_proj.", "in_proj_qkv", "in_proj_z")) and "in_proj_b" not in name
            and "in_proj_a" not in name)


# logits' relative error of W8A8 against the dequantized weights at these tiny widths (blocks of 8): measured
# 0.15 dense and 0.25 MoE, of which the Gated DeltaNet projections alone 0.16 and the rest 0.07 (the dense
# models' 0.04-0.06, test_fp8_models); in_proj_qkv's q and v scales swapped measured 0.82 and 1.0. Every
# decisive greedy token agrees.
TOLERANCE = 0.35


def write(hf, folder: Path, swap_qv_scales: bool = False) -> tuple[Path, Path]:
    """(the block-FP8 checkpoint, the same weights dequantized) as two model folders. swap_qv_scales: a
    loader's mistake written in: in_proj_qkv's q and v parts take each other's block scales (where they
    fit)."""
    src = folder / "src"
    if not src.exists():
        hf.save_pretrained(str(src))
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    fp8, deq = {}, {}
    for name, w in tensors.items():
        if not quantizable(name):
            fp8[name] = deq[name] = w
            continue
        q, s = quantize_weight(w.float(), SCHEME)
        fp8[name], fp8[name[:-len("weight")] + "weight_scale_inv"] = q, s
        if swap_qv_scales and "in_proj_qkv" in name:
            n = s.shape[0] // 4  # q, k: a quarter of the block rows each, v: half
            swapped = torch.cat([s[2 * n:3 * n], s[n:2 * n], s[:n], s[3 * n:]])
            fp8[name[:-len("weight")] + "weight_scale_inv"] = swapped
        deq[name] = dequantize_weight(q, s, SCHEME)
    out, ref = folder / ("fp8-swapped" if swap_qv_scales else "fp8"), folder / "dequantized"
    for d, sd in ((out, fp8), (ref, deq)):
        d.mkdir(exist_ok=True)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
        shutil.copy(src / "config.json", d / "config.json")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(SCHEME.block),
                                     "modules_to_not_convert": UNCONVERTED}
    (out / "config.json").write_text(json.dumps(config))
    return out, ref


def logits(model) -> torch.Tensor:
    return hybrid.chunk_logits(model, hybrid.Caches(model.config), hybrid.IDS, 0)


@pytest.fixture(scope="module", params=["dense", "moe"])
def folders(request, tmp_path_factory):
    config = {**(hybrid.TINY if request.param == "dense" else hybrid.TINY_MOE), "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "head_dim": 16}
    hf, folder = hybrid.hf_model(config), tmp_path_factory.mktemp(f"fp8-{request.param}")
    return (*write(hf, folder), write(hf, folder, swap_qv_scales=True)[0])


def test_an_fp8_hybrid_checkpoint_gives_the_logits_of_its_dequantized_weights(folders):
    fp8, ref, swapped = folders
    model = ours(fp8)
    assert model.config.quant == SCHEME
    gdn = model.model.layers[0].linear_attn
    assert gdn.in_proj_qkv.weight.dtype == gdn.out_proj.weight.dtype == torch.float8_e4m3fn
    assert gdn.in_proj_ba.weight.dtype == torch.float32  # left unconverted, as the checkpoint says
    want = logits(ours(ref))
    err, agree = compare(logits(model), want)
    assert err < TOLERANCE and agree >= 0.9, (err, agree)
    assert compare(logits(ours(swapped)), want)[0] > TOLERANCE + 0.2  # the tolerance sees a part's scales


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_the_dequantized_shard_of_in_proj_qkv_part_by_part(folders, rank):
    """in_proj_qkv's q | k | v rows and their block scales come in one tensor each: a rank's FP8 rows times
    its scales are its q, k and v heads of the dequantized weight."""
    fp8, ref, _ = folders
    model, full = ours(fp8, TP(rank, 2)), ours(ref)
    mine, whole = model.model.layers[0].linear_attn.in_proj_qkv, full.model.layers[0].linear_attn.in_proj_qkv
    got = dequantize_weight(mine.weight.data, mine.weight_scale.data, SCHEME)
    mc = model.config
    parts = [mc.linear_key_dim, mc.linear_key_dim, mc.linear_value_dim]
    want = torch.cat([p.chunk(2)[rank] for p in whole.weight.data.split(parts)])
    torch.testing.assert_close(got, want)


def test_fp8_at_load_is_refused_for_a_hybrid_model_naming_the_flag():
    with pytest.raises(ConfigError, match="--quantization"):
        validate(ServerConfig(model="tiny-hybrid", quantization="fp8", attention_backend="torch",
                              report_dir=None))


def test_a_qwen3_next_fp8_checkpoint_is_refused_before_any_gpu_work(tmp_path):
    """Qwen3-Next's grouped projections load bf16 only: its FP8 checkpoint is refused naming --model."""
    builtin = Path(__file__).parents[1] / "models" / "configs" / "qwen3-next-80b-a3b" / "config.json"
    config = json.loads(builtin.read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": UNCONVERTED}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="--model: .*Qwen3-Next FP8"):
        validate(ServerConfig(model=str(tmp_path), load_format="dummy", report_dir=None), serving=False)


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b-fp8", "qwen3.5-122b-a10b-fp8"])
def test_the_fp8_builtins_plan(name):
    from autoprofile.plan import GPUS, make_plan
    cfg = validate(ServerConfig(model=name, tp=2 if "122b" in name else 1), serving=False)
    p = make_plan(cfg, GPUS["h100"])
    assert cfg.model_config.quant is not None and p.tokens > 0 and p.problem is None, p.problem
