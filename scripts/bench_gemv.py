"""The batch-1 GEMMs: triton_gemv against cuBLAS (F.linear), side by side in one run, on llama-3.1-8b's
weight shapes. Each shape has 32 distinct weights (a model's layers) replayed in one CUDA graph, so no weight
is served from L2 (a 4,096 x 4,096 bf16 weight fits an H100's 50 MB L2, and repeating one times the cache).

    PYTHONPATH=. python3 scripts/bench_gemv.py [--sweep]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_attention  # noqa: E402 - the copy-bandwidth timer
from cuda_timing import capture  # noqa: E402
from autoprofile.kernels import triton_gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
SWEEP = [(2, 2048, 8), (2, 2048, 4), (1, 4096, 8), (2, 4096, 8), (4, 2048, 8), (4, 1024, 4), (8, 1024, 4)]


def graph_us(fn, layers: int) -> float:
    """Microseconds per call: `layers` calls captured in one graph (capture), replayed 10 times."""
    graph, _ = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * layers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="time each of SWEEP (BLOCK_N, BLOCK_K, warps)")
    args = p.parse_args()
    torch.manual_seed(0)
    copy = bench_attention.copy_bandwidth(2 << 30)  # bench_decode's floor rate
    rate = copy["GB_per_s"] * 1e9
    print(f"{torch.cuda.get_device_name()}: copy {copy['GB_per_s']:.0f} GB/s")
    configs = SWEEP if args.sweep else [(triton_gemv.BLOCK_N, triton_gemv.BLOCK_K, triton_gemv.WARPS)]
    for name, (n, k) in SHAPES.items():
        layers = 1 if name == "lm_head" else 32
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(layers)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        floor = n * k * 2 / rate * 1e6
        cublas = graph_us(lambda: [F.linear(x, w) for w in ws], layers)
        line = f"{name:8s} {n}x{k}: floor {floor:6.1f} us, cuBLAS {cublas:6.1f} us"
        for bn, bk, warps in configs:
            triton_gemv.BLOCK_N, triton_gemv.BLOCK_K, triton_gemv.WARPS = bn, bk, warps
            ours = graph_us(lambda: [triton_gemv.gemv(x, w) for w in ws], layers)
            err = ((triton_gemv.gemv(x, ws[0]).float() - F.linear(x, ws[0]).float()).norm()
                   / F.linear(x, ws[0]).float().norm()).item()
            line += f" | {bn}/{bk}/w{warps} {ours:6.1f} us ({cublas / ours:.2f}x, err {err:.0e})"
        print(line, flush=True)
        ws = None  # this shape's weights go before the next shape's are made


if __name__ == "__main__":
    main()
