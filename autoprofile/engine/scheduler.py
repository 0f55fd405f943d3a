"""Continuous batching inside the envelope: host-side only (no torch), so it is tested without a model.

Each step computes decode rows (every running request whose tokens are all computed but the last) and
prefill rows (chunks of waiting or partly computed requests, at most envelope.prefill_tokens new tokens,
prefill_rows rows and prefill_kv_tokens attended tokens) in ONE forward: a mixed step, whose decode rows
count against the token budget (mixed_tokens = --batch_max_tokens), as vLLM's and SGLang's chunked
prefill do. So prompts never stall the decodes and the decodes ride on the prefill's weight reads. With
nothing to prefill, the step is decode only (a captured graph); with nothing to decode, prefill only.
Pages are allocated as requests grow; when a running request needs a page and none is free, the
youngest running requests are preempted (pages and slot freed, recomputed later from prompt + output
so far), by its decode row; a chunk in a step that has decode rows waits instead (it would preempt a
row already in the step). A request is admitted only when its first chunk's pages are free, so admission never
preempts, and when engine.admission's estimate (SGLang's new_token_ratio) says the output to come of it and of
the running requests fits too, so that long outputs do not outgrow the cache together and thrash.

Overlap (LLMEngine(overlap=True), SGLang's overlap scheduler): the engine launches step N+1 before it reads
step N's tokens back, so the host's scheduling and input building run while the GPU computes. `launched`
advances the step's requests as if computed and gives each sampled row's request a PENDING output id; the
next step's decode row of that request feeds the token from the GPU (ReqTable.last_tokens); `resolve` writes
the tokens once read back and finishes requests there. A request whose next token is its last (max_tokens) is
not scheduled again; one that stopped on a token has run one row too many, whose token is dropped. A
preempted request with a PENDING token waits for it before it is admitted again (its recompute needs it).

Prefix caching and the host tier (--host_kv) are engine.prefix_cache.PrefixCache's: a request being admitted
takes the cached run of its leading pages (match, then take), so its first chunk starts after them; a request
whose run continues in the host tier is LOADING (its slot and pages its own, no row) until the runner reports
the copies done (loads_done, polled by the engine before each schedule; never waited for), then runs its
remaining prefill like a request whose prefix was cached on the GPU. A request whose GPU hit includes a page
still loading waits; a request that leaves while loading (abort, a failed step) gives its pages back once the
copies are done. Each step carries the cache's copies (Step.kv_saves, kv_loads, kv_load_id, kv_ready).
The pages a step filled enter the cache when the step is read back (resolve), so a preempted request's full
pages that steps already read back are cached under their keys (a page only a step still in flight filled is
not: that step may fail), alloc saves them to the host tier when it takes them, and the request comes back
through the GPU or host hit of any other.

A hybrid model (Scheduler(state_checkpoints=N, hybrid=True)) resumes a cached prefix only from a state
checkpoint at its end (PrefixCache.match's need_state: the match is cut back to the last page carrying one);
its first row copies that checkpoint into the request's slot (Step.state_loads, before the forward) instead of
starting from zeros. Its prefill ends a chunk at each checkpoint stop (checkpoint_stops: the end of the
prompt's full pages, where a multi-turn history's next turn resumes; and the end of the cached K/V run where
another cached prefix goes on, PrefixMatch.fork: where two prompts part, a shared system prompt, one row for a
crowd behind it), and that step copies the slot's state into a checkpoint row after its forward
(Step.state_saves); the row goes onto the page's entry when the step is read back (resolve), or back to the
cache's pool when the request leaves first.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator

from autoprofile.engine.admission import (HOLD_MIN_DECODE_ROWS, NewTokenRatio, admit_now, admits,
                                         future_tokens, reserved_tokens)
from autoprofile.engine.envelope import Envelope
from autoprofile.engine.multimodal import MultiModalInput
from autoprofile.engine.prefix_cache import Copies, PrefixCache, PrefixMatch
from autoprofile.engine.request import PENDING, Request, RequestStatus
from autoprofile.engine.step import Step, StepRow, image_spans


def checkpoint_stops(num_tokens: int, page_size: int, start: int, fork_pages: int) -> list[int]:
    """Where a hybrid request's prefill from `start` ends a chunk and checkpoints its state: the end of the
    full pages its keys cover (all but the last token), and the end of the cached K/V run it matched where
    another cached prefix goes on (fork_pages: where two prompts part, a shared system prompt; 0: none), each
    if after start."""
    last = (num_tokens - 1) // page_size * page_size
    return sorted({b for b in (fork_pages * page_size, last) if b > start})


def grammar_ended(matcher, token: int) -> bool:
    """engine.grammar.advance, imported when a request has a grammar: that module needs torch (the scheduler
    does not), which the serving layer that made the matcher has loaded."""
    from autoprofile.engine.grammar import advance
    return advance(matcher, token)


class Scheduler:
    def __init__(self, envelope: Envelope, kv_pages: int, prefix_caching: bool = True, host_pages: int = 0,
                 state_checkpoints: int = 0, hybrid: bool = False, schedule_conservativeness: float = 0.0,
                 max_waiting_steps: int = 0, waiting_served_ratio: float = 0.0,
                 hold_min_rows: int = HOLD_MIN_DECODE_ROWS):
        """kv_pages: pages of the built cache, the pad page included (never handed out); host_pages: pages
        of the host tier (0: none; needs prefix caching); hybrid: a model with recurrent state, whose cached
        prefix resumes only from one of its state_checkpoints rows (none: no prefix caching);
        schedule_conservativeness: scales admission's estimate of the output to come (0: free pages alone);
        max_waiting_steps, waiting_served_ratio, hold_min_rows: when waiting requests join running decode
        rows (admission.admit_now; max_waiting_steps 0: at once)."""
        self.env = envelope
        self.cache = PrefixCache(kv_pages, envelope.page_size, host_pages,
                                 enabled=prefix_caching and (state_checkpoints > 0 or not hybrid),
                                 checkpoints=state_checkpoints if hybrid else 0)
        self.hybrid = hybrid and self.cache.enabled  # its prefills end chunks at checkpoint stops
        self._stops: dict[Request, dict[int, tuple | None]] = {}  # a hybrid's stops -> the fork's key or None
        self._saving: dict[Request, dict[int, int]] = {}  # page index -> its pending checkpoint
        self._fresh: set[Request] = set()  # back from the host tier, no row yet: the next is a prefill row
        self.free_slots = list(range(envelope.running_reqs - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: preemption takes from the tail
        self.num_preemptions = 0
        self.preempted_tokens = 0  # tokens computed by requests when preempted: what their recompute redoes
        self.new_token_ratio = NewTokenRatio(schedule_conservativeness)  # admission's estimate (admission.py)
        self.max_waiting_steps, self.waiting_served_ratio = max_waiting_steps, waiting_served_ratio
        self.hold_min_rows = hold_min_rows
        self.held_steps = 0  # steps in a row that held waiting requests back from running decode rows
        self.free_mm_slots = list(range(envelope.encoder_images - 1, -1, -1))  # encoder buffer slots

    # ------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.cache.loads)

    @property
    def pending_loads(self) -> list[int]:
        """Ids of the host tier's loads in flight (the engine asks the runner which are done)."""
        return self.cache.pending_loads

    def loads_done(self, ids) -> None:
        """The runner's copies of these loads have run: their requests run from the next step on."""
        for req in self.cache.loads_done(ids):
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._fresh.add(req)

    def finish(self, req: Request, reason: str) -> None:
        """Finished, or aborted: its pages and slot are free when this returns (a step still in flight may
        write K/V into them: the GPU runs it before any later step that reuses them). Its PENDING tokens
        go."""
        del req.output_ids[req.num_known:]
        if req.status is RequestStatus.RUNNING:
            self._release(req)
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.LOADING:
            self._leave_loading(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason

    @property
    def pages_used(self) -> int:
        return self.cache.num_used

    @property
    def prefix_hit_tokens(self) -> int:
        """Tokens whose K/V admission found in the prefix cache (the GPU's or the host tier's)."""
        return self.cache.hit_tokens

    # ------------------------------------------------------------ one step
    def schedule(self) -> Step | None:
        """The decode rows first (they may preempt to grow), then chunks in what the budget leaves."""
        if not self.running and not self.cache.loads:
            self.new_token_ratio.reset()  # idle: the next crowd starts from the initial estimate
        preempted = self.num_preemptions
        decode = self._schedule_decode()
        budget = self.env.mixed_tokens - len(decode.rows) if decode else self.env.prefill_tokens
        admit = admit_now(len(decode.rows) if decode else 0, len(self.waiting), self.held_steps,
                          self.max_waiting_steps, self.waiting_served_ratio,
                          self.hold_min_rows) or self._waiting_fill(budget)
        self.held_steps = 0 if admit else self.held_steps + 1
        step = self._schedule_prefill(budget, may_preempt=decode is None, admit=admit) if budget > 0 else None
        writes = []
        if step is not None and not step.rows:  # only admissions whose pages come back from the host tier
            writes, step = step.page_writes, None
        if step is None:
            step = decode
        elif decode is not None:
            step.decode, step.page_writes = decode.rows, decode.page_writes + step.page_writes
        if step is None and (writes or self.cache.has_copies()):
            step = Step(is_prefill=False, rows=[])  # the page writes and copies alone
        if step is not None:
            step.page_writes += writes
            step.running, step.pages_used = len(self.running), self.pages_used
            c = self.cache.take_copies()
            step.kv_saves, step.kv_loads, step.kv_load_id = c.saves, c.loads, c.load_id
            step.kv_ready = c.ready
        self.new_token_ratio.update(self.num_preemptions > preempted, decode is not None, self.running)
        return step

    def _waiting_fill(self, budget: int) -> bool:
        """Whether the waiting requests' prompts hold at least `budget` tokens (a prefix cache hit not counted
        off: an estimate; counted only when admission.admit_now holds them, and only until they do). Then the
        prefill step they make is a full one, no dearer a token than any, and they join at once: held, a
        burst's arrivals waited for nothing (H200, c256, 1,000 prompts of 1,024 tokens, before this rule:
        TTFT p50 2.5 s against 0.8 s with pacing off, which this rule comes near at that load; tok/s 0.98x;
        prefill steps of 5,712 tokens against 8,077; TPOT p50 49.7 against 60.0 ms)."""
        held = 0
        for req in self.waiting:
            held += req.num_tokens
            if held >= budget:
                return True
        return False

    def _schedule_prefill(self, budget: int, may_preempt: bool = True, admit: bool = True) -> Step | None:
        """Chunks of at most `budget` new tokens in all. may_preempt False (the step has decode rows):
        a running request's chunk that needs pages none can give waits, rather than preempt a row of
        this step. admit False: only running requests' chunks (the waiting are held: admission.admit_now)."""
        env, ps = self.env, self.env.page_size
        tokens_left, kv_left = min(env.prefill_tokens, budget), env.prefill_kv_tokens
        step = Step(is_prefill=True, rows=[])
        partial = [r for r in self.running if r.num_tokens - r.num_computed > 1 or r in self._fresh]
        for req in partial + (list(self.waiting) if admit else []):
            if len(step.rows) == env.prefill_rows or tokens_left == 0:
                break
            admit = req.status is RequestStatus.WAITING
            if admit and not self.free_slots:
                break
            if req.pending:
                continue  # preempted with a token in flight: its recompute needs the token
            hit = self.cache.match(self._page_keys(req), need_state=self.hybrid) if admit else PrefixMatch()
            if hit.loading:
                continue  # its prefix is coming back from the host tier for another request: wait for it
            if admit and not self._fits(req, hit):
                break  # its output to come would crowd the running requests' out: wait for some to finish
            if hit.host:  # the copies first: its first chunk runs in a step after them
                if len(hit.host) > self.cache.available(hit):
                    break  # admission never preempts: wait for pages
                self._admit(req, hit, step)
                continue
            start = len(hit.pages) * ps if admit else req.num_computed
            n = min(req.num_tokens - start, tokens_left, kv_left - start)
            stops = self._stops.get(req, {}) if not admit else self._plan_stops(req, hit, start)
            n = min([n] + [b - start for b in stops if b > start][:1])
            encode = []
            if req.mm is not None:
                n, encode = self._fit_images(req.mm, start, n, step)
            if n < 1:
                if req.mm is not None:
                    continue  # its next image waits for the encoder: later requests may still fit
                break
            held = hit.pages if admit else req.pages
            need = math.ceil((start + n) / ps) - len(held)
            if need > self.cache.available(hit):
                if admit:
                    break  # admission never preempts: wait for pages
                if not may_preempt or not self._make_room(need, req):
                    continue  # req itself was preempted, or it waits for a step without decode rows
            if admit:
                self._admit(req, hit, step)
                if stops:
                    self._stops[req] = stops
            self._fresh.discard(req)
            self._grow(req, need, step)
            if start + n in stops:
                self._checkpoint(req, start + n, stops[start + n], step)
            row = StepRow(req.slot, start, req.tokens(start, start + n), start + n == req.num_tokens,
                          req.params, req, req.mm)
            if req.mm is not None:
                for i in encode:
                    req.mm.slots[i] = self.free_mm_slots.pop()
                    step.encode.append((req.mm.slots[i], req.mm.images[i]))
                row.spans = image_spans(req.mm, start, n)
            step.rows.append(row)
            tokens_left -= n
            kv_left -= start + n
        return step if step.rows or step.page_writes else None

    def _schedule_decode(self) -> Step | None:
        step = Step(is_prefill=False, rows=[])
        for req in list(self.running):
            if (req.status is not RequestStatus.RUNNING or req.num_tokens - req.num_computed != 1
                    or req in self._fresh):
                continue  # preempted by an older request of this step, or still in prefill
            if len(req.output_ids) >= req.max_tokens:
                continue  # its last token is in flight (overlap): it finishes when read back
            need = 1 if req.num_computed == len(req.pages) * self.env.page_size else 0
            if need and need > self.cache.num_free and not self._make_room(need, req):
                continue
            self._grow(req, need, step)
            step.rows.append(StepRow(req.slot, req.num_computed, [req.token(req.num_computed)], True,
                                     req.params, req,
                                     req.mm))
        return step if step.rows else None

    def _fit_images(self, mm: MultiModalInput, start: int, n: int, step: Step) -> tuple[int, list[int]]:
        """Shorten a chunk [start, start + n) to end before the first of its images that is neither in the
        encoder buffer nor can be encoded in this step (one new image per row, a free slot, the step's
        encoder images and patches); return the tokens left and the images to encode."""
        env, encode = self.env, []
        images, patches = len(step.encode), sum(im.patches for _, im in step.encode)
        for i in mm.overlapping(start, start + n):
            im = mm.images[i]
            if i in mm.slots:
                continue
            if (encode or not self.free_mm_slots or images + 1 > env.encoder_images
                    or patches + im.patches > env.encoder_patches):  # one new image per row and step
                return max(im.offset - start, 0), encode
            encode.append(i)
            images, patches = images + 1, patches + im.patches
        return n, encode

    # ------------------------------------------------------------ pages, prefix cache, preemption
    def _page_keys(self, req: Request) -> Iterator[tuple]:
        """The keys of req's leading full pages, all but its last token (that one must be computed to be
        sampled); none when it asks for prompt logprobs (every prompt position's logits: a cached position has
        none, as vLLM)."""
        ps = self.env.page_size
        if req.params.prompt_logprobs is None:
            for i in range((req.num_tokens - 1) // ps):
                yield req.key(i * ps, (i + 1) * ps)

    def _fits(self, req: Request, hit: PrefixMatch) -> bool:
        """The admission estimate (engine.admission): req's tokens beyond `hit` and its output to
        come, beside the running (and loading) requests' own, fit the free pages; always when none
        holds pages, or when the estimate is off (schedule_conservativeness 0: the first chunk's pages
        alone, the caller's check)."""
        ps, ratio = self.env.page_size, self.new_token_ratio.value
        held = self.running + [r for load in self.cache.loads.values() for r in load.requests]
        left = req.max_tokens - len(req.output_ids)
        need = future_tokens(req.num_tokens - len(hit.pages) * ps, left, ratio)
        return (not held or not self.new_token_ratio.conservativeness
                or admits(self.cache.available(hit) * ps, reserved_tokens(held, ps, ratio), need))

    def _admit(self, req: Request, hit: PrefixMatch, step: Step) -> None:
        """Admitted with the cached run `hit`: RUNNING, or LOADING when it continues in the host tier."""
        self.waiting.remove(req)
        req.slot = self.free_slots.pop()
        pages, chain = self.cache.take(hit, owner=req)
        if hit.host:
            req.status = RequestStatus.LOADING
        else:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        req.pages, req.num_computed = pages, len(pages) * self.env.page_size
        req.cached_pages, req.chain = len(pages), chain
        if pages:
            step.page_writes.append((req.slot, 0, list(pages)))
        if hit.state is not None:
            step.state_loads.append((hit.state, req.slot))
            self.cache.resumed(hit.state)

    def _plan_stops(self, req: Request, hit: PrefixMatch, start: int) -> dict[int, tuple | None]:
        """A hybrid request's checkpoint stops at admission -> the key of the cached page it checkpoints where
        two prompts part (hit.fork), None at its prompt's end."""
        if not self.hybrid:
            return {}
        fork = hit.kv_pages if hit.fork is not None else 0
        return {b: hit.fork if b == fork * self.env.page_size else None
                for b in checkpoint_stops(req.num_tokens, self.env.page_size, start, fork)}

    def _checkpoint(self, req: Request, end: int, fork: tuple | None, step: Step) -> None:
        """req's chunk ends at checkpoint stop `end`: the step copies its slot's state into a checkpoint row
        (none free and none to evict: no checkpoint), which its page takes when the step is read back."""
        row = self.cache.new_checkpoint(fork)
        if row is not None:
            self._saving.setdefault(req, {})[end // self.env.page_size - 1] = row
            step.state_saves.append((req.slot, row))

    def _leave_loading(self, req: Request) -> None:
        """A LOADING request leaves (finished, or sent back to wait): its pages go back once its load is
        done (the copies may still write them), its slot now."""
        self.cache.leave(req, req.pages)
        self.free_slots.append(req.slot)
        self._free_images(req, done_before=None)
        req.pages, req.slot, req.cached_pages, req.chain = [], None, 0, 0

    def _register(self, req: Request, upto: int) -> None:
        """Put req's newly full pages of K/V computed up to token `upto` in the prefix cache."""
        ps = self.env.page_size
        while self.cache.enabled and req.cached_pages < min(upto, req.num_computed) // ps:
            i = req.cached_pages
            state = self._saving[req].pop(i, None) if req in self._saving else None
            req.chain = self.cache.insert(req.pages[i], req.chain, req.key(i * ps, (i + 1) * ps), state=state)
            req.cached_pages += 1

    def _grow(self, req: Request, n: int, step: Step) -> None:
        if n > 0:
            pages = self.cache.alloc(n)
            step.page_writes.append((req.slot, len(req.pages), pages))
            req.pages += pages

    def _make_room(self, need: int, req: Request) -> bool:
        """Preempt the youngest running requests until `need` pages are free; False if req itself went."""
        while self.cache.num_free < need:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Back to wait. Its pages go back; the full ones that steps already read back put in the prefix cache
        (resolve), so alloc saves them to the host tier when it takes them and the request's recompute finds
        them. Pages filled only by a step still in flight are not cached: that step may yet fail, and a
        cached page of unknown K/V would be served to the next prompt that shares it."""
        self.preempted_tokens += req.num_computed
        self._release(req)
        self.running.remove(req)
        req.status, req.num_computed = RequestStatus.WAITING, 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)  # youngest preempted first, so older ones end up ahead of it

    def _release(self, req: Request) -> None:
        self._fresh.discard(req)
        self._stops.pop(req, None)
        for row in self._saving.pop(req, {}).values():  # its steps' copies reach no entry
            self.cache.drop_checkpoint(row)
        self.cache.free(req.pages)  # cached pages stay cached until alloc needs them
        self.free_slots.append(req.slot)
        self._free_images(req, done_before=None)
        req.pages, req.slot, req.cached_pages, req.chain = [], None, 0, 0

    def _free_images(self, req: Request, done_before: int | None) -> None:
        """Give back the encoder buffer slots of req's images whose tokens all lie before `done_before`
        (None: every image, the request leaves)."""
        if req.mm is None:
            return
        for i, slot in list(req.mm.slots.items()):
            if done_before is None or req.mm.images[i].end <= done_before:
                del req.mm.slots[i]
                self.free_mm_slots.append(slot)

    # ------------------------------------------------------------ a step that never launched
    def rollback(self, step: Step) -> None:
        """The step's launch raised (the device's page table may not have learned its pages): the pages it
        granted to requests still running go back, so each holds the pages the table had before the step and
        its next row grows (and writes) them again. Else a row writes K/V through a stale column into a page
        the prefix cache may map to another prompt. Call it after the step's failed requests finished."""
        copies = Copies(step.kv_saves, step.kv_loads, step.kv_load_id, step.kv_ready)
        for req in self.cache.rollback(copies):  # they wait again: recomputed
            self._leave_loading(req)
            req.status, req.num_computed = RequestStatus.WAITING, 0
            self.waiting.appendleft(req)
        by_slot = {req.slot: req for req in self.running}
        for slot, first, pages in reversed(step.page_writes):
            req = by_slot.get(slot)
            if req is not None and req.pages[first:] == pages:  # a grant: requests admitted in it failed
                del req.pages[first:]
                self.cache.free(pages)

    # ------------------------------------------------------------ after the step launched, after it ran
    def launched(self, step: Step) -> None:
        """The step's GPU work is enqueued: each row's request counts its tokens as computed and, for a
        sampled row, holds a PENDING output id. Images whose tokens are all computed give back their encoder
        slots (a later step's encoder writes after this step's forward read them: one stream)."""
        for row in step.all_rows:
            req = row.request
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted while the step was built
            row.applied, row.preemptions = True, req.num_preemptions
            req.num_computed = row.start + len(row.ids)
            self._free_images(req, done_before=req.num_computed)
            if row.sample:
                req.output_ids.append(PENDING)

    def resolve(self, step: Step, sampled: list[int]) -> list[Request]:
        """The step's tokens (one per sampled row, in row order) are read back: each replaces its request's
        oldest PENDING id, the pages the step filled enter the prefix cache, and requests finish on a stop
        token or max_tokens. Rows of requests that finished (stopped, aborted) since the launch are dropped.
        Returns the requests that got a token (a preempted one too: it keeps its tokens)."""
        got, it = [], iter(sampled)
        for row in step.all_rows:
            req, token = row.request, next(it) if row.sample else None
            if not row.applied or req.finished:
                continue
            if req.status is RequestStatus.RUNNING and req.num_preemptions == row.preemptions:
                # (preempted since the launch and admitted again: its pages now are other pages, filled by
                # steps still in flight, which may yet fail; their own read back caches them)
                self._register(req, upto=row.start + len(row.ids))
            if token is None:
                continue
            at = req.num_known
            req.output_ids[at] = token
            got.append(req)
            ended = req.grammar is not None and grammar_ended(req.grammar, token)
            if token in req.stop_token_ids or ended:
                self.finish(req, "stop")
            elif at + 1 >= req.max_tokens:
                self.finish(req, "length")
        return got
