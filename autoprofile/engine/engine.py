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

Overlap (LLMEngine(runner, overlap=True), the server's default on one GPU; SGLang's overlap scheduler): step()
schedules and launches the next step before it waits for the step in flight, so the host's scheduling, input
building and token handling run while the GPU computes, and step() returns the outputs of the step before
(scheduler: PENDING tokens). Without it, step() runs one step and returns its outputs. A step that samples for
a request with a grammar (structured output) overlaps too, as vLLM's structured output does under async
scheduling: its forward is launched first (ModelRunner.launch), the step before is read back (its tokens
advance the matchers), then its sample (StepTokens.sample): the mask is filled on the host from the matchers
while the GPU runs the forward, and applied on the GPU before the sample.

A step that raises ends its prefill rows' requests with finish_reason "error" (a decode step's: all of them);
a mixed step's decode rows give back the pages it granted them (Scheduler.rollback: the device's page table
may never have learned them) and run again in the next step; a hybrid model's end too (their recurrent state
may have advanced in the layers that ran). A step that raises on its read back (overlap) ends every request
it holds.
"""
from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from autoprofile import budget
from autoprofile.engine.host_kv import HostTierStats
from autoprofile.engine.multimodal import MultiModalInput, window_count
from autoprofile.engine.request import Request, RequestError, RequestOutput
from autoprofile.engine.sampler import SampledTokens
from autoprofile.engine.sampling import GREEDY, SamplingParams
from autoprofile.engine.scheduler import Scheduler, Step
from autoprofile.engine.step_clock import HostTimer, StepTimes
from autoprofile.engine.step_runner import StepRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    preemptions: int  # total since start
    pages_used: int
    pages_total: int
    steps: int
    failed_steps: int  # steps that raised: their requests finished with finish_reason "error"
    ooms: int  # of those, out-of-memory errors (a validated envelope keeps this 0)
    prefix_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    launched: int = 0  # steps launched (overlap: one ahead of `steps`); none while every request starves
    host: HostTierStats | None = None  # the prefix cache's host tier (--host_kv); None: off
    state_slots: int = 0  # a hybrid model's state slots (one per request slot); 0: no state cache
    state_slots_used: int = 0  # held by requests (running, or loading)


class LLMEngine:
    def __init__(self, runner: StepRunner, prefix_caching: bool = True, overlap: bool = False,
                 state_checkpoints: int | None = None, schedule_conservativeness: float = 0.0,
                 max_waiting_steps: int = 0, waiting_served_ratio: float = 0.0):
        """overlap: launch each step before reading the one in flight back (a runner that `overlaps`; a TP
        StepBroadcaster does not: its workers would feed tokens they never sampled). state_checkpoints: a
        hybrid's --state_checkpoints, as the runner built them (None: budget.state_checkpoints' default).
        schedule_conservativeness: admission's estimate of the output to come (engine.admission; SGLang's
        --schedule-conservativeness): 0 admits on free pages alone, 1 (the server's) as SGLang's default.
        max_waiting_steps, waiting_served_ratio: when waiting requests join running decode rows
        (engine.admission.admit_now; 0, the default here: at once; the server's: its flags)."""
        if runner.envelope is None:
            raise RuntimeError("LLMEngine needs a built runner (autoprofile.profiler.boot returns one)")
        if overlap and not runner.overlaps:
            raise ValueError(f"overlap needs a runner that launches a step without waiting for it "
                             f"(ModelRunner.launch); {type(runner).__name__} does not")
        self.overlap = overlap
        self._inflight: tuple[Step, object] | None = None  # overlap: the launched step, its tokens in flight
        self.runner, self.envelope = runner, runner.envelope
        # a hybrid's cached prefix resumes only from a state checkpoint at its end: the runner builds as many
        # rows as budget.state_checkpoints gives (none under --disable_prefix_caching)
        hybrid = runner.model_config.is_hybrid
        checkpoints = budget.state_checkpoints(self.envelope.running_reqs, prefix_caching, state_checkpoints)
        pool = runner.host_kv  # the host tier's pinned pages (--host_kv), or None
        self.scheduler = Scheduler(runner.envelope, runner.kv.num_pages, prefix_caching,
                                   host_pages=pool.num_pages if pool is not None else 0,
                                   state_checkpoints=checkpoints, hybrid=hybrid,
                                   schedule_conservativeness=schedule_conservativeness,
                                   max_waiting_steps=max_waiting_steps,
                                   waiting_served_ratio=waiting_served_ratio)
        if hybrid and prefix_caching:
            log.info("prefix caching %s for %s, a hybrid model: a cached prefix resumes from one of %d state "
                     "checkpoints (--state_checkpoints; the built line gives their GiB; no host tier for it)",
                     "on" if self.scheduler.cache.enabled else "off", runner.model_config.name, checkpoints)
        self.vocab_size = runner.model_config.vocab_size
        self._requests: dict[str, Request] = {}
        self._ended: list[Request] = []  # aborted or failed, reported by the next step()
        self._arrivals = itertools.count()
        self._steps = self._failed_steps = self._ooms = self._launched = 0
        self.clock = runner.clock
        self.clock.reset()

    @classmethod
    def from_config(cls, runner: StepRunner, cfg) -> LLMEngine:
        """The server's engine: prefix caching unless --disable_prefix_caching; overlap on one GPU unless
        --disable_overlap_schedule (under --tp the runner is the step broadcast, which does not overlap);
        admission under the estimate of the output to come (engine.admission), so that a crowd of long outputs
        does not outgrow the cache together and thrash."""
        return cls(runner, prefix_caching=not cfg.disable_prefix_caching,
                   overlap=not cfg.disable_overlap_schedule and cfg.tp == 1,
                   state_checkpoints=cfg.state_checkpoints, schedule_conservativeness=1.0,
                   max_waiting_steps=cfg.max_waiting_steps, waiting_served_ratio=cfg.waiting_served_ratio)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams = GREEDY, max_tokens: int = 16,
                    stop_token_ids: Iterable[int] = (), request_id: str | None = None,
                    mm: MultiModalInput | None = None, grammar=None) -> str:
        """Queue a request; returns its id. Raises RequestError naming the field ("prompt", "max_tokens",
        "request_id") when it can never be served: empty prompt, ids outside the vocabulary,
        prompt + max_tokens > --max_req_total_len, or more pages than the whole cache holds."""
        prompt = list(prompt_ids)
        context = self.envelope.max_req_total_len
        if not prompt:
            raise RequestError("prompt", "must hold at least one token")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt):
            raise RequestError("prompt", f"token ids must be integers in [0, {self.vocab_size})")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError("max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
        if len(prompt) >= context:
            raise RequestError("prompt",
                               f"{len(prompt)} tokens leave no room for output under the {context}-token "
                                         f"request limit (--max_req_total_len): at most {context - 1} tokens")
        if len(prompt) + max_tokens > context:
            raise RequestError("max_tokens",
                               f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                                             f"the {context}-token request limit (--max_req_total_len); "
                                             f"try max_tokens <= {context - len(prompt)}")
        self._check_processors(params, max_tokens, stop_token_ids)
        if request_id in self._requests:
            raise RequestError("request_id", f"'{request_id}' is already in use")
        arrival = next(self._arrivals)
        request_id = request_id if request_id is not None else f"req-{arrival}"
        if mm is not None:
            self._check_images(mm, len(prompt))
        req = Request(request_id, prompt, params, max_tokens, frozenset(stop_token_ids), arrival, mm=mm,
                      grammar=grammar)
        pages = math.ceil(req.max_len / self.envelope.page_size)
        if pages > self.scheduler.cache.capacity:
            capacity = self.scheduler.cache.capacity * self.envelope.page_size
            raise RequestError("max_tokens",
                               f"the request can grow to {req.max_len} tokens, the KV cache holds "
                                             f"{capacity}; try max_tokens <= {capacity - len(prompt) + 1}")
        self._requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def _check_processors(self, params: SamplingParams, max_tokens: int,
                          stop_token_ids: Iterable[int]) -> None:
        """Token ids inside the vocabulary (logit_bias, stop_token_ids); min_tokens <= max_tokens (vLLM)."""
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise RequestError("logit_bias", f"keys must be token ids in [0, {vocab})")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in stop_token_ids):
            raise RequestError("stop_token_ids", f"token ids must be integers in [0, {vocab})")
        if params.min_tokens > max_tokens:
            raise RequestError("min_tokens", f"min_tokens ({params.min_tokens}) must be <= max_tokens "
                               f"({max_tokens})")

    def _check_images(self, mm: MultiModalInput, prompt_len: int) -> None:
        """Images inside the envelope (what the encoder's stress ran), each inside the prompt, in order."""
        env = self.envelope
        if not env.encoder_images:
            raise RequestError("images", "this model takes no images (it has no vision encoder)")
        if len(mm.images) > env.images_per_request:
            raise RequestError("images",
                               f"{len(mm.images)} images, at most {env.images_per_request} per request "
                                         f"(--max_images_per_request)")
        end = 0
        for im in mm.images:
            too_many_windows = window_count(*im.grid[1:]) > window_count(*env.image_grid[1:])
            if im.num_tokens > env.image_tokens or too_many_windows:
                raise RequestError("images",
                                   f"an image of {im.num_tokens} tokens ({im.grid[1]} x {im.grid[2]} "
                                             f"patches) is larger than the encoder's stress ran "
                                             f"({env.image_tokens} tokens; --max_image_pixels)")
            if im.offset < end or im.end > prompt_len:
                raise RequestError("images",
                                   "image tokens must lie inside the prompt, in order, without overlap")
            end = im.end

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request now (its pages and slot are freed before this returns);
        the next step() reports it once with finish_reason "abort". False if unknown or finished."""
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return False
        self.scheduler.finish(req, "abort")
        self._ended.append(req)
        return True

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step (a prefill chunk batch or a decode batch); return an output for every
        request that got new tokens or finished in it (aborted ones included). Overlap: launch the next
        step, then return the outputs of the one launched before it."""
        ended, self._ended = self._ended, []
        outputs = [self._report(req) for req in ended]
        with HostTimer(self.clock, "schedule"):
            self._poll_loads()
            step = self.scheduler.schedule()
        launched = self._launch(step, outputs) if step is not None else None
        before, self._inflight = self._inflight, launched if self.overlap else None
        got = self._read_back(*before, outputs) if before is not None else []
        if launched is not None and self.overlap and has_grammar(step):
            # the matchers hold the tokens before now: the mask, then the sample, behind the forward; the
            # reports of the step before are built once the sample is launched
            self._inflight = self._sample(*launched, outputs, got)
        else:
            outputs += self._reports(got)
        if launched is not None and not self.overlap:
            outputs += self._reports(self._read_back(*launched, outputs))
        if not self.has_unfinished() or (step is None and before is None):
            self.clock.idle()
        if step is None and before is None and self.scheduler.pending_loads:
            self._wait_loads()
        return outputs

    def _wait_loads(self) -> None:
        """Nothing launched and nothing in flight, only host tier loads: wait for the first of them to land
        (the runner's event) instead of coming straight back to poll it, a busy loop on the host."""
        with HostTimer(self.clock, "wait"):
            self.runner.wait_load(self.scheduler.pending_loads[0])

    def _poll_loads(self) -> None:
        """The host tier's loads that the runner has finished (never waits): their requests run from now
        on."""
        pending = self.scheduler.pending_loads
        if pending:
            self.scheduler.loads_done(self.runner.loads_ready(pending))

    def _launch(self, step: Step, outputs: list[RequestOutput]) -> tuple[Step, object] | None:
        try:
            with HostTimer(self.clock, "execute"):
                tokens = self.runner.launch(step) if self.overlap else self.runner.execute(step)
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine serves on
            # a mixed step's decode rows run again in the next step, with the pages the device knows; a hybrid
            # model's fail too: a forward that raised after some layers ran advanced their recurrent state
            # there, and running the token again would apply it twice (K/V written twice is the same K/V)
            self._failed(step.all_rows if self.runner.model_config.is_hybrid else step.rows, e, outputs)
            self.scheduler.rollback(step)
            return None
        self.scheduler.launched(step)
        self._launched += 1
        return step, tokens

    def _sample(self, step: Step, tokens, outputs: list[RequestOutput],
                got: list[Request]) -> tuple[Step, object] | None:
        """Launch a grammar step's deferred sample (ModelRunner.launch), then report `got` (the step before's
        requests, read back: their reports are built while the GPU samples); its rows fail if it raises
        (after those reports: what the requests got before)."""
        try:
            with HostTimer(self.clock, "execute"):
                tokens.sample()
        except Exception as e:  # noqa: BLE001 - every row was counted as launched: all of them fail
            outputs += self._reports(got)
            self._failed(step.all_rows, e, outputs)
            return None
        outputs += self._reports(got)
        return step, tokens

    def _read_back(self, step: Step, tokens, outputs: list[RequestOutput]) -> list[Request]:
        """The step's tokens (read back: overlap waits here for that step alone) into its requests; the
        requests that got one (to report)."""
        if self.overlap:
            try:
                with HostTimer(self.clock, "wait"):
                    tokens = tokens.result()
            except Exception as e:  # noqa: BLE001 - every row was counted as launched: all of them fail
                self._failed(step.all_rows, e, outputs)
                return []
        self._steps += 1
        with HostTimer(self.clock, "update"):
            keep_logprobs(step, tokens)
            return self.scheduler.resolve(step, tokens.tokens)

    def _reports(self, got: list[Request]) -> list[RequestOutput]:
        with HostTimer(self.clock, "update"):
            return [self._report(req) for req in got]

    def _failed(self, rows: list, e: Exception, outputs: list[RequestOutput]) -> None:
        self._failed_steps += 1
        self._ooms += isinstance(e, torch.OutOfMemoryError)
        log.error("step of %d rows failed; their requests end with finish_reason 'error'", len(rows),
                  exc_info=e)
        for req in dict.fromkeys(row.request for row in rows):
            if not req.finished:
                self.scheduler.finish(req, "error")
                outputs.append(self._report(req))

    def _report(self, req: Request) -> RequestOutput:
        new = req.output_ids[req.num_sent:req.num_known]
        lps = req.output_logprobs[req.num_sent:req.num_known] if req.params.logprobs is not None else None
        prompt = None
        if req.params.prompt_logprobs is not None and new and not req.prompt_logprobs_sent:
            prompt, req.prompt_logprobs_sent = [None, *req.prompt_logprobs], True
        req.num_sent = req.num_known
        if req.finished:
            self._requests.pop(req.request_id, None)
        return RequestOutput(req.request_id, new, req.finished, req.finish_reason, len(req.prompt_ids),
                             req.num_known, lps, prompt)

    def step_times(self) -> StepTimes:
        """Where the steps' time went since the engine started (autoprofile.engine.step_clock)."""
        return self.clock.read()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._ended) or self._inflight is not None

    @property
    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), s.num_preemptions, s.pages_used,
                           s.cache.capacity,
                           self._steps, self._failed_steps, self._ooms, s.prefix_hit_tokens, self._launched,
                           self._host_stats(), *self._state_slots())

    def _state_slots(self) -> tuple[int, int]:
        """(state slots, held): every request slot of a hybrid model holds a state; (0, 0) for any other."""
        if not self.runner.model_config.is_hybrid:
            return 0, 0
        total = self.envelope.running_reqs
        return total, total - len(self.scheduler.free_slots)

    def _host_stats(self) -> HostTierStats | None:
        cache, pool = self.scheduler.cache, self.runner.host_kv
        host = cache.host
        if host is None:
            return None
        return HostTierStats(pages=host.num_pages, cached=host.num_cached, saved=host.saved,
                             loaded=host.loaded, dropped=host.dropped,
                             hit_tokens=cache.host_hit_tokens,
                             bytes_moved=pool.bytes_moved, copy_seconds=pool.copy_seconds)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = GREEDY,
                 max_tokens: int = 16) -> list[list[int]]:
        """Offline: run every prompt to completion over the same loop; output ids per prompt, in order."""
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(each) != len(prompts):
            raise ValueError(f"{len(each)} sampling params for {len(prompts)} prompts")
        ids = [self.add_request(p, sp, max_tokens) for p, sp in zip(prompts, each)]
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self._requests for rid in ids):
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id] += o.new_token_ids
        return [out[rid] for rid in ids]


def keep_logprobs(step: Step, sampled: SampledTokens) -> None:
    """The logprobs read back with a step's tokens into their requests, before Scheduler.resolve takes the
    tokens: an output token's entry goes where resolve puts the token (rows of requests that finished since
    the launch are dropped alike); prompt entries not known yet (a request recomputed after a preemption
    scores its prompt again) extend the request's."""
    for i, (first, entries) in sampled.prompt_logprobs.items():
        row = step.rows[i]
        req = row.request
        if row.applied and not req.finished:
            req.prompt_logprobs += entries[len(req.prompt_logprobs) + 1 - first:]
    if sampled.logprobs is None:
        return
    for row, entry in zip((r for r in step.all_rows if r.sample), sampled.logprobs):
        if entry is not None and row.applied and not row.request.finished:
            row.request.output_logprobs.append(entry)


def has_grammar(step: Step) -> bool:
    """A row of the step samples for a request with a grammar (structured output: engine.grammar)."""
    return any(r.sample and r.request is not None and r.request.grammar is not None for r in step.all_rows)
