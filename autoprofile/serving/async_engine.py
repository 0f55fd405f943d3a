"""The asyncio side that HTTP handlers talk to, over the engine loop (serving.engine_loop).

    engine loop: on a thread of this process (an LLMEngine given), or alone in a process of its own
    (--engine_process: serving.engine_process); drain the inbox (add / abort), step() while there is work,
    block on the inbox when idle; each step's outputs come to the event loop in one call_soon_threadsafe
    event loop: submit() -> RequestHandle (its RequestOutputs, merged while unread); close() aborts if
    unfinished

Backpressure: at most `max_running + max_waiting` requests are outstanding (submitted, not finished);
`max_running` is the engine's running-request limit, so `max_waiting` bounds the requests beyond what the
engine can run at once. submit() past the bound raises QueueFull (HTTP 429) before anything is queued.

A step that raises (torch.OutOfMemoryError included) ends its requests with finish_reason "error"
inside the engine, which counts it (EngineStats.ooms, .failed_steps); those requests fail here with
EngineFailure ("oom" or "internal": HTTP 500 without internal text) and the loop goes on. An error
that escapes step() itself fails every request the engine holds, counted the same way.

Anything else that ends the loop thread (an exception outside a step, e.g. while applying an abort: the
engine's state is then unknown) makes the engine dead, and so does a wedged loop: work outstanding and no
loop iteration for `wedged_after_s`, and a starved one: work outstanding, the loop iterating, and no step run
for `starved_after_s` (every request waits for a KV page or a request slot that never frees: a leak). A
watchdog on the event loop checks both. Dead: every outstanding request fails with EngineFailure("dead")
(HTTP 503), submit() refuses, and `on_dead(reason)` tells the server (its /health answers 503 with the
reason), which ends the process with a non-zero exit so that a supervisor restarts it.

A trace of the served steps (--profile_dir, POST /start_profile and /stop_profile): profile() hands the start
or the stop to the engine loop, which owns the profiler (engine.step_profile) and marks each step it runs.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from autoprofile.engine.request import RequestOutput
from autoprofile.serving.engine_loop import PREPARE_GRAMMARS, STOP, EngineFailure, EngineLoop, Pulse, Snapshot

log = logging.getLogger(__name__)
WEDGED_AFTER_S = 60.0  # work outstanding and no loop iteration for this long: the engine loop is dead
STARVED_AFTER_S = 60.0  # work outstanding, the loop iterating, and no step run for this long: dead too
__all__ = ["AsyncEngine", "EngineFailure", "QueueFull", "RequestHandle", "Snapshot", "Timing"]


class QueueFull(Exception):
    """More requests outstanding than the running limit plus --max_waiting_requests."""


@dataclass
class Timing:
    """Per-request latencies, measured on the event loop when outputs arrive."""

    submitted: float = field(default_factory=time.perf_counter)
    first: float | None = None
    tokens: int = 0


class _NoMetrics:
    def first_token(self, timing: Timing) -> None:
        pass

    def request_finished(self, timing: Timing, completion_tokens: int, finish_reason: str) -> None:
        pass


class RequestHandle:
    """One submitted request: iterate its RequestOutputs; close() (always) aborts it if unfinished.

    An output the reader has not taken yet absorbs the next one (RequestOutput.then, as vLLM's
    RequestOutputCollector): a reader that lags behind the steps (an event loop busy with many streams) reads
    several steps' tokens at once, one SSE chunk for them, instead of falling further behind one token at a
    time. A failure is queued after what came before it.

    stream_interval (--stream_interval, SGLang's and vLLM's): the reader is woken once the unread outputs hold
    that many tokens, or the first token, or the end (finished, or a failure); in between they merge. Each
    wake is a handler's turn on the event loop (a chunk built and written), whose thread shares the GIL with
    the engine's. math.inf: the first token and the end alone (AsyncEngine.submit's final_only)."""

    def __init__(self, owner: AsyncEngine, request_id: str, prompt_tokens: int,
                 stream_interval: float = 1):
        self.owner, self.request_id, self.prompt_tokens = owner, request_id, prompt_tokens
        self.stream_interval = stream_interval
        self._unread = 0  # tokens in the unread outputs
        self._first = True  # no token has reached the reader yet
        self._items: collections.deque[RequestOutput | EngineFailure] = collections.deque()
        self._waiter: asyncio.Future | None = None  # the reader, blocked on an empty handle
        self.added: asyncio.Future | None = None  # settled once the engine thread has taken it
        self.timing = Timing()
        self.finished = False

    def put(self, item: RequestOutput | EngineFailure) -> None:
        """From the event loop (AsyncEngine._dispatch, _fail)."""
        items = self._items
        if items and isinstance(item, RequestOutput) and isinstance(items[-1], RequestOutput):
            items[-1] = items[-1].then(item)
        else:
            items.append(item)
        if isinstance(item, RequestOutput):
            self._unread += len(item.new_token_ids)
        if not self._due():
            return  # merged into the unread output: the reader is woken with more
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not (self._items and self._due()):
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, RequestOutput):
            self._unread = 0
            self._first = self._first and not item.new_token_ids
        if isinstance(item, EngineFailure):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def _due(self) -> bool:
        """The unread items (at least one) go to the reader now: a failure, the end, the first token, or
        stream_interval tokens (at 1: every output with a token; the engine reports none without one but the
        last)."""
        last = self._items[-1]
        return (not isinstance(last, RequestOutput) or last.finished or self._unread >= self.stream_interval
                or (self._first and self._unread > 0))

    def close(self, completed: bool = False) -> None:
        """Abort in the engine if it is still running there (a disconnect, a stop string, an error).
        completed: the server ended it on purpose (a stop string): it counts in the latency metrics."""
        self.owner._close(self, completed)


class AsyncEngine:
    def __init__(self, engine, max_running: int, max_waiting: int, metrics=None, on_dead=None,
                 wedged_after_s: float | None = None, starved_after_s: float | None = None,
                 profile_dir: str | None = None, stream_interval: int = 1):
        """engine: an LLMEngine (its loop runs on a thread of this process) or a started
        serving.engine_process.EngineProcess (its loop runs there). metrics: .first_token(timing) and
        .request_finished(timing, completion_tokens, finish_reason), called on the event loop
        (ServerMetrics). on_dead(reason): called once on the event loop when the loop dies, wedges or starves
        (defaults: WEDGED_AFTER_S, STARVED_AFTER_S). profile_dir: where profile() writes its traces (None: no
        profiler). stream_interval: each handle's (RequestHandle)."""
        self.engine, self.max_running, self.max_waiting = engine, max_running, max_waiting
        self.remote = getattr(engine, "remote", False)
        self.stream_interval = stream_interval
        self.metrics = metrics or _NoMetrics()
        self.on_dead = on_dead
        self.wedged_after_s = WEDGED_AFTER_S if wedged_after_s is None else wedged_after_s
        self.starved_after_s = STARVED_AFTER_S if starved_after_s is None else starved_after_s
        self.profile_dir = profile_dir
        self.dead: str | None = None
        self._watchdog: asyncio.Task | None = None
        self._loop_thread: int | None = None  # the event loop's thread (start())
        self.snapshot = Snapshot()
        self.handles: dict[str, RequestHandle] = {}  # event-loop side only
        self._profiles: dict[int, asyncio.Future] = {}  # profile() calls waiting for the loop's answer
        self._tokens = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._idle: asyncio.Event | None = None
        self._grammars_prepared = False  # prepare_grammars() sent
        if self.remote:
            self.pulse, self.looper = engine.pulse, None
        else:
            self.pulse = Pulse()
            self.looper = EngineLoop(engine, self._post_kind, self._take_snapshot, self.pulse,
                                     lambda: self.dead is not None, profile_dir)

    @property
    def profiler(self):
        """The step profiler of an engine loop in this process (None: none, or the loop runs elsewhere)."""
        return None if self.looper is None else self.looper.profiler

    # ------------------------------------------------------------ event-loop side
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._idle = asyncio.Event()
        self._idle.set()
        self.pulse.beat = time.monotonic()
        if self.remote:
            self.engine.attach(self._post_kind, self._take_snapshot, self._lost)
        else:
            self.looper.report()
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()
        self._watchdog = asyncio.ensure_future(self._watch())

    async def stop(self) -> None:
        """Stop the loop (requests still held are failed first); a dead one is left alone (a wedged thread
        never returns: only the process exit ends it)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self.remote:
            await self.engine.stop(wait=self.dead is None)
        elif self._thread is not None and self.dead is None:
            self.looper.inbox.put(STOP)
            await asyncio.to_thread(self._thread.join)
        self._thread = None

    def prepare_grammars(self) -> None:
        """An engine process starts building its grammar compiler now (once), beside the server's own build
        of the first grammar request, instead of after it: the two are seconds each (xgrammar's import and
        vocabulary). An engine in this process uses the server's compiler: nothing to do."""
        if self.remote and not self._grammars_prepared:
            self._grammars_prepared = True
            self._send((PREPARE_GRAMMARS,))

    def _send(self, cmd) -> None:
        if self.remote:
            self.engine.send(cmd)
        else:
            self.looper.inbox.put(cmd)

    async def _watch(self) -> None:
        """A loop that ends posts its own death (_run, _lost); one that ends otherwise stops beating:
        wedged."""
        period = min(1.0, self.wedged_after_s / 4, self.starved_after_s / 4)
        while self.dead is None:
            await asyncio.sleep(period)
            if not self.handles:
                continue
            if since(self.pulse.beat) > self.wedged_after_s:
                self._died(f"the engine loop made no progress for {self.wedged_after_s:g} s with "
                           f"{len(self.handles)} requests outstanding (wedged)")
            elif since(self.pulse.beat) < period and since(self.pulse.progress) > self.starved_after_s:
                s = self.snapshot
                self._died(f"the engine loop ran no step for {self.starved_after_s:g} s with {s.running} "
                           f"running and {s.waiting} waiting requests and {s.pages_used} of {s.pages_total} "
                           f"KV pages held: every request waits for a KV page or a request slot that never "
                           f"frees (starved)")

    def _died(self, reason: str) -> None:
        """The loop is gone or wedged: fail every outstanding request (503) and tell the server."""
        if self.dead is not None:
            return
        self.dead = reason
        log.error("engine loop dead: %s; failing %d requests", reason, len(self.handles))
        for handle in self.handles.values():
            settle(handle.added, EngineFailure("dead"))
        for fut in self._profiles.values():
            settle(fut, EngineFailure("dead"))
        self._fail(list(self.handles), "dead")
        if self.on_dead is not None:
            self.on_dead(reason)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds of the event loop's thread and the engine loop's, so far ({} where the platform has no
        per-thread clock). In one process the two share the GIL; the engine's also count CUDA's spin-wait
        for the GPU, which runs without the GIL. An engine process: all of its threads."""
        threads = {"event_loop": self._loop_thread,
                   "engine": self._thread.ident if self._thread is not None else None}
        out = {}
        for name, ident in threads.items():
            if ident is None or not hasattr(time, "pthread_getcpuclockid"):
                continue
            try:
                out[name] = time.clock_gettime(time.pthread_getcpuclockid(ident))
            except OSError:  # the thread has ended
                continue
        if self.remote and (engine := self.engine.cpu_seconds()) is not None:
            out["engine"] = engine
        return out

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_waiting

    @property
    def outstanding(self) -> int:
        return len(self.handles)

    def has_room(self, n: int = 1) -> bool:
        return self.outstanding + n <= self.capacity

    async def submit(self, prompt_ids: Sequence[int], params, max_tokens: int,
                     stop_token_ids: Sequence[int] = (), mm=None, grammar=None,
                     final_only: bool = False) -> RequestHandle:
        """Queue one request; QueueFull past the bound, RequestError if the engine can never serve it,
        EngineFailure("dead") once the loop is dead. final_only (vLLM's RequestOutputKind.FINAL_ONLY: a reader
        that needs only the whole answer): its handle wakes the reader at the first token and the end
        alone. grammar: a matcher (an engine in this process), or what an engine process builds one from
        (serving.engine_process.GrammarRequest)."""
        if self.dead is not None:
            raise EngineFailure("dead")
        if not self.has_room():
            raise QueueFull(f"{self.outstanding} requests outstanding: {self.max_running} running + "
                            f"{self.max_waiting} waiting (--max_waiting_requests) is the limit")
        handle = RequestHandle(self, uuid.uuid4().hex, len(prompt_ids),
                               math.inf if final_only else self.stream_interval)
        self.handles[handle.request_id] = handle
        self._idle.clear()
        added = handle.added = self._loop.create_future()
        self._send(("add", handle.request_id,
                    (list(prompt_ids), params, max_tokens, tuple(stop_token_ids), mm, grammar)))
        try:
            await added
        except BaseException:  # refused, or the client went away while it was being queued
            handle.close()
            raise
        return handle

    async def profile(self, action: str, num_steps: int | None = None):
        """Start ("start": None) or stop ("stop": its step_profile.Trace) a trace of the engine's steps, on
        the engine loop that owns the profiler; step_profile.ProfileError: started twice, or no trace."""
        if self.dead is not None:
            raise EngineFailure("dead")
        token = next(self._tokens)
        done = self._profiles[token] = self._loop.create_future()
        self._send(("profile", action, num_steps, token))
        return await done

    async def wait_idle(self) -> None:
        """Until no request is outstanding."""
        while self.handles:
            await self._idle.wait()

    def _close(self, handle: RequestHandle, completed: bool) -> None:
        if self.handles.pop(handle.request_id, None) is None:
            return
        if self.dead is None:
            self._send(("abort", handle.request_id))
        if completed:
            self.metrics.request_finished(handle.timing, handle.timing.tokens, "stop")
        self._check_idle()

    def _check_idle(self) -> None:
        if not self.handles:
            self._idle.set()

    def _added(self, request_id: str, error: BaseException | None) -> None:
        handle = self.handles.get(request_id)
        if handle is not None and handle.added is not None:
            settle(handle.added, error)

    def _profiled(self, token: int, error: BaseException | None, value) -> None:
        fut = self._profiles.pop(token, None)
        if fut is not None:
            settle(fut, error, value)

    def _dispatch(self, outputs: list[RequestOutput], error_code: str) -> None:
        now = time.perf_counter()
        for out in outputs:
            handle = self.handles.get(out.request_id)
            if handle is None:  # closed by the server side already
                continue
            if out.finish_reason == "error":
                del self.handles[out.request_id]
                handle.put(EngineFailure(error_code))
                continue
            if out.new_token_ids and handle.timing.first is None:
                handle.timing.first = now
                self.metrics.first_token(handle.timing)
            handle.timing.tokens = out.completion_tokens
            handle.put(out)
            if out.finished:
                del self.handles[out.request_id]
                if out.finish_reason in ("stop", "length"):
                    self.metrics.request_finished(handle.timing, out.completion_tokens, out.finish_reason)
        self._check_idle()

    def _fail(self, request_ids: list[str], code: str) -> None:
        for rid in request_ids:
            handle = self.handles.pop(rid, None)
            if handle is not None:
                handle.put(EngineFailure(code))
        self._check_idle()

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # ------------------------------------------------------------ from the engine loop's side
    def _post_kind(self, kind: str, *args) -> None:
        """EngineLoop.post: its message to the event loop's handler of that kind (_dispatch, _fail, _added,
        _profiled)."""
        self._post(getattr(self, "_" + kind), *args)

    def _take_snapshot(self, snapshot: Snapshot) -> None:
        """EngineLoop.publish (an engine process's: from its pipe's reader)."""
        self.snapshot = snapshot

    def _lost(self, reason: str) -> None:
        """From an engine process's reader: it ended without being stopped."""
        self._post(self._died, reason)

    def _run(self) -> None:
        try:
            self.looper.run()
        except BaseException as e:  # noqa: BLE001 - the engine's state is unknown: the server must go down
            log.critical("the engine loop thread died", exc_info=True)
            self._post(self._died, f"the engine loop thread died: {type(e).__name__}: {e}")


def since(stamp: float | None) -> float:
    """Seconds since a time.monotonic() stamp (0 for None: not counting)."""
    return 0.0 if stamp is None else time.monotonic() - stamp


def settle(fut: asyncio.Future, error: BaseException | None, value=None) -> None:
    """Resolve a future from call_soon_threadsafe (a no-op if it was cancelled meanwhile)."""
    if fut.done():
        return
    if error is None:
        fut.set_result(value)
    else:
        fut.set_exception(error)
