"""OpenAI-API load generator for `autoprofile serve` (or any OpenAI-compatible server on this host).

Reports what vLLM's benchmarks/benchmark_serving.py reports, under the same names (table and JSON):
request and token throughput; TTFT, TPOT (excluding the first token), ITL and end-to-end latency as
mean / median / std / p50 / p90 / p99 in ms; plus failed requests and their errors.

    # a running server: fixed concurrency, or a Poisson request rate
    python3 scripts/bench_serving.py --base-url http://127.0.0.1:8000 --max-concurrency 64 --num-prompts 512
    python3 scripts/bench_serving.py --request-rate 20 --num-prompts 1000 --random-input-len 512
    # start the server, wait for /health (the validated profile), run, then SIGTERM it (it must exit 0)
    python3 scripts/bench_serving.py --launch "autoprofile serve --port 0" --max-concurrency 256
    # soak: N minutes at the server's running capacity with a hostile mix; exits 1 on any failure. It
    # samples the CUDA caching allocator (/metrics: reserved bytes, segments) every --soak-sample-seconds
    # into the result's "memory_timeline" and plots them against the profile's peak (--soak-plot)
    python3 scripts/bench_serving.py --launch "autoprofile serve --port 0" --soak-minutes 20 \
        --result-file soak.json
    # where a served step's time goes: a torch.profiler trace of the server's engine steps (its --profile_dir)
    python3 scripts/bench_serving.py --launch "autoprofile serve --port 0 --profile_dir traces" \
        --max-concurrency 256 --num-prompts 300 --profile --profile-steps 60

Prompts are random token ids (exact input lengths, no prefix reuse, like vLLM's random dataset), sent
as `prompt: [ids]` to /v1/completions with `ignore_eos` (exact output lengths) unless --no-ignore-eos.
`--dataset-name random-mm` (vLLM's random-mm) sends chat completions instead: random words and
--random-mm-base-items-per-request random-pixel PNG images of --random-mm-image-size each, as data: URLs:

    python3 scripts/bench_serving.py --dataset-name random-mm --random-mm-base-items-per-request 2 \
        --random-mm-image-size 1280x720 --random-input-len 256 --max-concurrency 64 --num-prompts 256
    # 200 requests about one 1200x900 picture, all at once (scripts/tp_images_check.sh: --tp 1 against 2)
    python3 scripts/bench_serving.py --dataset-name random-mm --random-mm-shared-images \
        --random-mm-image-size 1200x900 --random-input-len 64 --random-output-len 64 --num-prompts 200
Multi-turn chat (--multi-turn N): N conversations of --num-turns turns; each turn sends the whole history
(every earlier turn's prompt and the server's reply to it: --multi-turn-replies) plus --random-input-len new
tokens, so the histories grow past the GPU's KV and a returning conversation finds its prefix in the prefix
cache, in the host tier (--host_kv) or nowhere. Turns go out at a steady --request-rate (fixed intervals),
each once its conversation's previous turn is done; it reports TTFT per turn and the host tier's figures.
--compare-launch runs the same conversations against a second server afterwards (tier on, then off; one GPU):

    python3 scripts/bench_serving.py --multi-turn 64 --num-turns 10 --random-input-len 1024 \
        --random-output-len 128 --request-rate 4 --seed 1 \
        --launch "autoprofile serve --port 0 --host_kv auto" --compare-launch "autoprofile serve --port 0"
Loopback only: the URL must resolve to this host. Bounded: --num-prompts and --max-duration.

A cut (--max-duration SECONDS, default 1800, counted from the first request; or SIGTERM / SIGINT, e.g. from
an outer `timeout`): no request is sent after it, those in flight are cancelled (their streams closed, so
the server aborts them as it does a client that hangs up), and the usual summary is printed over the
requests that completed, with lines saying the run was cut (by what, when, how many completed whole, how many
were cancelled in flight, how many were never sent; "cut_by", "cut_at_s", "cancelled", "not_sent" in
--result-file). The cancelled and never-sent are not failed requests. A launched server is stopped as after
any run, and the exit status is as for an uncut run (0 unless something failed):

    timeout 590 python3 scripts/bench_serving.py --launch "autoprofile serve --port 0" --max-concurrency 512 \
        --num-prompts 512 --random-input-len 1000 --random-output-len 2000 --max-duration 540
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import ipaddress
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
import dataclasses
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import aiohttp
from PIL import Image

MAX_PROMPTS = 1_000_000
TOKEN_IDS = (3, 259)  # ids every tokenizer has (the byte-level tokenizer's bytes)
SERVING_ON = re.compile(r"serving on (http://\S+?)(?:,|\s|$)")
WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from",
         "it", "an", "are", "this", "be", "or", "which", "one", "all", "were", "her", "there", "been", "more")
IMAGE_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")
MAX_DATASET_BYTES = 8 << 30  # the random-mm requests are built before sending: their images, base64


# ---------------------------------------------------------------- one request
@dataclass
class Result:
    kind: str = "random"
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    status: int = 0
    disconnected: bool = False  # the client hung up on purpose (soak)
    lost: bool = False  # no answer within --request-timeout
    token_ids: list[int] = field(default_factory=list)  # the reply's ids (a request with return_token_ids)


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int
    kind: str = "random"
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0})
    disconnect_after: int | None = None  # chunks read before hanging up
    messages: list | None = None  # a chat completion (random-mm) instead of `prompt`


def request_body(model: str, job: Job, ignore_eos: bool) -> dict:
    """The streamed request: a completion of token ids, or a chat completion of job.messages."""
    prompt = {"messages": job.messages} if job.messages is not None else {"prompt": job.prompt}
    return {"model": model, **prompt, "max_tokens": job.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos, **job.sampling}


def chunk_text(msg: dict) -> str:
    """A stream chunk's text: a completion's `text` or a chat completion's `delta.content`."""
    if not msg.get("choices"):
        return ""
    choice = msg["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send(session: aiohttp.ClientSession, url: str, model: str, job: Job, ignore_eos: bool,
               timeout: float) -> Result:
    body = request_body(model, job, ignore_eos)
    if job.messages is not None:  # a chat request (images) in a completions run (the soak's mix)
        url = url.replace("/v1/completions", "/v1/chat/completions")
    r = Result(kind=job.kind, prompt_len=len(job.prompt))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            r.status = resp.status
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    r.success = not r.error
                    break
                msg = json.loads(data)
                if "error" in msg:
                    err = msg["error"]
                    r.error = f"stream error: {err.get('code')}: {err.get('message', '')[:120]}"
                    continue
                if msg.get("usage"):
                    r.output_tokens = msg["usage"]["completion_tokens"]
                    if job.messages is not None:  # the server counts the chat prompt's tokens (images too)
                        r.prompt_len = msg["usage"]["prompt_tokens"]
                if msg.get("choices"):
                    r.token_ids += msg["choices"][0].get("token_ids") or []
                if chunk_text(msg):
                    now = time.perf_counter()
                    if chunks == 0:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    if job.disconnect_after is not None and chunks >= job.disconnect_after:
                        r.disconnected = True
                        return r
        r.latency = time.perf_counter() - start
        if not r.success and not r.error:
            r.error = "the stream ended without [DONE]"
    except asyncio.TimeoutError:
        r.lost, r.error = True, f"no answer within {timeout:.0f} s"
    except aiohttp.ClientError as e:
        r.error = f"{type(e).__name__}: {e}"[:200]
    return r


