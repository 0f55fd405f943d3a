"""FP8 weights on one card, side by side in one run (kernels.triton_fp8), on llama-3.1-8b's weight shapes:

  1. one row (decode at batch 1): bf16 GEMV (triton_gemv) against the FP8 GEMV (channel and block scales),
     each against its copy floor (the weight's bytes at the card's copy rate: 2 bytes a weight in bf16, 1 in
     FP8); 32 distinct weights a shape replayed in one CUDA graph (no weight served from L2); then the FP8
     GEMV's (BLOCK_N, BLOCK_K, warps) sweep;
  2. prefill rows (M=8192): bf16 cuBLAS against torch._scaled_mm row-wise and our Triton GEMM (channel and
     block scales), inputs quantized beforehand, in TFLOP/s; then linear() whole (quant included); then the
     block GEMM's launch-config sweep;
  3. the activation quant kernels (per token, per 128-group) at M=8192: microseconds and GB/s moved;
  4. decode rows (1, 2, 4, 8, 16, 32, 64): today's path (triton_fp8.linear with the skinny rule off) against
     the skinny GEMM (triton_fp8_skinny) over SKINNY_SWEEP, each shape's rows as the model hands them (o_proj:
     bf16 rows; qkv, gate_up, down: rows its norm or SiLU-mul quantized, Fp8Rows), 32 weights a graph; us and
     fraction of the bytes floor (weight + activations + output at the copy rate), a layer's four GEMMs
     summed; then launch_rules.FP8_SKINNY_LAUNCHES and FP8_SKINNY_BLOCK_LAUNCHES to paste, one a layout
     (llama-3.1-8b-fp8's): a row count keeps today's path (None) where the skinny GEMM is not faster;
  5. (--rows_gemv alone) the multi-row FP8 GEMV (triton_fp8_rows) at 2, 4, 8, 16 rows over ROWS_GEMV_SWEEP,
     beside the skinny GEMM (its table's launch) and today's dispatch (triton_fp8.linear as the tree's tables
     say), the shapes' rows as in section 4, 32 weights a graph: us per layer (the four GEMMs) and fraction of
     the bytes floor, each launch's layer sum, then launch_rules.FP8_GEMV_ROWS_LAUNCHES and
     FP8_GEMV_ROWS_BLOCK_LAUNCHES to paste (None where the skinny GEMM's launch is faster);
  6. (--skinny_variants alone) the skinny GEMM's launches with and without SkinnyLaunch.split_k
     (VARIANT_SWEEP, a few launches each) at 2, 4, 8, 16, 32, 64 rows, channel and 128x128 block scales,
     beside today's dispatch and (per-channel) cuBLAS's _scaled_mm with the weight on the left and as today,
     on rows quantized beforehand; the shapes' rows as in section 4, 32 weights a graph: each shape's us and
     fraction of the bytes floor under each variant's fastest launch, the layer under one table entry a
     variant, then the launch_rules tables to paste. Its compiles first run in --prewarm processes (Triton's
     disk cache), --prewarm_only alone.

    PYTHONPATH=. python3 scripts/bench_fp8.py [--quick] [--skinny | --rows_gemv | --skinny_variants]
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
from bench_gemv import SHAPES, graph_us  # noqa: E402
from cuda_timing import cuda_median_ms  # noqa: E402
from autoprofile.kernels import launch_rules, triton_fp8, triton_fp8_skinny, triton_gemv  # noqa: E402
from autoprofile.kernels import triton_fp8_rows  # noqa: E402
from autoprofile.kernels.launch_rules import GemvRowsLaunch, SkinnyLaunch, fp8_gemv_rows_launch  # noqa: E402
from autoprofile.kernels.launch_rules import fp8_skinny_launch  # noqa: E402
from autoprofile.layers.quant import Fp8Rows  # noqa: E402
from unit_tests.test_triton_fp8 import REFERENCE  # noqa: E402

ref: dict = {}  # the torch references (a private copy of layers.quant's)
exec(compile(REFERENCE, "reference", "exec"), ref)
CHANNEL = ref["Scheme"]("channel")
BLOCK = ref["Scheme"]("block", (128, 128), "group")
GEMV_SWEEP = [(4, 512, 1), (2, 1024, 1), (4, 512, 2), (4, 1024, 2), (8, 1024, 4), (8, 512, 2), (4, 2048, 4),
              (2, 4096, 8), (16, 256, 4)]  # the first two: triton_fp8.gemv_config's (an H100 sweep of 46)
GEMM_SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=w, num_stages=s)
              for bm, bn, w, s in ((128, 128, 8, 3), (128, 128, 4, 4), (128, 256, 8, 3), (64, 128, 4, 4),
                                   (128, 64, 4, 4), (64, 256, 8, 3))]
PREFILL_M = 8192
SKINNY_ROWS = (1, 2, 4, 8, 16, 32, 64)
SKINNY_SWEEP = [SkinnyLaunch(*c) for c in (
    (16, 128, 4, 4), (16, 256, 4, 3), (16, 512, 4, 2), (32, 256, 4, 3), (32, 512, 4, 2), (64, 128, 4, 4),
    (64, 256, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3), (128, 256, 8, 2), (16, 256, 2, 3), (32, 128, 4, 5))]

ROWS_GEMV_ROWS = (2, 4, 8, 16)
# (block_n, block_k, sum_k, warps): the one-row GEMV's shape first; min_programs the rule's default
ROWS_GEMV_SWEEP = [GemvRowsLaunch(*c) for c in (
    (4, 512, 16, 1), (2, 512, 16, 1), (4, 256, 16, 1), (2, 1024, 16, 1), (8, 512, 16, 4), (4, 512, 512, 1))]


def fp8_weights(n: int, k: int, scheme, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    w = torch.randn(n, k, device="cuda") * k ** -0.5
    wq, ws = ref["quantize_weight"](w, scheme)
    del w
    return [(wq.clone(), ws.clone()) for _ in range(layers)]


def gemv_table(rate: float, sweep: bool) -> None:
    print("\n== one row: GEMV (us per call; fraction of the copy floor) ==")
    print(f"{'shape':9s} {'N x K':>13s} | {'bf16 floor':>10s} {'bf16':>7s} {'frac':>5s} | {'fp8 floor':>9s} "
          f"{'channel':>7s} {'frac':>5s} {'block':>7s} {'frac':>5s} | {'fp8/bf16':>8s}")
    for name, (n, k) in SHAPES.items():
        layers = 1 if name == "lm_head" else 32
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(layers)]
        bf16 = graph_us(lambda: [triton_gemv.gemv(x, w) for w in ws], layers)
        ws = None
        floor16, floor8 = n * k * 2 / rate * 1e6, n * k / rate * 1e6
        times = {}
        for scheme in (CHANNEL, BLOCK):
            q = fp8_weights(n, k, scheme, layers)
            times[scheme.weight] = graph_us(lambda: [triton_fp8.gemv(x, w, s, scheme.block) for w, s in q],
                                            layers)
            if sweep and scheme is CHANNEL:
                line = f"  sweep {name}:"
                for bn, bk, warps in GEMV_SWEEP:
                    t = graph_us(lambda: [triton_fp8.gemv(x, w, s, None, config=(bn, bk, warps))
                                          for w, s in q], layers)
                    line += f" {bn}/{bk}/w{warps} {t:.1f} ({floor8 / t:.2f})"
                sweep_line = line
            q = None
        ch, bl = times["channel"], times["block"]
        print(f"{name:9s} {n:>6d}x{k:<6d} | {floor16:10.1f} {bf16:7.1f} {floor16 / bf16:5.2f} | "
              f"{floor8:9.1f} {ch:7.1f} {floor8 / ch:5.2f} {bl:7.1f} {floor8 / bl:5.2f} | {bf16 / ch:7.2f}x",
              flush=True)
        if sweep:
            print(sweep_line, flush=True)


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / ms / 1e9


def gemm_table(sweep: bool) -> None:
    m = PREFILL_M
    print(f"\n== prefill rows M={m}: TFLOP/s (inputs quantized beforehand; 'linear' includes the quant) ==")
    print(f"{'shape':9s} {'N x K':>13s} | {'bf16 cuBLAS':>11s} {'_scaled_mm':>10s} {'ours ch':>8s} "
          f"{'ours blk':>8s} | {'linear ch':>9s} {'linear blk':>10s}")
    for name, (n, k) in list(SHAPES.items())[:4]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        bf16 = cuda_median_ms(lambda: F.linear(x, w16), 20)
        w16 = None
        (wc, sc), = fp8_weights(n, k, CHANNEL, 1)
        (wb, sb), = fp8_weights(n, k, BLOCK, 1)
        xq, xs = triton_fp8.quantize_per_token(x)
        xg, xgs = triton_fp8.quantize_per_group(x, 128)
        scaled = cuda_median_ms(lambda: torch._scaled_mm(xq, wc.t(), scale_a=xs, scale_b=sc.view(1, n),
                                                         out_dtype=torch.bfloat16), 20)
        ours_ch = cuda_median_ms(lambda: triton_fp8.gemm(xq, xs, wc, sc, None, torch.bfloat16), 20)
        ours_bl = cuda_median_ms(lambda: triton_fp8.gemm(xg, xgs, wb, sb, (128, 128), torch.bfloat16), 20)
        lin_ch = cuda_median_ms(lambda: triton_fp8.linear(x, wc, sc, CHANNEL), 20)
        lin_bl = cuda_median_ms(lambda: triton_fp8.linear(x, wb, sb, BLOCK), 20)
        print(f"{name:9s} {n:>6d}x{k:<6d} | {tflops(m, n, k, bf16):11.0f} {tflops(m, n, k, scaled):10.0f} "
              f"{tflops(m, n, k, ours_ch):8.0f} {tflops(m, n, k, ours_bl):8.0f} | "
              f"{tflops(m, n, k, lin_ch):9.0f} {tflops(m, n, k, lin_bl):10.0f}", flush=True)
        if sweep:
            line = "  block GEMM sweep (BM/BN/warps/stages):"
            for cfg in GEMM_SWEEP:
                try:
                    t = cuda_median_ms(lambda: triton_fp8.gemm(xg, xgs, wb, sb, (128, 128), torch.bfloat16,
                                                               config=cfg), 10)
                    line += (f" {cfg['BLOCK_M']}/{cfg['BLOCK_N']}/w{cfg['num_warps']}/s{cfg['num_stages']} "
                             f"{tflops(m, n, k, t):.0f}")
                except Exception as e:  # noqa: BLE001 - a config past the shared memory is reported
                    line += f" {cfg['BLOCK_M']}/{cfg['BLOCK_N']}: {type(e).__name__}"
            print(line, flush=True)


def quant_table() -> None:
    m = PREFILL_M
    print(f"\n== activation quant, M={m} (us; GB/s moved: 2 bytes read + 1 written an element) ==")
    for k in (4096, 14336):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        token = cuda_median_ms(lambda: triton_fp8.quantize_per_token(x), 50)
        group = cuda_median_ms(lambda: triton_fp8.quantize_per_group(x, 128), 50)
        moved = 3 * m * k / 1e9
        print(f"K={k:6d}: per token {token * 1e3:7.1f} us ({moved / token * 1e3:5.0f} GB/s), "
              f"per 128-group {group * 1e3:7.1f} us ({moved / group * 1e3:5.0f} GB/s)", flush=True)


def model_rows(name: str, m: int, k: int, scheme) -> torch.Tensor | Fp8Rows:
    """A shape's input as the model hands it: o_proj reads attention's bf16 rows, the others rows their
    producer quantized past one row (models.llama's RMSNorm and SiLU-mul)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if name == "o" or m == 1:
        return x
    if scheme.activation == "group":
        return Fp8Rows(*triton_fp8.quantize_per_group(x, scheme.block[1]), x.dtype)
    return Fp8Rows(*triton_fp8.quantize_per_token(x), x.dtype)


def floor_us(m: int, n: int, k: int, x, rate: float) -> float:
    """The bytes floor of one call: the weight, the activations as they come, the bf16 output."""
    act = m * k + x.scale.numel() * 4 if isinstance(x, Fp8Rows) else m * k * 2
    return (n * k + act + m * n * 2) / rate * 1e6


def rule_launch(m: int, n: int, k: int, cfg: SkinnyLaunch) -> SkinnyLaunch | None:
    """What launch_rules makes of `cfg` at this shape (block_n halved for a narrow N, K step capped)."""
    return fp8_skinny_launch(m, n, k, ((launch_rules.SKINNY_MAX_ROWS, cfg),))


def skinny_times(name: str, m: int, n: int, k: int, scheme, rate: float, launches) -> dict:
    """us per call of today's path ("today") and of each launch the rule makes of `launches` at this shape
    (keyed by that launch), 32 weights a graph; "floor", and "err": the skinny GEMM's largest difference
    from today's output, relative to its largest value."""
    block = tuple(scheme.block) if scheme.weight == "block" else None
    q = fp8_weights(n, k, scheme, 32)
    x = model_rows(name, m, k, scheme)
    launch_rules.FP8_SKINNY_LAUNCHES = launch_rules.FP8_SKINNY_BLOCK_LAUNCHES = ()
    launch_rules.FP8_GEMV_ROWS_LAUNCHES = launch_rules.FP8_GEMV_ROWS_BLOCK_LAUNCHES = ()  # today's path
    out = {"today": graph_us(lambda: [triton_fp8.linear(x, w, s, scheme) for w, s in q], 32),
           "floor": floor_us(m, n, k, x, rate), "err": 0.0}
    want = triton_fp8.linear(x, *q[0], scheme).float()
    q = [(w, s if block else s.reshape(n)) for w, s in q]
    for launch in {rule_launch(m, n, k, cfg) for cfg in launches} - {None}:
        try:
            got = triton_fp8_skinny.linear(x, *q[0], block, launch).float()
            out[launch] = graph_us(lambda: [triton_fp8_skinny.linear(x, w, s, block, launch) for w, s in q],
                                   32)
        except Exception as e:  # noqa: BLE001 - a launch past the shared memory or registers is reported
            print(f"  {name} m={m} {tuple(launch)}: {type(e).__name__}", flush=True)
            continue
        out["err"] = max(out["err"], float((got - want).abs().max() / want.abs().max()))
    return out


def layer_us(m: int, cfg: SkinnyLaunch, shapes: dict, times: dict) -> float | None:
    """A layer's four GEMMs under one table entry, or None where a shape's launch failed."""
    keys = {name: rule_launch(m, n, k, cfg) for name, (n, k) in shapes.items()}
    if not all(key in times[name] for name, key in keys.items()):
        return None
    return sum(times[name][key] for name, key in keys.items())


def rule_line(best: dict, name: str = "FP8_SKINNY_LAUNCHES", kind: str = "SkinnyTable") -> str:
    """launch_rules.FP8_SKINNY_LAUNCHES from each row count's choice (None: today's path), neighbours with
    the same choice merged into the larger row count's entry, trailing Nones dropped."""
    entries: list[tuple[int, SkinnyLaunch | None]] = []
    for m in sorted(best):
        if entries and entries[-1][1] == best[m]:
            entries.pop()
        entries.append((m, best[m]))
    while entries and entries[-1][1] is None:
        entries.pop()
    body = ", ".join(f"({m}, {None if cfg is None else cfg})" for m, cfg in entries)
    return f"{name}: {kind} = ({body}{',' if len(entries) == 1 else ''})"


def skinny_table(rate: float, sweep: bool) -> None:
    launches = SKINNY_SWEEP if sweep else [SkinnyLaunch()]
    shapes = {name: nk for name, nk in SHAPES.items() if name != "lm_head"}
    print("\n== decode rows: today's path / the skinny GEMM's fastest launch (us per call; fraction of the "
          "bytes floor); a layer's four under one table entry ==")
    best: dict[str, dict[int, SkinnyLaunch | None]] = {"channel": {}, "block": {}}
    for scheme in (CHANNEL, BLOCK):
        for m in SKINNY_ROWS:
            times = {name: skinny_times(name, m, n, k, scheme, rate, launches)
                     for name, (n, k) in shapes.items()}
            floor, today = (sum(t[key] for t in times.values()) for key in ("floor", "today"))
            layer = {cfg: us for cfg in launches if (us := layer_us(m, cfg, shapes, times)) is not None}
            cfg = min(layer, key=layer.get) if layer else None
            line = f"{scheme.weight:7s} m={m:2d} |"
            for name, t in times.items():
                fast = min((v for key, v in t.items() if isinstance(key, SkinnyLaunch)), default=float("nan"))
                line += f" {name} {t['today']:.1f} ({t['floor'] / t['today']:.2f}) / {fast:.1f} " \
                        f"({t['floor'] / fast:.2f}) |"
            line += f" layer floor {floor:.1f}: today {today:.1f} ({floor / today:.2f})"
            if cfg is not None:
                line += f", skinny {layer[cfg]:.1f} ({floor / layer[cfg]:.2f}) at {tuple(cfg)}, " \
                        f"{today / layer[cfg]:.2f}x; err {max(t['err'] for t in times.values()):.1e}"
            print(line, flush=True)
            if m > 1:
                best[scheme.weight][m] = cfg if cfg is not None and layer[cfg] < today else None
    print("\nlaunch_rules, one table a weight layout (pasted, they turn the skinny GEMM on where it won):")
    print(rule_line(best["channel"]), flush=True)
    print(rule_line(best["block"], "FP8_SKINNY_BLOCK_LAUNCHES"), flush=True)


def rows_rule_launch(m: int, n: int, k: int, cfg: GemvRowsLaunch, block: bool) -> GemvRowsLaunch | None:
    """What launch_rules makes of `cfg` at this shape (block_n halved for a narrow N, K step capped)."""
    return fp8_gemv_rows_launch(m, n, k, ((launch_rules.GEMV_ROWS_MAX, cfg),), block)


def gemv_rows_times(name: str, m: int, n: int, k: int, scheme, rate: float, launches) -> dict:
    """us per call of today's dispatch ("today"), the skinny GEMM's table launch ("skinny", absent where its
    table has none) and each launch the rule makes of `launches` (keyed by that launch), 32 weights a graph;
    "floor", and "err": the GEMV's largest difference from today's output, relative to its largest value."""
    block = tuple(scheme.block) if scheme.weight == "block" else None
    q = fp8_weights(n, k, scheme, 32)
    x = model_rows(name, m, k, scheme)
    out = {"today": graph_us(lambda: [triton_fp8.linear(x, w, s, scheme) for w, s in q], 32),
           "floor": floor_us(m, n, k, x, rate), "err": 0.0}
    want = triton_fp8.linear(x, *q[0], scheme).float()
    q = [(w, s if block else s.reshape(n)) for w, s in q]
    if (skinny := fp8_skinny_launch(m, n, k, block=block is not None)) is not None:
        out["skinny"] = graph_us(lambda: [triton_fp8_skinny.linear(x, w, s, block, skinny) for w, s in q], 32)
    for launch in {rows_rule_launch(m, n, k, cfg, block is not None) for cfg in launches} - {None}:
        try:
            got = triton_fp8_rows.linear(x, *q[0], block, launch).float()
            out[launch] = graph_us(lambda: [triton_fp8_rows.linear(x, w, s, block, launch) for w, s in q], 32)
        except Exception as e:  # noqa: BLE001 - a launch past the registers is reported
            print(f"  {name} m={m} {tuple(launch)}: {type(e).__name__}", flush=True)
            continue
        out["err"] = max(out["err"], float((got - want).abs().max() / want.abs().max()))
    return out


def gemv_rows_table(rate: float, quick: bool) -> None:
    launches = ROWS_GEMV_SWEEP[:1] if quick else ROWS_GEMV_SWEEP
    shapes = {name: nk for name, nk in SHAPES.items() if name != "lm_head"}
    print("\n== decode rows: the multi-row FP8 GEMV's launches beside the skinny GEMM and today's dispatch "
          "(us per layer, the four GEMMs; fraction of the bytes floor) ==")
    best: dict[str, dict[int, GemvRowsLaunch | None]] = {"channel": {}, "block": {}}
    for scheme in (CHANNEL, BLOCK):
        is_block = scheme.weight == "block"
        for m in ROWS_GEMV_ROWS:
            times = {name: gemv_rows_times(name, m, n, k, scheme, rate, launches)
                     for name, (n, k) in shapes.items()}
            floor, today = (sum(t[key] for t in times.values()) for key in ("floor", "today"))
            skinny = sum(t.get("skinny", float("nan")) for t in times.values())
            layer = {}
            for cfg in launches:
                keys = {name: rows_rule_launch(m, n, k, cfg, is_block) for name, (n, k) in shapes.items()}
                if all(key in times[name] for name, key in keys.items()):
                    layer[cfg] = sum(times[name][key] for name, key in keys.items())
            print(f"{scheme.weight:7s} m={m:2d} | floor {floor:.1f} | today {today:.1f} "
                  f"({floor / today:.2f}) | skinny {skinny:.1f} ({floor / skinny:.2f}) | err "
                  f"{max(t['err'] for t in times.values()):.1e}", flush=True)
            for cfg, us in sorted(layer.items(), key=lambda item: item[1]):
                shares = " ".join(f"{name} {times[name][rows_rule_launch(m, n, k, cfg, is_block)]:.1f}"
                                  for name, (n, k) in shapes.items())
                print(f"    {tuple(cfg)}: {us:.1f} ({floor / us:.2f}) [{shares}]", flush=True)
            cfg = min(layer, key=layer.get) if layer else None
            best[scheme.weight][m] = cfg if cfg is not None and not layer[cfg] >= skinny else None
    print("\nlaunch_rules, one table a weight layout (None: the skinny GEMM's launch was faster):")
    print(rule_line(best["channel"], "FP8_GEMV_ROWS_LAUNCHES", "GemvRowsTable"), flush=True)
    print(rule_line(best["block"], "FP8_GEMV_ROWS_BLOCK_LAUNCHES", "GemvRowsTable"), flush=True)


# ---------------------------------------------------------------- 6. the skinny GEMM's variants (issue 48)
VARIANT_ROWS = (2, 4, 8, 16, 32, 64)
# A few launches a variant, not a grid: the rule (fp8_skinny_launch) narrows block_n for a narrow N without
# split_k, and with it keeps block_n and splits K up to split_k for SKINNY_MIN_PROGRAMS programs. "classic":
# the earlier tables' launches and the best of the 12-launch sweep. (TMA loads and o_proj's rows quantized in
# the kernel were swept beside these on 2026-11-28, within 1-3% of split-K, and removed.)
VARIANT_SWEEP = {
    "classic": [SkinnyLaunch(*c) for c in ((16, 256, 2, 3), (64, 256, 4, 3), (32, 128, 4, 5),
                                           (64, 128, 4, 4))],
    "split": [SkinnyLaunch(*c, split_k=8) for c in ((64, 256, 4, 3), (64, 128, 4, 4), (64, 128, 4, 5),
                                                    (128, 256, 8, 3), (128, 128, 8, 4))],
}
CUBLAS = ("cublas swapped", "cublas")  # torch._scaled_mm on rows quantized beforehand, per-channel scales


def variant_rows(name: str, x: torch.Tensor, scheme) -> torch.Tensor | Fp8Rows:
    """x [M, K] bf16 as the model hands it to `name` (model_rows' choice)."""
    if name == "o":
        return x
    if scheme.activation == "group":
        return Fp8Rows(*triton_fp8.quantize_per_group(x, scheme.block[1]), x.dtype)
    return Fp8Rows(*triton_fp8.quantize_per_token(x), x.dtype)


def variant_calls(name: str, m: int, n: int, k: int, scheme, launches, cublas: bool) -> tuple[dict, object]:
    """{key: call(weight, scale)} at this shape: "today" (triton_fp8.linear as the tree's tables say), each
    launch the rule makes of `launches` (keyed by that launch), and with `cublas` (per-channel scales only)
    torch._scaled_mm on the rows quantized per token and padded to 16, weight as the left operand ("cublas
    swapped": [N, M] out) and as today ("cublas"); and the rows as the model hands them (for the floor)."""
    block = tuple(scheme.block) if scheme.weight == "block" else None
    x16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x = variant_rows(name, x16, scheme)
    calls = {"today": lambda w, s: triton_fp8.linear(x, w, s, scheme)}
    for launch in {rule_launch(m, n, k, cfg) for cfg in launches} - {None}:
        calls[launch] = lambda w, s, launch=launch: triton_fp8_skinny.linear(x, w, s, block, launch)
    if cublas and block is None:
        padded = -(-m // 16) * 16
        xq, xs = triton_fp8.quantize_per_token(F.pad(x16, (0, 0, 0, padded - m)))
        calls[CUBLAS[0]] = lambda w, s: torch._scaled_mm(w, xq.t(), scale_a=s.view(n, 1),
                                                         scale_b=xs.view(1, padded), out_dtype=torch.bfloat16)
        calls[CUBLAS[1]] = lambda w, s: torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.view(1, n),
                                                         out_dtype=torch.bfloat16)
    return calls, x


def as_rows(key, y: torch.Tensor, m: int) -> torch.Tensor:
    """A call's output as [M, N] (the swapped GEMM's is [N, padded M])."""
    return (y.t() if key == CUBLAS[0] else y)[:m].float()


def variant_times(name: str, m: int, n: int, k: int, scheme, q: list, rate: float, launches) -> dict:
    """us per call of each of variant_calls' keys, 32 weights a graph; "floor", and "err" {key: the largest
    difference from today's output, relative to its largest value}."""
    calls, x = variant_calls(name, m, n, k, scheme, launches, cublas=True)
    out = {"floor": floor_us(m, n, k, x, rate), "err": {}}
    want = as_rows("today", calls["today"](*q[0]), m)
    for key, call in calls.items():
        try:
            got = as_rows(key, call(*q[0]), m)
            out[key] = graph_us(lambda: [call(w, s) for w, s in q], 32)
        except Exception as e:  # noqa: BLE001 - a launch past the shared memory or registers is reported
            print(f"  {name} m={m} {key if isinstance(key, str) else tuple(key)}: {type(e).__name__}: "
                  f"{str(e)[:200]}", flush=True)
            continue
        out["err"][key] = float((got - want).abs().max() / want.abs().max())
    return out


def prewarm_task(task: tuple[str, int, str, str]) -> list[str]:
    """A worker's compiles (scripts run it in a spawned process): one call of each of variant_calls' keys at
    (scheme, rows, shape, variant), one weight; Triton's cache on disk then serves the timed run."""
    scheme_name, m, name, variant = task
    scheme = CHANNEL if scheme_name == "channel" else BLOCK
    n, k = SHAPES[name]
    try:
        (w, s), = fp8_weights(n, k, scheme, 1)
        calls, _ = variant_calls(name, m, n, k, scheme, VARIANT_SWEEP.get(variant, []), variant == "today")
    except Exception as e:  # noqa: BLE001 - the timed run compiles what is missing
        return [f"{task}: {type(e).__name__}: {str(e)[:100]}"]
    failed = []
    for key, call in calls.items():
        if (key in ("today", *CUBLAS)) == (variant == "today"):
            try:
                call(w, s)
            except Exception as e:  # noqa: BLE001 - the timed run reports it
                failed.append(f"{scheme_name} m={m} {name} {key}: {type(e).__name__}")
    torch.cuda.synchronize()
    return failed


def prewarm(workers: int) -> None:
    """Every compile of variants_table in `workers` spawned processes (a padded row count's compiles once:
    rows 2, 32, 64; and today's dispatch at 4 rows, the skinny table's where 2 rows take the multi-row
    GEMV), into Triton's cache on disk."""
    import concurrent.futures
    import multiprocessing
    import time
    start = time.perf_counter()
    tasks = [(scheme, m, name, variant) for m in (2, 4, 32, 64) for scheme in ("channel", "block")
             for name in ("gate_up", "down", "qkv", "o") for variant in ("today", *VARIANT_SWEEP)
             if variant == "today" or m != 4]  # 2 and 4 rows: one padded tile, the skinny launches' compiles
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        failed = [f for fails in pool.map(prewarm_task, tasks) for f in fails]
    print(f"prewarm: {len(tasks)} tasks in {workers} processes, {time.perf_counter() - start:.0f} s; "
          f"{len(failed)} calls failed {failed[:8]}", flush=True)


def variant_layer(m: int, cfg, shapes: dict, times: dict) -> float | None:
    """A layer's four GEMMs under one key (a table launch, or "today"/cuBLAS), or None where one failed."""
    keys = {name: cfg if isinstance(cfg, str) else rule_launch(m, n, k, cfg)
            for name, (n, k) in shapes.items()}
    if not all(key in times[name] for name, key in keys.items()):
        return None
    return sum(times[name][key] for name, key in keys.items())


def short(cfg) -> str:
    """A launch in a few characters: block_n/block_k/warps/stages, then k<split_k>."""
    if isinstance(cfg, str) or cfg is None:
        return str(cfg)
    split = f" k{cfg.split_k}" if cfg.split_k > 1 else ""
    return f"{cfg.block_n}/{cfg.block_k}/w{cfg.warps}/s{cfg.stages}{split}"


def variants_table(rate: float) -> None:
    shapes = {name: nk for name, nk in SHAPES.items() if name != "lm_head"}
    every = [cfg for launches in VARIANT_SWEEP.values() for cfg in launches]
    print("\n== decode rows: the skinny GEMM's variants (us per call; fraction of the bytes floor), 32 "
          "weights a graph; per shape the fastest launch of each variant (the rule's launch at that shape); "
          "a layer's four under one table entry ==", flush=True)
    summary, best = [], {"channel": {}, "block": {}}
    for scheme in (CHANNEL, BLOCK):
        weights = {name: fp8_weights(n, k, scheme, 32) for name, (n, k) in shapes.items()}
        for m in VARIANT_ROWS:
            times = {name: variant_times(name, m, n, k, scheme, weights[name], rate, every)
                     for name, (n, k) in shapes.items()}
            floor = sum(t["floor"] for t in times.values())
            print(f"{scheme.weight} m={m}: layer floor {floor:.1f} us", flush=True)
            for name, (n, k) in shapes.items():
                t = times[name]
                line = (f"    {name:7s} floor {t['floor']:6.1f} | today {t['today']:6.1f} "
                        f"({t['floor'] / t['today']:.2f})")
                for variant, launches in VARIANT_SWEEP.items():
                    keys = {rule_launch(m, n, k, cfg) for cfg in launches} & set(t)
                    if keys:
                        key = min(keys, key=t.get)
                        line += f" | {variant} {t[key]:6.1f} ({t['floor'] / t[key]:.2f}) {short(key)}"
                for key in CUBLAS:
                    if key in t:
                        line += f" | {key} {t[key]:6.1f} ({t['floor'] / t[key]:.2f})"
                err = max((e for key, e in t["err"].items() if key != "today"), default=0.0)
                print(line + f" | err {err:.1e}", flush=True)
            row = {"today": variant_layer(m, "today", shapes, times)}
            for variant, launches in VARIANT_SWEEP.items():
                layer = {cfg: us for cfg in launches
                         if (us := variant_layer(m, cfg, shapes, times)) is not None}
                row[variant] = min(layer.items(), key=lambda item: item[1]) if layer else None
            row["cublas swapped"] = variant_layer(m, CUBLAS[0], shapes, times)
            row["per-shape best"] = sum(min(v for key, v in t.items() if key not in ("floor", "err", *CUBLAS))
                                        for t in times.values())
            summary.append((scheme.weight, m, floor, row))
            fastest = min((row[variant] for variant in VARIANT_SWEEP if row[variant]),
                          key=lambda item: item[1], default=None)
            best[scheme.weight][m] = fastest[0] if fastest and fastest[1] < row["today"] else None
    print("\n== the layer (llama-3.1-8b's four GEMMs), us (fraction of the bytes floor) [the variant's table "
          "launch]; today: triton_fp8.linear as the tree's tables say; cublas swapped: _scaled_mm with the "
          "weight on the left, rows quantized beforehand (o's quant not counted); per-shape best: each shape "
          "its fastest key ==")
    cols = ["today", *VARIANT_SWEEP, "cublas swapped", "per-shape best"]
    print("| scales | rows | floor | " + " | ".join(cols) + " |")
    print("|" + "---|" * (len(cols) + 3))
    for weight, m, floor, row in summary:
        cells = []
        for col in cols:
            value = row[col]
            if value is None:
                cells.append("-")
            elif isinstance(value, tuple):
                cells.append(f"{value[1]:.1f} ({floor / value[1]:.2f}) [{short(value[0])}]")
            else:
                cells.append(f"{value:.1f} ({floor / value:.2f})")
        print(f"| {weight} | {m} | {floor:.1f} | " + " | ".join(cells) + " |")
    print("\nlaunch_rules, one table a weight layout: each row count's fastest launch of every variant where "
          "it beat today's dispatch (None: today's). NOTE: 2 rows go to the multi-row GEMV first "
          "(FP8_GEMV_ROWS_LAUNCHES); an entry at 2 rows counts only where that table drops them")
    print(rule_line(best["channel"]), flush=True)
    print(rule_line(best["block"], "FP8_SKINNY_BLOCK_LAUNCHES"), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="no config sweeps")
    p.add_argument("--skinny", action="store_true", help="only the decode rows' table (section 4)")
    p.add_argument("--rows_gemv", action="store_true", help="only the multi-row GEMV's sweep (section 5)")
    p.add_argument("--skinny_variants", action="store_true",
                   help="only the skinny GEMM's variants beside today's and cuBLAS (section 6)")
    p.add_argument("--prewarm", type=int, default=12, metavar="PROCESSES",
                   help="--skinny_variants: compile in this many processes first (0: none)")
    p.add_argument("--prewarm_only", action="store_true", help="--skinny_variants' compiles alone")
    args = p.parse_args()
    torch.manual_seed(0)
    if args.skinny_variants and args.prewarm:
        prewarm(args.prewarm)
    if args.prewarm_only:
        return
    copy = bench_attention.copy_bandwidth(2 << 30)
    print(f"{torch.cuda.get_device_name()}: copy {copy['GB_per_s']:.0f} GB/s; FP8 GEMV config "
          f"by shape (gemv_config); bf16 GEMV "
          f"{triton_gemv.BLOCK_N}/{triton_gemv.BLOCK_K}/w{triton_gemv.WARPS}; GEMM {triton_fp8.GEMM_LARGE}")
    if args.rows_gemv:
        gemv_rows_table(copy["GB_per_s"] * 1e9, args.quick)
        return
    if args.skinny_variants:
        variants_table(copy["GB_per_s"] * 1e9)
        return
    if not args.skinny:
        gemv_table(copy["GB_per_s"] * 1e9, not args.quick)
        gemm_table(not args.quick)
        quant_table()
    skinny_table(copy["GB_per_s"] * 1e9, not args.quick)


if __name__ == "__main__":
    main()
