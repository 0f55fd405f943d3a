"""Decode attention alone, side by side in one run: AITER's paged decode over bf16 pages, AITER's over FP8
pages (the path FP8 caches took before: q * k_scale, AITER v1/v2 at scales 1.0, out * v_scale), our split
decode (kernels.triton_decode) over FP8 pages and over bf16 pages.

    PYTHONPATH=. python3 scripts/bench_decode_attention.py [--shapes 1x1024,64x1024,256x1024,256x4096]
        [--configs] [--json out.json]

llama-3.1-8b's attention (32/8 heads of 128, pages of 16), every row of a shape BATCHxCTX holding CTX tokens
on a shuffled page pool. Each call is captured in a CUDA graph (as serving runs decode:
AttentionMetadata.captured) and its replay timed (triton.testing.do_bench median, L2 flushed between calls,
--rotate input sets). Every method is first checked against AITER over the same pages (FP8 ones
dequantised to bf16): rel err < 2e-2. GB/s counts the K and V bytes a call must read (one byte a value for
FP8, two for bf16), against the device-to-device copy bandwidth measured in the same run. --configs: ours
again at every launch config of triton_decode.SWEEP.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention  # noqa: E402 - the copy-bandwidth timer
from cuda_timing import graphed  # noqa: E402

from autoprofile.engine.attention import AttentionMetadata  # noqa: E402
from autoprofile.engine.attention.aiter_triton import AiterTritonBackend  # noqa: E402
from autoprofile.kernels import triton_decode  # noqa: E402
from autoprofile.layers.attention import FP8_MAX, KVLayer, dequantize, quantize  # noqa: E402

GB = 1e9
HQ, HKV, D, PAGE = 32, 8, 128, 16
FP8 = torch.float8_e4m3fn


def inputs(b: int, ctx: int, n: int) -> list[dict]:
    """n sets of (q, bf16 pages, the same pages in FP8 with their [2] scales, metadata)."""
    pages_per_req = -(-ctx // PAGE)
    sets = []
    for _ in range(n):
        num_pages = b * pages_per_req
        kc = torch.randn(num_pages, HKV, PAGE, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        scales = torch.stack([kc.abs().max(), vc.abs().max()]).float() / FP8_MAX
        tables = torch.randperm(num_pages, device="cuda").to(torch.int32).view(b, pages_per_req)
        meta = AttentionMetadata(is_prefill=False, block_tables=tables, max_seq_len=ctx, captured=True,
                                 slot_mapping=torch.zeros(b, dtype=torch.int64, device="cuda"),
                                 seq_lens=torch.full((b,), ctx, dtype=torch.int32, device="cuda"))
        sets.append({"q": torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16), "meta": meta,
                     "bf16": KVLayer(kc, vc), "fp8": KVLayer(quantize(kc, scales[0], FP8),
                                                              quantize(vc, scales[1], FP8), scales)})
    return sets


def aiter_fp8(be: AiterTritonBackend, q: torch.Tensor, kv: KVLayer, meta: AttentionMetadata) -> torch.Tensor:
    """The FP8 path before triton_decode: AITER's kernels read the FP8 pages at scales 1.0 (by value), the
    real scales applied around them."""
    out = be.decode(q * kv.scales[0], KVLayer(kv.k, kv.v), meta)
    return out.mul_(kv.scales[1])


def median_ms(replays: list[Callable[[], None]]) -> float:
    cycle = itertools.cycle(replays)
    return bench_attention.median_ms(lambda: next(cycle)())


def methods(configs: bool) -> dict[str, tuple[str, Callable]]:
    """name -> (the pages it reads, a call on one input set)."""
    aiter = AiterTritonBackend(HQ, HKV, D, PAGE, torch.bfloat16, torch.device("cuda"))
    scale = 1 / math.sqrt(D)

    def ours(cache: str, cfg: triton_decode.Config | None):
        def call(s):
            kv, meta = s[cache], s["meta"]
            ks, vs = (kv.scales[0], kv.scales[1]) if kv.scales is not None else (None, None)
            return triton_decode.decode(torch.empty_like(s["q"]), s["q"], kv.k, kv.v, meta.block_tables,
                                        meta.seq_lens, meta.max_seq_len, scale, ks, vs, cfg)
        return call

    out = {"aiter bf16": ("bf16", lambda s: aiter.decode(s["q"], s["bf16"], s["meta"])),
           "aiter fp8": ("fp8", lambda s: aiter_fp8(aiter, s["q"], s["fp8"], s["meta"])),
           "ours fp8": ("fp8", ours("fp8", None)),
           "ours bf16": ("bf16", ours("bf16", None))}
    if configs:
        for cfg in triton_decode.SWEEP:
            tag = f"bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
            tag += f" x{cfg.splits}" if cfg.splits else ""
            tag += " f16" if cfg.f16_dots else ""
            out[f"ours fp8 {tag}"] = ("fp8", ours("fp8", cfg))
            out[f"ours bf16 {tag}"] = ("bf16", ours("bf16", cfg))
    return out


def references(aiter: Callable, s: dict) -> dict[str, torch.Tensor]:
    """What each cache's methods must return: AITER over the bf16 pages, and over the FP8 pages dequantised
    to bf16."""
    fp8 = s["fp8"]
    deq = KVLayer(dequantize(fp8.k, fp8.scales[0], torch.bfloat16), dequantize(fp8.v, fp8.scales[1],
                                                                            torch.bfloat16))
    return {"bf16": aiter(s), "fp8": aiter({**s, "bf16": deq})}


def check(fn: Callable, s: dict, want: torch.Tensor, name: str) -> None:
    got = fn(s)
    err = float((got.double() - want.double()).norm() / want.double().norm())
    if not err < 2e-2:
        raise AssertionError(f"{name}: rel err {err:.2e} against AITER over the same (dequantised) pages")


def run(args: argparse.Namespace) -> dict:
    copy = bench_attention.copy_bandwidth(args.copy_bytes)
    r: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "copy_GB_per_s": copy["GB_per_s"], "default": dataclasses.asdict(triton_decode.DEFAULT),
               "fp8": dataclasses.asdict(triton_decode.FP8),
               "shapes": {}}
    calls = methods(args.configs)
    for b, ctx in args.shapes:
        sets = inputs(b, ctx, args.rotate)
        splits, _ = triton_decode.config(b, HKV, ctx)
        row: dict = {"batch": b, "ctx": ctx, "splits": splits, "methods": {}}
        want = references(calls["aiter bf16"][1], sets[0])
        for name, (cache, fn) in calls.items():
            check(fn, sets[0], want[cache], name)
            ms = median_ms([graphed(lambda s=s: fn(s)) for s in sets])
            kv_bytes = 2 * b * ctx * HKV * D * (1 if cache == "fp8" else 2)
            bw = kv_bytes / (ms * 1e-3) / GB
            row["methods"][name] = {"ms": ms, "kv_bytes": kv_bytes, "GB_per_s": bw,
                                    "of_copy": bw / copy["GB_per_s"]}
        r["shapes"][f"{b}x{ctx}"] = row
        del sets
        torch.cuda.empty_cache()
    return r


def table(r: dict) -> str:
    lines = [f"{r['device']}  torch {r['torch']}  HBM copy (D2D, read+write): {r['copy_GB_per_s']:.0f} GB/s",
             f"llama-3.1-8b attention ({HQ}/{HKV} heads of {D}, pages of {PAGE}); ours' config: bf16 pages "
             f"{r['default']}, FP8 pages {r['fp8']}"]
    for key, row in r["shapes"].items():
        lines.append(f"\nbatch {row['batch']} x ctx {row['ctx']} (ours: {row['splits']} splits)")
        lines.append(f"{'method':<34}{'ms':>9}{'KV GB/s':>10}{'of copy':>9}")
        for name, m in row["methods"].items():
            lines.append(f"{name:<34}{m['ms']:>9.4f}{m['GB_per_s']:>10.0f}{m['of_copy']:>9.2f}")
    return "\n".join(lines)


def shape(text: str) -> tuple[int, int]:
    try:
        b, ctx = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is BATCHxCTX, e.g. 256x1024, not {text!r}") from None
    if b < 1 or ctx < 1:
        raise argparse.ArgumentTypeError(f"batch and ctx must be >= 1, e.g. 256x1024, not {text!r}")
    return b, ctx


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=lambda s: [shape(x) for x in s.split(",")],
                   default=[(1, 1024), (64, 1024), (256, 1024), (256, 4096)],
                   help="BATCHxCTX,... (default 1x1024,64x1024,256x1024,256x4096)")
    p.add_argument("--configs", action="store_true", help="also ours at every config of triton_decode.SWEEP")
    p.add_argument("--rotate", type=int, default=2, help="input sets cycled through (defeats L2 reuse)")
    p.add_argument("--copy_bytes", type=int, default=2 << 30, help="size of the D2D copy")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.rotate < 1:
        p.error(f"--rotate must be >= 1, e.g. --rotate 2, not {args.rotate}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_decode_attention needs a CUDA GPU")
    with torch.inference_mode():
        r = run(args)
    print(table(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