# ---------------------------------------------------------------- the cut
@dataclass
class Cut:
    """A run cut short: --max-duration expired (counted from the first request sent) or SIGTERM / SIGINT
    arrived. Once set, no request is sent any more and those in flight are cancelled (their streams closed:
    the server aborts them as it does any client that hangs up); the summary is over the requests that
    completed, with the cancelled and the never-sent ones counted apart (not as failures)."""
    event: asyncio.Event = field(default_factory=asyncio.Event)
    by: str = ""  # "--max-duration" or the signal's name
    start: float = 0.0  # perf_counter of the first request
    at: float = 0.0  # perf_counter of the cut
    cancelled: int = 0
    not_sent: int | None = 0  # None: an open-ended workload (the soak)
    timer: asyncio.TimerHandle | None = None

    def is_set(self) -> bool:
        return self.event.is_set()

    def set(self, by: str) -> None:
        """Cut now (the first cause only counts)."""
        if not self.event.is_set():
            self.by, self.at = by, time.perf_counter()
            self.event.set()

    def begin(self, max_duration: float | None) -> float:
        """The first request goes out now: --max-duration counts from here (None: no limit). Its start."""
        self.start = time.perf_counter()
        if max_duration is not None:
            self.timer = asyncio.get_running_loop().call_later(max_duration, self.set, "--max-duration")
        return self.start

    def end(self, cancelled: int, not_sent: int | None) -> None:
        """The run is over: stop the timer; when it was cut, what the cut left undone."""
        if self.timer is not None:
            self.timer.cancel()
        if self.is_set():
            self.cancelled, self.not_sent = cancelled, not_sent

    def figures(self, max_duration: float) -> dict:
        """The summary's keys for a cut run (none for a run that was not cut)."""
        if not self.is_set():
            return {}
        by = f"--max-duration {max_duration:g} s" if self.by == "--max-duration" else self.by
        return {"cut_by": by, "cut_at_s": max(self.at - self.start, 0.0) if self.start else 0.0,
                "cancelled": self.cancelled, "not_sent": self.not_sent}


async def unless_cut(aw, cut: Cut) -> bool:
    """Await aw unless the run is cut first (aw is then cancelled): whether aw completed."""
    task = asyncio.ensure_future(aw)
    stopper = asyncio.ensure_future(cut.event.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not task.done():
            task.cancel()
    await asyncio.wait({task})
    if task.cancelled():
        return False
    task.result()  # its exception, if it raised one
    return True


async def finish_or_cut(tasks: list[asyncio.Task], cut: Cut, timeout: float | None = None) -> int:
    """Wait for the request tasks (at most timeout s) unless the run is cut first, then cancel those still
    running (closing their streams) and wait for them to end: how many were cancelled."""
    pending = {t for t in tasks if not t.done()}
    end = None if timeout is None else time.monotonic() + timeout
    stopper = asyncio.ensure_future(cut.event.wait())
    try:
        while pending and not cut.is_set():
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            _, pending = await asyncio.wait(pending | {stopper}, timeout=left,
                                            return_when=asyncio.FIRST_COMPLETED)
            pending.discard(stopper)
    finally:
        stopper.cancel()
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending)
    return sum(t.cancelled() for t in pending)


def install_cut_signals(cut: Cut) -> dict:
    """SIGTERM and SIGINT cut the run (as --max-duration expiring would): an outer `timeout` still gets the
    figures. The handlers they replace, for restore_signals; none off the main thread (no signals there)."""
    loop, saved = asyncio.get_running_loop(), {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous = signal.getsignal(sig)
            loop.add_signal_handler(sig, cut.set, sig.name)
        except (ValueError, RuntimeError, NotImplementedError):
            continue
        saved[sig] = previous
    return saved


def restore_signals(saved: dict) -> None:
    loop = asyncio.get_running_loop()
    for sig, previous in saved.items():
        loop.remove_signal_handler(sig)
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def cut_line(s: dict) -> str:
    """The cut in one line: what completed, what was cancelled in flight, what was never sent."""
    unsent = "" if s["not_sent"] is None else f", {s['not_sent']} never sent"
    return (f"CUT: the run was cut by {s['cut_by']} at {s['cut_at_s']:.1f} s after its first request: "
            f"{s['completed']} requests completed whole, {s['cancelled']} cancelled in flight (streams "
            f"closed){unsent}; the figures above are over the completed ones")


# ---------------------------------------------------------------- workloads
def random_jobs(n: int, input_len: int, output_len: int, range_ratio: float, rng: random.Random,
                sampling: dict) -> list[Job]:
    """vLLM's random dataset: lengths uniform in [len * (1 - ratio), len * (1 + ratio)]; every request with
    the `sampling` fields (sampling_fields)."""
    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))
    return [Job([rng.randrange(*TOKEN_IDS) for _ in range(length(input_len))], length(output_len), "random",
                dict(sampling)) for _ in range(n)]


def conversation_jobs(conversations: int, turns: int, input_len: int, output_len: int, rng: random.Random,
                      sampling: dict) -> list[list[Job]]:
    """Multi-turn chat: each conversation's turns, each the history so far (earlier prompts, each followed by
    an output_len reply of random ids standing for the answer) plus input_len new tokens."""
    out = []
    for _ in range(conversations):
        history, jobs = [], []
        for t in range(turns):
            history = history + [rng.randrange(*TOKEN_IDS) for _ in range(input_len)]
            jobs.append(Job(list(history), output_len, f"turn{t}", dict(sampling)))
            history = history + [rng.randrange(*TOKEN_IDS) for _ in range(output_len)]
        out.append(jobs)
    return out


def with_real_reply(planned: Job, planned_before: Job, sent_before: Job, reply: list[int]) -> Job:
    """A turn whose history holds the reply the server gave (a chat client): the prompt the conversation sent
    last, that reply's ids, then the turn's new tokens (what `planned` adds after planned_before's prompt and
    its random reply)."""
    new = planned.prompt[len(planned_before.prompt) + planned_before.max_tokens:]
    return dataclasses.replace(planned, prompt=sent_before.prompt + reply + new,
                               sampling={**planned.sampling, "return_token_ids": True})


async def run_conversations(url: str, model: str, conversations: list[list[Job]], args,
                            cut: Cut) -> tuple[list[Result], float]:
    """Turns at a steady --request-rate (one every 1 / rate seconds; inf: as soon as one is ready), each
    once its conversation's previous turn has ended, conversations in round-robin order. --multi-turn-replies
    real (the default): each turn's history holds the replies the server gave (their ids: return_token_ids),
    as a chat client sends it; random: the random ids conversation_jobs put there. The cut (--max-duration,
    a signal) stops the sending and cancels the turns in flight."""
    results: list[Result] = []
    ready = list(range(len(conversations)))
    next_turn = [0] * len(conversations)
    sent: list[tuple[Job, list[int]] | None] = [None] * len(conversations)  # last prompt sent, its reply
    woken = asyncio.Event()
    interval = 0.0 if args.request_rate == float("inf") else 1.0 / args.request_rate
    real = args.multi_turn_replies == "real"

    def turn_job(c: int) -> Job:
        t, planned = next_turn[c], conversations[c][next_turn[c]]
        if not real:
            return planned
        if t == 0:
            return dataclasses.replace(planned, sampling={**planned.sampling, "return_token_ids": True})
        return with_real_reply(planned, conversations[c][t - 1], *sent[c])

    async def one(c: int, job: Job) -> None:
        try:
            r = await send(session, url, model, job, args.ignore_eos, args.request_timeout)
            results.append(r)
            sent[c] = (job, r.token_ids)
        finally:
            next_turn[c] += 1
            if next_turn[c] < len(conversations[c]):
                ready.append(c)
            woken.set()

    start = cut.begin(args.max_duration)
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        sent_n, total = 0, sum(map(len, conversations))
        while sent_n < total and not cut.is_set():
            if not ready:
                woken.clear()
                await unless_cut(woken.wait(), cut)
                continue
            c = ready.pop(0)
            tasks.append(asyncio.create_task(one(c, turn_job(c))))
            sent_n += 1
            if interval:
                await unless_cut(asyncio.sleep(interval), cut)
        cut.end(await finish_or_cut(tasks, cut), total - sent_n)
    return results, time.perf_counter() - start


