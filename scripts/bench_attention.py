"""Attention kernels on this GPU: HBM copy bandwidth, then per backend prefill TFLOP/s and decode KV GB/s.

    PYTHONPATH=. python3 scripts/bench_attention.py [--backends torch,aiter_triton] [--json out.json]

Times are triton.testing.do_bench medians; every call takes the next of --rotate input sets, so no
input stays in L2 between calls. Prefill: one causal request of --prefill_tokens (FLOPs counted for
the causal half: 2 * T^2 * Hq * D), compared with plain torch SDPA on pre-expanded K/V. Decode:
--decode_batch requests of --decode_ctx tokens on a shuffled page pool; bandwidth counts the K and V
bytes each step must read, compared with the measured device-to-device copy bandwidth.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F

from autoprofile.config import ConfigError
from autoprofile.kernels.aiter_loader import aiter_installed
from autoprofile.engine.attention import BACKENDS, AttentionBackend, AttentionMetadata, resolve_backend_name

GB = 1e9


def median_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def rotating(sets: list, call: Callable) -> Callable[[], object]:
    """A no-argument callable that feeds `call` the next input set each time."""
    cycle = itertools.cycle(sets)
    return lambda: call(*next(cycle))


# ---------------------------------------------------------------- copy bandwidth
def copy_bandwidth(nbytes: int) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return {"bytes": nbytes, "ms": ms, "GB_per_s": 2 * nbytes / (ms * 1e-3) / GB}  # read + write


# ---------------------------------------------------------------- prefill
def prefill_inputs(t: int, hq: int, hkv: int, d: int, n: int):
    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(t, device="cuda"), cu_seqlens=cu,
                             max_seqlen=t)
    return [(*(torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv)), meta)
            for _ in range(n)]


def prefill_flops(t: int, hq: int, d: int) -> float:
    return 2.0 * t * t * hq * d  # QK^T and PV, 2 FLOPs per MAC, causal half


def bench_sdpa_prefill(sets: list, hq: int, hkv: int) -> float:
    """Plain torch SDPA ([1, H, T, D], K/V expanded beforehand): the baseline every backend is set against."""
    g = hq // hkv
    expanded = [(q.transpose(0, 1)[None], k.transpose(0, 1).repeat_interleave(g, 0)[None],
                 v.transpose(0, 1).repeat_interleave(g, 0)[None]) for q, k, v, _ in sets]
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    return median_ms(rotating(expanded, sdpa))


def bench_prefill(be: AttentionBackend, sets: list) -> float:
    return median_ms(rotating(sets, be.prefill))


# ---------------------------------------------------------------- decode
def decode_inputs(b: int, ctx: int, hq: int, hkv: int, d: int, page: int, n: int):
    pages_per_req = -(-ctx // page)
    sets = []
    for _ in range(n):
        num_pages = b * pages_per_req
        kc = torch.randn(num_pages, hkv, page, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        tables = torch.randperm(num_pages, device="cuda").to(torch.int32).view(b, pages_per_req)
        meta = AttentionMetadata(is_prefill=False, block_tables=tables, max_seq_len=ctx,
                                 slot_mapping=torch.zeros(b, dtype=torch.int64, device="cuda"),
                                 seq_lens=torch.full((b,), ctx, dtype=torch.int32, device="cuda"))
        sets.append((torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16), kc, vc, meta))
    return sets


def bench_decode(be: AttentionBackend, sets: list) -> float:
    return median_ms(rotating(sets, be.decode))


# ---------------------------------------------------------------- hook for the lead
def full_decode_step(args: argparse.Namespace) -> tuple[Callable[[], object], int] | None:
    """Hook: return (one decode step of a real model through the runner, tokens it decodes). None until
    the runner exists; then main() times it next to the kernels."""
    return None


# ---------------------------------------------------------------- main
def available(names: list[str]) -> list[str]:
    """The requested backends that run here; the others are named on stderr."""
    ok = []
    for name in names:
        try:
            ok.append(resolve_backend_name(name))
        except ConfigError as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
    return ok


def run(args: argparse.Namespace) -> dict:
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    out: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "amd_aiter": metadata.version("amd-aiter") if aiter_installed() else None,
        "copy": copy_bandwidth(args.copy_bytes),
        "shape": {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": "bfloat16"},
        "backends": {},
    }
    copy_bw = out["copy"]["GB_per_s"]
    t, flops = args.prefill_tokens, prefill_flops(args.prefill_tokens, hq, d)
    psets = prefill_inputs(t, hq, hkv, d, args.rotate)
    sdpa_ms = bench_sdpa_prefill(psets, hq, hkv)
    out["sdpa_prefill"] = {"tokens": t, "ms": sdpa_ms, "TFLOP_per_s": flops / (sdpa_ms * 1e-3) / 1e12}
    b, ctx, page = args.decode_batch, args.decode_ctx, args.page_size
    dsets = decode_inputs(b, ctx, hq, hkv, d, page, args.rotate)
    kv_bytes = 2 * b * ctx * hkv * d * 2
    for name in available(args.backends):
        be = BACKENDS[name](hq, hkv, d, page, torch.bfloat16, torch.device("cuda"))
        be.build(b, ctx)
        p_ms, d_ms = bench_prefill(be, psets), bench_decode(be, dsets)
        be.teardown()
        kv_bw = kv_bytes / (d_ms * 1e-3) / GB
        out["backends"][name] = {
            "prefill": {"tokens": t, "ms": p_ms, "TFLOP_per_s": flops / (p_ms * 1e-3) / 1e12,
                        "vs_sdpa": sdpa_ms / p_ms},
            "decode": {"batch": b, "ctx": ctx, "page_size": page, "ms": d_ms, "kv_bytes": kv_bytes,
                       "GB_per_s": kv_bw, "of_copy_bw": kv_bw / copy_bw},
        }
    if (step := full_decode_step(args)) is not None:
        fn, tokens = step
        ms = median_ms(fn)
        out["decode_step"] = {"ms": ms, "tokens": tokens, "tokens_per_s": tokens / (ms * 1e-3)}
    return out


def table(r: dict) -> str:
    lines = [f"{r['device']}  torch {r['torch']}  amd-aiter {r['amd_aiter']}",
             f"HBM copy (D2D, read+write): {r['copy']['GB_per_s']:.0f} GB/s",
             f"torch SDPA prefill T={r['sdpa_prefill']['tokens']}: {r['sdpa_prefill']['ms']:.3f} ms "
             f"{r['sdpa_prefill']['TFLOP_per_s']:.0f} TFLOP/s",
             f"{'backend':<14}{'prefill ms':>11}{'TFLOP/s':>9}{'vs SDPA':>9}"
             f"{'decode ms':>11}{'KV GB/s':>9}{'of copy':>9}"]
    for name, x in r["backends"].items():
        p, d = x["prefill"], x["decode"]
        lines.append(f"{name:<14}{p['ms']:>11.3f}{p['TFLOP_per_s']:>9.0f}{p['vs_sdpa']:>9.2f}"
                     f"{d['ms']:>11.3f}{d['GB_per_s']:>9.0f}{d['of_copy_bw']:>9.2f}")
    if "decode_step" in r:
        s = r["decode_step"]
        lines.append(f"model decode step: {s['ms']:.3f} ms, {s['tokens_per_s']:.0f} tokens/s")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", type=lambda s: s.split(","), default=["torch", "aiter_triton"])
    p.add_argument("--prefill_tokens", type=int, default=8192)
    p.add_argument("--decode_batch", type=int, default=256)
    p.add_argument("--decode_ctx", type=int, default=2048)
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--q_heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--rotate", type=int, default=2, help="input sets cycled through (defeats L2 reuse)")
    p.add_argument("--copy_bytes", type=int, default=2 << 30, help="size of the D2D copy")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        p.error(f"unknown backend(s) {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA/ROCm GPU")
    with torch.inference_mode():
        r = run(args)
    print(table(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
