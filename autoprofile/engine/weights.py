"""Weights: seeded random init on the device, or safetensors with HF names, sharded for this TP rank."""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

log = logging.getLogger(__name__)

INIT_STD = 0.02
IGNORED = ("rotary_emb.inv_freq", "rotary_pos_emb.inv_freq")  # buffers in some HF checkpoints; computed
NORM_WEIGHTS = ("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")  # RMSNorm scales: 1 when random


def load_weights(model: nn.Module, checkpoint_files: list[Path], seed: int,
                 show_progress: bool = True) -> None:
    """Fill every parameter of `model`: from the checkpoint files if any, else seeded random values."""
    if checkpoint_files:
        load_checkpoint(model, checkpoint_files, show_progress)
    else:
        init_random(model, seed)


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
    for hf, (ours, part) in packed.items():
        if f".{hf}." in name:
            return name.replace(f".{hf}.", f".{ours}."), part
    return name, 0


@torch.no_grad()
def load_checkpoint(model: nn.Module, files: list[Path], show_progress: bool = True) -> None:
    """Read each tensor's shard for this rank (safetensors slices: only the shard leaves the disk).

    Every parameter part must be found once; a missing one is an error naming it."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    renames = getattr(model, "checkpoint_renames", ())
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    seen: Counter[str] = Counter()
    for path in tqdm(files, desc="loading weights", unit="file", disable=not show_progress):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(IGNORED) or (tied and name == "lm_head.weight"):
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