def ttft_by_turn(results: list[Result]) -> dict[str, float]:
    """Median TTFT (ms) of each turn's successful requests."""
    turns: dict[str, list[float]] = {}
    for r in results:
        if r.success and r.kind.startswith("turn"):
            turns.setdefault(r.kind, []).append(r.ttft * 1000)
    return {k: statistics.median(v) for k, v in sorted(turns.items(), key=lambda kv: int(kv[0][4:]))}


def random_png(width: int, height: int, rng: random.Random) -> bytes:
    """A PNG of random pixels (stored, not compressed: random pixels do not compress)."""
    buf = io.BytesIO()
    pixels = rng.randbytes(width * height * 3)
    Image.frombytes("RGB", (width, height), pixels).save(buf, "PNG", compress_level=0)
    return buf.getvalue()


def random_mm_jobs(n: int, input_len: int, output_len: int, range_ratio: float, num_images: int,
                   size: tuple[int, int], rng: random.Random, sampling: dict,
                   shared: bool = False) -> list[Job]:
    """vLLM's random-mm dataset: each request one user message of num_images random-pixel PNGs of size
    (width, height) as data: URLs, then about input_len random words; no two images alike, or (shared) every
    request with the same images (clients asking about one picture)."""
    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    def images() -> list[dict]:
        return [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                    + base64.b64encode(random_png(*size, rng)).decode()}}
                for _ in range(num_images)]
    same = images() if shared else None

    def message() -> list[dict]:
        text = " ".join(rng.choice(WORDS) for _ in range(length(input_len)))
        return [{"role": "user", "content": [*(same or images()), {"type": "text", "text": text}]}]
    return [Job([], length(output_len), "random-mm", dict(sampling), messages=message()) for _ in range(n)]


def image_size(text: str) -> tuple[int, int]:
    """--random-mm-image-size WxH -> (width, height)."""
    m = IMAGE_SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"must be WIDTHxHEIGHT in pixels, e.g. 1280x720, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r:.80}")
    return value


def sampling_fields(args: argparse.Namespace) -> dict:
    """--temperature / --top-p / --top-k as the request's fields (vLLM's benchmark flags)."""
    fields = {"temperature": args.temperature}
    if args.top_p is not None:
        fields["top_p"] = args.top_p
    if args.top_k is not None:
        fields["top_k"] = args.top_k
    return {**fields, **args.extra_body}


SOAK_IMAGE_SIZES = ((1400, 1000), (1280, 720), (640, 480), (300, 2000), (2000, 60), (56, 56))
SOAK_KINDS = ("long", "short", "top_p", "disconnect", "image", "image_disconnect")


def soak_image_pool(rng: random.Random, per_size: int = 2) -> list[dict]:
    """Image content parts for the soak (random pixels, assorted sizes and shapes; reused across requests,
    so the same image also comes back through the prefix cache)."""
    return [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                + base64.b64encode(random_png(w, h, rng)).decode()}}
            for w, h in SOAK_IMAGE_SIZES for _ in range(per_size)]


