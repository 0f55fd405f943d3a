"""The worst routing from outside: N concurrent prompts, each one token repeated (a different token a
prompt, so no prefix is shared), sent to a running server's /generate. Every token of a prompt is the same,
so an MoE router sends the whole prompt to the same experts: the corner the profile's forced worst routing
stands for. Prints how many came back whole (exactly max_new_tokens), the failures by status, the time,
and the server's OOM counter.

    python3 scripts/repeated_prompts.py --base-url http://127.0.0.1:8124 --prompts 512 --len 1000 --out 64
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time

import aiohttp


async def one(session: aiohttp.ClientSession, url: str, token: int, length: int, out: int) -> str:
    body = {"input_ids": [[token] * length], "max_new_tokens": out}
    try:
        async with session.post(url + "/generate", json=body) as r:
            if r.status != 200:
                return f"HTTP {r.status}"
            got = (await r.json())["output_ids"][0]
            return "whole" if len(got) == out else f"{len(got)} of {out} tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return type(e).__name__


async def oom_total(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return " ".join(line for line in text.splitlines() if line.startswith("autoprofile_serving_oom_total"))


async def run(args: argparse.Namespace) -> dict:
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(one(session, args.base_url, args.first_token + i, args.len, args.out)
                                          for i in range(args.prompts)))
        seconds = time.perf_counter() - t0
        return {"prompts": args.prompts, "len": args.len, "out": args.out,
                "outcomes": dict(collections.Counter(outcomes)), "seconds": round(seconds, 1),
                "output_tok_per_s": round(outcomes.count("whole") * args.out / seconds, 1),
                "metrics": await oom_total(session, args.base_url)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8124")
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--len", type=int, default=1000, help="tokens a prompt (one token, repeated)")
    p.add_argument("--out", type=int, default=64, help="max_new_tokens a prompt")
    p.add_argument("--first-token", type=int, default=1000, help="prompt i repeats token first_token + i")
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result))
    return 0 if result["outcomes"] == {"whole": args.prompts} else 1


if __name__ == "__main__":
    raise SystemExit(main())
