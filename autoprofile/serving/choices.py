"""The choices of one OpenAI request (`n`, `best_of`): one engine request each, read together.

The first choice is submitted alone; the others once it has returned its first token, so that its prompt's
full pages are in the prefix cache (Scheduler._register) and every other choice's admission takes them
(PrefixCache.match): the choices share the prompt's KV pages and compute only its last partial page.
Choice i of a seeded request draws from its own generator seeded with seed + i (reproducible, distinct).
best_of > n: the n choices with the highest cumulative logprob (of the raw logits) are returned (vLLM's).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from autoprofile.serving.tokenizer import TextStream


def cumulative(entries: Sequence) -> float:
    """A choice's cumulative logprob (best_of ranks choices by it)."""
    return sum(lp for _, lp, _ in entries)


@dataclass
class Choice:
    index: int
    handle: object  # async_engine.RequestHandle
    text: TextStream
    head: list = field(default_factory=list)  # outputs read before the other choices were submitted
    parts: list[str] = field(default_factory=list)
    entries: list = field(default_factory=list)  # logprob entries of its output tokens
    prompt: list | None = None  # prompt logprobs (the first choice's, when asked)
    tokens: int = 0  # completion tokens
    reason: str | None = None  # set once the choice ended
    offset: int = 0  # completions' text_offset of the next streamed token

    def advance(self, out, finish_reason: Callable, ids: list[int] | None = None) -> tuple[str, list]:
        """One engine output into the choice: its text delta and its new logprob entries; ids: the output's
        ids that make text (default: all of them)."""
        delta = self.text.push(out.new_token_ids if ids is None else ids)
        self.tokens = out.completion_tokens
        new = list(out.logprobs or [])
        if out.prompt_logprobs is not None:
            self.prompt = out.prompt_logprobs
        if self.text.stopped:
            self.reason = "stop"
            self.handle.close(completed=True)
        elif out.finished:
            delta += self.text.finish()
            self.reason = "stop" if self.text.stopped else finish_reason(out)
        self.parts.append(delta)
        self.entries += new
        return delta, new


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, object]]:
    """Every choice's outputs as they come, until each choice has ended (its reason set by the caller's
    advance); an EngineFailure of any choice is raised. One choice (n = 1, the common case) is read from its
    handle directly: no task and no second queue a token."""
    if len(choices) == 1:
        c = choices[0]
        for out in c.head:
            if c.reason is None:
                yield c, out
        while c.reason is None:
            try:
                out = await anext(c.handle)
            except StopAsyncIteration:
                return
            yield c, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            for out in c.head:
                queue.put_nowait((c, out, None))
            async for out in c.handle:
                queue.put_nowait((c, out, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((c, None, e))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        while any(c.reason is None for c in choices):
            c, out, error = await queue.get()
            if error is not None:
                raise error
            if c.reason is None:
                yield c, out
    finally:
        for t in tasks:
            t.cancel()


def best(choices: list[Choice], n: int) -> list[Choice]:
    """The n choices of highest cumulative logprob (all of them when n is every choice), in that order."""
    if n == len(choices):
        return choices
    return sorted(choices, key=lambda c: -cumulative(c.entries))[:n]
