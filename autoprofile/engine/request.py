"""A request's lifecycle state, owned by the scheduler; what one engine step reports back for it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from autoprofile.engine.multimodal import MultiModalInput, image_key_tokens
from autoprofile.engine.sampling_params import GREEDY, SamplingParams


# an output token a launched step samples, not yet read back (the overlapped engine: LLMEngine(overlap=True));
# the next step's decode row feeds it from the GPU (ReqTable.last_tokens), never from the host
PENDING = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted (its pages were freed; it is recomputed when resumed)
    RUNNING = "running"  # holds a request slot and the pages of its computed tokens
    LOADING = "loading"  # holds a slot and pages whose K/V is coming back from the host tier (no row yet)
    FINISHED = "finished"


class RequestError(ValueError):
    """A request the engine can never serve (refused up front): names the field and what would work."""

    def __init__(self, field_name: str, message: str):
        self.field, self.detail = field_name, message
        super().__init__(f"{field_name}: {message}")

    def __reduce__(self):  # pickled to the server from an engine process (serving.engine_process)
        return type(self), (self.field, self.detail)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = GREEDY
    max_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    arrival: int = 0  # admission order: preemption picks the youngest (largest arrival) running request
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_computed: int = 0  # tokens of prompt + output whose K/V are in the cache
    pages: list[int] = field(default_factory=list)
    slot: int | None = None
    num_preemptions: int = 0
    num_sent: int = 0  # output tokens already reported by step()
    generator: object | None = None  # a seeded request's own sampling.SeedStream, made on its first sample
    cached_pages: int = 0  # leading pages registered in the prefix cache (or taken from it)
    chain: int = 0  # chain id of the last of them (0: the empty prefix)
    mm: MultiModalInput | None = None  # images (a vision-language model's request)
    # logprobs.TokenLogprob entries, read back: of each known output token (params.logprobs), and of prompt
    # tokens 1.. (params.prompt_logprobs: the first prompt token has none)
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # structured output: an xgrammar.GrammarMatcher (engine.grammar), fed each output token once
    grammar: object | None = None
    prompt_array: object | None = None  # prompt_ids as an int64 numpy array, made once (logits_process)

    @property
    def pending(self) -> int:
        """Trailing PENDING output ids: sampled by launched steps, not read back yet (at most two)."""
        n, out = 0, self.output_ids
        while n < len(out) and out[-1 - n] == PENDING:
            n += 1
        return n

    @property
    def num_known(self) -> int:
        """Output tokens read back (what may be reported)."""
        return len(self.output_ids) - self.pending

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens: the K/V a full recompute would hold."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_len(self) -> int:
        """The most tokens this request can ever hold in the cache (prompt + max_tokens - 1: the last
        sampled token is never fed back)."""
        return len(self.prompt_ids) + self.max_tokens - 1

    def token(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return (self.prompt_ids[start:] if start < n else []) + self.output_ids[max(start - n, 0):end - n]

    def key(self, start: int, end: int) -> tuple:
        """The prefix-cache key of tokens [start, end): the ids, with image tokens keyed by their image."""
        ids = self.tokens(start, end)
        return image_key_tokens(ids, start, self.mm.images) if self.mm is not None else tuple(ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: the tokens new since the last report."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" (a stop token id), "length" (max_tokens) or "abort"
    prompt_tokens: int
    completion_tokens: int
    logprobs: list | None = None  # of new_token_ids (logprobs.TokenLogprob each), when the request asks
    prompt_logprobs: list | None = None  # once, with the first output: None, then prompt tokens 1..

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the one after it as one (vLLM's RequestOutputCollector merges so): both steps'
        tokens and logprobs, the later one's state and counts, the prompt's logprobs from whichever has them
        (the first output)."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            [*(self.logprobs or ()), *(later.logprobs or ())]
        prompt = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        tokens = [*self.new_token_ids, *later.new_token_ids]
        return RequestOutput(self.request_id, tokens, later.finished, later.finish_reason,
                             later.prompt_tokens, later.completion_tokens, logprobs, prompt)
