"""Gated DeltaNet's one-token decode (kernels.triton_gdn) against its bytes floor, and beside the torch
reference.

PYTHONPATH=. python3 scripts/bench_gdn.py [--model qwen3.5-27b] [--rows 1,64,256]
PYTHONPATH=. python3 scripts/bench_gdn.py --sweep   # every launch candidate of a layer's decode rows

One linear layer's step at the model's widths: each row's [v_heads, k_dim, v_dim] state (the checkpoint's
mamba_ssm_dtype) read and written once, q, k, v, g, beta read, o written; floor = those bytes / the device's
copy bandwidth measured in this run. Rows' slots are a permutation of the cache's (in place by slot).

--sweep times a layer's decode rows from its projections to out_proj's input (triton_gdn.decode_layer: conv
window, gates, rule, gated norm) for every candidate launch (launch_rules.GdnLaunch), each call replayed from
a CUDA graph of --reps calls (as serving replays them), beside the path before (torch conv, gates and norm
around the rule's kernel) and the torch reference; floor = the layer's bytes (state, conv windows, qkv, z, ba,
output, conv weight) / copy bandwidth. It prints each candidate's ms,
share of the floor, largest difference from the torch reference (relative) and local-memory spills, the
best per row count, and the table for launch_rules.GDN_DECODE_LAUNCHES."""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention  # noqa: E402 - the copy bandwidth
from cuda_timing import cuda_median_ms, graphed  # noqa: E402

from autoprofile.engine.state_cache import STATE_TORCH_DTYPES  # noqa: E402
from autoprofile.kernels import triton_gdn  # noqa: E402
from autoprofile.kernels.launch_rules import GdnLaunch  # noqa: E402
from autoprofile.layers import gdn  # noqa: E402
from autoprofile.model_config import load_model_config  # noqa: E402


ARGS = ("qkv", "z", "ba", "conv_weight", "a_log", "dt_bias", "norm_weight", "eps", "conv", "ssm", "slots")


def candidates() -> list[GdnLaunch]:
    """The sweep's launches: the rule apart from the conv (blocks, warps, heads a program, stages where a
    program loops), and with the conv fused (a key head's heads and blocks in one program)."""
    apart = [GdnLaunch(bv, heads, warps, stages) for bv, warps, heads, stages
             in itertools.product((16, 32, 64, 128), (2, 4, 8), (1, 3), (1, 2)) if heads > 1 or stages == 1]
    fused = [GdnLaunch(bv, 1, warps, stages, True)
             for bv, warps, stages in itertools.product((32, 64, 128), (4, 8), (1, 2))]
    return apart + fused


def layer_inputs(mc, rows: int, slots_n: int, sdt: torch.dtype, dev: torch.device) -> dict:
    hk, hv, kd, vd = (mc.linear_num_key_heads, mc.linear_num_value_heads, mc.linear_key_head_dim,
                      mc.linear_value_head_dim)
    c, kw, bf = 2 * hk * kd + hv * vd, mc.linear_conv_kernel_dim, torch.bfloat16
    return {"qkv": torch.randn(rows, c, device=dev, dtype=bf),
            "z": torch.randn(rows, hv * vd, device=dev, dtype=bf),
            "ba": torch.randn(rows, 2 * hv, device=dev, dtype=bf),
            "conv_weight": torch.randn(c, kw, device=dev, dtype=bf) * 0.3,
            "a_log": torch.rand(hv, device=dev), "dt_bias": torch.randn(hv, device=dev),
            "norm_weight": torch.ones(vd, device=dev, dtype=bf), "eps": 1e-6,
            "conv": torch.randn(slots_n, c, kw - 1, device=dev, dtype=bf),
            "ssm": (torch.randn(slots_n, hv, kd, vd, device=dev) * 0.01).to(sdt),
            "slots": torch.randperm(slots_n, device=dev)[:rows]}


def layer_bytes(t: dict) -> int:
    """What a layer's decode rows must move: each row's state and conv window read and written, its
    projections read, its output written, the conv weight read."""
    rows = t["slots"].shape[0]
    state = 2 * rows * t["ssm"][0].numel() * t["ssm"].element_size()
    window = 2 * rows * t["conv"][0].numel() * t["conv"].element_size()
    rows_in = sum(t[n].numel() * t[n].element_size() for n in ("qkv", "z", "ba"))
    return state + window + rows_in + t["z"].numel() * 2 + t["conv_weight"].numel() * 2


