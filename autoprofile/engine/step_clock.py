"""StepClock: where serving's time goes, summed since the engine started.

The host side, on the engine thread (perf_counter): scheduling a step, executing it (inputs, launches and
the wait for the sampled tokens), and applying its tokens (update and outputs). On a GPU, the stream's own
view through CUDA events recorded by ModelRunner.execute: `prepare` (from the step's start to its forward's
first launch: building and copying inputs), `forward` (the forward and the sampler) and `idle` (the stream
waiting for the host between two steps of one busy stretch). The events are read once they have completed,
never waited for: a step with no sampled row returns unsynchronised and the host runs ahead, as it would
without the clock.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch


# the engine thread's parts (HostTimer): execute is the launch (inputs and kernels; without the overlap also
# the wait for the tokens), wait the overlapped engine's wait for a step's tokens
HOST_PARTS = ("inbox", "schedule", "execute", "wait", "update", "post")


@dataclass
class _Pending:
    kind: str
    start: torch.cuda.Event
    launch: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    after_idle: bool = False  # the engine waited for work before this step: its gap is not host overhead


@dataclass
class StepTimes:
    """Totals since start. steps, tokens: by step kind ("prefill": a step with prompt tokens, its decode rows
    riding along; "decode": decode rows only); tokens are the forward's rows (prompt tokens + decode rows).
    host: seconds by part; gpu: seconds by (kind, part) and "idle"."""

    steps: Counter = field(default_factory=Counter)
    tokens: Counter = field(default_factory=Counter)
    host: Counter = field(default_factory=Counter)
    gpu: Counter = field(default_factory=Counter)

    def copy(self) -> StepTimes:
        return StepTimes(Counter(self.steps), Counter(self.tokens), Counter(self.host), Counter(self.gpu))


class StepClock:
    def __init__(self, device: torch.device):
        self.timed = device.type == "cuda"
        self.times = StepTimes()
        self._pending: list[_Pending] = []
        self._last_end: torch.cuda.Event | None = None
        self._idle = True
        self._after_launch = None  # the one callable to run once the next step's work is enqueued

    def reset(self) -> None:
        """Start the totals over (the engine does at its start: the profile's stress is not serving)."""
        self.times, self._pending, self._last_end, self._idle = StepTimes(), [], None, True

    def idle(self) -> None:
        """The engine ran out of work: the gap before its next step is waiting for requests, not overhead."""
        self._idle = True

    def host(self, part: str, seconds: float) -> None:
        self.times.host[part] += seconds

    # ------------------------------------------------------------ ModelRunner.execute's marks
    def begin(self, kind: str, tokens: int) -> None:
        self.times.steps[kind] += 1
        self.times.tokens[kind] += tokens
        if self.timed:
            self._settle()
            self._pending.append(_Pending(kind, self._record(), after_idle=self._idle))
        self._idle = False

    def launched(self) -> None:
        if self.timed and self._pending:
            self._pending[-1].launch = self._record()

    def ended(self) -> None:
        """The step's GPU work is all enqueued (the host waits for its tokens next): runs what after_launch
        deferred."""
        if self.timed and self._pending:
            self._pending[-1].end = self._record()
        fn, self._after_launch = self._after_launch, None
        if fn is not None:
            fn()

    def after_launch(self, fn) -> None:
        """Run fn once the next step's GPU work is enqueued, while the GPU runs it and this thread waits (the
        server posts a step's outputs so: the event loop's work for them takes the GIL during the next
        forward, not during the host's scheduling and input building). Its caller runs fn itself if no step
        launches. A later call replaces an earlier one not yet run."""
        self._after_launch = fn

    def read(self) -> StepTimes:
        """The totals of every step whose events have completed (none is waited for)."""
        if self.timed:
            self._settle()
        return self.times.copy()

    # ------------------------------------------------------------ internals
    @staticmethod
    def _record() -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _settle(self) -> None:
        """Fold in the steps (oldest first) whose events have all completed; a step that raised between its
        marks has none to wait for and is dropped."""
        while self._pending:
            p = self._pending[0]
            if p.end is None or p.launch is None:
                if p is self._pending[-1]:
                    return  # still being executed
                self._pending.pop(0)
                self._last_end = None
                continue
            if not p.end.query():
                return
            self._pending.pop(0)
            g = self.times.gpu
            g[(p.kind, "prepare")] += p.start.elapsed_time(p.launch) / 1e3
            g[(p.kind, "forward")] += p.launch.elapsed_time(p.end) / 1e3
            if self._last_end is not None and not p.after_idle:
                g["idle"] += self._last_end.elapsed_time(p.start) / 1e3
            self._last_end = p.end


class HostTimer:
    """`with HostTimer(clock, "schedule"):` adds the block's wall seconds to clock.times.host["schedule"]."""

    def __init__(self, clock: StepClock, part: str):
        self.clock, self.part = clock, part

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.clock.host(self.part, time.perf_counter() - self.t0)
        return False
