"""Where a decode step's host time goes at serving's concurrency: the engine loop (LLMEngine, overlapped, as
`serve` runs it, no HTTP) over --rows requests decoding at once, timed, then under cProfile, then one step
under torch.cuda's sync debug mode (each call that waits for the GPU, with its line).

    PYTHONPATH=. python3 scripts/engine_host_profile.py --model llama-3.1-8b --rows 256 [--greedy]
    # c256's mixed steps: 176 rows decoding, 6 fresh 1,024-token prompts joining every step
    PYTHONPATH=. python3 scripts/engine_host_profile.py --rows 176 --prefill_prompts 6 --fresh_len 1024

Random weights, random prompts of --prompt_len tokens, top-p 0.9 at temperature 0.8 (--greedy: greedy);
the KV cache is sized for the rows (no profile: the runner is built directly). Prints the step's wall time
and the step clock's GPU and host parts, the --top functions by own and by cumulative time, and the syncs.
--prefill_prompts K: K fresh prompts of --fresh_len tokens (one token each to generate) are added before
every timed step, so each step is a mixed one, as a c256 burst's are (admitted at once: --max_waiting_steps
0): how much of a served prefill step's host time (about 80 ms at c256 on an H200, beside the event loop) is
the engine's own.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import sys
import time
import warnings

import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.sampling import GREEDY, SamplingParams


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_steps(engine: LLMEngine, steps: int, feed=lambda: None) -> float:
    """ms a step of `steps` engine steps (the GPU drained before and after); feed() before each step."""
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        feed()
        engine.step()
    sync()
    return (time.perf_counter() - t0) * 1e3 / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--prompt_len", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--prefill_prompts", type=int, default=0, metavar="K",
                   help="fresh prompts added before each timed step (0: the rows decode alone)")
    p.add_argument("--fresh_len", type=int, default=1024, help="tokens of each fresh prompt")
    args = p.parse_args(argv)
    if args.prefill_prompts < 0 or args.fresh_len < 1:
        p.error("--prefill_prompts must be >= 0 and --fresh_len >= 1 (e.g. --prefill_prompts 6 "
                "--fresh_len 1024)")
    cuda = torch.cuda.is_available()
    fresh = args.prefill_prompts
    context = max(args.prompt_len + 4 * args.steps, args.fresh_len + 1) + 64
    cpu = {} if cuda else dict(model="tiny", device="cpu", attention_backend="torch")  # a dry run
    # fresh prompts join the step after they arrive (no pacing) and take a slot each until they end
    cfg = validate(ServerConfig(**{"model": args.model, "dtype": "bfloat16", "max_req_total_len": context,
                                   "graph_max_batch_size": args.rows,
                                   "running_max_req_size": args.rows + 2 * fresh,
                                   "max_waiting_steps": 0, "report_dir": None, **cpu}))
    runner = ModelRunner(cfg)
    runner.build((args.rows + 2 * fresh) * (context + cfg.page_size))
    engine = LLMEngine(runner, overlap=True)
    params = GREEDY if args.greedy else SamplingParams(temperature=0.8, top_p=0.9)
    rng = random.Random(0)
    vocab = runner.model_config.vocab_size
    for _ in range(args.rows):
        engine.add_request([rng.randrange(vocab) for _ in range(args.prompt_len)], params,
                           max_tokens=4 * args.steps)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(10):  # every row decoding
        engine.step()

    def feed() -> None:
        for _ in range(fresh):
            engine.add_request([rng.randrange(vocab) for _ in range(args.fresh_len)], params, max_tokens=1)
    runner.clock.reset()
    ms = run_steps(engine, args.steps, feed)
    times = runner.clock.read()
    prof = cProfile.Profile()
    prof.enable()
    profiled = run_steps(engine, args.steps, feed)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    caught = []
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [f"{w.filename}:{w.lineno}: {str(w.message)[:90]}" for w in caught
             if "synchroniz" in str(w.message)]
    joining = f", {fresh} fresh {args.fresh_len}-token prompts a step" if fresh else ""
    print(f"{torch.cuda.get_device_name() if cuda else 'CPU'}: {cfg.model}, {args.rows} rows decoding"
          f"{joining}, {'greedy' if args.greedy else 'top-p 0.9'}: {ms:.2f} ms a step ({profiled:.2f} under "
          f"cProfile)")
    kinds = {k: round(v / args.steps, 2) for k, v in times.steps.items()}
    print("steps timed, by kind, a timed step:", json.dumps(kinds))
    per = {k: round(v * 1e3 / args.steps, 2) for k, v in {**times.host, **{
        "gpu " + " ".join(map(str, k)) if isinstance(k, tuple) else f"gpu {k}": v
        for k, v in times.gpu.items()}}.items()}
    print("step clock, ms a step:", json.dumps(per))
    print(text.getvalue())
    print(f"synchronizing calls in two steps: {len(syncs)}", *syncs, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
