"""An FP8 model against the same model with its weights dequantized to bf16 (issue 31's accuracy check on the
GPU): the FP8 model through the backend's kernels (aiter_triton: our W8A16 GEMV at one row, the norms and
SiLU-mul that quantize their rows, cuBLASLt's FP8 GEMM), the reference through bf16 GEMMs over the
dequantized weights, both with random weights drawn from one seed (no download).

  1. prompt logits: the relative error ||fp8 - ref|| / ||ref|| over every position of --prompts random
     prompts of --prompt_len tokens, and the share of positions whose argmax agrees (all positions, and the
     decisive ones: the reference's top-2 margin at least --margin of its logits' standard deviation);
  2. greedy decode, teacher-forced: --steps tokens, one at a time (the one-row path), each model fed the
     reference's token; the share of steps whose argmax agrees, and the logits' relative error.

--against reference compares the same FP8 weights through the torch backend's fp8_linear_reference
instead (W8A8 in fp32: what the kernels alone change); for a bf16 --model, the backend's kernels against
the torch backend (rounding alone: how much this random model amplifies a perturbation).

    PYTHONPATH=. python3 scripts/fp8_accuracy.py [--model llama-3.1-8b-fp8] [--against reference]
    PYTHONPATH=. python3 scripts/fp8_accuracy.py --model tiny-fp8 --backend torch --device cpu  # smoke test
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autoprofile.engine.attention import get_backend_class  # noqa: E402
from autoprofile.engine.kv_cache import KVCache  # noqa: E402
from autoprofile.engine.weights import load_weights  # noqa: E402
from autoprofile.layers.attention import AttentionMetadata  # noqa: E402
from autoprofile.layers.parallel import TP  # noqa: E402
from autoprofile.layers.quant import FP8, dequantize_weight  # noqa: E402
from autoprofile.model_config import load_model_config  # noqa: E402
from models import model_class  # noqa: E402

PAGE = 16


def build(mc, backend_name: str, device: torch.device, dtype: torch.dtype):
    """The model on `device` with its backend's GEMMs wired as the runner wires them (layers.parallel.TP)."""
    backend = get_backend_class(backend_name)(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE, dtype, device)
    tp = TP()
    tp.matmul, tp.fp8_matmul, tp.router_matmul = backend.gemm, backend.fp8_gemm, backend.router_gemm
    tp.matmul_add, tp.add_in_gemm = backend.gemm_add, True
    with torch.device(device):
        model = model_class(mc)(mc, backend, tp, dtype, 4096)
    return model


@torch.no_grad()
def dequantized_twin(fp8_model, mc, backend_name: str, device: torch.device, dtype: torch.dtype):
    """The bf16 model whose weights are the FP8 model's, dequantized (every other parameter copied)."""
    ref = build(dataclasses.replace(mc, quant=None, quant_method=None, quant_ignore=()), backend_name, device,
                dtype)
    mods = dict(fp8_model.named_modules())
    params = dict(fp8_model.named_parameters())
    for name, p in ref.named_parameters():
        src = params[name]
        if src.dtype == FP8:
            owner = mods[name.rpartition(".")[0]]
            src = dequantize_weight(src, owner.weight_scale, owner.quant, dtype)
        p.copy_(src)
    return ref


@torch.no_grad()
def logits(model, ids: list[int], kv: KVCache, start: int, device: torch.device) -> torch.Tensor:
    """One request's tokens `ids` at positions start.. on pages 1, 2, ... (page 0 is the pad), its prefix in
    the cache; fp32 logits [len(ids), vocab]."""
    n, total = len(ids), start + len(ids)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(start, total, device=device) + PAGE,
                             cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=device), max_seqlen=n)
    if start:
        meta.kv_slots = torch.arange(total, device=device) + PAGE
        meta.cu_seqlens_k = torch.tensor([0, total], dtype=torch.int32, device=device)
        meta.max_seqlen_k = total
    ids_t = torch.tensor(ids, device=device)
    hidden = model(ids_t, torch.arange(start, total, device=device), meta, kv.layers)
    return model.compute_logits(hidden).float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def decisive(ref: torch.Tensor, margin: float) -> torch.Tensor:
    """Positions whose reference top-2 gap is at least `margin` of that row's logits' standard deviation."""
    top = ref.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]) >= margin * ref.std(dim=-1)


def score(out: dict, got: torch.Tensor, want: torch.Tensor, margin: float) -> None:
    """Append the logits' relative error and the argmax agreement (all rows, decisive rows) to `out`."""
    same = got.argmax(-1) == want.argmax(-1)
    out["err"].append(rel_err(got, want))
    out["agree"].append(float(same.float().mean()))
    out["decisive"].append(float(same[decisive(want, margin)].float().mean()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b-fp8")
    p.add_argument("--backend", default="aiter_triton")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--margin", type=float, default=0.1)
    p.add_argument("--against", choices=("dequantized", "reference"), default="dequantized",
                   help="dequantized: the bf16 twin; reference: the same FP8 weights through the torch "
                        "backend's fp8_linear_reference (W8A8 in fp32: what the kernels alone change)")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mc = load_model_config(args.model)
    if mc.quant is None and args.against == "dequantized":  # a bf16 model: --against reference is the
        sys.exit(f"--model {args.model} has no FP8 weights: try llama-3.1-8b-fp8")  # kernels' own control
    fp8 = build(mc, args.backend, device, dtype)
    load_weights(fp8, [], seed=0, show_progress=False)
    if args.against == "dequantized":
        ref = dequantized_twin(fp8, mc, args.backend, device, dtype)
    else:
        ref = build(mc, "torch", device, dtype)
        ref.load_state_dict(fp8.state_dict())
    pages = (args.prompt_len + args.steps) // PAGE + 2
    caches = [KVCache(mc.num_layers, pages, mc.num_kv_heads, PAGE, mc.head_dim, dtype, device) for _ in "ab"]
    gen = torch.Generator().manual_seed(1)
    prompt, decode = {"err": [], "agree": [], "decisive": []}, {"err": [], "agree": [], "decisive": []}
    for _ in range(args.prompts):
        ids = torch.randint(3, mc.vocab_size, (args.prompt_len,), generator=gen).tolist()
        got, want = (logits(m, ids, kv, 0, device) for m, kv in zip((fp8, ref), caches))
        score(prompt, got, want, args.margin)
        token = int(want[-1].argmax())
        steps_g, steps_w = [], []
        for step in range(args.steps):
            start = args.prompt_len + step
            g, w = (logits(m, [token], kv, start, device)[0] for m, kv in zip((fp8, ref), caches))
            steps_g.append(g)
            steps_w.append(w)
            token = int(w.argmax())  # teacher-forced: both models take the reference's token
        score(decode, torch.stack(steps_g), torch.stack(steps_w), args.margin)
    summary = {"model": args.model, "weights": mc.weight_format, "backend": args.backend,
               "against": args.against,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "prompt_logits_rel_err": max(prompt["err"]), "prompt_argmax_agree": min(prompt["agree"]),
               "prompt_decisive_agree": min(prompt["decisive"]),
               "decode_logits_rel_err": max(decode["err"]), "decode_argmax_agree": min(decode["agree"]),
               "decode_decisive_agree": min(decode["decisive"])}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
