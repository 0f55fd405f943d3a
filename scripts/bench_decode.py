"""A decode step against the hardware floor, side by side in one run (issue 9).

    PYTHONPATH=. python3 scripts/bench_decode.py [--backend aiter_triton] [--json out.json]

llama-3.1-8b with random weights (no download), built through ModelRunner as serving builds it (CUDA
graphs per batch x max_seq_len bucket); each decode step is a real Step through `runner.execute`
(graph replay + sampling + the tokens back on the host), timed on the host over --iters steps.
  floor      = (weights + the batch's K/V bytes + a hybrid model's state, read and written) / the
               device-to-device copy bandwidth of this run (an MoE model's weights: the dense ones and the
               experts a batch of that many rows reaches)
  step       : batch 1 and 256 at --ctx tokens, greedy (targets: >= 0.75 and >= 0.6 of the floor);
               "overlapped" is the step as serving's overlapped scheduler runs it (each launched before
               the one before is read back: the host's share hidden where the GPU's is longer); "replay" is
               the decode graph's replay alone (CUDA events)
  context    : the same steps built with --max_req_total_len 131072 and 4096 (target: within 1.15x)
  sampling   : sample() alone on [256, vocab] bf16 logits, greedy and top-p 0.9 (<= 0.1 ms, <= 1 ms)
  prefill    : attention alone, one causal request of --prefill_tokens, each backend vs torch SDPA
               (target >= 0.8x; amd-aiter's Triton kernel with autoprofile's PREFILL_CONFIG)
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention  # noqa: E402 - the copy-bandwidth and prefill timers
from cuda_timing import cuda_median_ms  # noqa: E402

from autoprofile.config import ServerConfig, validate  # noqa: E402
from autoprofile.engine import stress  # noqa: E402
from autoprofile.engine.runner import ModelRunner  # noqa: E402
from autoprofile.engine.sampling import (GREEDY, SamplingBatch, SamplingParams,  # noqa: E402
                                         make_generator, sample)
from autoprofile.engine.scheduler import Step  # noqa: E402
from autoprofile.kernels import launch_rules  # noqa: E402

TOP_P = SamplingParams(temperature=0.8, top_p=0.9)
TARGETS = {"floor_b1": 0.75, "floor_b256": 0.6, "context_ratio": 1.15, "greedy_ms": 0.1, "top_p_ms": 1.0,
           "prefill_vs_sdpa": 0.8}


def decode_step(runner: ModelRunner, b: int, ctx: int, params: SamplingParams) -> Step:
    """b rows whose next token sits at position ctx - 1 (ctx tokens of K/V read), on distinct pages."""
    step = stress.corner_step(runner.envelope, False, [(ctx - 1, 1)] * b, runner.kv.num_pages - 1,
                              runner.model_config.vocab_size, seed=b)
    step.rows = [dataclasses.replace(r, params=params) for r in step.rows]
    return step


def time_steps(runner: ModelRunner, step: Step, iters: int) -> float:
    """Median host wall time of runner.execute(step) (each returns the tokens: a full serving step)."""
    runner.execute(step)
    step.page_writes = []  # serving writes a request's pages once, when it gets them
    for _ in range(3):
        runner.execute(step)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        runner.execute(step)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def time_overlapped(runner: ModelRunner, step: Step, iters: int) -> float:
    """Host wall time a step when each is launched before the one before is read back, as the overlapped
    scheduler (serving's default) runs them: runner.launch, then the previous step's tokens. The host's
    input preparation, sampling launch and read-back overlap the GPU's step; what is left is the longer of
    the two."""
    inflight = runner.launch(step)
    for _ in range(3):
        inflight, done = runner.launch(step), inflight
        done.result()
    t = time.perf_counter()
    for _ in range(iters):
        inflight, done = runner.launch(step), inflight
        done.result()
    inflight.result()
    return (time.perf_counter() - t) / iters * 1e3


def step_weight_bytes(runner: ModelRunner, batch: int) -> float:
    """The weight bytes a decode step of `batch` rows reads: every dense parameter, and of each MoE layer's
    experts only those its rows reach when the router spreads them (ModelConfig.unreached_expert_share)."""
    from autoprofile.layers.moe import FusedMoE
    total = sum(p.nbytes for p in runner.model.parameters())
    experts = sum(m.gate_up_proj.nbytes + m.down_proj.nbytes for m in runner.model.modules()
                  if isinstance(m, FusedMoE))
    return total - experts * runner.model_config.unreached_expert_share(batch)


GIB = 1 << 30


def fit_batches(batches: list[int], ctx: int, page_size: int, cell_bytes: int, free_bytes: int,
                weight_bytes: int, headroom_bytes: int) -> tuple[list[int], int, str | None]:
    """(the batches whose rows fit the card, the KV tokens to build, a note when some do not fit). Each of b
    rows holds ctx tokens and a page more; the KV gets what the free memory leaves after the weights and the
    headroom (graphs, activations, scratch). Raises SystemExit naming the flags when not even the smallest fits
    (an MoE model's 57.5 GB of bf16 weights leave an 80 GB card about 20 GB)."""
    def tokens(b: int) -> int:
        return b * (ctx + page_size) + 4 * page_size

    room = max(free_bytes - weight_bytes - headroom_bytes, 0) // cell_bytes
    fits = [b for b in batches if tokens(b) <= room]
    if not fits:
        raise SystemExit(f"bench_decode: {free_bytes / GIB:.1f} GiB free - {weight_bytes / GIB:.1f} GiB of weights "
                         f"- {headroom_bytes / GIB:.1f} GiB headroom leaves KV for {room} tokens; batch "
                         f"{min(batches)} at --ctx {ctx} needs {tokens(min(batches))}: lower --ctx (e.g. "
                         f"--ctx {max(room // max(min(batches), 1) - 2 * page_size, 0)}) or --kv_headroom_gib")
    note = None
    if len(fits) < len(batches):
        largest = max((room - 4 * page_size) // (ctx + page_size), 0)
        note = (f"KV capped at {room} tokens ({free_bytes / GIB:.1f} GiB free, {weight_bytes / GIB:.1f} GiB of "
                f"weights, {headroom_bytes / GIB:.1f} GiB headroom): skipping batches "
                f"{[b for b in batches if b not in fits]} at --ctx {ctx} (the largest that fits: {largest})")
    return fits, tokens(max(fits)), note


def fit_to_card(args: argparse.Namespace) -> None:
    """args.batches cut to what this card holds beside the model's weights (plan.weight_bytes), said on stderr."""
    from autoprofile import budget, plan
    from autoprofile.model_config import load_model_config

    mc = load_model_config(args.model)
    cell = budget.cell_bytes_for(mc, 1 if args.kv_cache_dtype == "fp8_e4m3" else 2)
    free, _ = torch.cuda.mem_get_info()
    args.batches, _, note = fit_batches(args.batches, args.ctx, 16, cell, free, plan.weight_bytes(mc, 2, 1),
                                        int(args.kv_headroom_gib * GIB))
    if note:
        print(note, file=sys.stderr)
    args.fit_note = note


def build(args: argparse.Namespace, context: int) -> ModelRunner:
    cfg = validate(ServerConfig(model=args.model, dtype="bfloat16", attention_backend=args.backend,
                                max_req_total_len=context, graph_max_batch_size=max(args.batches),
                                kv_cache_dtype=args.kv_cache_dtype, deterministic=args.deterministic,
                                report_dir=None))
    runner = ModelRunner(cfg)
    if args.cublas:  # the linear layers through F.linear (cuBLAS) instead of the backend's GEMM
        runner.tp.matmul = None
    if args.split_decode_rows is not None:  # bf16 pages' split decode up to N rows (FP8 pages always)
        runner.backend.split_decode_rows = args.split_decode_rows
    if args.cublas_router:  # an fp32 router's logits as before the router GEMV: x.float() through cuBLAS
        runner.tp.router_matmul = None
    if args.moe_gemv_pairs is not None:  # the experts as GEMVs up to this many pairs (kernels.triton_moe_gemv)
        launch_rules.MOE_GEMV_MAX_PAIRS = args.moe_gemv_pairs
    if args.fp8_gemv_rows is not None:  # the multi-row FP8 GEMV's rows (kernels.triton_fp8_rows; 0: none)
        rows, launch = args.fp8_gemv_rows, launch_rules.FP8_GEMV_ROWS_LAUNCHES[0][1]
        table = ((rows, launch),) if rows else ()
        launch_rules.FP8_GEMV_ROWS_LAUNCHES = launch_rules.FP8_GEMV_ROWS_BLOCK_LAUNCHES = table
    if args.skinny_min_programs is not None:  # the skinny FP8 GEMM's split/narrowing target (a card's own)
        launch_rules.SKINNY_MIN_PROGRAMS = args.skinny_min_programs
    if args.moe_small_config:  # scripts/tune_moe.py's candidate for the experts' steps of few tokens
        from autoprofile.kernels import triton_moe
        table = triton_moe.FP8_CONFIGS if runner.model_config.quant else triton_moe.CONFIGS
        table[launch_rules.MOE_SMALL_BLOCK_M] = {"BLOCK_SIZE_M": launch_rules.MOE_SMALL_BLOCK_M,
                                                 **args.moe_small_config}
    tokens = max(args.batches) * (args.ctx + cfg.page_size) + 4 * cfg.page_size
    t = time.perf_counter()
    runner.build(tokens)
    print(f"context {context}: built {len(runner.graphs.graphs) if runner.graphs else 0} graphs in "
          f"{time.perf_counter() - t:.1f} s", file=sys.stderr)
    return runner


def run(args: argparse.Namespace) -> dict:
    copy = bench_attention.copy_bandwidth(args.copy_bytes)
    bw = copy["GB_per_s"] * 1e9
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "backend": args.backend,
                 "kv_cache_dtype": args.kv_cache_dtype, "split_decode_rows": args.split_decode_rows,
                 "copy_GB_per_s": copy["GB_per_s"], "ctx": args.ctx, "steps": {}, "targets": TARGETS}
    for context in args.contexts:
        runner = build(args, context)
        # K+V bytes per token, all layers
        cell = runner.kv.nbytes // (runner.kv.num_pages * runner.cfg.page_size)
        for b in args.batches:
            for name, params in (("greedy", GREEDY), ("top_p", TOP_P)):
                if name == "top_p" and context != args.contexts[0]:
                    continue
                step = decode_step(runner, b, args.ctx, params)
                ms = time_steps(runner, step, args.iters)
                overlapped = time_overlapped(runner, step, args.iters)
                # a hybrid model's rows also read and write their state (conv window, delta-rule matrices)
                state = 2 * b * runner.model_config.state_bytes(1, 2) if runner.state is not None else 0
                floor = (step_weight_bytes(runner, b) + b * args.ctx * cell + state) / bw * 1e3
                out["steps"][f"{context}/b{b}/{name}"] = {"context": context, "batch": b, "sampling": name,
                                                          "ms": ms, "floor_ms": floor, "of_floor": floor / ms,
                                                          "overlapped_ms": overlapped,
                                                          "overlapped_of_floor": floor / overlapped}
                if name == "greedy" and runner.graphs is not None:  # the GPU's share: the replay alone
                    graph = runner.graphs.graphs[runner.graphs.pick(b, args.ctx)]
                    replay = cuda_median_ms(graph.replay, args.iters)
                    out["steps"][f"{context}/b{b}/{name}"].update(replay_ms=replay,
                                                                  replay_of_floor=floor / replay)
        if context == args.contexts[0]:
            logits = torch.randn(max(args.batches), runner.model_config.vocab_size, device="cuda",
                                 dtype=torch.bfloat16) * 5
            gen = make_generator(0, runner.device)
            for name, params in (("greedy", GREEDY), ("top_p", TOP_P)):
                batch = SamplingBatch.from_params([params] * logits.shape[0], runner.device)
                out[f"sample_{name}_ms"] = cuda_median_ms(lambda: sample(logits, batch, gen), args.iters)
            del logits
        runner.teardown()
        runner = None  # the next build needs the weights' memory back
        gc.collect()
        torch.cuda.empty_cache()
    hq, hkv, d, t = 32, 8, 128, args.prefill_tokens
    psets = bench_attention.prefill_inputs(t, hq, hkv, d, 2)
    sdpa = bench_attention.bench_sdpa_prefill(psets, hq, hkv)
    out["prefill"] = {"tokens": t, "sdpa_ms": sdpa}
    for name in bench_attention.available(["torch", args.backend]):
        be = bench_attention.BACKENDS[name](hq, hkv, d, 16, torch.bfloat16, torch.device("cuda"))
        ms = bench_attention.bench_prefill(be, psets)
        out["prefill"][name] = {"ms": ms, "vs_sdpa": sdpa / ms}
    return out


def table(r: dict) -> str:
    first, last = r["ctx_list"][0], r["ctx_list"][-1]
    lines = [f"{r['device']}  torch {r['torch']}  backend {r['backend']}  copy {r['copy_GB_per_s']:.0f} GB/s",
             f"decode step at {r['ctx']} tokens of context per row (runner.execute: graph replay + sampling)",
             f"{'max_req_total_len':>18}{'batch':>7}{'sampling':>9}{'step ms':>10}{'floor ms':>10}"
             f"{'of floor':>10}{'overlapped':>12}{'of floor':>10}"
             f"{'replay ms':>11}{'of floor':>10}"]
    for s in r["steps"].values():
        replay = f"{s['replay_ms']:>11.2f}{s['replay_of_floor']:>10.2f}" if "replay_ms" in s else ""
        lines.append(f"{s['context']:>18}{s['batch']:>7}{s['sampling']:>9}{s['ms']:>10.2f}"
                     f"{s['floor_ms']:>10.2f}"
                     f"{s['of_floor']:>10.2f}{s['overlapped_ms']:>12.2f}{s['overlapped_of_floor']:>10.2f}"
                     f"{replay}")
    for key, ratio in r["context_ratio"].items():
        lines.append(f"context {first} / {last}, batch {key}: {ratio:.2f}x  (target <= "
                     f"{TARGETS['context_ratio']})")
    lines.append(f"sample() on [{r['batches'][-1]}, vocab]: greedy {r['sample_greedy_ms']:.3f} ms "
                 f"(target <= {TARGETS['greedy_ms']}), top-p {r['sample_top_p_ms']:.3f} ms "
                 f"(target <= {TARGETS['top_p_ms']})")
    p = r["prefill"]
    lines.append(f"prefill attention T={p['tokens']} causal: torch SDPA {p['sdpa_ms']:.2f} ms; " + ", ".join(
        f"{k} {v['ms']:.2f} ms ({v['vs_sdpa']:.2f}x SDPA)" for k, v in p.items() if isinstance(v, dict)))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--backend", default="aiter_triton")
    p.add_argument("--kv_cache_dtype", default="auto",
                   help="auto or fp8_e4m3 (the floor reads the cache's bytes)")
    p.add_argument("--deterministic", action="store_true", help="the batch-invariant kernels")
    p.add_argument("--cublas", action="store_true",
                   help="linear layers through cuBLAS, not the backend's GEMM (aiter_triton: the one-row GEMV)")
    p.add_argument("--split_decode_rows", type=int, default=None,
                   help="aiter_triton: bf16 pages decode through our split kernel (kernels.triton_decode) at "
                        "up to N rows, AITER's v1/v2 past them (0: AITER's at every row count, 100000: ours "
                        "at every one; default: the backend's launch_rules.SPLIT_DECODE_ROWS); FP8 pages "
                        "always take ours")
    p.add_argument("--cublas_router", action="store_true",
                   help="an fp32 router (DeepSeek's) through x.float() and cuBLAS instead of the backend's "
                        "GEMV")
    p.add_argument("--moe_gemv_pairs", type=int, default=None,
                   help="launch_rules.MOE_GEMV_MAX_PAIRS for this run: the experts as GEMVs up to this many "
                        "(token, slot) pairs (kernels.triton_moe_gemv)")
    p.add_argument("--skinny_min_programs", type=int, default=None,
                   help="launch_rules.SKINNY_MIN_PROGRAMS for this run: the programs the skinny FP8 GEMM's "
                        "K splits (or narrower column tiles) aim at")
    p.add_argument("--fp8_gemv_rows", type=int, default=None,
                   help="FP8 weights: the multi-row GEMV (kernels.triton_fp8_rows) at 2-N rows, the skinny "
                        "GEMM past them (0: the skinny GEMM from 2 rows; default: launch_rules' tables)")
    p.add_argument("--moe_small_config", type=json.loads, default=None,
                   help='the experts\' launch config for steps of few tokens (bf16\'s, or FP8\'s on an FP8 '
                        'model) instead of kernels.triton_moe\'s, '
                        'e.g. \'{"BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4, '
                        '"num_stages": 3}\' (scripts/tune_moe.py)')
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 256])
    p.add_argument("--ctx", type=int, default=1024, help="tokens of context per row")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[131072, 4096],
                   help="--max_req_total_len of each build (first: the serving default)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--prefill_tokens", type=int, default=8192)
    p.add_argument("--copy_bytes", type=int, default=2 << 30)
    p.add_argument("--kv_headroom_gib", type=float, default=8.0,
                   help="memory kept beside the weights and the KV for graphs, activations and scratch; batches "
                        "whose KV does not fit the rest are skipped (said on stderr and in the JSON)")
    p.add_argument("--json", type=Path, default=None, help="write the JSON here (else it follows the table)")
    args = p.parse_args(argv)
    if args.split_decode_rows is not None and args.backend != "aiter_triton":
        p.error(f"--split_decode_rows is aiter_triton's, not --backend {args.backend}; "
                "try --backend aiter_triton")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_decode needs a CUDA GPU")
    fit_to_card(args)
    with torch.inference_mode():
        r = run(args)
    r["skipped"] = args.fit_note
    r["ctx_list"], r["batches"] = args.contexts, args.batches
    first, last = args.contexts[0], args.contexts[-1]
    ms = {key: step["ms"] for key, step in r["steps"].items()}
    r["context_ratio"] = {b: ms[f"{first}/b{b}/greedy"] / ms[f"{last}/b{b}/greedy"]
                          for b in args.batches}
    print(table(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    else:
        print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
