"""Where the engine thread's time goes in a step with grammar rows and without (issue 48 item 1).

The real overlapped engine (LLMEngine(overlap=True)) on the tiny model (random weights, torch backend) serves
--requests requests at once, every one with phase 2's JSON schema (scripts/openai_features_check.py's LONG: a
free string), then the same requests without one (no stop token: each runs to --max-tokens). Reported per
decode step, in ms: the step clock's host parts (engine.step_clock.HOST_PARTS; on a CPU `execute` holds the
forward itself, which runs synchronously) and the grammar's own calls, timed by wrapping them:

    fill        TokenBitmask.fill: the matchers' next-token masks on the host (xgrammar)
    apply       TokenBitmask._apply: the copy up and xgrammar's in-place mask of the logits
    advance     engine.grammar.advance: the matchers fed the tokens read back (Scheduler.resolve)
    meta        SamplingMetadata.from_rows and .running: the step's sampled rows read on the host
    has_grammar engine.engine.has_grammar: the engine's per-step check

and `per_row_us` (each grammar part per masked row, microseconds). The two runs interleave --repeats times;
the medians are printed as JSON (--result-file writes them too).

    python3 scripts/grammar_host_steps.py --requests 128 --max-tokens 48 --repeats 3
    python3 scripts/grammar_host_steps.py --model llama-3.1-8b --requests 256 --max-tokens 128  # a GPU host

With --model on a GPU (random weights, bf16, its CUDA graphs) `gpu_ms` adds the step clock's GPU figures: a
decode step's forward (whose events span the deferred sample of a grammar step: the host's read-back, advance
and fill between the forward and the sample show there) and its inputs, and the GPU's idle time a step. No
HTTP: set beside openai_features_check's schema run, it tells the engine's own host path from the event
loop's share of the GIL.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autoprofile.config import ServerConfig, validate  # noqa: E402
from autoprofile.engine import engine as engine_module, grammar, sampler  # noqa: E402
from autoprofile.engine.engine import LLMEngine  # noqa: E402
from autoprofile.engine.runner import ModelRunner  # noqa: E402
from autoprofile.engine.sampling import SamplingParams  # noqa: E402
from autoprofile.engine.step_clock import HOST_PARTS  # noqa: E402
from autoprofile.engine.weights import init_random  # noqa: E402
from autoprofile.serving.structured import Grammars, Spec  # noqa: E402
from autoprofile.serving.tokenizer import ByteTokenizer  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["text"],
          "properties": {"text": {"type": "string"}}}
GRAMMAR_PARTS = ("fill", "apply", "advance", "meta", "has_grammar")


class Timed:
    """Wraps callables so that each call's wall seconds add to `seconds[part]`; `rows[part]` counts the masked
    rows the fill and apply calls were given. undo() puts the originals back."""

    def __init__(self):
        self.seconds: Counter = Counter()
        self.rows: Counter = Counter()
        self._undo: list = []

    def wrap(self, owner, name: str, part: str, rows_of=None) -> None:
        real = owner.__dict__[name]
        fn = real.__func__ if isinstance(real, classmethod) else real

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[part] += time.perf_counter() - t0
                if rows_of is not None:
                    self.rows[part] += rows_of(*a)
        setattr(owner, name, classmethod(timed) if isinstance(real, classmethod) else timed)
        self._undo.append((owner, name, real))

    def undo(self) -> None:
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)


def wrap_grammar_calls(timed: Timed) -> None:
    """The grammar's host calls (GRAMMAR_PARTS), wherever the engine looks them up."""
    timed.wrap(grammar.TokenBitmask, "fill", "fill", rows_of=lambda self, rows: len(rows))
    timed.wrap(grammar.TokenBitmask, "_apply", "apply", rows_of=lambda self, logits, index: len(index))
    timed.wrap(grammar, "advance", "advance")
    timed.wrap(sampler.SamplingMetadata, "from_rows", "meta")
    timed.wrap(sampler.SamplingMetadata, "running", "meta")
    timed.wrap(engine_module, "has_grammar", "has_grammar")


