"""Where a served step's GPU time goes, from a trace the server wrote (serve --profile_dir, POST
/start_profile and /stop_profile, or bench_serving --profile).

    python3 scripts/trace_steps.py traces/engine-<stamp>.json.gz [--long_ms 50]

Each engine step is a "gpu_user_annotation" range named "engine step N" in torch.profiler's Chrome trace:
the span of the GPU work that step launched. Inside it, every kernel, memset and copy is put in a group by
its name (GROUPS: the GEMMs, the two attentions, the elementwise passes, ...); what the span holds beyond the
union of that work is the GPU idle inside the step, named by the groups of the work on each side of it.
Steps whose span is at least --long_ms are "long" (prefill and mixed steps at serving's sizes), the rest
"short" (decode); each kind gets a table: the mean span, the idle, each group's mean time and its share, and
the TOP_GAPS places of most idle (a step whose launches are late shows its GPU waiting there). A profiled
run is slower than a plain one (torch.profiler records every op): the shares are what it is for, not the
totals.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
from dataclasses import dataclass, field

GROUPS = (  # first match wins; names as CUDA, cuBLAS and our Triton kernels spell them
    ("gemm", r"nvjet|gemm|cutlass|xmma|_gemv|splitk|matmul"),
    ("attn_decode", r"paged_attn|decode_attn|_decode"),
    ("attn_prefill", r"prefill|flash|fmha"),
    ("norm", r"rms|norm"),
    ("act", r"silu|gelu|act_and_mul|swiglu"),
    ("rope_kv", r"rope|rotary|kv_store|store_kv|reshape_and_cache"),
    ("sample", r"sampl|argmax|topk|top_p|softmax|bitmask"),
    ("copy", r"memcpy|memset|copy|fill"),
)
WORK = ("kernel", "gpu_memset", "gpu_memcpy")
TOP_GAPS = 3  # the places of most idle GPU a table names


def group_of(name: str) -> str:
    low = name.lower()
    for group, pattern in GROUPS:
        if re.search(pattern, low):
            return group
    return "other"


@dataclass
class Step:
    name: str
    start: float  # us
    span: float  # us
    groups: dict[str, float] = field(default_factory=dict)  # us of work a group
    busy: float = 0.0  # us: the union of the work's intervals inside the span
    # us of idle GPU by where it falls: (the group of the work before it, of the work after it; "start" and
    # "end" at the span's edges); a host-bound step's launches show here
    gaps: dict[tuple[str, str], float] = field(default_factory=dict)

    @property
    def idle(self) -> float:
        return max(self.span - self.busy, 0.0)


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def steps_of(events: list[dict]) -> list[Step]:
    """One Step a "engine step N" GPU range, with the work that ran inside it."""
    steps = sorted((Step(e["name"], e["ts"], e["dur"]) for e in events
                    if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("engine step")),
                   key=lambda s: s.start)
    work = sorted((e for e in events if e.get("cat") in WORK and e.get("ph") == "X"), key=lambda e: e["ts"])
    i = 0
    for step in steps:
        end = step.start + step.span
        while i < len(work) and work[i]["ts"] < step.start:
            i += 1
        inside = []
        j = i
        done, before = step.start, "start"  # the latest end so far, and whose
        while j < len(work) and work[j]["ts"] < end:
            e = work[j]
            a, b = e["ts"], min(e["ts"] + e["dur"], end)
            inside.append((a, b))
            g = "copy" if e["cat"] != "kernel" else group_of(e["name"])
            step.groups[g] = step.groups.get(g, 0.0) + (b - a)
            if a > done:
                step.gaps[before, g] = step.gaps.get((before, g), 0.0) + (a - done)
            if b > done:
                done, before = b, g
            j += 1
        if end > done:
            step.gaps[before, "end"] = step.gaps.get((before, "end"), 0.0) + (end - done)
        step.busy = union_length(inside)
    return steps


def table(steps: list[Step], title: str) -> str:
    if not steps:
        return f"{title}: none\n"
    span = statistics.mean(s.span for s in steps) / 1e3
    idle = statistics.mean(s.idle for s in steps) / 1e3
    names = sorted({g for s in steps for g in s.groups},
                   key=lambda g: -sum(s.groups.get(g, 0.0) for s in steps))
    lines = [f"{title}: {len(steps)} steps, span {span:.2f} ms (idle inside {idle:.2f} ms, "
             f"{idle / span:.1%})", f"  {'group':<14}{'ms a step':>10}{'share':>8}"]
    for g in names:
        ms = sum(s.groups.get(g, 0.0) for s in steps) / len(steps) / 1e3
        lines.append(f"  {g:<14}{ms:>10.2f}{ms / span:>8.1%}")
    gaps: dict[tuple[str, str], float] = {}
    for s in steps:
        for pair, us in s.gaps.items():
            gaps[pair] = gaps.get(pair, 0.0) + us
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:TOP_GAPS]
    if worst:
        lines.append("  idle most between: " + "; ".join(
            f"{a} -> {b} {us / len(steps) / 1e3:.2f} ms" for (a, b), us in worst))
    return "\n".join(lines) + "\n"


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="the Chrome trace a /stop_profile wrote (.json or .json.gz)")
    p.add_argument("--long_ms", type=float, default=50.0,
                   help="steps whose GPU span is at least this long are 'long' (prefill, mixed) (default 50)")
    args = p.parse_args(argv)
    if args.long_ms <= 0:
        p.error(f"--long_ms must be > 0, got {args.long_ms:g} (e.g. 50)")
    steps = steps_of(load(args.trace))
    if not steps:
        raise SystemExit(f"{args.trace}: no 'engine step N' GPU ranges (a trace of a GPU server's steps?)")
    long_steps = [s for s in steps if s.span >= args.long_ms * 1e3]
    short = [s for s in steps if s.span < args.long_ms * 1e3]
    print(table(long_steps, f"long steps (>= {args.long_ms:g} ms)"), end="")
    print(table(short, "short steps"), end="")


if __name__ == "__main__":
    main()
