"""What an FP8 KV cache costs in accuracy: the same model and prompts decoded over a cache in the model's
dtype (the reference) and over FP8 caches (scales from the first batch, and 1.0), side by side.

For each prompt: prefill it, then decode the reference's own greedy continuation (teacher-forced, so every
step compares logits at the same context), and separately let each cache decode freely:
  logits rel err   ||logits - ref||_2 / ||ref||_2 per decode step, mean and max over steps and prompts
  top-1 agree      teacher-forced steps whose argmax equals the reference's
  greedy match     free-running greedy tokens equal to the reference's, up to the first difference
    PYTHONPATH=. python3 scripts/kv_accuracy.py --model llama-3.1-8b --prompt-len 1024 --steps 64   # GPU
    PYTHONPATH=. python3 scripts/kv_accuracy.py --model tiny --attention_backend torch --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from autoprofile.engine.attention import get_backend_class
from autoprofile.layers.attention import AttentionMetadata
from autoprofile.engine.kv_cache import KVCache
from autoprofile.layers.parallel import TP
from autoprofile.engine.runner import TORCH_DTYPES
from autoprofile.engine.weights import init_random, load_weights
from autoprofile.model_config import load_model_config
from models import model_class

PAGE = 16


@dataclass
class Accuracy:
    kv: str
    mean_rel_err: float
    max_rel_err: float
    top1_agree: float
    # fraction of free-running tokens equal to the reference's before the first difference
    greedy_match: float


class Decoder:
    """One model, any number of caches: prefill a prompt into a cache, then decode step by step."""

    def __init__(self, model_name: str, backend: str, dtype: str, device: torch.device, seed: int,
                 std: float | None):
        self.mc = mc = load_model_config(model_name)
        self.device, self.dtype = device, TORCH_DTYPES[dtype]
        self.backend = get_backend_class(backend)(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE,
                                                  self.dtype,
                                                  device)
        with torch.device(device):
            self.model = model_class(mc)(mc, self.backend, TP(), self.dtype, mc.max_position_embeddings)
        if std is not None and not mc.checkpoint_files:
            init_random(self.model, seed, std)
        else:
            load_weights(self.model, mc.checkpoint_files, seed, show_progress=False)
        self.backend.build(1, 1 << 16)

    def cache(self, kv_dtype: str, tokens: int) -> KVCache:
        mc = self.mc
        dtype = self.dtype if kv_dtype == "auto" else TORCH_DTYPES[kv_dtype]
        return KVCache(mc.num_layers, tokens // PAGE + 1, mc.num_kv_heads, PAGE, mc.head_dim, dtype,
                       self.device)

    @torch.no_grad()
    def prefill(self, kv: KVCache, ids: list[int], calibrate: bool) -> torch.Tensor:
        n, dev = len(ids), self.device
        slots = torch.arange(PAGE, PAGE + n, device=dev)  # pages 1.. in order (page 0 is the pad page)
        meta = AttentionMetadata(is_prefill=True, slot_mapping=slots, max_seqlen=n,
                                 cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=dev))
        self.backend.calibrating = calibrate and kv.scales is not None
        try:
            hidden = self.model(torch.tensor(ids, device=dev), torch.arange(n, device=dev), meta, kv.layers)
        finally:
            self.backend.calibrating = False
        return self.model.compute_logits(hidden[-1:])[0].float()

    @torch.no_grad()
    def decode(self, kv: KVCache, token: int, pos: int) -> torch.Tensor:
        dev = self.device
        tables = torch.arange(1, kv.num_pages, dtype=torch.int32, device=dev)[None]
        meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([PAGE + pos], device=dev),
                                 block_tables=tables, seq_lens=torch.tensor([pos + 1], dtype=torch.int32,
                                                                            device=dev),
                                 max_seq_len=tables.shape[1] * PAGE)
        hidden = self.model(torch.tensor([token], device=dev), torch.tensor([pos], device=dev), meta,
                            kv.layers)
        return self.model.compute_logits(hidden)[0].float()

    def run(self, kv_dtype: str, calibrate: bool, ids: list[int], steps: int,
            forced: list[int] | None) -> tuple[list[torch.Tensor], list[int]]:
        """(logits of each step, teacher-forced by `forced` if given), and the free-running greedy tokens."""
        def walk(feed: list[int] | None) -> tuple[list[torch.Tensor], list[int]]:
            kv = self.cache(kv_dtype, len(ids) + steps + PAGE)
            logits = [self.prefill(kv, ids, calibrate)]
            out = [int(logits[-1].argmax())]
            for i in range(steps - 1):
                token = feed[i] if feed is not None else out[-1]
                logits.append(self.decode(kv, token, len(ids) + i))
                out.append(int(logits[-1].argmax()))
            return logits, out

        logits, _ = walk(forced)
        free = walk(None)[1] if forced is not None else [int(x.argmax()) for x in logits]
        return logits, free


def compare(dec: Decoder, prompts: list[list[int]], steps: int, variants: dict[str, tuple[str, bool]],
            control: Decoder | None = None) -> list[Accuracy]:
    """variants: name -> (kv dtype, calibrate from the prefill). The first is the reference. control: the
    same weights behind another backend, cache in the model's dtype: the error that rounding differences
    alone (another kernel's order of operations) cause in this model, for scale."""
    (ref_name, (ref_dtype, ref_cal)), *others = variants.items()
    refs = [dec.run(ref_dtype, ref_cal, p, steps, None) for p in prompts]
    runs = [(name, dec, kv_dtype, cal) for name, (kv_dtype, cal) in others]
    if control is not None:
        runs.append((f"auto, {control.backend.name} backend (control)", control, ref_dtype, False))
    rows = []
    for name, d, kv_dtype, cal in runs:
        errs, agree, match, total = [], 0, 0, 0
        for p, (ref_logits, ref_tokens) in zip(prompts, refs):
            logits, free = d.run(kv_dtype, cal, p, steps, ref_tokens)
            errs += [float((a - b).norm() / b.norm()) for a, b in zip(logits, ref_logits)]
            agree += sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(logits, ref_logits))
            same = next((i for i, (a, b) in enumerate(zip(free, ref_tokens)) if a != b), len(ref_tokens))
            match += same
            total += len(ref_tokens)
        rows.append(Accuracy(name, sum(errs) / len(errs), max(errs), agree / total, match / total))
    return rows


