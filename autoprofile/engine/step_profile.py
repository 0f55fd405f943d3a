"""A torch.profiler trace of the serving engine's steps, on demand: the server's POST /start_profile and
/stop_profile under --profile_dir (vLLM's endpoints; SGLang's take num_steps too). The issue-48 question
"where does a served step's time go" needs the steps as served (the requests' own chunks, decode rows and
host contention), which a step rebuilt by scripts/profile_decode.py does not have.

    profiler = StepProfiler(folder, device)      # one owner: the engine loop's thread (AsyncEngine)
    profiler.start(num_steps)                    # None: until stop()
    with profiler.step():                        # around each engine step: "engine step N" in the trace
        engine.step()
    profiler.stop() -> Trace                     # also after num_steps steps, by itself

Each trace is two files in the folder: the Chrome trace (`engine-<stamp>.json.gz`: chrome://tracing or
Perfetto) and a table of the ops and kernels by their own device time (by CPU time without a GPU). The
profiler's events and CUPTI's activity buffers are host memory; whatever device memory CUPTI itself takes is
outside the probe's measurement (not yet measured on a GPU: the endpoints are for diagnosis, off by default).
A profiled engine runs slower (every op is recorded): figures from a profiled run are for where the time goes,
not for how much there is.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function

log = logging.getLogger(__name__)
TABLE_ROWS = 40


class ProfileError(Exception):
    """start() while a profile runs, or stop() with none running."""


@dataclass(frozen=True)
class Trace:
    trace: str  # the Chrome trace's path
    table: str  # the ops' table's path
    steps: int  # engine steps inside it


class StepProfiler:
    def __init__(self, folder: str, device: torch.device):
        self.folder, self.device = folder, device
        self._prof: profile | None = None
        self._limit: int | None = None
        self._steps = 0
        self.done: Trace | OSError | None = None  # written (or failed) after its num_steps, until stop()

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self, num_steps: int | None = None) -> None:
        if self.active:
            raise ProfileError("a profile is already running: POST /stop_profile first")
        if num_steps is not None and num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        os.makedirs(self.folder, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities)
        self._prof.start()
        self._limit, self._steps, self.done = num_steps, 0, None

    @contextlib.contextmanager
    def step(self):
        """Around one engine step: marked in the trace while a profile runs; the profile ends after its
        num_steps-th step (its trace kept for stop())."""
        if not self.active:
            yield
            return
        self._steps += 1
        with record_function(f"engine step {self._steps}"):
            yield
        if self._limit is not None and self._steps >= self._limit:
            try:
                self.done = self._finish()
            except OSError as e:  # never the engine loop's error: stop() answers it
                log.error("the trace after %d steps could not be written: %s", self._steps, e)
                self.done = e

    def stop(self) -> Trace:
        """The running profile's trace, written now; or the one that ended after its num_steps (once)."""
        if self.active:
            return self._finish()
        if self.done is None:
            raise ProfileError("no profile is running: POST /start_profile first")
        done, self.done = self.done, None
        if isinstance(done, OSError):
            raise done
        return done

    def close(self) -> None:
        """The engine loop ends: a running profile is dropped unwritten (one torch profiler a process)."""
        if self.active:
            prof, self._prof = self._prof, None
            prof.stop()

    def _finish(self) -> Trace:
        prof, self._prof = self._prof, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the steps' kernels into the trace
        prof.stop()
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        trace = os.path.join(self.folder, f"engine-{stamp}.json.gz")
        table = os.path.join(self.folder, f"engine-{stamp}.txt")
        prof.export_chrome_trace(trace)
        by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        with open(table, "w") as f:
            f.write(f"{self._steps} engine steps\n")
            f.write(prof.key_averages().table(sort_by=by, row_limit=TABLE_ROWS))
        return Trace(trace, table, self._steps)
