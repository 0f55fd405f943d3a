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

log = logging.getLogger(__name__)

INIT_STD = 0.02
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
    if checkpoint_files:
        return load_checkpoint(model, checkpoint_files, show_progress)
    init_random(model, seed)
    return None


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


@torch.no_grad()
def init_random(model: nn.Module, seed: int, std: float = INIT_STD) -> None:
    """N(0, std) for matrices and biases, 1 for norm weights; drawn where the parameters live."""
    params = list(model.named_parameters())
    if not params:
        return
    gen = torch.Generator(device=params[0][1].device).manual_seed(seed)
    for name, p in params:
        if name.endswith(NORM_WEIGHTS):
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)


def checkpoint_target(name: str, packed: dict[str, tuple[str, int]],
                      renames: tuple[tuple[str, str], ...] = ()) -> tuple[str, int]:
    """HF tensor name -> (our parameter name, part): a leading prefix renamed (`model.language_model.` ->
    `model.`), then q/k/v_proj -> qkv_proj parts 0/1/2, etc."""
    for prefix, ours in renames:
        if name.startswith(prefix):
            name = ours + name[len(prefix):]
            break
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


@torch.no_grad()
def load_checkpoint(model: nn.Module, files: list[Path], show_progress: bool = True) -> torch.Tensor | None:
    """Read each tensor's shard for this rank (safetensors slices: only the shard leaves the disk).

    Every parameter part must be found once; a missing one is an error naming it. KV cache scales are
    not parameters: returned (kv_scales_tensor), or None."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    renames = getattr(model, "checkpoint_renames", ())
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    seen: Counter[str] = Counter()
    scales: dict[tuple[int, str], float] = {}
    for path in tqdm(files, desc="loading weights", unit="file", disable=not show_progress):
        with open_checkpoint(path) as f:
            for name in f.keys():
                if name.endswith(IGNORED) or (tied and name == "lm_head.weight"):
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
                param.weight_loader(param, f.get_slice(name), part)
                seen[target] += 1
    missing = [n for n, p in params.items() if seen[n] < getattr(p, "num_parts", 1)]
    if missing:
        raise ValueError(f"checkpoint {files[0].parent} lacks tensors for: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    layers = getattr(getattr(model, "config", None), "num_layers", 0)
    return kv_scales_tensor(scales, layers, str(files[0].parent))
