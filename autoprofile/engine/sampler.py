"""Logits to tokens, in one place (vLLM's Sampler.forward): for a step's sampled rows, the raw logits'
log-softmax (vLLM's raw_logprobs: before anything edits them), then the grammar mask (engine.grammar), the
logits processors (engine.logits_process), the sample (engine.sampling) and the sampled tokens' logprobs
(engine.logprobs). The prompt logprobs of a prefill are scored during the forward (prompt_logprobs: the
hidden states are gone once the last rows' logits exist) and ride with the result.

    sampler = Sampler(bitmask, generator, last_tokens, staging)        # built with the runner's build()
    out = sampler(logits, SamplingMetadata.from_rows(rows))            # SamplerOutput, on the device
    StepTokens(out).result()                                           # SampledTokens, on the host

The result is explicit: SampledTokens(tokens, logprobs, prompt_logprobs), read by the engine
(keep_logprobs, Scheduler.resolve) and returned by every rank of the TP step broadcast.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from autoprofile.engine import logits_process, logprobs
from autoprofile.engine.grammar import TokenBitmask
from autoprofile.engine.kv_cache import to_device
from autoprofile.engine.logits_process import RowTokens
from autoprofile.engine.logprobs import PromptLogprobs, SampledLogprobs, TokenLogprob
from autoprofile.engine.sampling import SamplingBatch, SeedStream, greedy, request_generator, sample
from autoprofile.engine.sampling_params import SamplingParams
from autoprofile.engine.step_inputs import Staging

NO_TOKENS = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class SamplingMetadata:
    """What the sampler reads of a step's sampled rows, taken from them on the host: each row's parameters,
    the (row, matcher) of rows with a grammar, the processed rows and their inputs (logits_process), each
    row's seed stream (None: all draw from the engine's generator), and whether the rows are a stress corner's
    (every row masked)."""

    params: tuple[SamplingParams, ...]
    grammars: tuple[tuple[int, object], ...] = ()
    processed: tuple[int, ...] = ()
    row_tokens: tuple[RowTokens, ...] = ()
    generators: tuple[SeedStream | None, ...] | None = None
    stress: bool = False

    @classmethod
    def from_rows(cls, rows: Sequence, stress: bool = False) -> SamplingMetadata:
        params = tuple(r.params for r in rows)
        processed = tuple(logits_process.processed_rows(params))
        greedy = all(p.temperature == 0 for p in params)
        return cls(params,
                   tuple((i, r.request.grammar) for i, r in enumerate(rows)
                         if r.request is not None and r.request.grammar is not None),
                   processed, tuple(logits_process.row_tokens(rows[i]) for i in processed),
                   None if greedy else row_generators(rows), stress)

    def running(self, rows: Sequence) -> SamplingMetadata:
        """Without the grammar rows of requests that ended since the launch (the overlapped engine samples a
        grammar step after it read the step before back: a row of a request that stopped there is dropped,
        its matcher is done)."""
        live = tuple((i, m) for i, m in self.grammars if not rows[i].request.finished)
        return self if len(live) == len(self.grammars) else replace(self, grammars=live)

    @property
    def all_greedy(self) -> bool:
        return all(p.temperature == 0 for p in self.params)


def row_generators(rows: Sequence) -> tuple[SeedStream | None, ...] | None:
    """Seeded requests draw from their own seed stream (sampling.SeedStream, kept on the request, so their
    tokens do not depend on the batch, nor on a preemption: it advances once per sampled token)."""
    if all(r.params.seed is None for r in rows):
        return None
    for r in rows:
        if r.params.seed is not None and r.request is not None and r.request.generator is None:
            r.request.generator = request_generator(r.params)
    return tuple(r.request.generator if r.request is not None else None for r in rows)


@dataclass(frozen=True)
class SamplerOutput:
    """A step's sampled tokens [rows] int64 and their logprobs, on the device (None: no row asked)."""

    tokens: torch.Tensor
    logprobs: SampledLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [self.tokens] + [lp.scores for lp in (self.logprobs, self.prompt_logprobs) if lp is not None]


