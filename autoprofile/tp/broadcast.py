"""Serving under TP: rank 0 ships each step over the control group, every rank runs it in its guard's
section and votes on its errors (StepFailed: the step's requests end, serving goes on)."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from autoprofile import memory
from autoprofile.tp.channel import HEARTBEAT_S, GuardedRunner, StepFailed, TPError, is_consequence
from autoprofile.tp.votes import describe, gather_errors

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- serving: the step broadcast
def encode(step) -> tuple:
    """What a worker needs of a Step (requests stay on rank 0: only rank 0 samples for real). A
    vision-language model's rows carry their images (M-RoPE positions and deltas; the pixels of the images
    this step encodes, which every rank encodes with its own replica of the tower)."""
    rows = [[(r.slot, r.start, r.ids, r.sample, r.params, None, r.mm, r.spans) for r in part]
            for part in (step.rows, step.decode)]
    return step.is_prefill, rows, step.page_writes, step.running, step.pages_used, step.encode, step.routing


def decode(msg: tuple):
    from autoprofile.engine.scheduler import Step, StepRow
    is_prefill, (rows, decode_rows), page_writes, running, pages_used, encode_images, routing = msg
    return Step(is_prefill, [StepRow(*r) for r in rows], page_writes, running, pages_used, encode_images,
                decode=[StepRow(*r) for r in decode_rows], routing=routing)


def run_step(runner: GuardedRunner, step) -> list[int]:
    """Every rank: execute the step, then the error vote. Workers execute exactly what rank 0 does,
    sampling included (the memory the profile measured); their tokens are dropped: the LM head gathers
    the full logits on every rank, so rank 0's tokens are the step's tokens."""
    guard = runner.guard
    err, out = None, []
    try:
        out = runner.execute(step)
    except Exception as e:  # noqa: BLE001 - every failure goes to the vote
        err = describe(e)
    if memory.all_ok(err is None, guard.control):
        return out
    text = "; ".join(gather_errors(err, guard.control))
    if memory.all_reduce_max(int(guard.aborted), guard.control):
        raise TPError(f"tensor-parallel serving stopped: a step failed inside a collective and the data "
                      f"plane was aborted ({text})")
    guard.heal()
    raise StepFailed(text)


class StepBroadcaster:
    """Rank 0's runner for LLMEngine and the server: `execute(step)` ships the step to every rank over the
    control group, runs it here too and returns rank 0's tokens; every other attribute (envelope, kv,
    model_config, ...) is the runner's. `close()` ends the workers. Thread-safe (the heartbeat)."""

    def __init__(self, runner: GuardedRunner, on_fatal: Callable[[str], None] | None = None,
                 heartbeat_s: float = HEARTBEAT_S):
        self.runner, self.guard = runner, runner.guard
        self.on_fatal = on_fatal or (lambda text: None)
        self.fatal: str | None = None
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True)
        self._beat.start()

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute(self, step) -> list[int]:
        with self._lock:
            if self.fatal is not None:
                raise TPError(self.fatal)
            try:
                self._send(("step", encode(step)))
                return run_step(self.runner, step)
            except TPError as e:
                self._fail(str(e))
                raise
            except Exception as e:
                if not is_consequence(e):
                    raise
                # a peer is gone (killed, or ended itself: 2b): no step can run any more, on any rank
                text = f"tensor-parallel serving stopped: {self.guard.diagnose(e)}"
                self._fail(text)
                raise TPError(text) from e

    def _fail(self, text: str) -> None:
        self.fatal = text
        self.on_fatal(text)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self.fatal is None:
                self._send(("stop", None))
                self.fatal = "closed"

    def _send(self, msg: tuple) -> None:
        dist.broadcast_object_list([msg], src=0, group=self.guard.control)
        self._last = time.monotonic()

    def _heartbeat(self, every: float) -> None:
        while not self._stop.wait(every / 4):
            with self._lock:
                if self.fatal is None and time.monotonic() - self._last >= every:
                    self._send(("ping", None))


def worker_loop(runner: GuardedRunner) -> int:
    """Ranks > 0: run every step rank 0 ships until it says stop; returns the steps run. A fatal step
    raises TPError (the same text as rank 0's); rank 0 dying ends the loop with a gloo error."""
    steps = 0
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0, group=runner.guard.control)
        kind, payload = msg[0]
        if kind == "stop":
            return steps
        if kind == "step":
            steps += 1
            try:
                run_step(runner, decode(payload))
            except StepFailed as e:
                log.warning("step %d failed on some rank (rank 0 ends its requests): %s", steps, e)

