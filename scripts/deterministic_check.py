"""A seeded and a greedy request, alone and inside a crowd of 300, on a default auto-profiled engine (issue
19's --deterministic check on a GPU, at a real model's widths; tests/test_deterministic_gpu.py and
unit_tests/test_deterministic.py run the same check, unit_tests/crowd.py, on small models).

    PYTHONPATH=. python3 scripts/deterministic_check.py --model llama-3.1-8b [--deterministic]

Prints, per request: whether its tokens were the same, the first index where they differ, the chunks its
prompt was cut into alone and in the crowd, and the crowd's mixed and graph steps. Random weights (no
download); the crowd's prompts are random token ids.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autoprofile.config import ServerConfig, validate  # noqa: E402
from autoprofile.engine.sampling import GREEDY, SamplingParams  # noqa: E402
from autoprofile.profiler import boot  # noqa: E402
from unit_tests.crowd import alone_and_in_a_crowd  # noqa: E402

REQUESTS = {"seeded top-p 0.9": SamplingParams(temperature=0.9, top_p=0.9, seed=1234), "greedy": GREEDY}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--crowd", type=int, default=300)
    p.add_argument("--prompt_len", type=int, default=3000)
    p.add_argument("--batch_max_tokens", type=int, default=2048, help="small enough to chunk the prompt")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--max_req_total_len", type=int, default=8192)
    args = p.parse_args(argv)
    cfg = validate(ServerConfig(model=args.model, deterministic=args.deterministic, report_dir=None,
                                max_req_total_len=args.max_req_total_len,
                                batch_max_tokens=args.batch_max_tokens))
    runner, _ = boot(cfg, log_report=False)
    vocab = runner.model_config.vocab_size
    prompt = [(7919 * i) % (vocab - 3) + 3 for i in range(args.prompt_len)]
    same = True
    for name, params in REQUESTS.items():
        t0 = time.perf_counter()
        got = alone_and_in_a_crowd(runner, prompt, params, args.max_tokens, crowd=args.crowd)
        differ = next((i for i, (a, b) in enumerate(zip(got.alone, got.crowded)) if a != b), None)
        equal = got.alone == got.crowded
        same &= equal
        print(f"--deterministic {'on ' if args.deterministic else 'off'} | {name}: alone == in a crowd of "
              f"{args.crowd}: {equal}" + ("" if equal else f" (first difference at token {differ})")
              + f" | prompt chunks alone {got.chunks_alone}, crowded {got.chunks_crowded} | most rows beside "
              f"it {got.most_rows}, mixed steps {got.mixed_steps}, graph steps {got.graph_steps} | "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    runner.teardown()
    return 0 if same or not args.deterministic else 1


if __name__ == "__main__":
    sys.exit(main())
