"""Sweep a Triton varlen prefill kernel's launch configs on this GPU against torch SDPA (issues 9, 19).

    PYTHONPATH=. python3 scripts/tune_prefill.py [--kernel aiter|ours] [--full] [--json out.json]

--kernel aiter (default): AITER's flash_attn_varlen_func; ours: kernels.triton_prefill.

Two shapes, bf16, 32 query / 8 KV heads, head_dim 128 (llama-3.1-8b per rank):
  full   one causal request of --tokens (8192) new tokens
  chunk  --chunk (2048) new tokens over a cached prefix, --chunk_kv (32768) keys in all (causal
         aligned bottom-right: what a prefill chunk over its prefix runs)
  batch  --batch (8) causal requests of --batch_len (1024) tokens in one varlen call (a serving prefill step
         of 1k prompts; q/k/v are views of one packed projection, as the model hands them over); timed and
         printed, not scored: its best config is printed on its own line
Each candidate (BLOCK_M, BLOCK_N, num_warps, num_stages, PRELOAD_V; never `waves_per_eu`, an AMD-only
launch option) is checked against SDPA's output (relative error < 2e-2, bf16) and timed
(triton.testing.do_bench median, inputs cycled so nothing stays in L2). The best is the lowest mean
of time / SDPA time over the two shapes among the correct ones; paste the printed line into
autoprofile/engine/attention/aiter_triton.py (PREFILL_CONFIGS), or triton_prefill.py (CONFIGS) for --kernel
ours, for this compute capability.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import median_ms, rotating  # noqa: E402

from autoprofile.kernels.aiter_loader import load_aiter_triton  # noqa: E402
from autoprofile.kernels import triton_prefill  # noqa: E402
from autoprofile.engine.attention.aiter_triton import prefill_config  # noqa: E402

HQ, HKV, D = 32, 8, 128
TOL = 2e-2


def candidates(full: bool, kernel: str) -> list[dict]:
    if kernel == "ours":
        grid = itertools.product([(128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 2), (128, 64, 8, 3),
                                  (64, 32, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2)], [True])
        current, short = triton_prefill.configs(triton_prefill.capability())
        short = short or current
        out = [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s, "TMA": tma}
               for (m, n, w, s), tma in grid]
        out.append({"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3})  # plain loads
        return [current] + [c for c in [short] + out if c != current]
    if full:
        grid = itertools.product([64, 128, 256], [32, 64, 128], [4, 8], [1, 2, 3, 4], [False, True])
    else:
        grid = itertools.chain(itertools.product([64, 128], [64, 128], [4, 8], [2, 3, 4], [False]),
                               itertools.product([128], [64, 128], [8], [2, 3], [True]),
                               itertools.product([256], [64], [8], [2, 3], [False, True]))
    out = [{"BLOCK_M": m, "BLOCK_N": n, "PRELOAD_V": pv, "num_warps": w, "num_ctas": 1, "num_stages": s}
           for m, n, w, s, pv in grid]
    current = prefill_config()
    return [current] + [c for c in out if c != current]


def shape_inputs(new: int, kv: int, sets: int, seqs: int = 1) -> list[tuple]:
    """(q, k, v, cu_q, cu_k) sets of `seqs` equal requests of `new` tokens over `kv` keys each; q/k/v as the
    model hands them over: views of the packed projection [T, (HQ + 2 HKV) D] without a prefix, contiguous
    (k/v gathered from the cache) with one."""
    out = []
    for _ in range(sets):
        if new == kv:
            packed = torch.randn(seqs * new, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
            q, k, v = (t.view(seqs * new, -1, D) for t in packed.split([HQ * D, HKV * D, HKV * D], dim=1))
        else:
            q = torch.randn(seqs * new, HQ, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(seqs * kv, HKV, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(seqs * kv, HKV, D, device="cuda", dtype=torch.bfloat16)
        cu_q = torch.arange(0, seqs * new + 1, new, dtype=torch.int32, device="cuda")
        cu_k = torch.arange(0, seqs * kv + 1, kv, dtype=torch.int32, device="cuda")
        out.append((q, k, v, cu_q, cu_k))
    return out


def heads_first(q, k, v, cu_q, cu_k) -> tuple[torch.Tensor, ...]:
    """[seqs, heads, tokens, D] of each, K/V expanded to the query heads."""
    seqs, g = cu_q.numel() - 1, HQ // HKV
    return (q.reshape(seqs, -1, HQ, D).transpose(1, 2),
            *(t.reshape(seqs, -1, HKV, D).transpose(1, 2).repeat_interleave(g, 1) for t in (k, v)))


def sdpa(q, k, v, cu_q, cu_k) -> torch.Tensor:
    qh, kh, vh = heads_first(q, k, v, cu_q, cu_k)
    new, kv = qh.shape[2], kh.shape[2]
    if new == kv:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(new, kv))
    return o.transpose(1, 2).reshape(q.shape)


def kernel_call(kernel: str, cfg: dict):
    """(q, k, v, cu_q, cu_k) -> the kernel's output at launch config cfg."""
    def call(q, k, v, cu_q, cu_k):
        seqs = cu_q.numel() - 1  # equal requests: no host sync inside the timed call
        most_q, most_k = q.shape[0] // seqs, k.shape[0] // seqs
        if kernel == "ours":
            return triton_prefill.prefill(torch.empty(q.shape, dtype=q.dtype, device=q.device), q, k, v,
                                          cu_q, cu_k, most_q, most_k, D ** -0.5, dict(cfg))
        return load_aiter_triton().flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, most_q, most_k, softmax_scale=D ** -0.5, causal=True, config=dict(cfg))
    return call


