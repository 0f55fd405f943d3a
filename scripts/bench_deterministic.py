"""--deterministic's kernels against the default ones, side by side in one run on this GPU, with their
batch-invariance checked bit for bit (issue 19).

    PYTHONPATH=. python3 scripts/bench_deterministic.py [--gemm_configs] [--attention_configs]

  GEMM       kernels.triton_matmul at its CONFIG (or each of GEMM_CONFIGS) against cuBLAS (F.linear) over
             llama-3.1-8b's five weight shapes at 1 to 8,192 rows; "invariant": rows 0..m of an 8,192-row call
             equal an m-row call, bit for bit (cuBLAS's are printed too)
  attention  kernels.triton_unified at its config (or each of ATTENTION_CONFIGS) against torch SDPA
             (T=8192 causal, GQA 32/8 x 128) and the default paged decode (256 rows x 1,024 tokens); its
             "invariant": a token's output the same as a decode row, in a chunk over its prefix, and whole

    PYTHONPATH=. python3 scripts/bench_deterministic.py --families [qwen3-30b-a3b,deepseek-v2-lite,...]
        [--layers 8]

  families   each model (random weights, its first --layers decoder layers: 0 = all) served through the
             engine with and without --deterministic: total tok/s at concurrency 1 and 256 (1,024-token
             random prompts, 128 tokens out, greedy; the overlapped loop as `serve` runs it), and the cost;
             a vision-language model also times its tower on 8 images of 448 x 448 in one call and one at a
             time (--deterministic's way)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import cuda_median_ms  # noqa: E402

from autoprofile.kernels import triton_matmul  # noqa: E402
from autoprofile.engine.attention import get_backend_class  # noqa: E402
from autoprofile.kernels import triton_unified  # noqa: E402
from autoprofile.layers.attention import AttentionMetadata, KVLayer  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
ROWS = [1, 16, 64, 256, 1024, 8192]
GEMM_CONFIGS = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4), (64, 256, 64, 8, 3),
                (64, 64, 64, 4, 4), (64, 32, 64, 4, 4), (64, 64, 64, 4, 6), (64, 64, 128, 4, 4),
                (32, 128, 64, 4, 5), (16, 128, 128, 4, 4)]  # BLOCK_M/N/K, warps, stages
# BLOCK_M, TILE_SIZE, warps, stages
ATTENTION_CONFIGS = [(16, 64, 4, 1), (16, 32, 2, 2), (64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 4, 2)]


def bench_gemm(configs: list[dict]) -> None:
    dev = torch.device("cuda")
    weights = {n: torch.randn(s, device=dev, dtype=torch.bfloat16) * s[1] ** -0.5 for n, s in SHAPES.items()}
    xs = {k: torch.randn(8192, k, device=dev, dtype=torch.bfloat16) for k in (4096, 14336)}

    def total(fn, m: int) -> float:  # the lm_head runs on sampled rows only: up to 1,024
        return sum(cuda_median_ms(lambda: fn(xs[w.shape[1]][:m], w), iters=10)
                   for w in weights.values() if m <= 1024 or w.shape[0] != SHAPES["lm_head"][0])

    base = {m: total(F.linear, m) for m in ROWS}
    print("cuBLAS ms: " + " | ".join(f"{m} rows {base[m]:.3f}" for m in ROWS))
    w, x = weights["down"], xs[14336]
    print(f"cuBLAS invariant: {torch.equal(F.linear(x, w)[:1], F.linear(x[:1], w))}")
    served = triton_matmul.linear(x, w)  # the configs as served, at 8,192 rows
    for cfg in configs:
        saved, triton_matmul.CONFIGS = triton_matmul.CONFIGS, ((None, cfg),)
        try:
            ratio = " | ".join(f"{m} rows {base[m] / total(triton_matmul.linear, m):.2f}x" for m in ROWS)
            full = triton_matmul.linear(x, w)
            inv = all(torch.equal(triton_matmul.linear(x[:m], w), full[:m]) for m in (1, 300, 4097))
            # a config for some row counts only must give the bits of the served one at 8,192 rows
            same = all(torch.equal(triton_matmul.linear(x[:m], w), served[:m]) for m in (1, 16, 64, 256))
        finally:
            triton_matmul.CONFIGS = saved
        print(f"{cfg}: {ratio} of cuBLAS | invariant {inv} | the served bits {same}", flush=True)


def bench_attention(configs: list[tuple]) -> None:
    hq, hkv, d, page, t, rows, ctx = 32, 8, 128, 16, 8192, 256, 1024
    dev = torch.device("cuda")
    pages = t // page + rows * ctx // page
    kc = torch.randn(pages, hkv, page, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16)
    one = torch.arange(t // page, device=dev, dtype=torch.int32)[None]

    def i32(*v):
        return torch.tensor(v, device=dev, dtype=torch.int32)

    k = kc[:t // page].permute(0, 2, 1, 3).reshape(1, t, hkv, d).transpose(1, 2).repeat_interleave(4, 1)
    v = vc[:t // page].permute(0, 2, 1, 3).reshape(1, t, hkv, d).transpose(1, 2).repeat_interleave(4, 1)
    qh = q.transpose(0, 1)[None]
    sdpa = cuda_median_ms(lambda: F.scaled_dot_product_attention(qh, k, v, is_causal=True), iters=10)
    backend = get_backend_class("aiter_triton")(hq, hkv, d, page, torch.bfloat16, dev)
    tables = (t // page + torch.arange(rows * ctx // page, device=dev, dtype=torch.int32)).view(rows, -1)
    lens = torch.full((rows,), ctx, device=dev, dtype=torch.int32)
    qd = torch.randn(rows, hq, d, device=dev, dtype=torch.bfloat16)
    meta = AttentionMetadata(False, torch.zeros(rows, dtype=torch.int64, device=dev), block_tables=tables,
                             seq_lens=lens, max_seq_len=ctx)
    default = cuda_median_ms(lambda: backend.decode(qd, KVLayer(kc, vc), meta), iters=10)
    print(f"torch SDPA T={t} causal {sdpa:.3f} ms; default decode {rows} rows x {ctx} {default:.3f} ms")
    for bm, tile, warps, stages in configs:
        triton_unified.BLOCK_M, triton_unified.TILE_SIZE = bm, tile
        triton_unified.CONFIG = {"num_warps": warps, "num_stages": stages}

        def run(lo: int, hi: int) -> torch.Tensor:
            out = torch.empty(hi - lo, hq, d, device=dev, dtype=torch.bfloat16)
            return triton_unified.attention(out, q[lo:hi], kc, vc, one, i32(hi), i32(0, hi - lo), d ** -0.5)

        prefill = cuda_median_ms(lambda: run(0, t), iters=10)
        out = torch.empty_like(qd)
        cu = torch.arange(rows + 1, device=dev, dtype=torch.int32)
        decode = cuda_median_ms(
            lambda: triton_unified.attention(out, qd, kc, vc, tables, lens, cu, d ** -0.5), iters=10)
        whole = run(0, t)
        inv = torch.equal(run(t - 1, t), whole[-1:]) and torch.equal(run(4000, t), whole[4000:])
        print(f"BLOCK_M {bm} TILE {tile} warps {warps} stages {stages}: prefill {prefill:.3f} ms "
              f"({sdpa / prefill:.2f}x SDPA), decode {decode:.3f} ms ({default / decode:.2f}x default) | "
              f"invariant {inv}", flush=True)


FAMILIES = ["qwen3-30b-a3b", "deepseek-v2-lite", "qwen2.5-vl-7b"]


def family_folder(name: str, layers: int) -> str:
    """The builtin config with its first `layers` decoder layers (0: all), in a temporary folder."""
    import json
    import tempfile

    from autoprofile.model_config import CONFIG_DIR
    config = json.loads((CONFIG_DIR / name / "config.json").read_text())
    if layers:
        config["num_hidden_layers"] = layers
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def serve_rate(folder: str, deterministic: bool, concurrencies: list[int], prompt: int,
               out: int) -> tuple[dict[int, float], float | None]:
    """Total tok/s (prompt + output) at each concurrency through the overlapped engine; a vision model's tower
    ms for 8 images batched and one at a time (None for text models)."""
    import gc
    import random
    import time

    from autoprofile.config import ServerConfig, validate
    from autoprofile.engine.engine import LLMEngine
    from autoprofile.engine.runner import ModelRunner
    from autoprofile.engine.sampling import GREEDY
    from autoprofile.engine.weights import init_random

    most = max(concurrencies)
    cfg = validate(ServerConfig(model=folder, load_format="dummy", attention_backend="aiter_triton",
                                max_req_total_len=prompt + out, graph_max_batch_size=most,
                                running_max_req_size=most, report_dir=None, deterministic=deterministic,
                                # a VL model: its largest image must fit one request (the tower's bench
                                # images are 448 x 448)
                                max_image_pixels=448 * 448))
    r = ModelRunner(cfg)
    init_random(r.model, seed=1, std=0.02)
    r.build(most * (prompt + out) + 4096)
    rng = random.Random(0)
    vocab = min(r.model_config.vocab_size, 30000)
    rates, tower = {}, None
    try:
        engine = LLMEngine(r, overlap=True)
        warm = [[rng.randrange(3, vocab) for _ in range(prompt)] for _ in range(4)]
        engine.generate(warm, GREEDY, 8)  # compiles
        for c in concurrencies:
            prompts = [[rng.randrange(3, vocab) for _ in range(prompt)] for _ in range(c)]
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.generate(prompts, GREEDY, out)
            rates[c] = c * (prompt + out) / (time.perf_counter() - start)
        if r.model_config.vision is not None:
            grid, visual = (1, 32, 32), r.model.visual
            x = torch.randn(8 * 32 * 32, r.model_config.vision.patch_dim, device="cuda", dtype=r.dtype)
            with torch.no_grad():
                batched = cuda_median_ms(lambda: visual(x, [grid] * 8), iters=5)
                single = cuda_median_ms(lambda: [visual(p, [grid]) for p in x.chunk(8)], iters=5)
            tower = (batched, single)
    finally:
        r.teardown()
        del r
        gc.collect()
        torch.cuda.empty_cache()
    return rates, tower


def bench_families(names: list[str], layers: int, concurrencies: list[int], prompt: int = 1024,
                   out: int = 128) -> None:
    print(f"| model ({layers or 'all'} layers) | concurrency | total tok/s, default | with --deterministic "
          f"| cost |\n|---|---|---|---|---|")
    for name in names:
        folder = family_folder(name, layers)
        base, tower = serve_rate(folder, False, concurrencies, prompt, out)
        det, _ = serve_rate(folder, True, concurrencies, prompt, out)
        for c in concurrencies:
            print(f"| {name} | {c} | {base[c]:,.0f} | {det[c]:,.0f} | {1 - det[c] / base[c]:.0%} |",
                  flush=True)
        if tower is not None:
            print(f"| {name} tower, 8 images 448x448 | | {tower[0]:.1f} ms in one call | {tower[1]:.1f} ms "
                  f"one at a time | {tower[1] / tower[0] - 1:.0%} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gemm_configs", action="store_true", help="sweep GEMM_CONFIGS instead of CONFIG")
    p.add_argument("--attention_configs", action="store_true", help="sweep ATTENTION_CONFIGS")
    p.add_argument("--families", nargs="?", const=",".join(FAMILIES), default=None,
                   help="serve each model with and without --deterministic instead (comma-separated)")
    p.add_argument("--layers", type=int, default=8, help="--families: decoder layers (0 = all)")
    p.add_argument("--concurrency", default="1,256", help="--families: comma-separated")
    args = p.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    if args.families:
        bench_families(args.families.split(","), args.layers, [int(c) for c in args.concurrency.split(",")])
        return
    gemm = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8, num_warps=w, num_stages=s)
            for m, n, k, w, s in GEMM_CONFIGS] if args.gemm_configs else [
        cfg for _, cfg in triton_matmul.CONFIGS]
    attention = ATTENTION_CONFIGS if args.attention_configs else [
        (triton_unified.BLOCK_M, triton_unified.TILE_SIZE, triton_unified.CONFIG["num_warps"],
         triton_unified.CONFIG["num_stages"])]
    bench_gemm(gemm)
    bench_attention(attention)


if __name__ == "__main__":
    main()
