"""Weights: seeded random init on the device, or safetensors / PyTorch .bin files with HF names, sharded for
this TP rank."""
from __future__ import annotations

import contextlib
import logging
import pickle
import re
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from autoprofile.layers.moe import expert_part
from autoprofile.layers.parallel import quantize_rows
from autoprofile.layers.quant import FP8

log = logging.getLogger(__name__)

INIT_STD = 0.02
DRAW_ELEMENTS = 1 << 26  # random experts drawn at once: 128 MiB of bf16 temporaries at most
IGNORED = ("rotary_emb.inv_freq", "rotary_pos_emb.inv_freq")  # buffers in some HF checkpoints; computed
NORM_WEIGHTS = ("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")  # RMSNorm scales: 1 when random
# An FP8 checkpoint's per-tensor KV cache scales, in the spellings vLLM reads: self_attn.{k,v}_scale,
# self_attn.attn.{k,v}_scale, self_attn.{k,v}_proj.{k,v}_scale or .output_scale, self_attn.kv_scale (both)
KV_SCALE_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?(?:([kv])_proj\.)?"
                           r"(k_scale|v_scale|kv_scale|output_scale)$")


def load_weights(model: nn.Module, checkpoint_files: list[Path], seed: int,
                 show_progress: bool = True) -> torch.Tensor | None:
    """Fill every parameter of `model`: from the checkpoint files if any, else seeded random values.
    Returns the checkpoint's KV cache scales [num_layers, 2] (k, v; CPU fp32), or None if it has none."""
    try:
        if checkpoint_files:
            return load_checkpoint(model, checkpoint_files, show_progress)
        init_random(model, seed)
        return None
    finally:
        release_quantization_temporaries(model)


def release_quantization_temporaries(model: nn.Module) -> None:
    """FP8 weights quantized on the device (random, --quantization fp8) leave their bf16/fp32 temporaries in
    the caching allocator: hand them back, or the probe would count them as reserved."""
    params = list(model.parameters())
    if params and params[0].device.type == "cuda" and any(p.dtype == FP8 for p in params):
        torch.cuda.empty_cache()


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer, 'k' | 'v' | 'kv') of a KV cache scale tensor's name, or None."""
    m = KV_SCALE_NAME.search(name)
    if m is None:
        return None
    layer, proj, kind = m.groups()
    if kind == "output_scale":
        return (int(layer), proj) if proj else None
    return int(layer), kind[:-len("_scale")]


def kv_scales_tensor(found: dict[tuple[int, str], float], num_layers: int, where: str) -> torch.Tensor | None:
    """[num_layers, 2] from {(layer, 'k'|'v'|'kv'): scale}; None if empty; every layer's k and v (or kv)
    must be there and positive, else a ValueError naming the first one missing."""
    if not found:
        return None
    out = torch.empty(num_layers, 2)
    for layer in range(num_layers):
        for col, kind in enumerate("kv"):
            value = found.get((layer, kind), found.get((layer, "kv")))
            if value is None or not value > 0:
                raise ValueError(f"{where}: has KV cache scales but layer {layer}'s {kind}_scale is "
                                 f"{'missing' if value is None else value} (it needs one > 0 per layer); "
                                 "remove the checkpoint's scales or try --kv_scales first_batch")
            out[layer, col] = value
    return out


def scale_name(weight: str) -> str:
    """An FP8 weight's scale parameter: `x.weight` -> `x.weight_scale`, experts' `gate_up_proj` ->
    `gate_up_proj_scale`."""
    return weight + "_scale"


@torch.no_grad()
def init_random(model: nn.Module, seed: int, std: float = INIT_STD) -> None:
    """N(0, std) for matrices and biases, 1 for norm weights; drawn where the parameters live. FP8 weights
    are drawn in the model's dtype and quantized one weight (one expert) at a time, in the same order, so
    a quantized model is its bf16 twin's weights quantized; static input scales are 1."""
    params = list(model.named_parameters())
    if not params:
        return
    named = dict(params)
    scales = {scale_name(n) for n, p in params if p.dtype == FP8}
    dtype = next((p.dtype for n, p in params if n.endswith(NORM_WEIGHTS)), torch.bfloat16)
    gen = torch.Generator(device=params[0][1].device).manual_seed(seed)
    for name, p in params:
        if name in scales:
            continue  # written with their weights
        if p.dtype == FP8:
            quant = model.get_submodule(name.rpartition(".")[0]).quant
            draw_fp8(p, named[scale_name(name)], quant, dtype, std, gen)
        elif name.endswith(NORM_WEIGHTS) or name.endswith("input_scale"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)


