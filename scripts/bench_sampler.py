"""Sampler time and transient memory on this GPU: the full-sort reference (old) and sample() (new).

    PYTHONPATH=. python3 scripts/bench_sampler.py [--vocab 128256] [--rows 1,64,256,1024] [--iters 50]
        [--split_rows 1,8,64,256] [--json out.json]

On CUDA sample() is one Triton kernel per batch (autoprofile.kernels.triton_sample) whatever the case; the
torch paths (CPU, no triton) prefilter and fall back to a sort. Logits are bf16 [rows, vocab]. "peaked" =
randn * 5 (at temperature 0.8 and top_p 0.9 a nucleus holds a few to a few hundred tokens, like a trained
model's; `wider` counts the rows whose nucleus outgrows the torch path's prefilter) and "flat" = randn
(every nucleus wider than the prefilter: the torch path's sort fallback, its worst case).
Times: CUDA events around each call after 10 warm-up calls, median of --iters (the logits stay in L2 at small
rows). Memory: peak allocated above what was allocated before one call, per row, next to the declared bound
sampler_workspace_bytes(rows) / rows. Ratios old/new come from the same run.
Side by side (--split_rows): the one-program kernel (triton_sample) and the split one (triton_sample_split)
called directly on the same logits and seeds, greedy / top-p 0.9 / top-k 50 + top-p 0.9, with torch's argmax
and the rate each reads the logits at (GB/s: rows x vocab x 2 bytes / time), and the launch rule's table line
(kernels.launch_rules.SAMPLE_SPLIT_*: set SAMPLE_SPLIT_MAX_ROWS to the most rows where split wins).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from cuda_timing import cuda_median_ms

from autoprofile.engine import sampling
from autoprofile.kernels import launch_rules
from autoprofile.engine.sampling import (
    PREFILTER, STRESS, SamplingBatch, SamplingParams, reference_sample, sample, sampler_workspace_bytes)

MIB = 2**20
CASES = {  # name: (logits scale, params)
    "greedy": (5.0, SamplingParams()),
    "top_k50": (5.0, SamplingParams(temperature=0.8, top_k=50)),
    "top_p0.9": (5.0, SamplingParams(temperature=0.8, top_p=0.9)),
    "top_k50_top_p0.9": (5.0, SamplingParams(temperature=0.8, top_k=50, top_p=0.9)),
    "temperature": (5.0, SamplingParams(temperature=0.8)),
    "top_p0.9_flat": (1.0, SamplingParams(temperature=0.8, top_p=0.9)),
    "stress": (1.0, STRESS),
}
TARGETS_MS = {("greedy", 256): 0.1, ("top_p0.9", 256): 1.0}  # issue 9, H100, vocab 128256
SPLIT_CASES = ("greedy", "top_p0.9", "top_k50_top_p0.9")
SPLIT_TARGETS_MS = {("top_p0.9", 1): 0.08, ("top_k50_top_p0.9", 1): 0.08, ("top_p0.9", 256): 0.3,
                    ("top_k50_top_p0.9", 256): 0.3}  # issue 48, H100, vocab 128256


def peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def wider_rows(logits: torch.Tensor, batch: SamplingBatch) -> int:
    """Rows whose nucleus is wider than the prefilter (they take the sort fallback)."""
    plan = sampling._plan(batch.params, logits.shape[-1])
    if not plan.nucleus:
        return 0
    step = sampling.CHUNK_ROWS
    wide = [sampling._prefilter(logits[lo:lo + step], batch.rows(lo, lo + step), plan.prefilter, True)[2]
            for lo in range(0, logits.shape[0], step)]
    return int(torch.cat(wide).sum())


def bench_case(rows: int, vocab: int, scale: float, params: SamplingParams, iters: int) -> dict:
    gen = torch.Generator("cuda").manual_seed(rows)
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * scale).to(torch.bfloat16)
    batch = SamplingBatch.from_params([params] * rows, torch.device("cuda"))
    gen = torch.Generator("cuda").manual_seed(0)

    def old():
        return reference_sample(logits, batch, gen)

    def new():
        return sample(logits, batch, gen)

    r = {"rows": rows, "vocab": vocab, "old_ms": cuda_median_ms(old, iters),
         "new_ms": cuda_median_ms(new, iters),
         "old_peak_bytes": peak_bytes(old), "new_peak_bytes": peak_bytes(new),
         "declared_bytes": sampler_workspace_bytes(rows, vocab, 2), "wider_rows": wider_rows(logits, batch)}
    r["speedup"] = r["old_ms"] / r["new_ms"]
    return r


def run(vocab: int, rows_list: list[int], iters: int) -> list[dict]:
    results = []
    for rows in rows_list:
        for name, (scale, params) in CASES.items():
            results.append({"case": name, **bench_case(rows, vocab, scale, params, iters)})
            torch.cuda.empty_cache()
    return results


def table(results: list[dict]) -> str:
    head = (f"{'rows':>5} {'case':<17} {'old ms':>8} {'new ms':>8} {'old/new':>8} {'old MiB/row':>11} "
            f"{'new MiB/row':>11} {'decl MiB/row':>12} {'wider':>6}")
    lines = [head, "-" * len(head)]
    for r in results:
        n = r["rows"]
        lines.append(f"{n:>5} {r['case']:<17} {r['old_ms']:>8.3f} {r['new_ms']:>8.3f} {r['speedup']:>8.1f} "
                     f"{r['old_peak_bytes'] / n / MIB:>11.3f} {r['new_peak_bytes'] / n / MIB:>11.3f} "
                     f"{r['declared_bytes'] / n / MIB:>12.3f} {r['wider_rows']:>6}")
    return "\n".join(lines)


def side_by_side(vocab: int, rows_list: list[int], iters: int) -> list[dict]:
    """The one-program and the split kernel on the same logits and seeds (and torch's argmax)."""
    from autoprofile.kernels.triton_sample import sample_batch
    from autoprofile.kernels.triton_sample_split import sample_batch_split
    results = []
    for rows in rows_list:
        gen = torch.Generator("cuda").manual_seed(rows)
        logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 5.0).to(torch.bfloat16)
        seeds = torch.randint(sampling.SEED_HIGH, (rows,), device="cuda", generator=gen)
        for name in SPLIT_CASES:
            b = SamplingBatch.from_params([CASES[name][1]] * rows, torch.device("cuda"))
            args = (logits, b.temperatures, b.top_ps, b.top_ks, seeds)
            one, split = sample_batch(*args), sample_batch_split(*args)
            greedy = name == "greedy"
            r = {"case": name, "rows": rows, "vocab": vocab, "same_tokens": bool(torch.equal(one, split)),
                 "one_ms": cuda_median_ms(lambda: sample_batch(*args), iters),
                 "split_ms": cuda_median_ms(lambda: sample_batch_split(*args), iters),
                 "argmax_ms": cuda_median_ms(lambda: logits.argmax(dim=-1), iters) if greedy else None,
                 "rule_split": launch_rules.sample_split(rows, vocab)}
            results.append(r)
    return results


