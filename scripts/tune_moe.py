"""The bf16 experts' launch configs at decode's few tokens (kernels.triton_moe: sort, AITER's fused gate_up +
SiLU, its down projection, our top-k sum), side by side in one run: each config checked against the torch
reference (layers.moe.moe_reference), then timed as a CUDA graph's replay of LAYERS layers (distinct weights,
so L2 holds none between layers; CUDA events, median), against the floor of reading the experts the tokens
reach once at the copy bandwidth.

    PYTHONPATH=. python3 scripts/tune_moe.py [--models deepseek-v2-lite,qwen3-30b-a3b] [--tokens 1,8]
        [--fp8] [--json out.json]

(--fp8: the FP8 experts' configs, triton_moe.FP8_CONFIGS, block-scaled 128 x 128 weights as the shipped
checkpoints; K tiles of 64 or 128, 4 or 8 warps.)

Only the small-block configs (launch_rules.MOE_SMALL_BLOCK_M rows a block, the steps of few tokens) are
swept: the block's rows set the sort's padding and the declared scratch (budget.moe_scratch_bytes), so
BLOCK_SIZE_M stays.

    PYTHONPATH=. python3 scripts/tune_moe.py --block_m [--models ...] [--tokens 8,...,512] [--json out.json]

times both row blocks (launch_rules.MOE_SMALL_BLOCK_M, MOE_LARGE_BLOCK_M) at each token count instead, bf16
and FP8 (block-scaled 128 x 128, as the shipped checkpoints) experts with uniform random routing, each
checked against the torch reference first: where the small block stops winning, in pairs per expert (T k / E),
is what launch_rules.moe_block_m's rule is set from.

    PYTHONPATH=. python3 scripts/tune_moe.py --gemv [--models ...] [--tokens 1,2,4,8] [--json out.json]

times AITER's blocked kernels against the experts' GEMVs (kernels.triton_moe_gemv) the same way: where the
GEMVs stop winning, in pairs (T k), is what launch_rules.MOE_GEMV_MAX_PAIRS is set from. FP8 experts: the
blocked path quantizes its activations (W8A8) and is checked against the W8A8 reference
(layers.quant.moe_reference_fp8); the GEMVs do not (W8A16) and are checked against the dequantized weights'
reference (layers.moe.moe_reference).

    PYTHONPATH=. python3 scripts/tune_moe.py --gemv_configs [--models ...] [--tokens 1,4] [--json out.json]

sweeps the GEMVs' launch configs (triton_moe_gemv.CONFIGS: rows a program, K step, warps of each kernel) the
same way, bf16 and FP8, one kernel's candidates at a time with the other's shipped config, then prints each
dtype's and kernel's pick (gemv_config_pick).

    PYTHONPATH=. python3 scripts/tune_moe.py --router [--router_tokens 1,64,256,8192] [--json out.json]

times DeepSeek-V3's noaux_tc router instead (fp32 logits [T, 256], 8 groups, 4 kept, top 8, renormalised,
times 2.5): the one Triton launch (kernels.triton_route.biased_grouped_topk) against the torch path
(layers.moe.biased_grouped_topk, then Routing.apply), each checked against the other first (the same ids),
then timed as a CUDA graph's replay of ROUTER_CALLS calls (CUDA events, median), per call.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention  # noqa: E402 - the copy bandwidth
from cuda_timing import cuda_median_ms, graphed  # noqa: E402

from autoprofile.kernels import launch_rules  # noqa: E402
from autoprofile.kernels import triton_moe, triton_route  # noqa: E402
from autoprofile.layers.moe import Routing, biased_grouped_topk, moe_reference  # noqa: E402
from autoprofile.kernels import triton_moe_gemv  # noqa: E402
from autoprofile.layers.quant import (Fp8Scheme, MoeQuant, dequantize_weight, moe_reference_fp8,  # noqa: E402
                                      quantize_weight)

# (experts, hidden, expert intermediate, top-k)
SHAPES = {"deepseek-v2-lite": (64, 2048, 1408, 6), "qwen3-30b-a3b": (128, 2048, 768, 8),
          "qwen3.5-35b-a3b": (256, 2048, 512, 8)}
LAYERS = 8
V3_ROUTER = (256, 8, 8, 4, 2.5)  # experts, top_k, n_group, topk_group, routed_scaling_factor
ROUTER_CALLS = 16


def candidates(fp8: bool = False) -> list[dict]:
    """The small-block configs swept; FP8 experts' K tiles stay within a 128-wide scale block."""
    out = []
    ks, warps = ((64, 128), (4, 8)) if fp8 else ((64, 128, 256), (4,))
    for n, k, w, stages in itertools.product((32, 64, 128), ks, warps, (2, 3, 4, 5)):
        out.append({"BLOCK_SIZE_M": launch_rules.MOE_SMALL_BLOCK_M, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k,
                    "GROUP_SIZE_M": 1, "num_warps": w, "num_stages": stages})
    return out