@dataclass(frozen=True)
class SampledTokens:
    """A step's result on the host: the sampled token ids in row order; `logprobs` one entry per sampled row
    (None for a row that asked for none; None when no row asked); `prompt_logprobs` {index in step.rows:
    (first prompt position scored, entries)}."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


class StepTokens:
    """A launched step's SamplerOutput on its way to the host: one non-blocking copy of each tensor into
    pinned memory and an event; result() waits for that step alone (a step launched after it keeps
    running).

    A step with grammar rows is launched without its sample (ModelRunner.launch: `sample` is the deferred
    call): the overlapped engine reads the step before back, so the matchers hold its tokens, then calls
    sample() (vLLM's sample_tokens) while the GPU runs this step's forward. result() samples first if no one
    did."""

    def __init__(self, out: SamplerOutput | None = None, sample: Callable[[], SamplerOutput] | None = None):
        self._sample = sample
        if out is not None:
            self._read_back(out)

    def sample(self) -> None:
        """Launch the deferred sample (once); nothing for a step sampled at its launch."""
        fn, self._sample = self._sample, None
        if fn is not None:
            self._read_back(fn())

    def _read_back(self, out: SamplerOutput) -> None:
        self.out = out
        tensors = out.tensors()
        if any(t.is_cuda for t in tensors):  # a step that samples nothing may still carry prompt logprobs
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self._host, tensors):
                h.copy_(t, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = tensors, None

    def result(self) -> SampledTokens:
        self.sample()
        if self._done is not None:
            self._done.synchronize()
        host = iter(self._host)
        tokens = next(host).tolist()
        lps, prompt = self.out.logprobs, self.out.prompt_logprobs
        return SampledTokens(tokens, None if lps is None else lps.host(next(host), tokens),
                             {} if prompt is None else prompt.host(next(host)))


class Sampler:
    """One build's sampler: the grammar bitmask of the envelope's sampled rows, the engine's generator, the
    request table's last tokens (a PENDING output id of a processed row) and the runner's pinned staging.
    logprob_log (tests): a list to record each logprob buffer's rows in, ("sampled" | "prompt", rows, k)."""

    def __init__(self, bitmask: TokenBitmask, generator: torch.Generator, last_tokens: torch.Tensor | None,
                 staging: Staging | None = None):
        self.bitmask, self.generator, self.device = bitmask, generator, bitmask.device
        self.last_tokens, self.staging = last_tokens, staging
        self.logprob_log: list | None = None

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 prompt: PromptLogprobs | None = None) -> SamplerOutput:
        """The tokens of logits [sampled rows, vocab] (edited in place) and their logprobs; `prompt` (the
        step's prompt logprobs) rides along."""
        k = logprobs.top_k_of(tuple(p.logprobs for p in meta.params))
        raw = None if k is None else self._raw(logits, k)
        # structured output first (vLLM's order): min_p then keeps tokens of the grammar's distribution,
        # never a threshold that only disallowed tokens pass
        if meta.stress:
            self.bitmask.apply_stress(logits)
        else:
            self.bitmask.apply(logits, list(meta.grammars))
        if meta.processed:  # penalties, logit_bias, min_tokens, min_p: in place, before the sample
            logits_process.apply(logits, meta.processed, meta.row_tokens, self.last_tokens, self.staging)
        tokens = self._sample(logits, meta)
        if raw is None:
            return SamplerOutput(tokens, None, prompt)
        scores = logprobs.scored(raw, tokens, k)
        del raw
        return SamplerOutput(tokens, SampledLogprobs(scores, k, tuple(p.logprobs for p in meta.params)),
                             prompt)

    def _raw(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        if self.logprob_log is not None:
            self.logprob_log.append(("sampled", logits.shape[0], k))
        return logprobs.raw_logprobs(logits)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.all_greedy:  # no parameters to upload
            return greedy(logits)
        batch = SamplingBatch.from_params(meta.params, self.device)
        return sample(logits, batch, self.generator, meta.generators, stress=meta.stress,
                      staging=self.staging)

    def prompt_logprobs(self, rows: Sequence, hidden: torch.Tensor, cu: np.ndarray,
                        compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> PromptLogprobs | None:
        """The prompt logprobs of the prefill rows that ask for them (logprobs.prompt_positions), scored from
        the forward's hidden states; None: no row asks."""
        kp = logprobs.top_k_of([r.params.prompt_logprobs for r in rows])
        if kp is None:
            return None
        index, targets, spans = logprobs.prompt_positions(rows, cu)
        on_device = (to_device(torch.from_numpy(a), self.device) for a in (index, targets))
        scores = logprobs.prompt_scores(compute_logits, hidden, *on_device, kp, log=self.logprob_log)
        ks = tuple(rows[i].params.prompt_logprobs for i, *_ in spans)
        return PromptLogprobs(scores, kp, tuple(spans), ks, tuple(targets.tolist()))
