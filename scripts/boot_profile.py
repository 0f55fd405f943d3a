"""Where a server's boot goes: `autoprofile serve`'s startup in one process, step by step, with a cProfile of
the boot thread's work (issue 48's boot item: "show where the time goes").

    PYTHONPATH=. python3 scripts/boot_profile.py --model llama-3.1-8b [serve flags...] [--top 40]
        [--no_cprofile]

Runs what `serve` runs before `/health` says 200, in its order, and prints a line a step (seconds): imports
(torch, then the engine and the server), CUDA's context, `profiler.boot` (load, probe, measure, rebuild,
validate: its own phases as the report gives them), the engine, the tokenizer (`serve` loads it beside the
boot) and xgrammar's vocabulary (server.grammars_for, which `serve` builds once it is ready). The log's lines
carry the ms since the interpreter started (each stress corner's time among them). Then the boot's cProfile:
the functions of most cumulative time, and the most time of their own (Triton's compiles, CUDA graph captures
and stress runs show by name). A cold boot: an empty TRITON_CACHE_DIR and `--profile_cache ''`; the profile
cache's warm boot: run it twice with `--profile_cache DIR`. cProfile adds host time to Python-heavy steps:
--no_cprofile gives the plain timeline; --log_compiles logs each Triton compile and cache load as it ends (its
kernel's name and seconds), so the timeline shows which compiles a step waited for.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats
import sys
import time

T0 = time.perf_counter()


def lap(timeline: list, name: str, since: float) -> float:
    now = time.perf_counter()
    timeline.append((name, now - since))
    return now


def log_compiles() -> None:
    """Chain a listener onto Triton's compilation listener that logs every compile and cache load as it ends
    (the boot's CompileAhead chains its own onto this one)."""
    from triton import knobs

    from autoprofile.kernels.compile_watch import compile_seconds, kernel_name
    log, chained = logging.getLogger("triton.compiles"), knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit, **kwargs):
        log.info("%s %s (%.2f s)", "loaded" if cache_hit else "compiled", kernel_name(src, metadata),
                 compile_seconds(times))
        if chained is not None:
            chained(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                    cache_hit=cache_hit, **kwargs)
    knobs.compilation.listener = listener


def main() -> int:
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--top", type=int, default=40)
    ours.add_argument("--no_cprofile", action="store_true")
    ours.add_argument("--log_compiles", action="store_true")
    args, rest = ours.parse_known_args()
    timeline: list[tuple[str, float]] = []
    t = T0
    from autoprofile.kernels import triton_key
    triton_key.start()  # as the engine process does: beside torch's import
    import torch  # noqa: F401 - timed
    t = lap(timeline, "import torch", t)
    from autoprofile.cli import build_parser
    from autoprofile.config import config_from_args
    from autoprofile.engine.engine import LLMEngine
    import autoprofile.engine.runner  # noqa: F401 - timed here: boot() imports it
    from autoprofile.profiler import boot
    from autoprofile.server import grammars_for
    from autoprofile.serving.tokenizer import load_tokenizer
    t = lap(timeline, "import autoprofile (engine, runner, profiler, server)", t)
    ns = build_parser().parse_args(["serve", *rest])
    cfg = config_from_args(ns)
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    logging.getLogger("autoprofile.engine.runner").setLevel(logging.DEBUG)  # each stress corner's time
    if args.log_compiles:
        log_compiles()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    t = lap(timeline, "CUDA context", t)
    prof = None if args.no_cprofile else cProfile.Profile()
    if prof is not None:
        prof.enable()
    runner, result = boot(cfg, log_report=False)
    if prof is not None:
        prof.disable()
    t_boot = time.perf_counter()
    timeline.append(("boot", t_boot - t))
    timeline.extend((f"  {name}", s) for name, s in result.phases)
    t = t_boot
    engine = LLMEngine.from_config(runner, cfg)
    t = lap(timeline, "engine", t)
    tokenizer = load_tokenizer(cfg)
    t = lap(timeline, "tokenizer (serve: on a thread beside the boot)", t)
    ready = t
    grammars_for(tokenizer, cfg.model_config.vocab_size)
    t = lap(timeline, "xgrammar's vocabulary (serve: on a thread once ready)", t)
    print(f"\nboot of {cfg.model}: {ready - T0:.2f} s from the interpreter's start to ready "
          f"(KV {result.tokens} tokens; structured output {t - T0:.2f} s)")
    for name, s in timeline:
        print(f"  {name:<52} {s:8.2f} s")
    if prof is not None:
        for key in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
            print(f"\ncProfile of the boot, by {key}:\n" + out.getvalue().split("\n", 6)[-1])
    del engine
    runner.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