def sdpa_ms(sets: list[tuple]) -> float:
    """SDPA on pre-expanded K/V (the expansion is not timed: the fairest baseline)."""
    expanded = [heads_first(*s) for s in sets]
    new, kv = expanded[0][0].shape[2], expanded[0][1].shape[2]
    mask = None if new == kv else causal_lower_right(new, kv)
    return median_ms(rotating(expanded, lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=mask is None, attn_mask=mask)))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run(args: argparse.Namespace) -> dict:
    shapes = {"full": shape_inputs(args.tokens, args.tokens, 2),
              "chunk": shape_inputs(args.chunk, args.chunk_kv, 2),
              "batch": shape_inputs(args.batch_len, args.batch_len, 2, seqs=args.batch)}
    scored = ("full", "chunk")
    refs = {name: sdpa(*sets[0]) for name, sets in shapes.items()}
    base = {name: sdpa_ms(sets) for name, sets in shapes.items()}
    rows = []
    for cfg in candidates(args.full, args.kernel):
        row = {"config": cfg}
        try:
            call = kernel_call(args.kernel, cfg)
            for name, sets in shapes.items():
                err = rel_err(call(*sets[0]), refs[name])
                row[name] = {"err": err, "ms": median_ms(rotating(sets, call)) if err < TOL else None}
                if err >= TOL:
                    raise ValueError(f"{name}: rel err {err:.2e} vs SDPA")
            row["score"] = sum(row[n]["ms"] / base[n] for n in scored) / len(scored)
        except Exception as e:  # noqa: BLE001 - out of shared memory, unsupported tile, wrong result
            row["error"] = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
        rows.append(row)
        print(line(row, base), file=sys.stderr, flush=True)
    ok = [r for r in rows if "score" in r]
    best = min(ok, key=lambda r: r["score"]) if ok else None
    best_batch = min(ok, key=lambda r: r["batch"]["ms"]) if ok else None
    return {"device": torch.cuda.get_device_name(), "kernel": args.kernel,
            "capability": "sm_%d%d" % torch.cuda.get_device_capability(),
            "shapes": {"full": [args.tokens, args.tokens], "chunk": [args.chunk, args.chunk_kv],
                       "batch": [args.batch, args.batch_len]},
            "sdpa_ms": base, "rows": rows, "current": rows[0], "best": best, "best_batch": best_batch}


def line(row: dict, base: dict) -> str:
    c = row["config"]
    head = f"M{c['BLOCK_M']:<4}N{c['BLOCK_N']:<4}w{c['num_warps']} s{c['num_stages']}"
    head += f" pv{int(c['PRELOAD_V'])}" if "PRELOAD_V" in c else ""
    head += f" tma{int(c['TMA'])}" if "TMA" in c else ""
    if "error" in row:
        return f"{head}  failed: {row['error']}"
    cells = "  ".join(f"{n} {row[n]['ms']:.3f} ms ({base[n] / row[n]['ms']:.2f}x SDPA, err "
                      f"{row[n]['err']:.1e})"
                      for n in base)
    return f"{head}  {cells}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--chunk_kv", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batch_len", type=int, default=1024)
    p.add_argument("--kernel", choices=["aiter", "ours"], default="aiter")
    p.add_argument("--full", action="store_true", help="the whole grid (slow: every config compiles)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tune_prefill needs a CUDA GPU")
    with torch.inference_mode():
        r = run(args)
    ranked = sorted((x for x in r["rows"] if "score" in x), key=lambda x: x["score"])
    print(f"{r['device']} ({r['capability']}), kernel {r['kernel']}: torch SDPA full "
          f"{r['sdpa_ms']['full']:.3f} ms, chunk {r['sdpa_ms']['chunk']:.3f} ms, batch "
          f"{r['sdpa_ms']['batch']:.3f} ms; configs by mean time / SDPA over full and chunk (lower: better)")
    for x in ranked:
        print(f"{x['score']:6.2f}  {line(x, r['sdpa_ms'])}")
    print(f"current: {line(r['current'], r['sdpa_ms'])}")
    if r["best"]:
        print(f'best for {r["capability"]}: "{r["capability"]}": {json.dumps(r["best"]["config"])}'
              .replace("false", "False").replace("true", "True"))
    if r["best_batch"]:
        print(f"best for batch: {line(r['best_batch'], r['sdpa_ms'])}")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
