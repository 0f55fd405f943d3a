"""The OpenAI features agents and eval harnesses send, under load, through HTTP (issue 33's GPU check).

Phase 1 (mix): --num-requests requests, all at once, each kind in turn: chat with `top_logprobs` 20,
completions with `n` 4, `best_of`, every sampling control (penalties, `logit_bias`, `min_p`, `min_tokens`,
`stop_token_ids`), a chat `response_format` JSON schema, `echo` with prompt logprobs (lm-eval's
loglikelihood), vLLM's `prompt_logprobs` 5 with `n` 2, a forced tool call, a Responses API request
(POST /v1/responses: instructions, input items, a forced function call) and, with --reasoning (a server
started with --reasoning_parser qwen3), a chat reply steered through <think>...</think> whose thinking must
come back as reasoning_content. Every answer is checked for its shape (logprobs present and sorted, n
choices, the schema satisfied, the tool call parsing,
the reasoning apart) and the server's /metrics must count 0 OOM.
Phase 2 (schema cost): --throughput-prompts streamed chat requests at --max-concurrency, every one with a
JSON schema, against the same requests without one (run before and after it); output tokens per second of
each, the ratio to the plain runs' mean against issue 48's target (>= 0.9), and every constrained answer
checked: one that stopped must be a document of the schema, one cut at max_tokens a prefix of one
(`schema_problem`). The schema answers may be shorter, so tok/s also counts more prefill per output token: two
length-matched figures beside it (schema_cost): a plain run whose requests give exactly their schema twins'
token counts (max_tokens, ignore_eos), and the mean TPOT (time per output token after the first, from the
streamed chunks' times) of each run.

    python3 scripts/openai_features_check.py --launch "autoprofile serve --model llama-3.1-8b --port 0"
    python3 scripts/openai_features_check.py --base-url http://127.0.0.1:8000 --num-requests 64
    python3 scripts/openai_features_check.py --reasoning \
        --launch "autoprofile serve --model llama-3.1-8b --port 0 --reasoning_parser qwen3"

Loopback only. Exits 1 when a request fails, an answer has the wrong shape, or the server counted an OOM.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import (WORDS, Launched, check_loopback, engine_figures, engine_line,  # noqa: E402
                           model_name, scrape, wait_ready)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colour"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "colour": {"enum": ["red", "green", "blue"]}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
# phase 2: a free string, so that constrained answers run to max_tokens as the plain ones do
LONG = {"type": "json_schema", "json_schema": {"name": "note", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["text"],
    "properties": {"text": {"type": "string"}}}}}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 32},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
# the Responses API's flat function tool: no free string (the chat tool kind has one)
RESPONSES_TOOL = {"type": "function", "name": "get_forecast", "description": "The forecast of a city.",
                  "parameters": {"type": "object", "additionalProperties": False,
                                 "required": ["city", "days"],
                                 "properties": {"city": {"enum": ["Oslo", "Lima", "Pune"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}
# the LONG schema's documents as a pattern (JSON whitespace, a JSON string): a cut answer must be a prefix of
# one (regex's partial match)
LONG_DOCUMENT = r'\s*\{\s*"text"\s*:\s*"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"\s*\}\s*'
SCHEMA_TARGET = 0.9  # issue 48: JSON-schema tok/s at >= 0.9x the plain requests'
THINKING = "<think>[a-z ]{1,48}</think>[a-z ]{1,48}"  # the reasoning kind's reply (random weights never
# think on their own)
KINDS = ("top_logprobs", "n4", "best_of", "controls", "json_schema", "echo", "prompt_logprobs", "tool",
         "responses")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}


def kinds(reasoning: bool) -> tuple[str, ...]:
    return (*KINDS, "reasoning") if reasoning else KINDS


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def request(kind: str, rng: random.Random, model: str, prompt_words: int,
            max_tokens: int) -> tuple[str, dict]:
    """(endpoint, body) of one request of `kind`."""
    text = words(rng, prompt_words)
    chat = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    done = {"model": model, "prompt": text, "max_tokens": max_tokens}
    seed = rng.randrange(1 << 30)
    if kind == "top_logprobs":
        return "chat", {**chat, "logprobs": True, "top_logprobs": 20, "temperature": 0.8, "seed": seed}
    if kind == "n4":
        return "completions", {**done, "n": 4, "temperature": 0.8, "seed": seed}
    if kind == "best_of":
        return "completions", {**done, "n": 2, "best_of": 4, "temperature": 0.8, "seed": seed}
    if kind == "controls":
        return "completions", {**done, "temperature": 0.7, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                               "repetition_penalty": 1.2, "min_p": 0.05, "logit_bias": {"3": 5, "4": -100},
                               "min_tokens": max_tokens // 2, "stop_token_ids": [5], "seed": seed}
    if kind == "json_schema":
        return "chat", {**chat, "max_tokens": max(max_tokens, 96), "response_format": FORMAT,
                        "temperature": 1.0, "seed": seed}
    if kind == "echo":
        return "completions", {**done, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0.0}
    if kind == "prompt_logprobs":
        return "completions", {**done, "n": 2, "prompt_logprobs": 5, "temperature": 0.8, "seed": seed}
    if kind == "tool":
        return "chat", {**chat, "max_tokens": max(max_tokens, 96), "tools": [TOOL], "temperature": 1.0,
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    if kind == "responses":
        return "responses", {"model": model, "instructions": "Answer with a tool call.", "temperature": 1.0,
                             "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}],
                             "max_output_tokens": max(max_tokens, 256), "tools": [RESPONSES_TOOL],
                             "tool_choice": "required"}
    if kind == "reasoning":
        return "chat", {**chat, "max_tokens": max(max_tokens, 128), "temperature": 1.0, "seed": seed,
                        "structured_outputs": {"regex": THINKING}}
    raise ValueError(kind)


def response_problems(answer: dict) -> list[str]:
    """A Responses answer to the forced function call: one function_call whose arguments fit the tool."""
    import jsonschema
    if answer.get("object") != "response" or answer.get("status") != "completed":
        return [f"responses: object {answer.get('object')!r}, status {answer.get('status')!r}"]
    calls = [o for o in answer.get("output") or [] if o.get("type") == "function_call"]
    if not calls or answer["usage"]["output_tokens"] < 1:
        return ["responses: no function_call item, or no output tokens"]
    try:
        jsonschema.validate(json.loads(calls[0]["arguments"]), RESPONSES_TOOL["parameters"])
    except (ValueError, jsonschema.ValidationError) as e:
        return [f"responses: {type(e).__name__}: {str(e)[:80]}"]
    return []


def prompt_logprobs_problems(entries, prompt_tokens: int) -> list[str]:
    """vLLM's prompt_logprobs (k 5): null first, then the prompt token and the top 5 (ranks 1..5), each
    logprob <= 0."""
    if not entries or len(entries) != prompt_tokens or entries[0] is not None:
        return ["prompt_logprobs: missing, not one per prompt token, or the first not null"]
    for e in entries[1:]:
        ranks = sorted(v["rank"] for v in e.values())
        if not 5 <= len(e) <= 6 or ranks[:5] != [1, 2, 3, 4, 5] or \
                any(v["logprob"] > 1e-6 for v in e.values()):
            return [f"prompt_logprobs: an entry of ranks {ranks[:8]}, or a logprob above 0"]
    return []


def problems(kind: str, body: dict, answer: dict) -> list[str]:
    """What is wrong with an answer of `kind` (an empty list: nothing)."""
    import jsonschema
    if kind == "responses":
        return response_problems(answer)
    choices = answer.get("choices") or []
    want = body.get("n", 1)
    if len(choices) != want:
        return [f"{len(choices)} choices, asked {want}"]
    out = []
    for c in choices:
        if kind == "top_logprobs":
            content = (c.get("logprobs") or {}).get("content") or []
            if not content:
                out.append("no logprobs.content")
            for t in content:
                tops = [x["logprob"] for x in t["top_logprobs"]]
                if len(tops) != 20 or tops != sorted(tops, reverse=True) or t["logprob"] > 1e-6:
                    out.append(f"top_logprobs: {len(tops)} entries, or unsorted, or a logprob above 0")
                    break
        elif kind == "echo":
            lp = c.get("logprobs") or {}
            if not lp.get("token_logprobs") or lp["token_logprobs"][0] is not None \
                    or len(lp["token_logprobs"]) != len(lp.get("tokens", ())):
                out.append("echo: prompt logprobs missing or the first one not null")
        elif kind == "prompt_logprobs":
            out += prompt_logprobs_problems(c.get("prompt_logprobs"), answer["usage"]["prompt_tokens"])
        elif kind == "json_schema" and c.get("finish_reason") == "stop":
            try:
                jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
            except (ValueError, jsonschema.ValidationError) as e:
                out.append(f"json_schema: {type(e).__name__}: {str(e)[:80]}")
        elif kind == "tool":
            calls = c["message"].get("tool_calls") or []
            if c.get("finish_reason") in ("tool_calls", "stop") and not calls:
                out.append("tool: no tool_calls")
            for call in calls:
                try:
                    jsonschema.validate(json.loads(call["function"]["arguments"]),
                                        TOOL["function"]["parameters"])
                except (ValueError, jsonschema.ValidationError) as e:
                    out.append(f"tool: {type(e).__name__}: {str(e)[:80]}")
        elif kind == "reasoning" and c.get("finish_reason") == "stop":
            message = c["message"]
            if not message.get("reasoning_content") or "<think>" in (message.get("content") or ""):
                out.append("reasoning: no reasoning_content, or <think> left in content")
    return out


async def post(session: aiohttp.ClientSession, url: str, endpoint: str, body: dict, timeout: float) -> dict:
    timeout_s = aiohttp.ClientTimeout(total=timeout)
    async with session.post(url + PATHS[endpoint], json=body, timeout=timeout_s) as r:
        answer = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {json.dumps(answer)[:200]}")
        return answer


async def mix(url: str, model: str, args) -> dict:
    rng = random.Random(args.seed)
    mixed = kinds(args.reasoning)
    jobs = [(k, *request(k, rng, model, args.prompt_words, args.max_tokens))
            for k in (mixed[i % len(mixed)] for i in range(args.num_requests))]
    by_kind = {k: Counter() for k in mixed}
    errors: Counter = Counter()

    async def one(session, kind, endpoint, body):
        try:
            bad = problems(kind, body, await post(session, url, endpoint, body, args.request_timeout))
        except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            bad = [f"{type(e).__name__}: {str(e)[:160]}"]
        by_kind[kind]["ok" if not bad else "failed"] += 1
        errors.update(f"{kind}: {b}" for b in bad[:1])

    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(one(session, *j) for j in jobs))
    return {"duration_s": round(time.perf_counter() - start, 2),
            "by_kind": {k: dict(v) for k, v in by_kind.items()}, "errors": dict(errors.most_common(10))}


def schema_problem(content: str, finish_reason: str) -> str | None:
    """Phase 2's check of a constrained answer: stopped, a document of the LONG schema; cut at max_tokens
    ("length"), a prefix of one. None when it holds, else what is wrong."""
    import jsonschema
    import regex
    if finish_reason == "length":
        return None if regex.fullmatch(LONG_DOCUMENT, content, partial=True) else "cut answer is no prefix"
    try:
        jsonschema.validate(json.loads(content), LONG["json_schema"]["schema"])
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e)[:80]}"
    return None


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict, timeout: float) -> dict:
    """A streamed chat request: its content, finish_reason, completion_tokens (the usage chunk) and the
    perf_counter times of its first and last content chunks."""
    timeout_s = aiohttp.ClientTimeout(total=timeout)
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    parts, out = [], {"finish_reason": None, "completion_tokens": 0, "first": None, "last": None}
    async with session.post(url + PATHS["chat"], json=body, timeout=timeout_s) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {json.dumps(chunk['error'])[:200]}")
            out["completion_tokens"] = (chunk.get("usage") or {}).get("completion_tokens",
                                                                     out["completion_tokens"])
            for c in chunk.get("choices") or []:
                text = (c.get("delta") or {}).get("content")
                if text:
                    now = time.perf_counter()
                    out["first"], out["last"] = out["first"] or now, now
                    parts.append(text)
                out["finish_reason"] = c.get("finish_reason") or out["finish_reason"]
    return out | {"content": "".join(parts)}


def tpot(first: float | None, last: float | None, tokens: int) -> float | None:
    """Time per output token after the first (vLLM's TPOT), seconds; None for fewer than two tokens."""
    if first is None or last is None or tokens < 2:
        return None
    return (last - first) / (tokens - 1)


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


async def throughput(url: str, model: str, args, schema: bool, lengths: dict[int, int] | None = None,
                     run: int = 0) -> dict:
    """Phase 2's run of --throughput-prompts streamed chat requests: with the LONG schema, or without;
    `lengths` {request: tokens} (the length-matched run): each such request asks exactly that many tokens
    (max_tokens, ignore_eos), so that it gives as many tokens as its schema twin. Each `run` draws its own
    prompts of --prompt-words words: a run that sent the prompts of a run before would find them in the
    server's prefix cache and skip their prefill (an H200 run: 25 prefill steps of 5,750 tokens in the first
    plain run, 5-15 of about 490 in the three after it, which skewed every ratio). Returns tok/s, mean TPOT,
    `lengths` (each answered request's completion tokens) and `engine`: the server's step clock grown over the
    run (bench_serving.engine_figures)."""
    rng = random.Random(args.seed + 1 + 1000 * run)
    limit = asyncio.Semaphore(args.max_concurrency)
    tokens, tpots, failed, invalid = {}, [], Counter(), Counter()

    async def one(session, i):
        body = {"model": model, "messages": [{"role": "user", "content": words(rng, args.prompt_words)}],
                "max_tokens": args.throughput_max_tokens, "temperature": 1.0, "seed": i}
        if schema:
            body["response_format"] = LONG
        if lengths is not None:
            body |= {"max_tokens": max(1, lengths.get(i, args.throughput_max_tokens)), "ignore_eos": True}
        async with limit:
            try:
                answer = await stream_chat(session, url, body, args.request_timeout)
            except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                failed[f"{type(e).__name__}: {str(e)[:120]}"] += 1
                return
        tokens[i] = answer["completion_tokens"]
        per_token = tpot(answer["first"], answer["last"], tokens[i])
        if per_token is not None:
            tpots.append(per_token)
        problem = schema and schema_problem(answer["content"], answer["finish_reason"])
        if problem:
            invalid[problem] += 1

    before = await scrape(url)
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(one(session, i) for i in range(args.throughput_prompts)))
    duration = time.perf_counter() - start
    after = await scrape(url)
    total = sum(tokens.values())
    out = {"requests": len(tokens), "failed": sum(failed.values()), "errors": dict(failed),
           "output_tokens": total, "duration_s": round(duration, 2),
           "output_tok_s": round(total / duration, 1),
           "tpot_ms": None if not tpots else round(1e3 * mean(tpots), 3), "lengths": tokens,
           # where the server's engine spent the run (its step clock): a schema step's host cost shows here
           "engine": engine_figures(lambda name: after.get(name, 0.0) - before.get(name, 0.0))}
    if schema:  # every answer checked: the schema holds in each, or `invalid` says how it broke
        out |= {"schema_checked": len(tokens), "schema_invalid": sum(invalid.values()),
                "invalid": dict(invalid.most_common(5))}
    return out


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else round(num / den, 3)


