"""The engine loop: the one thread that owns the LLMEngine (and the GPU), and what it tells its owner.

    drain the inbox (add / abort / profile), step() while there is work, block on the inbox when idle

It talks to its owner (serving.async_engine.AsyncEngine) through three things only, so that the same loop
runs on a thread of the server's process or alone in a process of its own (serving.engine_process):
- `inbox`: commands in ("add", request_id, payload), ("abort", request_id), ("profile", action, num_steps,
  token), and STOP;
- `post(kind, *args)`: what the owner must act on: ("dispatch", outputs, error_code), ("fail", request_ids,
  code), ("added", request_id, error or None), ("profiled", token, error or None, value);
- `publish(Snapshot)` after every iteration, and `pulse`: the last
  iteration's and the last step's times (time.monotonic(); None: idle, blocked on the inbox), which the
  owner's watchdog reads.

A step that raises (torch.OutOfMemoryError included) ends its requests with finish_reason "error" inside the
engine, which counts it; those requests fail with "oom" or "internal" and the loop goes on. Anything that
ends the loop otherwise (an exception outside a step) is raised from run() after the owner was told.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import time
from dataclasses import dataclass, field

import torch

from autoprofile.engine.host_kv import HostTierStats
from autoprofile.engine.request import RequestError, RequestOutput
from autoprofile.engine.step_clock import HostTimer, StepTimes
from autoprofile.engine.step_profile import StepProfiler

log = logging.getLogger(__name__)
STOP = "stop"  # the inbox's last command: abort what is live, collect the step in flight, return
PREPARE_GRAMMARS = "prepare_grammars"  # an engine process starts building its grammar compiler


class EngineFailure(Exception):
    """The engine failed this request (code: "oom" or "internal": the server stays up; "dead": the engine
    loop ended or wedged, the server is going down)."""

    def __init__(self, code: str):
        self.code = code
        super().__init__(code)


@dataclass(frozen=True)
class Snapshot:
    """Engine state as of the loop's last iteration (published by the engine thread)."""

    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    pages_used: int = 0
    pages_total: int = 0
    steps: int = 0
    ooms: int = 0  # torch.OutOfMemoryError while serving (a validated envelope keeps this 0)
    errors: int = 0  # failed steps, OOMs included
    prefix_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    host: HostTierStats | None = None  # the prefix cache's host tier (--host_kv); None: off
    step_times: StepTimes = field(default_factory=StepTimes)  # where the steps' time went (step_clock)
    state_slots: int = 0  # a hybrid model's state slots (0: none), and those held by requests
    state_slots_used: int = 0
    device_memory: tuple[int, int, int | None] | None = None  # an engine process's allocator (reserved
    # bytes, segments) and CUDA stack limit, read there (serving.engine_process); None: read in this process


class Pulse:
    """The loop's last iteration (beat) and the last step's launch, end or failure (progress), by
    time.monotonic(); None: idle, blocked on the inbox (neither wedged nor starved)."""

    def __init__(self):
        now = time.monotonic()
        self.beat: float | None = now
        self.progress: float | None = now