def soak_job(rng: random.Random, context_len: int, output_len: int, images: list[dict] = (),
             max_images: int = 0) -> Job:
    """One request of the hostile mix: context-filling prompts, many short ones, top-p, disconnects; with
    `images`, also chat requests of 1..max_images images (some disconnecting)."""
    weights = [0.05, 0.55, 0.25, 0.15] + ([0.3, 0.1] if images and max_images else [0, 0])
    kind = rng.choices(SOAK_KINDS, weights=weights)[0]
    out = max(min(output_len, context_len // 4), 1)
    if kind.startswith("image"):
        parts = [rng.choice(images) for _ in range(rng.randint(1, max_images))]
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 64)))
        return Job([], rng.randint(1, out), kind, {"temperature": 0.7, "top_p": 0.95},
                   messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
                   disconnect_after=rng.randint(1, 8) if kind == "image_disconnect" else None)
    ids = lambda n: [rng.randrange(*TOKEN_IDS) for _ in range(n)]  # noqa: E731
    medium = lambda: ids(rng.randint(1, max(min(1024, context_len - out - 1), 1)))  # noqa: E731
    if kind == "long":
        return Job(ids(context_len - out), out, kind)
    if kind == "short":
        return Job(ids(rng.randint(4, 64)), rng.randint(1, min(32, out)), kind)
    if kind == "top_p":
        return Job(medium(), out, kind,
                   {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": rng.randrange(1 << 31)})
    return Job(medium(), out, kind, disconnect_after=rng.randint(1, 8))


MEMORY_GAUGES = {"reserved": "autoprofile_cuda_memory_reserved_bytes",
                 "segments": "autoprofile_cuda_memory_segments", "kv_pages_used": "autoprofile_kv_pages_used",
                 "running": "autoprofile_num_requests_running"}
PEAK_GAUGE = "autoprofile_profile_peak_reserved_bytes"


async def sample_memory(url: str, period: float, stop: asyncio.Event) -> list[dict]:
    """Scrape the allocator gauges every `period` s until stop is set (one last sample then)."""
    samples, t0 = [], time.monotonic()
    while True:
        m = await scrape_or_none(url)
        if m is None:  # the server is gone: the requests say so
            return samples
        samples.append({"t": time.monotonic() - t0, "profile_peak": m.get(PEAK_GAUGE, 0.0),
                        **{k: m.get(name, 0.0) for k, name in MEMORY_GAUGES.items()}})
        if stop.is_set():
            return samples
        try:
            await asyncio.wait_for(stop.wait(), period)
        except asyncio.TimeoutError:
            pass


def memory_summary(timeline: list[dict]) -> dict:
    """Reserved memory and segments over the soak against the profile's peak (growth past it: fragments)."""
    peak = max((s["profile_peak"] for s in timeline), default=0.0)
    most = max((s["reserved"] for s in timeline), default=0.0)
    return {"samples": len(timeline), "profile_peak_reserved": peak, "max_reserved": most,
            "first_reserved": timeline[0]["reserved"] if timeline else 0.0,
            "max_segments": max((s["segments"] for s in timeline), default=0.0),
            "reserved_past_profile_peak": max(most - peak, 0.0) if peak else None}


def plot_soak_memory(timeline: list[dict], path: str | Path, title: str = "") -> Path:
    """Reserved memory (GiB) and segments over the soak, against the profile's peak (autoprofile/report.py's
    style)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = lambda b: b / (1 << 30)  # noqa: E731
    t = [s["t"] / 60 for s in timeline]
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.step(t, [gib(s["reserved"]) for s in timeline], where="post", label="reserved by the server", lw=2)
    peak = memory_summary(timeline)["profile_peak_reserved"]
    if peak:
        ax.axhline(gib(peak), color="grey", lw=1.2, ls="--", label="profile's reserved peak")
    ax.set_xlabel("minutes since the soak started")
    ax.set_ylabel("GiB")
    seg = ax.twinx()
    seg.step(t, [s["segments"] for s in timeline], where="post", color="C1", lw=1.2,
             label="allocator segments")
    seg.set_ylabel("segments")
    lines = ax.get_legend_handles_labels(), seg.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], loc="lower right", fontsize=8)
    ax.set_title(title or "autoprofile soak: reserved memory against the profile's peak")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


async def run_jobs(url: str, model: str, jobs, args, cut: Cut, deadline: float = math.inf,
                   max_duration: float | None = None) -> tuple[list[Result], float]:
    """Send jobs (a list, or a callable making one) at --request-rate (Poisson) and/or --max-concurrency,
    until `deadline` (monotonic; then a callable's requests have --request-timeout more to end) or the cut
    (max_duration after the first request, or a signal: the requests in flight are cancelled)."""
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed + 1)
    results: list[Result] = []
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0, force_close=False)

    async def one(job: Job) -> None:
        try:
            results.append(await send(session, url, model, job, args.ignore_eos, args.request_timeout))
        finally:
            if limit:
                limit.release()

    start = cut.begin(max_duration)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = []
        i = 0
        while time.monotonic() < deadline and (callable(jobs) or i < len(jobs)) and not cut.is_set():
            if limit and not await unless_cut(limit.acquire(), cut) or cut.is_set():
                break
            job = jobs() if callable(jobs) else jobs[i]
            tasks.append(asyncio.create_task(one(job)))
            i += 1
            if args.request_rate != float("inf"):
                await unless_cut(asyncio.sleep(rng.expovariate(args.request_rate)), cut)
        grace = max(deadline - time.monotonic(), 0) + args.request_timeout if callable(jobs) else None
        cancelled = await finish_or_cut(tasks, cut, grace)
        if not cut.is_set():  # the soak's requests still running --request-timeout after its end
            results += [Result(error="cancelled at --max-duration", lost=False)] * cancelled
        cut.end(cancelled, None if callable(jobs) else len(jobs) - i)
    return results, time.perf_counter() - start


# ---------------------------------------------------------------- report (vLLM's names)
def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def summarize(results: list[Result], duration: float, percentiles: list[float]) -> dict:
    ok = [r for r in results if r.success]
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": sum(not r.success and not r.disconnected for r in results),
        "disconnected": sum(r.disconnected for r in results),
        "lost": sum(r.lost for r in results),
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "request_throughput": len(ok) / duration if duration else 0.0,
        "errors": dict(Counter(r.error for r in results if r.error and not r.disconnected).most_common(10)),
    }
    out["output_throughput"] = out["total_output_tokens"] / duration if duration else 0.0
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / duration \
        if duration else 0.0
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name, values in series.items():
        ms = [v * 1000 for v in values]
        out[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        out[f"median_{name}_ms"] = statistics.median(ms) if ms else 0.0
        out[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else 0.0
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = _pct(ms, p)
    return out


TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def cut_rows(s: dict, row) -> list[str]:
    """A cut run's rows (none for a run that was not cut): by what, when, and what it left undone."""
    if "cut_at_s" not in s:
        return []
    return [row("Cut by:", s["cut_by"]), row("Cut at (s after the first request):", f"{s['cut_at_s']:.2f}"),
            row("Completed whole before the cut:", s["completed"]),
            row("Cancelled in flight at the cut:", s["cancelled"]),
            row("Never sent:", "-" if s["not_sent"] is None else s["not_sent"])]


def format_table(s: dict, percentiles: list[float], title: str = "Serving Benchmark Result") -> str:
    row = lambda k, v: f"{k:<40}{v:<10}"  # noqa: E731
    lines = [f"{' ' + title + ' ':=^50}",
             row("Successful requests:", s["completed"]),
             row("Failed requests:", s["failed"]),
             *cut_rows(s, row),
             row("Benchmark duration (s):", f"{s['duration']:.2f}"),
             row("Total input tokens:", s["total_input_tokens"]),
             row("Total generated tokens:", s["total_output_tokens"]),
             row("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
             row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
             row("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    for name, t in TITLES.items():
        lines.append(f"{t:-^50}")
        lines.append(row(f"Mean {name.upper()} (ms):", f"{s[f'mean_{name}_ms']:.2f}"))
        lines.append(row(f"Median {name.upper()} (ms):", f"{s[f'median_{name}_ms']:.2f}"))
        lines += [row(f"P{p:g} {name.upper()} (ms):", f"{s[f'p{p:g}_{name}_ms']:.2f}") for p in percentiles]
    for err, n in s["errors"].items():
        lines.append(f"error x{n}: {err}")
    lines.append("=" * 50)
    return "\n".join(lines)


# ---------------------------------------------------------------- the server
def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise SystemExit(f"error: --base-url: cannot resolve '{host}': {e}") from None
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise SystemExit(f"error: --base-url: {url} is not this host; this benchmark only sends to loopback "
                         "(127.0.0.1, ::1, localhost)")


def _own_session_tied_to_parent() -> None:
    """preexec_fn of a launched server: a session of its own, so a signal to the benchmark's process group
    (an outer `timeout`) reaches the benchmark alone, which cuts the run, reads the server's /metrics and
    stops it as after any run; and SIGTERM to the server if the benchmark dies first (Linux's
    PR_SET_PDEATHSIG), so no server outlives it holding a GPU."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG


class Launched:
    """`--launch CMD`: the server as a child process in a session of its own (_own_session_tied_to_parent);
    its log goes to stderr (prefixed) and is scanned for the address it bound."""

    def __init__(self, command: str):
        self.proc = subprocess.Popen(shlex.split(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, preexec_fn=_own_session_tied_to_parent)
        self.url: str | None = None
        self.bound = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if "aiohttp.access" not in line:  # one line per request: too many to echo
                sys.stderr.write(f"[server] {line}")
            m = SERVING_ON.search(line)
            if m and self.url is None:
                self.url = m.group(1).rstrip("/")
                self.bound.set()
        self.bound.set()

    def stop(self, timeout: float) -> int:
        """SIGTERM (the server drains), then the exit code; SIGKILL after timeout (code -9)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


async def wait_ready(url: str, timeout: float, proc: subprocess.Popen | None) -> dict:
    """Poll /health until 200 (the profile is validated); its body (capacity) is returned."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise SystemExit(f"error: the launched server exited with code {proc.returncode} before it "
                                 f"was ready")
            try:
                async with s.get(f"{url}/health") as r:
                    if r.status == 200:
                        return await r.json()
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit(f"error: {url}/health was not 200 within {timeout:.0f} s")


async def scrape(url: str) -> dict[str, float]:
    """The server's /metrics samples by name, labels included as written (autoprofile_serving_oom_total,
    autoprofile_engine_gpu_seconds_total{kind="decode",part="forward"}, ...)."""
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        return parse_samples(await r.text())


def parse_samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#"):
            out[parts[0]] = float(parts[1])
    return out


async def model_name(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/models") as r:
        return (await r.json())["data"][0]["id"]


# ---------------------------------------------------------------- main
async def bench(args, url: str, health: dict) -> dict:
    """The run and its summary; while it lasts, SIGTERM or SIGINT cuts it (Cut) instead of ending the
    process, so the summary of what completed is still printed."""
    cut = Cut()
    saved = install_cut_signals(cut)
    try:
        if args.profile:
            await profile_call(url, "/start_profile", {"num_steps": args.profile_steps} if args.profile_steps
                               else {})
        summary = await bench_run(args, url, health, cut)
        if args.profile:
            summary["profile"] = await profile_call(url, "/stop_profile", {})
        return summary
    finally:
        restore_signals(saved)


async def profile_call(url: str, path: str, body: dict) -> dict:
    """--profile: the server's /start_profile or /stop_profile (its --profile_dir); the server's refusal
    ends the run before a request is sent (start) or is kept in the summary (stop)."""
    async with aiohttp.ClientSession() as s, s.post(f"{url}{path}", json=body) as r:
        out = await r.json(content_type=None)
    if r.status != 200:
        message = (out.get("error") or {}).get("message") if isinstance(out, dict) else out
        if path == "/start_profile":
            raise SystemExit(f"error: {path} answered {r.status}: {message}")
        return {"error": f"{path} answered {r.status}: {message}"}
    print(f"{path}: {json.dumps(out)}")
    return out


async def bench_run(args, url: str, health: dict, cut: Cut) -> dict:
    model = args.model or await model_name(url)
    endpoint = f"{url}/v1/chat/completions" if args.dataset_name == "random-mm" else f"{url}/v1/completions"
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    rng = random.Random(args.seed)
    before = await scrape(url)
    if args.soak_minutes:
        context = health.get("max_req_total_len", args.random_input_len + args.random_output_len)
        args.max_concurrency = args.max_concurrency or health.get("max_running_requests", 64)
        deadline = time.monotonic() + args.soak_minutes * 60
        stop = asyncio.Event()
        pool = soak_image_pool(rng) if args.soak_images else []
        sampler = asyncio.create_task(sample_memory(url, args.soak_sample_seconds, stop))
        try:
            results, duration = await run_jobs(endpoint, model, lambda: soak_job(
                rng, context, args.random_output_len, pool, args.soak_images), args, cut, deadline)
        finally:
            stop.set()
            timeline = await sampler
    elif args.multi_turn:
        conversations = conversation_jobs(args.multi_turn, args.num_turns, args.random_input_len,
                                          args.random_output_len, rng, sampling_fields(args))
        results, duration = await run_conversations(endpoint, model, conversations, args, cut)
    else:
        jobs = dataset_jobs(args, rng)
        results, duration = await run_jobs(endpoint, model, jobs, args, cut, max_duration=args.max_duration)
    summary = summarize(results, duration, percentiles)
    summary.update(cut.figures(args.max_duration))
    if args.multi_turn:
        summary["ttft_by_turn_ms"] = ttft_by_turn(results)
    summary["model"], summary["max_concurrency"], summary["request_rate"] = model, args.max_concurrency, \
        args.request_rate
    summary["seed"] = args.seed
    summary["server_kv"] = {"tokens": before.get("autoprofile_kv_cache_tokens"),
                            "bytes": before.get("autoprofile_kv_cache_bytes")}
    await asyncio.sleep(1.0)  # aborted (disconnected) requests are freed by the next engine step
    after = await scrape_or_none(url)
    if after is None:
        summary["server"] = {"unreachable": f"{url}/metrics did not answer after the run "
                                            "(the server is gone)"}
    else:
        summary["server"] = server_figures(before, after)
    if args.soak_minutes:
        summary["by_kind"] = {k: {"sent": sum(r.kind == k for r in results),
                                  "ok": sum(r.kind == k and r.success for r in results),
                                  "failed": sum(r.kind == k and not r.success and not r.disconnected
                                                for r in results),
                                  "disconnected": sum(r.kind == k and r.disconnected for r in results),
                                  "lost": sum(r.kind == k and r.lost for r in results)}
                              for k in SOAK_KINDS}
        summary["memory"], summary["memory_timeline"] = memory_summary(timeline), timeline
        plot = args.soak_plot or (args.result_file and f"{Path(args.result_file).with_suffix('')}_memory.png")
        if plot:
            title = f"autoprofile soak: {model}, {args.soak_minutes:g} min at {args.max_concurrency} running"
            summary["memory_plot"] = str(plot_soak_memory(timeline, plot, title))
    return summary


def server_figures(before: dict, after: dict) -> dict:
    """What the server's /metrics say of the run: OOMs, pages left, preemptions, prefix-cache hits."""
    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)
    return {"oom_while_serving": grew("autoprofile_serving_oom_total"),
            "kv_pages_used_after": after.get("autoprofile_kv_pages_used"),
            "kv_pages_total": after.get("autoprofile_kv_pages_total"),
            "preemptions": grew("autoprofile_num_preemptions_total"),
            "requests_running_after": after.get("autoprofile_num_requests_running"),
            "prefix_cache_hit_tokens": grew(PREFIX_HITS),
            "host_kv": host_kv_figures(grew, after),
            "engine": engine_figures(grew)}


def host_kv_figures(grew, after: dict) -> dict | None:
    """The host tier's figures over the run (autoprofile_host_kv_*; None: the server has no tier): pages,
    hits, bytes moved, copy time and the copies' rate."""
    if "autoprofile_host_kv_pages_total" not in after:
        return None
    moved = grew("autoprofile_host_kv_moved_bytes_total")
    seconds = grew("autoprofile_host_kv_copy_seconds_total")
    return {"pages_total": after["autoprofile_host_kv_pages_total"],
            "pages_cached_after": after.get("autoprofile_host_kv_pages_cached"),
            "saved_pages": grew("autoprofile_host_kv_saved_pages_total"),
            "loaded_pages": grew("autoprofile_host_kv_loaded_pages_total"),
            "dropped_pages": grew("autoprofile_host_kv_dropped_pages_total"),
            "hit_tokens": grew("autoprofile_host_kv_hit_tokens_total"),
            "moved_gib": moved / 2**30, "copy_s": seconds,
            "copy_gib_per_s": moved / 2**30 / seconds if seconds else None}


def engine_figures(grew) -> dict:
    """Where the server's engine spent the run (autoprofile_engine_* counters, grown over the run): steps and
    tokens by kind, the GPU's seconds by kind and part and its idle gaps, the engine thread's by part."""
    out = {}
    for kind in ("prefill", "decode"):
        out[kind] = {"steps": grew(f'autoprofile_engine_step_kind_steps_total{{kind="{kind}"}}'),
                     "tokens": grew(f'autoprofile_engine_step_kind_tokens_total{{kind="{kind}"}}'),
                     **{f"gpu_{part}_s":
                        grew(f'autoprofile_engine_gpu_seconds_total{{kind="{kind}",part="{part}"}}')
                        for part in ("prepare", "forward")}}
    out["gpu_idle_s"] = grew('autoprofile_engine_gpu_seconds_total{kind="",part="idle"}')
    out["host_s"] = {part: grew(f'autoprofile_engine_host_seconds_total{{part="{part}"}}')
                     # step_clock.HOST_PARTS
                     for part in ("inbox", "schedule", "execute", "wait", "update", "post")}
    out["cpu_s"] = {t: grew(f'autoprofile_thread_cpu_seconds_total{{thread="{t}"}}')
                    for t in ("event_loop", "engine")}
    return out


def engine_line(e: dict, duration: float) -> str:
    """One line of where the engine's time went, against the run's duration."""
    def kind(k: str) -> str:
        d = e[k]
        n = d["steps"]
        if not n:
            return f"0 {k} steps"
        return (f"{n:.0f} {k} steps ({d['tokens'] / n:.0f} tokens each; GPU "
                f"{1e3 * d['gpu_forward_s'] / n:.2f} ms forward + "
                f"{1e3 * d['gpu_prepare_s'] / n:.2f} ms inputs each = "
                f"{d['gpu_forward_s'] + d['gpu_prepare_s']:.1f} s)")
    host = ", ".join(f"{p} {v:.1f} s" for p, v in e["host_s"].items())
    forward = e["prefill"]["gpu_forward_s"] + e["decode"]["gpu_forward_s"]
    return (f"engine over {duration:.1f} s: {kind('prefill')}; {kind('decode')}; forwards "
            f"{forward / duration:.0%} of the run; GPU idle between steps {e['gpu_idle_s']:.1f} s; engine "
            f"thread: {host}; CPU: event loop {e['cpu_s']['event_loop']:.1f} s, engine thread "
            f"{e['cpu_s']['engine']:.1f} s")


def dataset_jobs(args: argparse.Namespace, rng: random.Random) -> list[Job]:
    """--num-prompts requests of --dataset-name."""
    if args.dataset_name == "random-mm":
        return random_mm_jobs(args.num_prompts, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, args.random_mm_base_items_per_request,
                              args.random_mm_image_size, rng, sampling_fields(args),
                              args.random_mm_shared_images)
    return random_jobs(args.num_prompts, args.random_input_len, args.random_output_len,
                       args.random_range_ratio, rng, sampling_fields(args))


def soak_verdict(s: dict) -> list[str]:
    problems = []
    if s["failed"]:
        problems.append(f"{s['failed']} failed requests")
    if s["lost"]:
        problems.append(f"{s['lost']} lost requests (no answer in time)")
    if "unreachable" in s["server"]:
        return problems + [s["server"]["unreachable"]]
    if s["server"]["oom_while_serving"]:
        problems.append(f"{s['server']['oom_while_serving']:.0f} OOMs while serving")
    if s["server"]["kv_pages_used_after"]:
        problems.append(f"{s['server']['kv_pages_used_after']:.0f} KV pages still held after the soak")
    return problems


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    p.add_argument("--launch", default=None,
                   help='start this server command first, e.g. "autoprofile serve --port 0"')
    p.add_argument("--ready-timeout", type=float, default=1800,
                   help="seconds to wait for the server's /health to be 200 (its profile)")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--dataset-name", choices=("random", "random-mm"), default="random",
                   help="random: token-id completions; random-mm: chat completions with random images")
    p.add_argument("--random-mm-base-items-per-request", "--random-mm-num-images", type=int, default=1,
                   help="random-mm: images per request")
    p.add_argument("--random-mm-image-size", type=image_size, default=(512, 512),
                   help="random-mm: WIDTHxHEIGHT of every image (vLLM: --random-mm-bucket-config)")
    p.add_argument("--random-mm-shared-images", action="store_true",
                   help="random-mm: every request carries the same images (drawn once; the text differs), "
                        "as clients asking about one picture")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in len*(1 +- ratio)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="exact output lengths (default on)")
    p.add_argument("--seed", type=int, default=None,
                   help="prompts and images from this seed (default: a fresh one each run, printed; the same "
                        "seed "
                        "twice sends the same prompts, which the server's prefix cache then serves)")
    p.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=None, help="every request's top_p")
    p.add_argument("--top-k", type=int, default=None, help="every request's top_k")
    p.add_argument("--extra-body", type=json_object, default={},
                   help="fields added to every request's body (vLLM's flag), e.g. "
                   '\'{"response_format": {"type": "json_schema", "json_schema": {"name": "a", '
                   '"schema": {...}}}}\'')
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--max-duration", type=float, default=1800, metavar="SECONDS",
                   help="cut the run this long after its first request: send no more, cancel those in flight "
                        "(closing their streams), report the completed ones and count the cancelled and "
                        "never-sent apart (not the soak's length: --soak-minutes)")
    p.add_argument("--request-timeout", type=float, default=900,
                   help="a request without an answer by then is lost")
    p.add_argument("--soak-minutes", type=float, default=0,
                   help="soak mode: this long at the running capacity")
    p.add_argument("--soak-images", type=int, default=0,
                   help="soak: also chat requests of 1..N images of assorted sizes (a vision-language model)")
    p.add_argument("--soak-sample-seconds", type=float, default=5.0,
                   help="soak: seconds between allocator samples")
    p.add_argument("--soak-plot", default=None,
                   help="soak: the PNG of reserved memory over time (default: --result-file's *_memory.png)")
    p.add_argument("--result-file", default=None, help="write the JSON result here")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    p.add_argument("--multi-turn", type=int, default=0, metavar="N",
                   help="multi-turn chat: N conversations of --num-turns turns, each the history so far plus "
                        "--random-input-len new tokens, at a steady --request-rate")
    p.add_argument("--num-turns", type=int, default=10, help="turns of each --multi-turn conversation")
    p.add_argument("--multi-turn-replies", choices=("real", "random"), default="real",
                   help="real: each turn's history holds the replies the server gave (return_token_ids), "
                        "as a chat client sends it; random: random ids in their place (a history the server "
                        "never wrote: it parts from the cached reply, as an edited or regenerated turn does)")
    p.add_argument("--compare-launch", default=None, metavar="CMD",
                   help="after the --launch server's run, run the same workload against this server (e.g. "
                        "the same server with --host_kv off) and print both, side by side")
    p.add_argument("--roofline-tp", type=int, default=1, metavar="N",
                   help="the server's --tp: the roofline of N GPUs, each computing and reading 1/N of the "
                        "weights")
    p.add_argument("--profile", action="store_true",
                   help="a torch.profiler trace of the server's engine steps during the run (SGLang's "
                        "--profile): POST /start_profile before it, /stop_profile after (the server needs "
                        "--profile_dir); a traced server runs slower")
    p.add_argument("--profile-steps", type=int, default=None, metavar="N",
                   help="with --profile: the trace ends by itself after N engine steps")
    p.add_argument("--roofline-settle", type=float, default=SETTLE_S, metavar="S",
                   help="seconds of each rate's own work before the roofline's rates are timed (a card at "
                        "its power cap lowers its clock under load: the rates it holds); 0: a burst's rates")
    p.add_argument("--roofline", action="store_true",
                   help="measure this GPU's bf16 GEMM and copy rates first (before --launch starts the "
                        "server: the "
                        "GPU must be free) and print the run's roofline fraction (random dataset)")
    args = p.parse_args(argv)
    if not 1 <= args.num_prompts <= MAX_PROMPTS:
        p.error(f"--num-prompts must be in [1, {MAX_PROMPTS}]")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0")
    if not 0 <= args.random_range_ratio < 1:
        p.error("--random-range-ratio must be in [0, 1)")
    if not 0 <= args.soak_minutes <= 24 * 60:
        p.error("--soak-minutes must be in [0, 1440]")
    w, h = args.random_mm_image_size
    if args.dataset_name == "random-mm" and not 0 <= args.random_mm_base_items_per_request <= 64:
        p.error("--random-mm-base-items-per-request must be in [0, 64]")
    drawn = 1 if args.random_mm_shared_images else args.num_prompts
    if args.dataset_name == "random-mm" and \
            drawn * args.random_mm_base_items_per_request * w * h * 4 > MAX_DATASET_BYTES:
        p.error(f"--num-prompts x --random-mm-base-items-per-request x --random-mm-image-size is over "
                f"{MAX_DATASET_BYTES >> 30} GiB of base64 images, built before sending: fewer prompts or "
                "smaller images (e.g. --num-prompts 256 --random-mm-image-size 1280x720)")
    if not 0.1 <= args.soak_sample_seconds <= 600:
        p.error("--soak-sample-seconds must be in [0.1, 600], e.g. 5")
    if args.random_input_len < 1 or args.random_output_len < 1:
        p.error("--random-input-len and --random-output-len must be >= 1")
    if args.profile_steps is not None and not (args.profile and args.profile_steps >= 1):
        p.error("--profile-steps needs --profile and must be >= 1, e.g. --profile --profile-steps 40")
    if not 0 <= args.roofline_settle <= 60:
        p.error("--roofline-settle must be in [0, 60] seconds, e.g. 3")
    if args.temperature < 0 or (args.top_p is not None and not 0 < args.top_p <= 1) or \
            (args.top_k is not None and args.top_k < 0):
        p.error("--temperature must be >= 0, --top-p in (0, 1], --top-k >= 0 (e.g. --temperature 0.8 --top-p "
                "0.9)")
    if not 0 <= args.multi_turn <= 100_000 or not 1 <= args.num_turns <= 1000:
        p.error("--multi-turn must be in [0, 100000] and --num-turns in [1, 1000] (e.g. --multi-turn 64 "
                "--num-turns 10)")
    if not args.max_duration > 0:
        p.error("--max-duration must be > 0 seconds, e.g. 540")
    if args.compare_launch and not args.launch:
        p.error("--compare-launch needs --launch (the first server of the comparison)")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    return args