def schema_cost(plain: dict, constrained: dict, matched: dict, again: dict) -> dict:
    """Phase 2's figures, each run without its per-request lengths. `ratio`: schema tok/s over the mean of the
    two plain runs' (the schema answers may be shorter: more prefill per output token). Length-matched:
    `ratio_length_matched`, schema tok/s over the plain run whose requests gave exactly the schema answers'
    token counts; `tpot_ratio`, the plain runs' mean TPOT over the schema run's (TPOT: time per output token
    after the first; above 1 the schema decodes faster). Every ratio reads as schema speed / plain speed."""
    runs = {name: {k: v for k, v in run.items() if k != "lengths"} for name, run in
            (("none", plain), ("json_schema", constrained), ("none_length_matched", matched),
             ("none_again", again))}
    base = (plain["output_tok_s"] + again["output_tok_s"]) / 2
    plain_tpot = mean([t for t in (plain["tpot_ms"], again["tpot_ms"]) if t is not None])
    out = {**runs, "ratio": ratio(constrained["output_tok_s"], base),
           "ratio_length_matched": ratio(constrained["output_tok_s"], matched["output_tok_s"]),
           "tpot_ratio": ratio(plain_tpot, constrained["tpot_ms"]), "target": SCHEMA_TARGET}
    for key in ("ratio", "ratio_length_matched", "tpot_ratio"):
        out[f"meets_target_{key}"] = out[key] is not None and out[key] >= SCHEMA_TARGET
    out["meets_target"] = out["meets_target_ratio"]
    return out


