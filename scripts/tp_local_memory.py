"""Local memory and non-torch memory under --tp N (issue 32, item 5): where does a rank's CUDA stack limit
(1,744 B at --tp 2 against 1,024 B at --tp 1) and its non-torch memory (2.49 against 1.04 GiB) come from?

Each rank (fresh processes, as `autoprofile serve --tp N` starts them) reads, at every stage, its per-thread
stack limit (cuCtxGetLimit, memory.stack_limit_bytes), what the driver reserves for it, its non-torch memory
(total - free - torch reserved) and torch's reserved bytes: after its CUDA context and NCCL communicator
(eager init), after a first small and a first large all-reduce and an all-gather on the data group (NCCL's
kernels, before any kernel of the model), at each checkpoint of the real auto-profile (load, probe, measure,
rebuild, validate), and after serving a few requests through the step broadcast. Then it lists every Triton
kernel compiled in the process (local memory from the driver, stack frame from cuobjdump -res-usage on its
cubin), and rank 0 reads the stack frames of NCCL's own kernels from libnccl (cuobjdump -res-usage), with
NCCL's version and every NCCL_* setting (buffer sizes, channels: what NCCL allocates outside torch).

    NCCL_NVLS_ENABLE=0 python3 scripts/tp_local_memory.py --model deepseek-v2-lite --tp 2 --json dsv2.json
    NCCL_NVLS_ENABLE=0 python3 scripts/tp_local_memory.py --model qwen2.5-vl-7b --tp 2
    # NCCL's own account of its buffers: NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ALLOC ... 2> nccl.log
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GiB = 1 << 30
STACK_BOUND = 1024  # memory.STACK_BOUND: the CUDA default
NCCL_DEFAULTS = {  # NCCL's documented defaults of the settings that size its buffers
    "NCCL_BUFFSIZE": "4194304 (4 MiB per channel and peer, Simple protocol)",
    "NCCL_NVLS_ENABLE": "1 (NVLink SHARP buffers; autoprofile's ranks set 0)",
    "NCCL_CUMEM_ENABLE": "1 on recent NCCL (buffers through cuMem: outside torch's allocator)",
    "NCCL_MAX_NCHANNELS": "per topology (NVLink H100: up to 32)",
    "NCCL_MIN_NCHANNELS": "per topology",
    "NCCL_P2P_NVL_CHUNKSIZE": "524288",
    "NCCL_SET_STACK_SIZE": "0 (the driver raises the stack limit when a kernel of NCCL loads)",
    "NCCL_PROTO": "all (LL, LL128, Simple: a buffer each per channel)",
    "NCCL_RUNTIME_CONNECT": "1 on 2.22+ (buffers allocated at the first collective that needs them)",
}


# ---------------------------------------------------------------- kernels: cuobjdump, the driver, Triton
def cuobjdump_tool() -> str | None:
    """Triton's bundled cuobjdump, else one on PATH."""
    try:
        import triton
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if tool.exists():
            return str(tool)
    except ImportError:
        pass
    from shutil import which
    return which("cuobjdump")


def parse_res_usage(text: str, arch: str | None = None) -> list[dict]:
    """cuobjdump -res-usage output -> [{kernel, arch, regs, stack, local}] (of `arch`, e.g. "sm_90", when
    given; every arch when the dump names none)."""
    rows, current_arch, name = [], None, None
    for line in text.splitlines():
        line = line.strip()
        m = re.match(r"arch = (sm_\w+)", line)
        if m:
            current_arch = m.group(1)
            continue
        m = re.match(r"Function (\S+?):?$", line)
        if m:
            name = m.group(1)
            continue
        if name is not None and "REG:" in line:
            nums = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", line)}
            if arch is None or current_arch in (None, arch):
                rows.append({"kernel": name, "arch": current_arch, "regs": nums.get("REG", 0),
                             "stack": nums.get("STACK", 0), "local": nums.get("LOCAL", 0)})
            name = None
    return rows


def res_usage(path: str, arch: str | None, timeout_s: float = 600) -> list[dict] | str:
    """Per-kernel resources of a cubin or a library's fatbins; the reason as text when unreadable."""
    tool = cuobjdump_tool()
    if tool is None:
        return "no cuobjdump (Triton's bundled one nor on PATH)"
    try:
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"cuobjdump -res-usage {path} took over {timeout_s:.0f} s"
    rows = parse_res_usage(out.stdout, arch)
    if not rows:
        return f"cuobjdump -res-usage {path}: exit {out.returncode}, no kernels: {out.stderr.strip()[-300:]}"
    return rows


def loaded_library(fragment: str) -> str | None:
    """The path of a shared library this process has mapped (libnccl: pip's nvidia-nccl, or a system one)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if fragment in Path(path).name:
                    return path
    except OSError:
        pass
    return None


def local_size(function) -> int | None:
    """The driver's LOCAL_SIZE_BYTES of a loaded CUfunction."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v = ctypes.c_int()
    return v.value if lib.cuFuncGetAttribute(ctypes.byref(v), 3, ctypes.c_void_p(function)) == 0 else None