def draw_fp8(weight: nn.Parameter, scale: nn.Parameter, quant, dtype: torch.dtype, std: float,
             gen: torch.Generator) -> None:
    """N(0, std) in dtype, quantized into an FP8 weight [N, K] (or experts [E, N, K]) and its scale. Experts
    are drawn `expert_group` at a time as one [g * N, K] (one draw and a few quantize chunks, not a dozen
    launches an expert: qwen3-30b-a3b-fp8's 12,288 experts took 6 s), in the same order as one at a time."""
    if weight.dim() == 2:
        w = torch.empty(weight.shape, dtype=dtype, device=weight.device).normal_(0.0, std, generator=gen)
        quantize_rows(weight, w, 0, scale, quant)
        return
    experts, n, k = weight.shape
    group = expert_group(experts, n, k, 1 if quant.weight == "channel" else quant.block[0])
    for e in range(0, experts, group):
        g = min(group, experts - e)
        w = torch.empty(g * n, k, dtype=dtype, device=weight.device).normal_(0.0, std, generator=gen)
        quantize_rows(nn.Parameter(weight.data[e:e + g].flatten(0, 1), requires_grad=False), w, 0,
                      nn.Parameter(scale.data[e:e + g].flatten(0, 1), requires_grad=False), quant)


def expert_group(experts: int, n: int, k: int, bn: int) -> int:
    """Experts drawn at once (DRAW_ELEMENTS of temporaries at most): their [N, K] stacked into rows quantize
    as each one alone when N is whole blocks of bn rows (a block never spans two experts), else one."""
    if n % bn:
        return 1
    return max(1, min(experts, DRAW_ELEMENTS // (n * k)))


def checkpoint_target(name: str, packed: dict[str, tuple[str, int]],
                      renames: tuple[tuple[str, str], ...] = ()) -> tuple[str, int]:
    """HF tensor name -> (our parameter name, part): a leading prefix renamed (`model.language_model.` ->
    `model.`), then q/k/v_proj -> qkv_proj parts 0/1/2, etc."""
    for prefix, ours in renames:
        if name.startswith(prefix):
            name = ours + name[len(prefix):]
            break
    if name.endswith(".weight_scale_inv"):  # HF's FP8 block scales: a multiply factor despite the name
        name = name[:-len("_inv")]
    expert = expert_part(name)
    if expert is not None:  # experts.<e>.gate_proj -> the layer's packed experts.gate_up_proj, part 2e
        return expert
    for hf, (ours, part) in packed.items():
        if f".{hf}." in name:
            return name.replace(f".{hf}.", f".{ours}."), part
    return name, 0


class TorchFile(contextlib.AbstractContextManager):
    """A PyTorch .bin checkpoint read as safe_open reads a safetensors file (keys, get_slice, get_tensor):
    torch.load(weights_only=True) runs no pickled code, mmap=True maps the tensors (a shard reads its
    part)."""

    def __init__(self, path: Path):
        try:
            self.tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (RuntimeError, OSError, pickle.UnpicklingError) as e:
            raise ValueError(f"{path}: torch.load(weights_only=True, mmap=True) cannot read it ({e}); "
                             "convert it to safetensors (save_pretrained writes them)") from None
        if not isinstance(self.tensors, dict):
            raise ValueError(f"{path}: holds a {type(self.tensors).__name__}, not a state dict of tensors")

    def __exit__(self, *exc) -> None:
        self.tensors = {}

    def keys(self):
        return self.tensors.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    get_slice = get_tensor


def open_checkpoint(path: Path):
    """One checkpoint file: safetensors, or a PyTorch .bin (TorchFile)."""
    if path.suffix == ".bin":
        return TorchFile(path)
    return safe_open(str(path), framework="pt", device="cpu")


# safetensors' dtype names, for a .bin file's tensors (TorchFile.get_slice returns the tensor itself)
SAFETENSORS_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.bfloat16: "BF16",
                      torch.float16: "F16", torch.float32: "F32"}


def source_dtype(src) -> str:
    """A checkpoint tensor's dtype in safetensors' spelling (a safetensors slice or a torch tensor)."""
    if isinstance(src, torch.Tensor):
        return SAFETENSORS_DTYPES.get(src.dtype, str(src.dtype))
    return src.get_dtype()


def fp8_dtype_check(param: nn.Parameter, src_dtype: str, runtime: bool, name: str, path: Path) -> None:
    """An FP8 tensor goes into an FP8 parameter only (with its scale), and a bf16 one into an FP8 parameter
    only under --quantization fp8: otherwise config.json's quantization_config and the file disagree."""
    if src_dtype == "F8_E4M3" and param.dtype != FP8:
        raise ValueError(f"{path}: tensor '{name}' is FP8 but config.json's quantization_config leaves it "
                         "unconverted (modules_to_not_convert / ignore); remove it from that list")
    if src_dtype.startswith("F8") and src_dtype != "F8_E4M3":
        raise ValueError(f"{path}: tensor '{name}' is {src_dtype}; FP8 weights are served in F8_E4M3")
    if param.dtype == FP8 and not src_dtype.startswith("F8") and not runtime:
        raise ValueError(f"{path}: tensor '{name}' is {src_dtype}, not FP8, but config.json's "
                         "quantization_config converts it; list the module in modules_to_not_convert "
                         "(compressed-tensors: ignore)")


@torch.no_grad()
def load_checkpoint(model: nn.Module, files: list[Path], show_progress: bool = True) -> torch.Tensor | None:
    """Read each tensor's shard for this rank (safetensors slices: only the shard leaves the disk).

    Every parameter part must be found once; a missing one is an error naming it. KV cache scales are
    not parameters: returned (kv_scales_tensor), or None."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    renames = getattr(model, "checkpoint_renames", ())
    skip = getattr(model, "checkpoint_skip", None)  # tensors the model does not build (DeepSeek-V3's MTP)
    mc = getattr(model, "config", None)
    tied = getattr(mc, "tie_word_embeddings", False)
    runtime = getattr(mc, "quant_method", None) == "runtime"
    seen: Counter[str] = Counter()
    scales: dict[tuple[int, str], float] = {}
    for path in tqdm(files, desc="loading weights", unit="file", disable=not show_progress):
        with open_checkpoint(path) as f:
            for name in f.keys():
                if name.endswith(IGNORED) or (tied and name == "lm_head.weight") or (skip and skip(name)):
                    continue
                scale_of = kv_scale_target(name)
                if scale_of is not None:
                    scales[scale_of] = float(f.get_tensor(name).float().max())
                    continue
                target, part = checkpoint_target(name, packed, renames)
                param = params.get(target)
                if param is None:
                    log.warning("checkpoint tensor %s has no parameter in the model; skipped", name)
                    continue
                src = f.get_slice(name)
                fp8_dtype_check(param, source_dtype(src), runtime, name, path)
                try:
                    param.weight_loader(param, src, part)
                except ValueError as e:
                    raise ValueError(f"{path}: tensor '{name}': {e}") from None
                seen[target] += 1
                if param.dtype == FP8 and source_dtype(src) != "F8_E4M3":  # quantized here: its scale too
                    seen[scale_name(target)] += 1
    missing = [n for n, p in params.items() if seen[n] < getattr(p, "num_parts", 1)]
    if missing:
        raise ValueError(f"checkpoint {files[0].parent} lacks tensors for: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                         + (" (an FP8 weight needs its scale: `weight_scale_inv` or `weight_scale`)"
                            if any(n.endswith("_scale") for n in missing) else ""))
    layers = getattr(getattr(model, "config", None), "num_layers", 0)
    return kv_scales_tensor(scales, layers, str(files[0].parent))
