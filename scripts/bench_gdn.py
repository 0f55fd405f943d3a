"""Gated DeltaNet's one-token decode (kernels.triton_gdn) against its bytes floor, and beside the torch
reference.

PYTHONPATH=. python3 scripts/bench_gdn.py [--model qwen3.5-27b] [--rows 1,64,256]

One linear layer's step at the model's widths: each row's [v_heads, k_dim, v_dim] state (the checkpoint's
mamba_ssm_dtype) read and written once, q, k, v, g, beta read, o written; floor = those bytes / the device's
copy bandwidth measured in this run. Rows' slots are a permutation of the cache's (in place by slot)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention  # noqa: E402 - the copy bandwidth
from cuda_timing import cuda_median_ms  # noqa: E402

from autoprofile.engine.state_cache import STATE_TORCH_DTYPES  # noqa: E402
from autoprofile.kernels import triton_gdn  # noqa: E402
from autoprofile.layers import gdn  # noqa: E402
from models.config import load_model_config  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3.5-27b")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256])
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    mc = load_model_config(args.model)
    hk, hv, kd, vd = (mc.linear_num_key_heads, mc.linear_num_value_heads, mc.linear_key_head_dim,
                      mc.linear_value_head_dim)
    sdt = STATE_TORCH_DTYPES[mc.state_dtype]
    bw = bench_attention.copy_bandwidth(2 << 30)["GB_per_s"] * 1e9
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  copy {bw / 1e9:.0f} GB/s  {args.model}: "
          f"{hv} v heads x {kd} x {vd} "
          f"{mc.state_dtype} state a layer")
    print(" rows  kernel ms  floor ms  of floor  torch ms  kernel/torch")
    for b in args.rows:
        slots_n = max(args.rows) + 1
        ssm = torch.randn(slots_n, hv, kd, vd, device=dev).to(sdt) * 0.01
        slots = torch.randperm(slots_n, device=dev)[:b]
        q, k = (torch.randn(b, hk, kd, device=dev, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(b, hv, vd, device=dev, dtype=torch.bfloat16)
        g, beta = -torch.rand(b, hv, device=dev), torch.rand(b, hv, device=dev).bfloat16()
        ms = cuda_median_ms(lambda: triton_gdn.decode(q, k, v, g, beta, ssm, slots), args.iters)
        ref = cuda_median_ms(lambda: gdn.delta_rule_decode(q, k, v, g, beta, ssm, slots), args.iters)
        moved = 2 * b * hv * kd * vd * ssm.element_size() + b * (2 * hk * kd + 2 * hv * vd) * 2 + b * hv * 6
        floor = moved / bw * 1e3
        print(f"{b:5d}  {ms:9.4f}  {floor:8.4f}  {floor / ms:8.2f}  {ref:8.4f}  {ref / ms:12.1f}")


if __name__ == "__main__":
    main()