def cubin_stack(cubin: bytes, arch: str | None) -> int | None:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        rows = res_usage(f.name, None, timeout_s=60)
    return max((max(r["stack"], r["local"]) for r in rows), default=None) if isinstance(rows, list) else None


def compiled_triton_kernels(arch: str | None) -> list[dict]:
    """Every Triton kernel compiled in this process by autoprofile's and AITER's modules."""
    from triton.runtime.jit import JITFunction
    seen, rows = set(), []
    for name, mod in list(sys.modules.items()):
        if not name.startswith(("autoprofile", "aiter", "models")) or mod is None:
            continue
        for attr in list(vars(mod).values()):
            for _ in range(3):  # @triton.heuristics / autotune wrap the JIT function
                if isinstance(attr, JITFunction) or not hasattr(attr, "fn"):
                    break
                attr = attr.fn
            if not isinstance(attr, JITFunction) or id(attr) in seen:
                continue
            seen.add(id(attr))
            for cache in getattr(attr, "device_caches", {}).values():
                for kernel in cache[0].values():
                    try:
                        kernel._init_handles()
                        cubin = kernel.asm.get("cubin") if hasattr(kernel, "asm") else None
                        rows.append({"kernel": attr.__name__, "module": name, "regs": kernel.n_regs,
                                     "spills": kernel.n_spills, "local": local_size(kernel.function),
                                     "stack": cubin_stack(cubin, arch) if cubin else None})
                    except Exception as e:  # noqa: BLE001 - one unreadable kernel must not hide the others
                        rows.append({"kernel": attr.__name__, "module": name, "error": repr(e)[:200]})
    return rows


# ---------------------------------------------------------------- one rank
class Stages:
    """This rank's readings, one per stage."""

    def __init__(self, device):
        self.device, self.rows = device, []

    def __call__(self, stage: str) -> None:
        import torch
        from autoprofile import memory
        if stage == "graph_capture":  # inside a capture: nothing may synchronize; the next stage reads it
            return
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        got = memory.local_memory_reserved(self.device)
        self.rows.append({"stage": stage, "stack": got[0] if got else None,
                          "local_gib": got[1] / GiB if got else None,
                          "non_torch_gib": (total - free - reserved) / GiB,
                          "torch_reserved_gib": reserved / GiB})


def rank_probe(guard, cfg, serve_prompts: int = 8, nccl_dump: bool = True) -> dict:
    """One rank (a launch.launch target): the staged readings, the Triton kernels, NCCL's kernels and
    settings."""
    import torch
    import torch.distributed as dist
    from autoprofile.profiler import boot
    from autoprofile.tp import broadcast
    dev = torch.device("cuda", guard.rank)
    major, minor = torch.cuda.get_device_capability(dev)
    arch = f"sm_{major}{minor}"
    mark = Stages(dev)
    mark("CUDA context + NCCL communicator (eager init)")
    x = torch.ones(4096, dtype=torch.bfloat16, device=dev)
    dist.all_reduce(x, group=guard.data)
    torch.cuda.synchronize(dev)
    mark("first all-reduce (bf16, 8 KiB: LL)")
    big = torch.ones(32 << 20, dtype=torch.bfloat16, device=dev)
    dist.all_reduce(big, group=guard.data)
    torch.cuda.synchronize(dev)
    mark("all-reduce (bf16, 64 MiB: Simple)")
    parts = [torch.empty_like(x) for _ in range(guard.world)]
    dist.all_gather(parts, x, group=guard.data)
    torch.cuda.synchronize(dev)
    mark("all-gather (the ordered reduce of --deterministic, the LM head)")
    del x, big, parts
    torch.cuda.empty_cache()
    mark("collectives' tensors freed")
    runner, result = boot(cfg, guard.rank, guard.world, cpu_group=guard.control, guard=guard,
                          checkpoint=mark, log_report=False)
    mark("profile done (validated, serving size)")
    if guard.rank:
        broadcast.worker_loop(runner)
    else:
        from autoprofile.engine.engine import LLMEngine
        b = broadcast.StepBroadcaster(runner)
        try:
            vocab = runner.model_config.vocab_size
            prompts = [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(64 + 97 * i)]
                       for i in range(serve_prompts)]
            LLMEngine(b).generate(prompts, max_tokens=32)
        finally:
            b.close()
    torch.cuda.synchronize(dev)
    mark(f"served {serve_prompts} requests")
    out = {"rank": guard.rank, "arch": arch, "stages": mark.rows, "profile_stack_limit": result.stack_limit,
           "profile_non_torch_gib": result.terms.get("cuda_context_non_torch", 0) / GiB,
           "triton": compiled_triton_kernels(arch)}
    runner.teardown()
    if guard.rank == 0:
        out["nccl"] = nccl_facts(arch, nccl_dump)
    return out


