"""Hostile workloads against a validated profile: after the default auto-profile, each workload must end
with 0 OOM and every request answered. Engine level (no HTTP): the same LLMEngine the server drives.

    python3 scripts/hostile_workloads.py --model llama-3.1-8b --workloads wide,fill,long --json out.json
    python3 scripts/hostile_workloads.py --workloads mix --minutes 10

Workloads:
  wide  far more concurrent requests than the captured graph size, sampled with top-p/top-k
  fill  sampling requests whose prompts + outputs exceed the KV cache (pages run out: preemption)
  long  one request of --max_req_total_len tokens (chunked prefill over its own prefix) beside short ones
  mix   random arrivals for --minutes: lengths, sampling, stop tokens and aborts at random
Every workload prints requests, tokens, peak KV pages in use, preemptions, OOMs, the least free GPU
memory seen (sampled every 32 steps) and the time it took.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import time

import torch

from autoprofile.config import ServerConfig, add_server_args, config_from_args
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.sampling import SamplingParams
from autoprofile.profiler import boot

SAMPLERS = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9),
            SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=0.7, top_p=0.95, top_k=200)]


class Watch:
    """Runs the engine loop and keeps the figures a workload reports."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.peak_pages, self.min_free, self.steps, self.tokens = engine, 0, None, 0, 0
        self.finished: dict[str, str] = {}

    def step(self) -> None:
        for out in self.engine.step():
            self.tokens += len(out.new_token_ids)
            if out.finished:
                self.finished[out.request_id] = out.finish_reason
        self.steps += 1
        self.peak_pages = max(self.peak_pages, self.engine.stats.pages_used)
        if self.steps % 32 == 1 and torch.cuda.is_available():
            free = torch.cuda.mem_get_info()[0]
            self.min_free = free if self.min_free is None else min(self.min_free, free)

    def drain(self) -> None:
        while self.engine.has_unfinished():
            self.step()


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def run(name: str, engine: LLMEngine, cfg: ServerConfig, minutes: float, seed: int) -> dict:
    rng, vocab, ctx = random.Random(seed), cfg.model_config.vocab_size, cfg.context_len
    env, w = engine.envelope, Watch(engine)
    before = engine.stats
    t0, ids = time.perf_counter(), []
    if name == "wide":
        for _ in range(8 * env.decode_rows):
            n = rng.randint(8, min(512, ctx // 2))
            ids.append(engine.add_request(prompt(rng, n, vocab), rng.choice(SAMPLERS[1:]),
                                          max_tokens=rng.randint(16, min(64, ctx - n))))
        w.drain()
    elif name == "fill":
        # decode_rows requests whose prompts + outputs total 1.5x the cache; outputs long enough that
        # every request is still decoding when the last one is admitted: the pages run out (preemption)
        capacity = env.pages * env.page_size
        each = min(max(capacity * 3 // (2 * env.decode_rows), 64), ctx - 1)
        for _ in range(env.decode_rows):
            m = rng.randint(max(each // 8, 1), max(min(each // 4, 768), 1))
            ids.append(engine.add_request(prompt(rng, each - m, vocab), rng.choice(SAMPLERS[1:]),
                                          max_tokens=m))
        w.drain()
    elif name == "long":
        ids.append(engine.add_request(prompt(rng, ctx - 32, vocab), SAMPLERS[1], max_tokens=32))
        for _ in range(2 * env.decode_rows):
            n = rng.randint(4, min(256, ctx // 2))
            ids.append(engine.add_request(prompt(rng, n, vocab), rng.choice(SAMPLERS),
                                          max_tokens=rng.randint(8, min(128, ctx - n))))
        w.drain()
    elif name == "mix":
        deadline, aborted = t0 + minutes * 60, 0
        while time.perf_counter() < deadline:
            for _ in range(rng.randint(0, 3) if engine.stats.waiting < 4 * env.decode_rows else 0):
                long = rng.random() < 0.02
                p = rng.randint(ctx // 4, ctx - 64) if long else rng.randint(1, min(2048, ctx // 2))
                ids.append(engine.add_request(prompt(rng, p, vocab), rng.choice(SAMPLERS),
                                              max_tokens=rng.randint(1, min(ctx - p, 1024)),
                                              stop_token_ids={rng.randrange(vocab)}))
            if ids and rng.random() < 0.01:
                aborted += engine.abort(rng.choice(ids))
            w.step()
        w.drain()
    else:
        raise SystemExit(f"unknown workload {name}: choose wide, fill, long, mix")
    after = engine.stats
    lost = [i for i in ids if i not in w.finished]
    return {
        "workload": name, "requests": len(ids), "answered": len(ids) - len(lost), "lost": len(lost),
        "finish_reasons": {r: list(w.finished.values()).count(r) for r in set(w.finished.values())},
        "generated_tokens": w.tokens, "steps": w.steps, "seconds": round(time.perf_counter() - t0, 1),
        "peak_kv_pages": w.peak_pages, "kv_pages": after.pages_total,
        "peak_kv_use": round(w.peak_pages / after.pages_total, 4),
        "preemptions": after.preemptions - before.preemptions,
        "failed_steps": after.failed_steps - before.failed_steps,
        "ooms": after.ooms - before.ooms,
        "min_free_gib": None if w.min_free is None else round(w.min_free / 2 ** 30, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_args(p)
    p.add_argument("--workloads", default="wide,fill,long")
    p.add_argument("--minutes", type=float, default=10.0, help="length of the mix workload")
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    work = args.__dict__.pop("workloads").split(",")
    minutes, out_json = args.__dict__.pop("minutes"), args.__dict__.pop("json")
    cfg = config_from_args(args)
    if torch.cuda.is_available():
        runner, kv_tokens = boot(cfg)[0], None
    else:  # a CPU smoke run of the script itself (the profiler needs a GPU): a pinned cache, unprofiled
        runner = ModelRunner(cfg)
        runner.build(cfg.max_total_token_num or 4 * cfg.context_len)
    kv_tokens = runner.built_tokens
    engine = LLMEngine.from_config(runner, cfg)
    print(f"KV cache: {kv_tokens} tokens, envelope {engine.envelope}", flush=True)
    results = []
    for i, name in enumerate(work):
        results.append(run(name, engine, cfg, minutes, cfg.seed + i))
        print(json.dumps(results[-1]), flush=True)
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"kv_tokens": kv_tokens, "results": results}, f, indent=1)
    bad = [r for r in results if r["lost"] or r["ooms"] or r["failed_steps"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