class EngineLoop:
    def __init__(self, engine, post, publish, pulse: Pulse, halted=lambda: False,
                 profile_dir: str | None = None, device_memory=lambda: None):
        """engine: an LLMEngine; post(kind, *args) and publish(snapshot): to the owner; halted(): the owner
        gave up on this loop (it returns at its next iteration); profile_dir: where the step profiler writes
        (None: no profiler)."""
        self.engine, self.post, self.publish, self.pulse, self.halted = engine, post, publish, pulse, halted
        self.device_memory = device_memory  # each snapshot's Snapshot.device_memory (an engine process's)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[str] = set()  # ids the engine holds
        self._ooms = self._errors = 0
        self._unposted: tuple[list[RequestOutput], str] | None = None  # a step's outputs, to the next launch
        runner = getattr(engine, "runner", None)
        self.device = getattr(runner, "device", None)
        self.profiler = None if profile_dir is None else StepProfiler(
            profile_dir, self.device or torch.device("cpu"))

    def run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NOTE: the current device is per thread
        pulse = self.pulse
        while not self.halted():
            if self.engine.has_unfinished():
                cmd = self._next_nowait()
            else:
                self._flush()  # no step will launch: the last step's outputs go now
                pulse.beat = pulse.progress = None  # blocked for input: neither wedged nor starved
                cmd = self.inbox.get()
            pulse.beat = time.monotonic()
            if pulse.progress is None:
                pulse.progress = pulse.beat
            inbox = time.perf_counter()
            while cmd is not None:
                if cmd == STOP:
                    self._abort_live("internal")
                    self._settle()
                    if self.profiler is not None:
                        self.profiler.close()
                    return
                self._apply(cmd)
                cmd = self._next_nowait()
            self.engine.clock.host("inbox", time.perf_counter() - inbox)
            if self.engine.has_unfinished():
                with self.profiler.step() if self.profiler is not None else contextlib.nullcontext():
                    self._step()  # publishes after the step
            else:
                self.report()

    def _settle(self) -> None:
        """At stop, after every live request is aborted: collect the step still in flight (overlap launches
        one ahead) and report the aborted ones, so the engine holds no page and no launched step when the
        runner is torn down or handed to another engine. A failing step is logged: the loop is ending."""
        for _ in range(4):  # the in-flight step, the reports, a host tier load landing: a few calls
            if not self.engine.has_unfinished():
                return
            try:
                self.engine.step()
            except Exception:  # noqa: BLE001 - shutting down: the runner's teardown frees what is left
                log.exception("the step in flight at stop failed")
                return

    def _next_nowait(self):
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    def _apply(self, cmd) -> None:
        if cmd[0] == "profile":
            _, action, num_steps, token = cmd
            try:
                out = self.profiler.start(num_steps) if action == "start" else self.profiler.stop()
            except Exception as e:  # noqa: BLE001 - ProfileError, or the trace could not be written: answered
                self.post("profiled", token, e, None)
            else:
                self.post("profiled", token, None, out)
            return
        if cmd[0] == "abort":
            if cmd[1] in self._live:
                self._live.discard(cmd[1])
                self.engine.abort(cmd[1])
            return
        _, rid, (prompt, params, max_tokens, stop_ids, mm, grammar) = cmd
        try:
            self.engine.add_request(prompt, params, max_tokens, stop_token_ids=stop_ids, request_id=rid,
                                    mm=mm, **({"grammar": grammar} if grammar is not None else {}))
        except RequestError as e:
            self.post("added", rid, e)
            return
        except Exception:  # noqa: BLE001 - the server answers 500 and stays up
            log.exception("add_request failed")
            self.post("added", rid, EngineFailure("internal"))
            return
        self._live.add(rid)
        self.post("added", rid, None)

    def _step(self) -> None:
        """One engine step. Its outputs are posted to the owner once the next step's GPU work is enqueued
        (StepClock.after_launch), or as soon as no step follows: the event loop then writes them to the
        clients while the GPU runs, instead of contending for the GIL with the host's scheduling and input
        building. H100, llama-3.1-8b, 256 streams, one run: a prefill step's inputs 13.5 -> 4.6 ms, a decode
        step's 5.9 -> 0.8 ms, 26,963 -> 30,145 tok/s. The overlapped engine (LLMEngine.overlap) returns a
        step's outputs once the next step is launched already: they are posted at once (held to the launch
        after, a launch that waits for a full launch queue held them a step longer)."""
        stats = self.engine.stats
        ooms, ran = stats.ooms, (stats.launched, stats.steps, stats.failed_steps)
        overlap = getattr(self.engine, "overlap", False)
        if not overlap:
            self.engine.clock.after_launch(self._flush)
        try:
            outputs = self.engine.step()
            stats = self.engine.stats
            if (stats.launched, stats.steps, stats.failed_steps) != ran:  # a step launched, ended or failed
                self.pulse.progress = time.monotonic()
        except torch.OutOfMemoryError:
            self.pulse.progress = time.monotonic()
            self._ooms += 1
            self._errors += 1
            log.error("out of memory in an engine step (%d since start): failing %d requests",
                      self._ooms, len(self._live), exc_info=True)
            self._abort_live("oom")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.report()
            return
        except Exception:  # noqa: BLE001 - fail the requests, keep serving
            self.pulse.progress = time.monotonic()
            self._errors += 1
            log.exception("engine step failed: failing %d requests", len(self._live))
            self._abort_live("internal")
            self.report()
            return
        with HostTimer(self.engine.clock, "post"):
            self._flush()  # the step before, if this one launched nothing
            for out in outputs:
                if out.finished:
                    self._live.discard(out.request_id)
            self.report()  # before the outputs: what a client has seen, the snapshot already shows
            if outputs:
                self._unposted = (outputs, "oom" if stats.ooms > ooms else "internal")
            if overlap:
                self._flush()

    def _flush(self) -> None:
        """Post the outputs held back from the last step (if any) to the owner."""
        held, self._unposted = self._unposted, None
        if held is not None:
            self.post("dispatch", *held)

    def _abort_live(self, code: str) -> None:
        self._flush()  # what the requests got before they fail
        failed = list(self._live)
        for rid in failed:
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine may be inconsistent after a failed step
                log.exception("abort of %s failed", rid)
        self._live.clear()
        if failed:
            self.post("fail", failed, code)

    def report(self) -> None:
        """Publish a Snapshot of the engine now."""
        s = self.engine.stats
        self.publish(Snapshot(s.running, s.waiting, s.preemptions, s.pages_used, s.pages_total, s.steps,
                              s.ooms + self._ooms, s.failed_steps + self._errors, s.prefix_hit_tokens, s.host,
                              self.engine.step_times(), s.state_slots, s.state_slots_used,
                              self.device_memory()))