VARIANTS = {"auto (reference)": ("auto", False), "fp8_e4m3, first-batch scales": ("fp8_e4m3", True),
            "fp8_e4m3, scales 1.0": ("fp8_e4m3", False)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--attention_backend", default="aiter_triton")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=None, help="random-weight std (default: the loader's)")
    p.add_argument("--control", default=None, help="another backend (e.g. torch) over a cache in the model's "
                                                  "dtype, same weights: the error of rounding differences "
                                                  "alone")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dec = Decoder(args.model, args.attention_backend, args.dtype, device, args.seed, args.std)
    control = Decoder(args.model, args.control, args.dtype, device, args.seed,
                      args.std) if args.control else None
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, dec.mc.vocab_size, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.prompts)]
    rows = compare(dec, prompts, args.steps, VARIANTS, control)
    print(f"{args.model} ({args.dtype} weights, {args.attention_backend}), {args.prompts} prompts x "
          f"{args.prompt_len} tokens, {args.steps} decode steps; reference: KV in {args.dtype}")
    print(f"{'KV cache':<40}{'logits rel err mean':>20}{'max':>9}{'top-1 agree':>13}{'greedy match':>14}")
    for r in rows:
        print(f"{r.kv:<40}{r.mean_rel_err:>20.4f}{r.max_rel_err:>9.4f}{r.top1_agree:>13.3f}"
              f"{r.greedy_match:>14.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