def nccl_facts(arch: str, dump: bool) -> dict:
    import torch
    try:
        v = torch.cuda.nccl.version()  # a tuple; an int (e.g. 21805) on old torch
        version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001
        version = f"unknown ({e})"
    lib = loaded_library("libnccl")
    facts = {"version": version, "library": lib or "none mapped (NCCL linked into libtorch_cuda?)",
             "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
             "defaults": NCCL_DEFAULTS}
    if lib and dump:
        rows = res_usage(lib, arch)
        if isinstance(rows, str):
            facts["kernels"] = rows
        else:
            rows.sort(key=lambda r: -max(r["stack"], r["local"]))
            facts["kernels"] = {"count": len(rows), "max_stack": max(r["stack"] for r in rows),
                                "max_local": max(r["local"] for r in rows),
                                "over_bound": sum(max(r["stack"], r["local"]) > STACK_BOUND for r in rows),
                                "largest": rows[:8]}
    return facts


# ---------------------------------------------------------------- the report
def report(outcomes: list[dict]) -> str:
    lines = []
    for o in outcomes:
        lines.append(f"== rank {o['rank']} ({o['arch']}): the profile recorded stack "
                     f"{o['profile_stack_limit']} B, non-torch {o['profile_non_torch_gib']:.2f} GiB")
        lines.append(f"{'stage':<58}{'stack B':>9}{'local GiB':>11}{'non-torch GiB':>15}{'torch GiB':>11}")
        prev = None
        for s in o["stages"]:
            moved = "  <- stack raised" if prev is not None and s["stack"] != prev else ""
            lines.append(f"{s['stage'][:57]:<58}{s['stack'] or 0:>9}{s['local_gib'] or 0:>11.2f}"
                         f"{s['non_torch_gib']:>15.2f}{s['torch_reserved_gib']:>11.2f}{moved}")
            prev = s["stack"]
        kernels = [k for k in o["triton"] if "error" not in k]
        bad = [k for k in kernels if max(k["local"] or 0, k["stack"] or 0) > STACK_BOUND]
        unread = len(o["triton"]) - len(kernels)
        lines.append(f"Triton kernels compiled: {len(kernels)} ({unread} unreadable); "
                     f"over {STACK_BOUND} B per thread: {len(bad)}")
        for k in sorted(kernels, key=lambda k: -max(k["local"] or 0, k["stack"] or 0))[:8]:
            lines.append(f"  {k['kernel']:<48} local {k['local']} B, stack {k['stack']} B, spills "
                         f"{k['spills']}, regs {k['regs']} ({k['module']})")
        if "nccl" in o:
            n = o["nccl"]
            lines.append(f"NCCL {n['version']}: {n['library']}")
            lines.append(f"  NCCL_* set: {n['settings'] or 'none'}")
            k = n.get("kernels")
            if isinstance(k, dict):
                lines.append(f"  {k['count']} kernels for this arch: max STACK {k['max_stack']} B, max LOCAL "
                             f"{k['max_local']} B, {k['over_bound']} over {STACK_BOUND} B; largest:")
                lines += [f"    {r['kernel'][:90]}: stack {r['stack']} B, local {r['local']} B, regs "
                          f"{r['regs']}" for r in k["largest"]]
            elif k is not None:
                lines.append(f"  kernels: {k}")
            lines.append("  defaults of the settings that size NCCL's buffers: "
                         + "; ".join(f"{a}={b}" for a, b in n["defaults"].items()))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v2-lite")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--max_req_total_len", type=int, default=None, help="default: the server's default")
    p.add_argument("--serve-prompts", type=int, default=8, help="requests served after the profile")
    p.add_argument("--no-nccl-dump", action="store_true", help="skip cuobjdump on libnccl")
    p.add_argument("--json", default=None, help="write every reading here")
    p.add_argument("--timeout", type=float, default=1500, help="seconds for the whole run")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    from autoprofile.config import ServerConfig, validate
    from autoprofile import launch
    if torch.cuda.device_count() < args.tp:
        print(f"error: --tp {args.tp} needs {args.tp} GPUs, this host has {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    flags = {"max_req_total_len": args.max_req_total_len} if args.max_req_total_len else {}
    cfg = validate(ServerConfig(model=args.model, tp=args.tp, report_dir=None, **flags))
    outcomes = launch.launch(rank_probe, args.tp, (cfg, args.serve_prompts, not args.no_nccl_dump),
                             timeout_s=args.timeout)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        print(f"error: {failed[0].value}", file=sys.stderr)
        return 1
    values = [o.value for o in outcomes]
    print(report(values))
    if args.json:
        Path(args.json).write_text(json.dumps(values, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