PREFIX_HITS = "autoprofile_prefix_cache_hit_tokens_total"


# ---------------------------------------------------------------- the roofline
SETTLE_S = 3.0  # seconds of a rate's own work before it is timed: a 700 W card settles at its power cap
BURST_CALLS = 20


def held_ms(call, timer, settle_s: float, timed_s: float = 1.0) -> tuple[float, float]:
    """ms a call: (in a burst of BURST_CALLS, as held after settle_s seconds of the same calls). `timer(call,
    n)` runs `call` n times and returns their ms (the probe: CUDA events, synchronized). A card at its power
    cap lowers its clock within a second of full load: under sustained prefill an H200 held 1,425-1,530 MHz
    at 700 W against its 1,980 MHz maximum (nvidia-smi: SW power cap), so a burst's rate is one no serving
    run gets. settle_s 0: the burst alone (both the same)."""
    burst = timer(call, BURST_CALLS) / BURST_CALLS
    if settle_s <= 0:
        return burst, burst
    chunk, spent = max(1, int(200 / burst)), 0.0  # about 0.2 s of calls between syncs
    while spent < settle_s * 1e3:
        spent += timer(call, chunk)
    n = max(BURST_CALLS, int(timed_s * 1e3 / burst))
    return burst, timer(call, n) / n