def routing(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return (weights / weights.sum(-1, keepdim=True)).cuda(), ids.to(torch.int32).cuda()


def fp8_experts(w: torch.Tensor, scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 experts [E, N, K] -> (fp8 [E, N, K], block scales [E, N/bn, K/bk]): N, K multiples of a block."""
    e, n, k = w.shape
    q, scale = quantize_weight(w.reshape(e * n, k), scheme)
    return q.view(e, n, k), scale.view(e, n // scheme.block[0], -1)


def experts_layers(model: str, fp8: bool) -> tuple[list, list, list]:
    """LAYERS layers of random experts (w13, w2, quant each): bf16, or FP8 block-scaled 128 x 128 as the
    shipped checkpoints (quant None for bf16)."""
    experts, hidden, inter, _ = SHAPES[model]
    scheme = Fp8Scheme("block", (128, 128), "group") if fp8 else None
    w13, w2, quant = [], [], []
    for _ in range(LAYERS):
        a = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5
        b = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * inter ** -0.5
        if fp8:
            (a, sa), (b, sb) = fp8_experts(a, scheme), fp8_experts(b, scheme)
        w13.append(a)
        w2.append(b)
        quant.append(MoeQuant(sa, sb, scheme) if fp8 else None)
    return w13, w2, quant


def reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              quant, w8a16: bool = False) -> torch.Tensor:
    """The torch reference of fused_moe over these experts: FP8 ones W8A8 as AITER's blocked kernels run them
    (the activations quantized), or with w8a16 as the GEMVs do (the dequantized weights, x as it is)."""
    if quant is None:
        return moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    if not w8a16:
        return moe_reference_fp8(x.float(), w13, w2, weights, ids, quant)
    return moe_reference(x.float(), dequantize_weight(w13, quant.w13_scale, quant.scheme),
                         dequantize_weight(w2, quant.w2_scale, quant.scheme), weights, ids)


def sweep(model: str, tokens: int, iters: int, bytes_per_s: float, fp8: bool = False) -> dict:
    """Each small-block candidate (the shipped one first) checked against the torch reference, then timed:
    us a layer and the fraction of the floor (the experts reached, read once)."""
    experts, hidden, inter, top_k = SHAPES[model]
    table = triton_moe.FP8_CONFIGS if fp8 else triton_moe.CONFIGS
    gen = torch.Generator().manual_seed(0)
    w13, w2, quant = experts_layers(model, fp8)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = routing(tokens, experts, top_k, gen)
    reached = len(set(ids.flatten().tolist()))
    floor_us = reached * 3 * hidden * inter * (1 if fp8 else 2) / bytes_per_s * 1e6
    want = reference(x, w13[0], w2[0], weights, ids, quant[0])
    rows = []
    default = dict(table[launch_rules.MOE_SMALL_BLOCK_M])
    for cfg in [default] + candidates(fp8):
        table[launch_rules.MOE_SMALL_BLOCK_M] = cfg
        try:
            got = triton_moe.fused_moe(x, w13[0], w2[0], weights, ids, quant[0]).float()
            err = ((got - want).norm() / want.norm()).item()
            if err > 3e-2:
                rows.append({"config": cfg, "error": f"rel error {err:.3g}"})
                continue
            replay = graphed(lambda: [triton_moe.fused_moe(x, w13[i], w2[i], weights, ids, quant[i])
                                      for i in range(LAYERS)])
            us = cuda_median_ms(replay, iters) * 1e3 / LAYERS
            rows.append({"config": cfg, "us": us, "floor_fraction": floor_us / us})
            del replay
        except Exception as e:  # noqa: BLE001 - a config the compiler refuses (shared memory) is a row
            rows.append({"config": cfg, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
    table[launch_rules.MOE_SMALL_BLOCK_M] = default
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    return {"model": model, "fp8": fp8, "tokens": tokens, "experts_reached": reached, "floor_us": floor_us,
            "default": rows[0], "best": timed[:5], "rows": rows[1:],
            "errors": [r for r in rows if "error" in r][:5]}


def time_router(tokens: int, iters: int) -> dict:
    """The noaux_tc router at DeepSeek-V3's widths: the Triton kernel and the torch path, us per call."""
    experts, top_k, n_group, topk_group, scale = V3_ROUTER
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen) * 2
    bias = torch.randn(experts, device="cuda", generator=gen) * 0.2
    routing = Routing(torch.device("cuda"))
    calls = {
        "triton": lambda: triton_route.biased_grouped_topk(logits, bias, top_k, n_group, topk_group, True,
                                                           scale, routing.mode),
        "torch": lambda: (lambda w, ids: (w, routing.apply(ids, experts)))(
            *biased_grouped_topk(logits, bias, top_k, n_group, topk_group, True, scale)),
    }
    (w, ids), (want_w, want_ids) = calls["triton"](), calls["torch"]()
    out = {"tokens": tokens, "ids_differ": int((ids != want_ids).any(1).sum()),
           "weights_max_rel_error": ((w - want_w).abs() / want_w.abs()).max().item()}
    for name, call in calls.items():
        replay = graphed(lambda call=call: [call() for _ in range(ROUTER_CALLS)])
        out[f"{name}_us"] = cuda_median_ms(replay, iters) * 1e3 / ROUTER_CALLS
    out["speedup"] = out["torch_us"] / out["triton_us"]
    return out


def paths_case(model: str, tokens_list: list[int], fp8: bool, iters: int, bytes_per_s: float,
               paths: dict) -> list[dict]:
    """Each path's us a layer (a graph of LAYERS layers, distinct weights) at each token count, beside the
    floor of the experts reached read once; None where its output strays from the torch reference. paths:
    name -> (a function setting the launch rules that pick it, whether it runs FP8 experts as W8A16: the
    reference it is checked against); both rules and the GEMVs' configs are restored after."""
    experts, hidden, inter, top_k = SHAPES[model]
    w13, w2, quant = experts_layers(model, fp8)
    gen, rows = torch.Generator().manual_seed(0), []
    rule, gemv_pairs = launch_rules.moe_block_m, launch_rules.MOE_GEMV_MAX_PAIRS
    configs = dict(triton_moe_gemv.CONFIGS)
    try:
        for tokens in tokens_list:
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            weights, ids = routing(tokens, experts, top_k, gen)
            reached = len(set(ids.flatten().tolist()))
            floor_us = reached * 3 * hidden * inter * (1 if fp8 else 2) / bytes_per_s * 1e6
            wants = {a16: reference(x, w13[0], w2[0], weights, ids, quant[0], a16)
                     for a16 in {a16 for _, a16 in paths.values()}}
            row = {"model": model, "fp8": fp8, "tokens": tokens, "pairs_per_expert": tokens * top_k / experts,
                   "experts_reached": reached, "floor_us": floor_us, "us": {}, "error": {}}
            for name, (pick, a16) in paths.items():
                launch_rules.moe_block_m, launch_rules.MOE_GEMV_MAX_PAIRS = rule, gemv_pairs
                triton_moe_gemv.CONFIGS = dict(configs)
                pick()
                want = wants[a16]
                got = triton_moe.fused_moe(x, w13[0], w2[0], weights, ids, quant[0]).float()
                row["error"][name] = err = ((got - want).norm() / want.norm()).item()
                if err > 3e-2:
                    row["us"][name] = None
                    continue
                replay = graphed(lambda: [triton_moe.fused_moe(x, w13[i], w2[i], weights, ids, quant[i])
                                          for i in range(LAYERS)])
                row["us"][name] = cuda_median_ms(replay, iters) * 1e3 / LAYERS
                del replay
            rows.append(row)
    finally:
        launch_rules.moe_block_m, launch_rules.MOE_GEMV_MAX_PAIRS = rule, gemv_pairs
        triton_moe_gemv.CONFIGS = configs
    return rows


def block_paths() -> dict:
    """The small and the large row block, forced."""
    def force(block: int):
        def pick():
            launch_rules.moe_block_m = lambda *_: block
        return pick
    return {f"block {b}": (force(b), False)
            for b in (launch_rules.MOE_SMALL_BLOCK_M, launch_rules.MOE_LARGE_BLOCK_M)}


def gemv_paths() -> dict:
    """AITER's blocked kernels (the row block by launch_rules.moe_block_m) against the experts' GEMVs."""
    def blocked():
        launch_rules.MOE_GEMV_MAX_PAIRS = 0

    def gemv():
        launch_rules.MOE_GEMV_MAX_PAIRS = 1 << 30
    return {"blocked": (blocked, False), "gemv": (gemv, True)}


GEMV_CANDIDATES = {  # (BLOCK_N, BLOCK_K, num_warps) of each GEMV kernel, swept one kernel at a time
    "gate_up": ((2, 256, 1), (4, 128, 1), (4, 512, 1), (8, 128, 1), (8, 256, 2), (4, 256, 2), (16, 128, 2)),
    "down": ((2, 512, 1), (4, 256, 1), (8, 256, 1), (8, 512, 2), (4, 1024, 2), (16, 256, 2), (4, 512, 2)),
}


def gemv_config_paths() -> dict:
    """The GEMVs at their shipped configs (each dtype's), then each candidate of one kernel beside the other
    kernel's shipped config."""
    shipped = dict(triton_moe_gemv.CONFIGS)

    def use(kernel: int, cfg):
        def pick():
            launch_rules.MOE_GEMV_MAX_PAIRS = 1 << 30
            triton_moe_gemv.CONFIGS = {k: tuple(cfg if i == kernel else c for i, c in enumerate(v))
                                       for k, v in shipped.items()}
        return pick, True
    paths = {"shipped": use(-1, None)}
    for kernel, name in enumerate(("gate_up", "down")):
        for c in GEMV_CANDIDATES[name]:
            paths[f"{name} {c}"] = use(kernel, c)
    return paths


def compare_paths(args: argparse.Namespace, bytes_per_s: float, paths: dict, key: str) -> list[dict]:
    results, (first, second) = [], (list(paths) + [None])[:2]
    with torch.inference_mode():
        for model in args.models.split(","):
            for fp8 in (False, True):
                print(f"{model} {'FP8 block 128' if fp8 else 'bf16'}: us a layer (of the floor), {first} "
                      f"against {second}")
                for r in paths_case(model, args.tokens, fp8, args.iters, bytes_per_s, paths):
                    results.append(r)
                    cell = (lambda us: "refused" if us is None else f"{us:7.1f} ({r['floor_us'] / us:.2f})")
                    head = (f"   T={r['tokens']:4d} ({r['pairs_per_expert']:6.2f} pairs/expert, "
                            f"{r['experts_reached']} experts): ")
                    if len(paths) == 2:
                        a, b = r["us"][first], r["us"][second]
                        win = "" if a is None or b is None else f"  {first}/{second} {a / b:.2f}"
                        print(f"{head}{cell(a)}  {cell(b)}{win}")
                        continue
                    print(f"{head}{first} {cell(r['us'][first])}")
                    for name in list(paths)[1:]:
                        print(f"      {name:24s} {cell(r['us'][name])}")
    if args.json:
        args.json.write_text(json.dumps({key: results}, indent=2))
    return results


def gemv_max_pairs(results: list[dict], first: str = "blocked", second: str = "gemv") -> int:
    """launch_rules.MOE_GEMV_MAX_PAIRS from --gemv's rows (every model and dtype timed): the most pairs (T k)
    timed below the fewest pairs where the GEMVs (`second`) were refused or not faster than the blocked
    kernels (`first`); every timed count when they always won, 0 when they lost at the fewest."""
    def pairs(row: dict) -> int:
        return round(row["pairs_per_expert"] * SHAPES[row["model"]][0])
    lost = [pairs(r) for r in results
            if r["us"][second] is None or r["us"][first] is not None and r["us"][second] >= r["us"][first]]
    return max((pairs(r) for r in results if not lost or pairs(r) < min(lost)), default=0)


def gemv_config_pick(results: list[dict]) -> dict:
    """triton_moe_gemv.CONFIGS from --gemv_configs' rows: for each dtype ("bf16", "fp8") and kernel, the
    candidate with the least geometric mean of its time over the shipped configs' across that dtype's rows
    (timed in all of them), if below 1.0; else the shipped config stays (None)."""
    picks: dict = {}
    for dtype, fp8 in (("bf16", False), ("fp8", True)):
        rows = [r for r in results if r["fp8"] is fp8 and r["us"].get("shipped")]
        for kernel in ("gate_up", "down"):
            scores = {}
            for name in {n for r in rows for n in r["us"] if n.startswith(kernel + " ")}:
                ratios = [r["us"][name] / r["us"]["shipped"] for r in rows if r["us"].get(name)]
                if rows and len(ratios) == len(rows):
                    scores[name] = math.prod(ratios) ** (1 / len(ratios))
            best = min(scores, key=scores.get, default=None)
            picks.setdefault(dtype, {})[kernel] = (
                None if best is None or scores[best] >= 1.0 else
                {"config": best.split(" ", 1)[1], "ratio": round(scores[best], 3)})
    return picks


def routers(args: argparse.Namespace) -> None:
    print(f"{torch.cuda.get_device_name()}: noaux_tc router, {V3_ROUTER[0]} experts, fp32 logits")
    results = []
    with torch.inference_mode():
        for tokens in args.router_tokens:
            r = time_router(tokens, args.iters)
            results.append(r)
            print(f"T={tokens:5d}: triton {r['triton_us']:8.1f} us  torch {r['torch_us']:8.1f} us  "
                  f"{r['speedup']:5.1f}x  (rows whose ids differ: {r['ids_differ']}, weights' max rel "
                  f"error {r['weights_max_rel_error']:.1e})")
    if args.json:
        args.json.write_text(json.dumps({"router": results}, indent=2))


def pick(results: list[dict]) -> dict | None:
    """The candidate with the least geometric mean of its time over the default's across every (model,
    tokens) swept, timed in all of them; None if none beats the default."""
    scores: dict[str, list[float]] = {}
    for r in results:
        for row in r["rows"]:
            if "us" in row and "us" in r["default"]:
                scores.setdefault(json.dumps(row["config"]), []).append(row["us"] / r["default"]["us"])
    full = {c: math.prod(v) ** (1 / len(v)) for c, v in scores.items() if len(v) == len(results)}
    best = min(full, key=full.get, default=None)
    return None if best is None or full[best] >= 1.0 else {"config": json.loads(best), "ratio": full[best]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="deepseek-v2-lite,qwen3-30b-a3b")
    p.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=[1, 8])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--router", action="store_true", help="time the noaux_tc router instead of the experts")
    p.add_argument("--fp8", action="store_true",
                   help="sweep the FP8 experts' small-block configs (triton_moe.FP8_CONFIGS), not bf16's")
    p.add_argument("--block_m", action="store_true",
                   help="time the small and large row blocks at each of --tokens, bf16 and FP8 experts")
    p.add_argument("--gemv", action="store_true",
                   help="time AITER's blocked kernels against the experts' GEMVs (kernels.triton_moe_gemv) "
                        "at each of --tokens, bf16 and FP8 experts")
    p.add_argument("--gemv_configs", action="store_true",
                   help="sweep the experts' GEMV launch configs at each of --tokens, bf16 and FP8 experts")
    p.add_argument("--router_tokens", type=lambda s: [int(t) for t in s.split(",")],
                   default=[1, 64, 256, 8192])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tune_moe needs a CUDA GPU")
    if args.router:
        return routers(args)
    copy = bench_attention.copy_bandwidth(2 << 30)
    print(f"{torch.cuda.get_device_name()}: copy {copy['GB_per_s']:.0f} GB/s")
    if args.block_m:
        return compare_paths(args, copy["GB_per_s"] * bench_attention.GB, block_paths(), "block_m")
    if args.gemv:
        results = compare_paths(args, copy["GB_per_s"] * bench_attention.GB, gemv_paths(), "gemv")
        print(f"launch_rules.MOE_GEMV_MAX_PAIRS = {gemv_max_pairs(results)} (today "
              f"{launch_rules.MOE_GEMV_MAX_PAIRS}): the GEMVs won at every count timed up to it")
        return
    if args.gemv_configs:
        results = compare_paths(args, copy["GB_per_s"] * bench_attention.GB, gemv_config_paths(),
                                "gemv_configs")
        print(f"pick (the geometric mean of each candidate's time over the shipped configs'; None: keep "
              f"{triton_moe_gemv.CONFIGS}):")
        print(json.dumps(gemv_config_pick(results)))
        return
    results = []
    with torch.inference_mode():
        for model in args.models.split(","):
            for tokens in args.tokens:
                r = sweep(model, tokens, args.iters, copy["GB_per_s"] * bench_attention.GB, args.fp8)
                results.append(r)
                d = r["default"]
                print(f"{model} T={tokens}: {r['experts_reached']} experts, floor {r['floor_us']:.1f} us; "
                      f"default {d.get('us', float('nan')):.1f} us")
                for b in r["best"]:
                    c = b["config"]
                    print(f"   {b['us']:7.1f} us  {b['floor_fraction']:.2f} of floor  N{c['BLOCK_SIZE_N']} "
                          f"K{c['BLOCK_SIZE_K']} w{c.get('num_warps', '-')} s{c.get('num_stages', '-')}")
                for e in r["errors"]:
                    print(f"   refused {e['config']}: {e['error']}")
    best = pick(results)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "pick": best}, indent=2))
    if best is not None:  # the last line: the config (less BLOCK_SIZE_M) for bench_decode --moe_small_config
        print(f"pick ({best['ratio']:.3f} of the default's time, geometric mean):")
        print(json.dumps({k: v for k, v in best["config"].items() if k != "BLOCK_SIZE_M"}))


if __name__ == "__main__":
    main()