def schema_lines(cost: dict) -> list[str]:
    """The three ratios, labelled, for the console, and each run's engine line (its step clock)."""
    runs = ("none", "json_schema", "none_length_matched", "none_again")
    engines = [f"{name}: {engine_line(cost[name]['engine'], cost[name]['duration_s'])}"
               for name in runs if "engine" in cost[name]]
    return engines + [
        f"schema/plain tok/s (answers of their own lengths): {cost['ratio']}",
        f"schema/plain tok/s, length-matched (plain requests give the schema answers' token counts, "
        f"ignore_eos): {cost['ratio_length_matched']}",
        f"plain TPOT / schema TPOT (ms per output token after the first: {cost['none']['tpot_ms']}, "
        f"{cost['none_again']['tpot_ms']} / {cost['json_schema']['tpot_ms']}): {cost['tpot_ratio']}",
        f"target >= {cost['target']}"]


async def phase2(url: str, model: str, args) -> dict:
    """None, schema, none length-matched to the schema answers, none again (the plain runs before and after:
    no order effect); each run its own prompts (`throughput`)."""
    plain = await throughput(url, model, args, schema=False, run=0)
    constrained = await throughput(url, model, args, schema=True, run=1)
    matched = await throughput(url, model, args, schema=False, lengths=constrained["lengths"], run=2)
    again = await throughput(url, model, args, schema=False, run=3)
    return schema_cost(plain, constrained, matched, again)