RATES_PROBE = """
import json, sys, torch
settle = float(sys.argv[1])
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
def timer(fn, n):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e)
def rates(name, fn, work):
    burst, held = held_ms(fn, timer, settle)
    return {name: work / (held * 1e-3), name.replace("_per_s", "_burst_per_s"): work / (burst * 1e-3)}
out = {"device": torch.cuda.get_device_name(), "settle_s": settle}
out.update(rates("gemm_flops_per_s", lambda: a @ b, 2 * 8192 ** 3))
out.update(rates("copy_bytes_per_s", lambda: dst.copy_(src), 2 * src.numel()))
out["fp8_gemm_flops_per_s"] = None  # cuBLASLt's FP8 GEMM with row-wise scales (FP8 weights' prefill)
if torch.cuda.get_device_capability() >= (8, 9):
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    sa, sb = torch.ones(8192, 1, device="cuda"), torch.ones(1, 8192, device="cuda")
    out.update(rates("fp8_gemm_flops_per_s", lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,
                                                                      out_dtype=torch.bfloat16),
                     2 * 8192 ** 3))
print(json.dumps(out))
"""
BURST_KEYS = {"gemm_flops_per_s": "gemm_flops_burst_per_s", "copy_bytes_per_s": "copy_bytes_burst_per_s",
              "fp8_gemm_flops_per_s": "fp8_gemm_flops_burst_per_s"}


