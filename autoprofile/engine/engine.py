"""LLMEngine: the one engine API (add_request / step / abort) used by the server, the stresses' callers
and the tests. Not thread-safe: one thread (the server's engine loop) owns it and the GPU.

    engine = LLMEngine(runner)                       # runner: a built ModelRunner (boot() returns one)
    rid = engine.add_request([1, 2, 3], SamplingParams(temperature=0.7, top_p=0.9), max_tokens=64,
                             stop_token_ids={2})     # RequestError (a ValueError, .field) if it can never fit
    while engine.has_unfinished():
        for out in engine.step():                    # one scheduled step inside the envelope
            out.request_id, out.new_token_ids, out.finished, out.finish_reason
    engine.abort(rid)                                # frees its pages and slot at once; reported as "abort"
    engine.generate(prompts, params, max_tokens)     # offline helper over the same loop
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from autoprofile.engine.request import RequestError, RequestOutput  # noqa: F401 - part of the API
from autoprofile.engine.sampling import GREEDY, SamplingParams


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    preemptions: int  # total since start
    pages_used: int
    pages_total: int
    steps: int


class LLMEngine:
    def __init__(self, runner):
        raise NotImplementedError("being built: see issue 7")

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams = GREEDY, max_tokens: int = 16,
                    stop_token_ids: Iterable[int] = (), request_id: str | None = None) -> str:
        """Queue a request; returns its id. Raises RequestError naming the field ("prompt", "max_tokens",
        "request_id") when it can never be served: empty prompt, ids outside the vocabulary,
        prompt + max_tokens > --max_req_total_len, or more pages than the whole cache holds."""
        raise NotImplementedError

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request now (its pages and slot are freed before this returns);
        the next step() reports it once with finish_reason "abort". False if unknown or finished."""
        raise NotImplementedError

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step (a prefill chunk batch or a decode batch); return an output for every
        request that got new tokens or finished in it."""
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        raise NotImplementedError

    @property
    def stats(self) -> EngineStats:
        raise NotImplementedError

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] = GREEDY,
                 max_tokens: int = 16) -> list[list[int]]:
        """Offline: run every prompt to completion over the same loop; output ids per prompt, in order."""
        raise NotImplementedError