def runner(requests: int, max_tokens: int, prompt_len: int, model: str = "tiny") -> ModelRunner:
    """The model with room for every request at once (decode steps of `requests` rows): the tiny one on the
    CPU (torch backend), another (`--model`, random weights, bf16, the default backend, its CUDA graphs) on
    this host's GPU."""
    flags = dict(dtype="float32", attention_backend="torch", device="cpu") if model == "tiny" else {}
    cfg = validate(ServerConfig(model=model, report_dir=None, max_req_total_len=prompt_len + max_tokens + 16,
                                batch_max_tokens=max(1024, requests * prompt_len),
                                graph_max_batch_size=requests, running_max_req_size=requests, **flags))
    r = ModelRunner(cfg)
    init_random(r.model, seed=1, std=0.08 if model == "tiny" else 0.02)
    r.build(requests * (prompt_len + max_tokens + 32))
    return r


def serve(r: ModelRunner, grammars: Grammars | None, requests: int, max_tokens: int,
          prompt_len: int) -> dict:
    """One run of `requests` at once (each with the schema if grammars is given): per decode step, ms."""
    engine = LLMEngine(r, overlap=True)
    spec = Spec("json", json.dumps(SCHEMA), "response_format")
    vocab = r.model_config.vocab_size
    for i in range(requests):
        prompt = [(7 * i + j) % (vocab - 96) + 3 for j in range(prompt_len)]
        engine.add_request(prompt, SamplingParams(temperature=1.0, seed=i), max_tokens,
                           grammar=grammars.new_matcher(spec) if grammars is not None else None)
    timed = Timed()
    wrap_grammar_calls(timed)
    out_tokens = 0
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished():
            out_tokens += sum(len(o.new_token_ids) for o in engine.step())
    finally:
        timed.undo()
    wall = time.perf_counter() - t0
    times = engine.step_times()
    steps = sum(times.steps.values())
    per_step = {p: 1e3 * times.host[p] / steps for p in HOST_PARTS}
    per_step |= {p: 1e3 * timed.seconds[p] / steps for p in GRAMMAR_PARTS}
    per_row = {p: 1e6 * timed.seconds[p] / timed.rows[p] for p in ("fill", "apply") if timed.rows[p]}
    if grammars is not None and out_tokens:
        per_row["advance"] = 1e6 * timed.seconds["advance"] / out_tokens
    decode = max(1, times.steps["decode"])
    gpu = {" ".join(k) if isinstance(k, tuple) else k: 1e3 * v / (decode if "decode" in k else steps)
           for k, v in times.gpu.items()}  # CUDA: ms a decode step (its forward, its inputs), idle a step
    return {"steps": steps, "decode_steps": times.steps["decode"], "output_tokens": out_tokens,
            "wall_ms_per_step": 1e3 * wall / steps, "host_ms_per_step": per_step, "per_row_us": per_row,
            "gpu_ms": gpu}


def median_of(runs: list[dict]) -> dict:
    """The per-key median of several runs' (nested) figures, rounded."""
    first = runs[0]
    out = {}
    for k, v in first.items():
        if isinstance(v, dict):
            out[k] = median_of([r[k] for r in runs])
        else:
            out[k] = round(statistics.median(r[k] for r in runs), 4)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (the CPU) or a model for this host's GPU")
    p.add_argument("--requests", type=int, default=128, help="requests at once (a decode step's rows)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="schema and plain runs, interleaved")
    p.add_argument("--result-file", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    r = runner(args.requests, args.max_tokens, args.prompt_len, args.model)
    vocab = r.model_config.vocab_size
    grammars = Grammars(ByteTokenizer(vocab, eos_token_ids=[2], specials=[1]), vocab)
    shape = (args.requests, args.max_tokens, args.prompt_len)
    serve(r, grammars, *shape)  # warm up: the compile cache, torch's first calls
    schema, plain = [], []
    for _ in range(args.repeats):
        schema.append(serve(r, grammars, *shape))
        plain.append(serve(r, None, *shape))
    out = {"args": vars(args), "json_schema": median_of(schema), "plain": median_of(plain)}
    print(json.dumps(out, indent=2))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