async def run(url: str, args) -> dict:
    model = await model_name(url)
    before = await scrape(url)
    out = {"model": model, "mix": await mix(url, model, args)}
    if args.throughput_prompts:
        out["throughput"] = await phase2(url, model, args)
    after = await scrape(url)
    out["oom_while_serving"] = after.get("autoprofile_serving_oom_total", 0.0) - before.get(
        "autoprofile_serving_oom_total", 0.0)
    return out


def verdict(out: dict) -> list[str]:
    bad = [f"{k}: {v['failed']} failed" for k, v in out["mix"]["by_kind"].items() if v.get("failed")]
    for name, t in out.get("throughput", {}).items():
        if isinstance(t, dict) and t["failed"]:
            bad.append(f"throughput {name}: {t['failed']} failed")
        if isinstance(t, dict) and t.get("schema_invalid"):
            bad.append(f"throughput {name}: {t['schema_invalid']} answers break the schema ({t['invalid']})")
    if out["oom_while_serving"]:
        bad.append(f"{out['oom_while_serving']:g} OOM while serving")
    return bad


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server (loopback only)")
    p.add_argument("--launch", default=None, help="start this server command instead (it must log its URL)")
    p.add_argument("--ready-timeout", type=float, default=1800)
    p.add_argument("--num-requests", type=int, default=256, help="phase 1: requests sent all at once")
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--throughput-prompts", type=int, default=768, help="phase 2 (0: skip)")
    p.add_argument("--max-concurrency", type=int, default=256, help="phase 2's requests in flight")
    p.add_argument("--throughput-max-tokens", type=int, default=128, help="phase 2's max_tokens")
    p.add_argument("--request-timeout", type=float, default=900)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reasoning", action="store_true",
                   help="add reasoning requests to the mix (the server runs with --reasoning_parser qwen3)")
    p.add_argument("--result-file", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    server = Launched(args.launch) if args.launch else None
    try:
        if server is not None:
            server.bound.wait(args.ready_timeout)
            if server.url is None:
                raise SystemExit("error: the launched server never logged 'serving on http://...'")
        url = server.url if server is not None else args.base_url.rstrip("/")
        check_loopback(url)
        asyncio.run(wait_ready(url, args.ready_timeout, server and server.proc))
        out = asyncio.run(run(url, args))
    finally:
        code = server.stop(timeout=600) if server is not None else None
    bad = verdict(out)
    if server is not None:
        out["server_exit_code"] = code
        if code != 0:
            bad.append(f"the server exited with code {code} after SIGTERM")
    print(json.dumps(out, indent=2))
    if "throughput" in out:
        print("\n".join(schema_lines(out["throughput"])))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(out, indent=2))
    for b in bad:
        print(f"FAIL: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