def side_table(results: list[dict]) -> str:
    head = (f"{'rows':>5} {'case':<17} {'one ms':>8} {'split ms':>8} {'argmax ms':>9} {'one GB/s':>8} "
            f"{'split GB/s':>10} {'same':>5} {'rule':>6}")
    lines = [launch_rules.sample_split_rule_line(), head, "-" * len(head)]
    for r in results:
        mb = r["rows"] * r["vocab"] * 2 / 1e6  # GB/s = MB / ms
        argmax = "" if r["argmax_ms"] is None else f"{r['argmax_ms']:.3f}"
        lines.append(f"{r['rows']:>5} {r['case']:<17} {r['one_ms']:>8.3f} {r['split_ms']:>8.3f} {argmax:>9} "
                     f"{mb / r['one_ms']:>8.0f} {mb / r['split_ms']:>10.0f} {str(r['same_tokens']):>5} "
                     f"{'split' if r['rule_split'] else 'one':>6}")
    for (case, rows), target in SPLIT_TARGETS_MS.items():
        got = [r["split_ms"] for r in results if r["case"] == case and r["rows"] == rows]
        if got:
            verdict = "OK" if got[0] <= target else "MISSED"
            lines.append(f"target split {case} at {rows} rows <= {target} ms: {got[0]:.3f} ms {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--rows", default="1,64,256,1024")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--split_rows", default="1,8,64,256", help="the side-by-side's rows ('': none)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    results = run(args.vocab, [int(r) for r in args.rows.split(",")], args.iters)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, vocab {args.vocab}, bf16 logits, "
          f"prefilter {PREFILTER}, chunk {sampling.CHUNK_ROWS} rows, sort {sampling.SORT_ROWS} rows at once")
    print(table(results))
    over = [r for r in results if r["new_peak_bytes"] > r["declared_bytes"]]
    for (case, rows), target in TARGETS_MS.items():
        got = [r["new_ms"] for r in results if r["case"] == case and r["rows"] == rows]
        if got:
            verdict = "OK" if got[0] <= target else "MISSED"
            print(f"target {case} at {rows} rows <= {target} ms: {got[0]:.3f} ms {verdict}")
    print(f"measured peak above the declared workspace: {len(over)} of {len(results)}")
    split = side_by_side(args.vocab, [int(r) for r in args.split_rows.split(",") if r], args.iters)
    if split:
        print(side_table(split))
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results,
           "side_by_side": split}
    print(json.dumps(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
