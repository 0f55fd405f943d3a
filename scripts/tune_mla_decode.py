"""MLA's absorbed decode (kernels.triton_mla: our kernel over the paged latents, the splits' merge) over
launch configs, side by side in one run: each config checked against the torch reference on fresh random
latents, then timed as a CUDA graph's replay (CUDA events, median), with the bytes floor (each row's latents
read once: rows x ctx x 576 x 2 B).

    PYTHONPATH=. python3 scripts/tune_mla_decode.py [--rows 1,16,64,256] [--ctx 4000] [--json out.json]

DeepSeek-V2-Lite's widths: 16 heads, latent 512 + rope 64, page 16.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention  # noqa: E402 - the copy bandwidth
from cuda_timing import cuda_median_ms, graphed  # noqa: E402

from autoprofile.kernels import triton_mla  # noqa: E402
from autoprofile.engine.attention.torch_sdpa import TorchBackend  # noqa: E402
from autoprofile.layers.attention import AttentionMetadata, KVLayer  # noqa: E402

HEADS, RANK, ROPE, PAGE = 16, 512, 64, 16


def inputs(rows: int, ctx: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_row = -(-ctx // PAGE)
    pages = rows * pages_per_row + 1
    latents = torch.randn(pages, 1, PAGE, RANK + ROPE, device="cuda", generator=g).bfloat16()
    tables = (torch.randperm(pages - 1, device="cuda", generator=g)[:rows * pages_per_row] + 1).view(rows, -1)
    lens = torch.full((rows,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(rows, HEADS, RANK + ROPE, device="cuda", generator=g).bfloat16()
    return q, latents, tables.int().contiguous(), lens


def configs(rows: int):
    """The current launch, then block sizes x warps x pipeline stages x splits (more splits for fewer rows:
    each (row, split) is one program, and the card has ~132 SMs)."""
    yield triton_mla.launch_for(rows)
    splits = (8, 16, 32) if rows <= 4 else (4, 8, 16) if rows <= 32 else (1, 2, 3, 4)
    for block_n, warps, stages, n in itertools.product((16, 32, 64), (4, 8), (2, 3), splits):
        yield n, {"BLOCK_N": block_n, "BLOCK_H": 16, "num_warps": warps, "num_stages": stages}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 4, 16, 32, 64, 128, 256])
    p.add_argument("--ctx", type=int, default=4000)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    bw = bench_attention.copy_bandwidth(2 << 30)["GB_per_s"] * 1e9
    ref_backend = TorchBackend(HEADS, HEADS, 128, PAGE, torch.bfloat16, torch.device("cuda"))
    scale = 192 ** -0.5
    results = []
    for rows in args.rows:
        floor = rows * args.ctx * (RANK + ROPE) * 2 / bw * 1e3
        current = triton_mla.launch_for(rows)
        for seed, (splits, cfg) in enumerate(configs(rows)):
            q, latents, tables, lens = inputs(rows, args.ctx, seed)
            meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(rows, dtype=torch.long,
                                                                                  device="cuda"),
                                     block_tables=tables, seq_lens=lens, max_seq_len=args.ctx)

            def run():
                return triton_mla.mla_decode(q, latents, tables, lens, scale, RANK, rows,
                                             (splits, cfg))
            try:
                got = run()
            except Exception as e:  # noqa: BLE001 - a config the card cannot launch (shared memory)
                print(f"rows {rows} splits {splits} {cfg}: {type(e).__name__}")
                continue
            want = ref_backend.mla_decode(q, KVLayer(latents, latents), meta, scale, RANK)
            err = float((got.float() - want.float()).norm() / want.float().norm())
            replay = graphed(run)  # as serving runs it: eager, the host's launches would be timed
            ms = cuda_median_ms(replay, args.iters)
            del replay
            results.append({"rows": rows, "ctx": args.ctx, "splits": splits, **cfg, "ms": ms,
                            "floor_ms": floor, "of_floor": floor / ms, "rel_err": err,
                            "current": (splits, cfg) == current})
    print(f"{torch.cuda.get_device_name()}: MLA decode, {HEADS} heads, ctx {args.ctx}")
    print(f"{'rows':>5}{'splits':>7}{'BLOCK_N':>8}{'stages':>7}{'warps':>6}{'ms':>9}{'floor':>8}"
          f"{'of floor':>9}"
          f"{'rel err':>9}")
    for rows in args.rows:
        mine = sorted((r for r in results if r["rows"] == rows), key=lambda r: r["ms"])
        for r in mine[:4] + [r for r in mine if r["current"]]:
            print(f"{r['rows']:>5}{r['splits']:>7}{r['BLOCK_N']:>8}{r['num_stages']:>7}{r['num_warps']:>6}"
                  f"{r['ms']:>9.3f}{r['floor_ms']:>8.3f}{r['of_floor']:>9.2f}{r['rel_err']:>9.1e}"
                  + ("  (current)" if r["current"] else ""))
    bad = [r for r in results if not r["rel_err"] < 2e-2]
    print(f"{len(results)} configs, {len(bad)} wrong")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