def measure_rates(settle_s: float = SETTLE_S) -> dict | str:
    """The GPU's bf16 (and FP8) GEMM rate (8192^3) and device-to-device copy rate as the card holds them
    after settle_s seconds of each (held_ms; the burst's rates too, under BURST_KEYS), in a child process
    (its CUDA context is gone before a server starts); the reason why not, as text, when it cannot run (no
    GPU, or a server already holding the memory)."""
    code = inspect.getsource(held_ms) + f"BURST_CALLS = {BURST_CALLS}\n" + RATES_PROBE
    try:
        out = subprocess.run([sys.executable, "-c", code, str(settle_s)], capture_output=True, text=True,
                             timeout=300)
    except subprocess.TimeoutExpired:
        return "the rate probe timed out"
    if out.returncode != 0:
        last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode
        return f"the rate probe failed: {last}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def burst_rates(rates: dict) -> dict | None:
    """The rates of a burst in the roofline's keys (None: the probe measured no held rates apart)."""
    if not rates.get("settle_s") or BURST_KEYS["gemm_flops_per_s"] not in rates:
        return None
    return {**rates, **{k: rates.get(b) for k, b in BURST_KEYS.items()}}


def ttft_floor(requests: int, burst: int, prefill_s: float, quantile: float) -> float:
    """The least a `quantile` TTFT can be when `burst` of `requests` arrive at once (a run at fixed
    concurrency starts so) and each prompt's prefill takes prefill_s at the GPU's rate: however the burst is
    scheduled, its k-th first token waits for k prefills; every later request waits at least its own."""
    floors = sorted([prefill_s] * (requests - burst) + [k * prefill_s for k in range(1, burst + 1)])
    return floors[max(math.ceil(quantile * requests) - 1, 0)]


def fp8_params(m, expert_share: float) -> float:
    """FP8 weights a token (expert_share = top_k / E) or a step (the share of experts its rows reach) computes
    with or reads: the dense FP8 layers' and that share of the FP8 experts' (0 for a bf16 model)."""
    layers = m.quantized_linears()
    return (sum(q.weight_elements for q in layers if not q.experts)
            + expert_share * sum(q.weight_elements for q in layers if q.experts))