def before(t: dict) -> torch.Tensor:
    """The decode path before: torch conv, gates and gated norm around the rule's kernel."""
    hv, kd, vd = t["ssm"].shape[1:]
    hk = (t["qkv"].shape[1] - hv * vd) // (2 * kd)
    c = gdn.conv_decode(t["qkv"], t["conv_weight"], t["conv"], t["slots"])
    o = triton_gdn.decode(*gdn.split_qkv(c, hk, kd, hv, vd), *gdn.gating(t["ba"], t["a_log"], t["dt_bias"]),
                          t["ssm"], t["slots"])
    return gdn.gated_rms_norm(o, t["z"].reshape(-1, hv, vd), t["norm_weight"], t["eps"])


def max_error(t: dict, launch: GdnLaunch) -> float:
    """The candidate's one call against the torch reference, each on its own copy of the state: the largest
    difference of the output, the conv windows and the state, relative to the reference's largest value."""
    ref, got = ({n: t[n].clone() if n in ("conv", "ssm") else t[n] for n in ARGS} for _ in range(2))
    want = gdn.decode_layer(*ref.values()).float()
    out = triton_gdn.decode_layer(*got.values(), launch=launch).float()
    pairs = ((out, want), (got["conv"], ref["conv"]), (got["ssm"], ref["ssm"]))
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in pairs)


def replay_ms(call, reps: int, iters: int) -> float:
    """One call's time from a CUDA graph of `reps` calls (the launch gaps a served graph has)."""
    run = graphed(lambda: [call() for _ in range(reps)])
    return cuda_median_ms(run, iters) / reps


def spills() -> dict:
    """Each compiled variant of the decode kernel and its local-memory spills (Triton's cache; {} if this
    Triton keeps it elsewhere)."""
    try:
        caches = triton_gdn._gdn_decode_kernel.device_caches.values()
        return {key: kernel.n_spills for cache in caches for key, kernel in cache[0].items()}
    except (AttributeError, IndexError, TypeError):
        return {}


def sweep(mc, rows_list: list[int], sdt: torch.dtype, bw: float, reps: int, iters: int) -> None:
    dev = torch.device("cuda")
    best: dict[int, tuple[float, GdnLaunch]] = {}
    for rows in rows_list:
        t = layer_inputs(mc, rows, max(rows_list) + 1, sdt, dev)
        floor = layer_bytes(t) / bw * 1e3
        args = [t[n] for n in ARGS]
        print(f"\n{rows} rows: layer floor {floor:.4f} ms")
        print(f"  {'launch':58s}  {'ms':>8s}  {'of floor':>8s}  {'max err':>8s}  spills")
        for name, call in (("torch reference (gdn.decode_layer)", lambda: gdn.decode_layer(*args)),
                           ("before: torch conv/gates/norm + rule kernel", lambda: before(t))):
            ms = replay_ms(call, reps, iters)
            print(f"  {name:58s}  {ms:8.4f}  {floor / ms:8.2f}")
        t["ssm"].mul_(0.0).add_(0.01)  # the before path advanced the states; bounded again for the errors
        for launch in candidates():
            known = spills()
            try:
                err = max_error(t, launch)
                ms = replay_ms(lambda: triton_gdn.decode_layer(*args, launch=launch), reps, iters)
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile or launch is reported
                print(f"  {str(launch)[9:]:58s}  failed: {type(e).__name__}: {str(e)[:60]}")
                continue
            new = [n for k, n in spills().items() if k not in known]
            spilled = max(new, default="-")
            print(f"  {str(launch)[9:]:58s}  {ms:8.4f}  {floor / ms:8.2f}  {err:8.1e}  {spilled}")
            if err < 0.02 and (rows not in best or ms < best[rows][0]):
                best[rows] = (ms, launch)
    print("\nbest:")
    for rows, (ms, launch) in best.items():
        print(f"  {rows:5d} rows  {ms:.4f} ms  {launch}")
    print("GDN_DECODE_LAUNCHES = (" + ", ".join(
        f"({rows if i < len(best) - 1 else '1 << 30'}, {launch})" for i, (rows, (_, launch))
        in enumerate(sorted(best.items()))) + ")  # rows up to each count; check spills above before use")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3.5-27b")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--sweep", action="store_true", help="every launch candidate, a layer's rows")
    p.add_argument("--reps", type=int, default=10, help="calls a CUDA graph holds (--sweep)")
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
    if args.sweep:
        sweep(mc, args.rows, sdt, bw, args.reps, min(args.iters, 20))
        return
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