def roofline(summary: dict, rates: dict, m, cell_bytes: float, param_bytes: float, input_len: float,
             output_len: float, concurrency: int, tp: int = 1) -> dict:
    """The run's floor on this GPU (on each of `tp` GPUs under tensor parallelism: a rank computes and reads
    1/tp of the weights' FLOPs and bytes; cell_bytes is a rank's own K/V a token, MLA's latent whole): the
    prefill's FLOPs over the measured GEMM rate, plus each decode step's bytes (weights, and the running rows'
    K/V) over the measured copy rate, against the measured duration.
    Prefill FLOPs per request: 2 x the non-embedding params a token computes with (an MoE model's: the
    experts it reaches) x prompt tokens + causal attention (2 x layers x q heads x (qk + v head widths) x
    L^2 / 2) + its sampled token's lm_head. Decode: the requests come in waves of `concurrency`, each wave
    output_len - 1 steps over rows at input_len + output_len / 2 tokens on average, each step reading the
    weights its rows reach (m.params_read) at `param_bytes` a parameter. FP8 weights (m.quant): their GEMMs
    at the measured FP8 rate (fp8_gemm_flops_per_s; the bf16 one where it is missing), one byte a weight."""
    n = summary["completed"]
    embed = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    dense = m.params_per_token() - embed
    qk, v = m.attention_dims()
    attn = m.num_layers * m.num_heads * (qk + v) * input_len ** 2
    share = m.num_experts_per_tok / m.num_experts if m.num_experts else 0.0
    fp8_flops = n * 2 * fp8_params(m, share) * input_len / tp
    prefill_flops = n * (2 * dense * input_len + attn + 2 * m.vocab_size * m.hidden_size) / tp
    rows = min(concurrency, n)
    steps = -(-n // rows) * max(output_len - 1, 0)
    fp8_read = fp8_params(m, 1 - m.unreached_expert_share(rows))
    weight_bytes = (m.params_read(rows) - fp8_read) * param_bytes + fp8_read
    step_bytes = weight_bytes / tp + rows * (input_len + output_len / 2) * cell_bytes
    fp8_rate = rates.get("fp8_gemm_flops_per_s") or rates["gemm_flops_per_s"]
    prefill_s = (prefill_flops - fp8_flops) / rates["gemm_flops_per_s"] + fp8_flops / fp8_rate
    decode_s = steps * step_bytes / rates["copy_bytes_per_s"]
    ttft_p99 = ttft_floor(n, rows, prefill_s / n, 0.99)
    return {"tp": tp, "prefill_pflop": prefill_flops / 1e15, "gemm_tflops": rates["gemm_flops_per_s"] / 1e12,
            "fp8_pflop": fp8_flops / 1e15, "fp8_tflops": fp8_rate / 1e12 if fp8_flops else None,
            "ttft_p99_floor_s": ttft_p99,
            "prefill_s": prefill_s, "decode_steps": steps,
            "decode_step_ms": step_bytes / rates["copy_bytes_per_s"] * 1e3,
            "copy_gbps": rates["copy_bytes_per_s"] / 1e9, "decode_s": decode_s,
            "roofline_s": prefill_s + decode_s,
            "duration_s": summary["duration"], "fraction": (prefill_s + decode_s) / summary["duration"]}


def roofline_line(r: dict) -> str:
    rate = f"{r['gemm_tflops']:.0f} TFLOP/s"
    if r.get("fp8_tflops"):
        rate = f"({r['fp8_pflop']:.2f} of them FP8 at {r['fp8_tflops']:.0f}, the rest at {rate})"
    ranks = f" (each of {r['tp']} ranks)" if r.get("tp", 1) > 1 else ""
    return (f"roofline{ranks}: prefill {r['prefill_pflop']:.2f} PFLOP / {rate} = "
            f"{r['prefill_s']:.1f} s"
            f" + decode {r['decode_steps']} steps x {r['decode_step_ms']:.2f} ms ({r['copy_gbps']:.0f} GB/s "
            f"copy) = "
            f"{r['decode_s']:.1f} s -> {r['roofline_s']:.1f} s against {r['duration_s']:.1f} s measured: "
            f"{r['fraction']:.2f} of the roofline; P99 TTFT floor {r['ttft_p99_floor_s']:.2f} s (the first "
            f"wave arrives at once: its k-th first token waits for k prompts' prefill)" + burst_text(r))


def burst_text(r: dict) -> str:
    """The rates' provenance: held after their settle time, and the fraction at a burst's rates."""
    b = r.get("burst")
    if not b:
        return ""
    return (f"; the rates as held after {b['settle_s']:g} s of each; at a burst's rates "
            f"({b['gemm_tflops']:.0f} TFLOP/s, {b['copy_gbps']:.0f} GB/s) {b['fraction']:.2f} of the "
            f"roofline, "
            f"P99 TTFT floor {b['ttft_p99_floor_s']:.2f} s")


def roofline_text(summary: dict, rates: dict | str | None, args: argparse.Namespace) -> str:
    if not isinstance(rates, dict):
        return f"roofline: not measured ({rates})"
    from autoprofile.model_config import load_model_config
    try:
        m = load_model_config(summary["model"])
    except ValueError as e:
        return f"roofline: not computed (model '{summary['model']}': {e})"
    kv = summary.get("server_kv") or {}
    if not kv.get("tokens") or not summary.get("completed"):
        return "roofline: not computed (no completed request, or no KV size in the server's /metrics)"
    done = summary["completed"]
    shape = (m, kv["bytes"] / kv["tokens"], 2, summary["total_input_tokens"] / done,
             summary["total_output_tokens"] / done, args.max_concurrency or done, args.roofline_tp)
    r = roofline(summary, rates, *shape)
    burst = burst_rates(rates)
    if burst is not None:
        b = roofline(summary, burst, *shape)
        r["burst"] = {k: b[k] for k in ("gemm_tflops", "copy_gbps", "fraction", "ttft_p99_floor_s")}
        r["burst"]["settle_s"] = rates["settle_s"]
    summary["roofline"] = r
    return roofline_line(r)


def cold_prefill_note(summary: dict) -> str | None:
    """A random dataset whose prompts the server found in its prefix cache did not measure a cold prefill."""
    hits = summary["server"].get("prefix_cache_hit_tokens") or 0
    if hits > 0:
        return (f"NOTE: {hits:.0f} prompt tokens came from the server's prefix cache: this is not a "
                f"cold-prefill "
                f"figure (the same --seed {summary['seed']} as an earlier run, or a server that kept them)")
    return None


async def scrape_or_none(url: str) -> dict[str, float] | None:
    """/metrics, or None when the server is gone (its requests already failed: a result, not a traceback)."""
    try:
        return await scrape(url)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


def comparison_lines(a: dict, b: dict, labels: tuple[str, str]) -> list[str]:
    """Two runs of one workload side by side: TTFT p50/p99, throughput, the host tier's hits."""
    def tier(s: dict) -> str:
        h = (s.get("server") or {}).get("host_kv")
        if not h:
            return "no host tier"
        rate = f", {h['copy_gib_per_s']:.1f} GiB/s" if h.get("copy_gib_per_s") else ""
        return (f"host tier: {h['hit_tokens']:.0f} hit tokens, {h['moved_gib']:.2f} GiB moved in "
                f"{h['copy_s']:.2f} s{rate}")
    out = [f"{'':<12}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'req/s':>8}{'tok/s':>10}{'failed':>8}"]
    for label, s in zip(labels, (a, b)):
        out.append(f"{label:<12}{s['median_ttft_ms']:>12.1f}{s.get('p99_ttft_ms', 0.0):>12.1f}"
                   f"{s['request_throughput']:>8.2f}{s['total_token_throughput']:>10.0f}{s['failed']:>8}  "
                   f"{tier(s)}")
    if b["median_ttft_ms"] and a["median_ttft_ms"]:
        out.append(f"TTFT p50 {labels[1]} / {labels[0]}: {b['median_ttft_ms'] / a['median_ttft_ms']:.2f}x; "
                   f"throughput {labels[0]} / {labels[1]}: "
                   f"{a['total_token_throughput'] / max(b['total_token_throughput'], 1e-9):.2f}x")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare_launch:
        first = run_main(args, args.launch)
        if first[1].get("cut_by") in ("SIGTERM", "SIGINT"):  # told to stop: no second server
            print(f"--compare-launch not run: the first run was cut by {first[1]['cut_by']}")
            if args.result_file:
                with open(args.result_file, "w") as f:
                    json.dump({"launch": first[1], "compare_launch": None,
                               "args": {k: v for k, v in vars(args).items()}}, f, indent=2, default=str)
            return first[0]
        second = run_main(args, args.compare_launch)
        print("\n".join(comparison_lines(first[1], second[1], ("--launch", "--compare-launch"))))
        if args.result_file:
            with open(args.result_file, "w") as f:
                json.dump({"launch": first[1], "compare_launch": second[1],
                           "args": {k: v for k, v in vars(args).items()}}, f, indent=2, default=str)
        return max(first[0], second[0])
    return run_main(args, args.launch)[0]


def run_main(args, launch: str | None) -> tuple[int, dict]:
    """One run (one server, if launched): (exit code, summary)."""
    rates = measure_rates(args.roofline_settle) if args.roofline else None
    server = Launched(launch) if launch else None
    try:
        if server is not None:
            server.bound.wait(args.ready_timeout)
            if server.url is None:
                raise SystemExit("error: the launched server never logged 'serving on http://...'")
            url = server.url
        else:
            url = args.base_url.rstrip("/")
        check_loopback(url)
        health = asyncio.run(wait_ready(url, args.ready_timeout, server and server.proc))
        summary = asyncio.run(bench(args, url, health))
    finally:
        code = server.stop(timeout=600) if server is not None else None
    if server is not None:
        summary["server"]["exit_code"] = code
    print(f"seed {args.seed}: --seed {args.seed} sends these prompts again")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    title = f"Soak ({args.soak_minutes:g} min)" if args.soak_minutes else "Serving Benchmark Result"
    print(json.dumps(summary, indent=2) if args.json else format_table(summary, percentiles, title))
    if not args.json:
        shown = ("server", "by_kind", "memory")
        print(json.dumps({k: v for k, v in summary.items() if k in shown}, indent=2))
    if "cut_at_s" in summary:
        print(cut_line(summary))
    if args.result_file and not args.compare_launch:
        with open(args.result_file, "w") as f:
            json.dump({**summary, "args": {k: v for k, v in vars(args).items()}}, f, indent=2, default=str)
    problems = soak_verdict(summary) if args.soak_minutes else []
    if not args.soak_minutes and "unreachable" in summary["server"]:
        problems.append(summary["server"]["unreachable"])
    reached = not args.soak_minutes and "unreachable" not in summary["server"]
    note = cold_prefill_note(summary) if reached else None
    if note:
        print(note)
    engine = summary["server"]["engine"] if reached else None
    if engine and engine["prefill"]["steps"] + engine["decode"]["steps"]:
        print(engine_line(engine, summary["duration"]))
    if args.roofline:
        print(roofline_text(summary, rates, args))
    if server is not None and code != 0:
        problems.append(f"the server exited with code {code} after SIGTERM")
    if args.multi_turn and "ttft_by_turn_ms" in summary:
        turns = summary["ttft_by_turn_ms"].items()
        print("TTFT p50 by turn (ms): " + ", ".join(f"{k} {v:.0f}" for k, v in turns))
        if reached and summary["server"].get("host_kv"):
            print(f"host tier: {json.dumps(summary['server']['host_kv'])}")
    for msg in problems:
        print(f"FAIL: {msg}", file=sys.stderr)
    return (1 if problems else 0), summary


if __name__ == "__main__":
    sys.exit(main())
