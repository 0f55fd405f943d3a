"""Tensor parallelism that serves and never hangs: rank processes, the failure channel, the step broadcast.

Processes and groups. `launch` (the parent) hosts the TCPStore, so it outlives every rank, and spawns one
process per rank (NCCL_NVLS_ENABLE=0 and TORCH_NCCL_ASYNC_ERROR_HANDLING=0 in their environment). A rank
joins two groups:
- control: the default process group, gloo. Every decision goes over it: the profiler's MIN and votes,
  the serving step broadcast and the step's error vote. Its waits are unbounded by design: whoever a rank
  waits for there will either vote (every failure below ends in a vote) or has died, and gloo raises at
  once when a peer process is gone (its sockets close).
- data: NCCL on GPUs, gloo on CPU, used only by the model's TP layers. This is where a rank blocks
  forever when a peer raised inside a forward (measured: > 200 s in an NCCL all-reduce on 2xH200).

Bounded failure, in three parts:
1. Report before waiting. Whatever a rank runs between two votes that touches the data group (build,
   each stress, each serving step) runs in `RankGuard.section`; an exception there (and any failure the
   profiler catches, through its `on_error` hook) is posted to the store at once, before the rank goes
   on to the vote. A rank that dies outside the profiler posts from its top-level handler; a killed one
   is posted by the parent, which sees its exit code.
2. The watchdog. A thread on each rank polls the store every POLL_S. When a peer posted a failure and
   this rank is still inside a section GRACE_S later, it can only be waiting for that peer in the data
   group, so the watchdog aborts the data plane: NCCL: `ProcessGroupNCCL.abort()` (ncclCommAbort: the
   kernels poll the abort flag and return, so the host's stream sync returns); gloo: abort() does not
   free a pending operation (measured, torch 2.13), so the TP layers wait on gloo work in WAIT_SLICE
   slices and raise PeerFailed once the watchdog marked the data plane aborted. The section then raises
   PeerFailed (an aborted step's numbers are garbage and are never returned) and the rank votes.
2b. When the abort does not free it. Measured on 2xH200 (torch 2.11, NCCL of its wheel): with the abort
   called under the guard's lock, no rank waiting on a running all-reduce was freed (killed by the
   backstop 60 s later). On its own thread, the abort freed ranks waiting in decode (back in 80 ms: every
   rank retried) and in graph capture, but not one waiting in a prefill; ncclCommAbort is known to hang
   in such states. So a rank still in its section STUCK_S after the abort gives up:
   it reports its peers' diagnostic as its outcome and exits (only a process exit reclaims a GPU
   with a wedged kernel). Its peers, waiting at the vote, see it gone and end with the same text.
   Retrying after such a failure would need a rank that can still run, so it is a diagnostic, not a
   retry: the text names the rank and the error that started it.
3. The vote. Every section is followed by an all_ok on the control group (the profiler's votes; the
   serving step's error vote) and the errors are gathered from every rank, so every rank ends with the
   same text. If any rank aborted its data plane, the next build replaces it on every rank (`heal`,
   collective): the profiler shrinks and retries after an OOM inside a forward. In serving a step that
   aborted is fatal (the captured graphs hold the old communicator): every rank stops with one text.
Backstop: the parent kills ranks that have not ended BOUND_S after an unresolved failure (a rank stuck
where Python cannot run, a collective outside every section) and reports the stored records.

Why not timeouts alone: a timeout on the data group bounds the wait, but it must exceed every legitimate
skew between ranks (weight loading, cold Triton compiles: 22 s measured), so it reacts at the wrong
scale, and NCCL's own watchdog ends the process after 10 minutes with an abort, not our diagnostic. The
store and the watchdog react to the failure itself, in about GRACE_S.
"""
from __future__ import annotations

import datetime
import inspect
import json
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import connection

import torch
import torch.distributed as dist

from autoprofile import memory
from autoprofile.profiler import ProfileError, _describe, _gather_errors, _is_consequence

log = logging.getLogger(__name__)

POLL_S = 0.05  # the watchdog reads the store this often
GRACE_S = 1.0  # a rank still in its section this long after a peer failed is waiting for that peer
STUCK_S = 5.0  # still in its section this long after the abort: the abort did not free it (see 2b)
WAIT_SLICE = datetime.timedelta(milliseconds=100)  # gloo data-plane waits check for a peer failure this often
BOUND_S = 60.0  # the parent ends ranks that have not agreed this long after a failure
HEARTBEAT_S = 60.0  # rank 0 pings idle workers: gloo ops fail after the group's 30-minute timeout
STORE_TIMEOUT = datetime.timedelta(minutes=5)
RANK_ENV = {"NCCL_NVLS_ENABLE": "0",  # NVLink multicast stays off (KINDS.md)
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}  # we abort communicators ourselves (torch's abort API asks for 0)


class PeerFailed(RuntimeError):
    """This rank stopped waiting in the data group because another rank failed."""


class TPError(RuntimeError):
    """A collective diagnostic outside the profiler (serving): every rank raises the same text."""


class StepFailed(RuntimeError):
    """A serving step failed on some rank without aborting the data plane: every rank raises this same
    text, the step's requests end with an error, serving goes on."""


# ---------------------------------------------------------------- the failure records
@dataclass(frozen=True)
class Record:
    seq: int
    epoch: int  # -1: posted by the parent
    rank: int
    text: str
    fatal: bool  # the rank is ending (a top-level failure or a dead process), not voting


class FailureLog:
    """Failure records in the TCPStore: `tp/failures` counts them, `tp/failure/<n>` holds each one."""

    COUNT = "tp/failures"

    def __init__(self, store):
        self.store = store

    def post(self, epoch: int, rank: int, text: str, fatal: bool = False) -> None:
        seq = self.store.add(self.COUNT, 1)
        self.store.set(f"tp/failure/{seq}", json.dumps([epoch, rank, text, fatal]))

    def count(self) -> int:
        return self.store.add(self.COUNT, 0)

    def read(self, first: int = 1, last: int | None = None) -> list[Record]:
        out = []
        for seq in range(first, (self.count() if last is None else last) + 1):
            key = f"tp/failure/{seq}"
            try:
                self.store.wait([key], datetime.timedelta(seconds=2))
            except RuntimeError:  # its poster died between counting and writing it
                continue
            out.append(Record(seq, *json.loads(self.store.get(key))))
        return out

    def resolve(self, epoch: int) -> None:
        """This rank has voted on epoch's failures and goes on (a retry, or serving on)."""
        self.store.add(f"tp/resolved/{epoch}", 1)

    def resolved(self, epoch: int) -> int:
        return self.store.add(f"tp/resolved/{epoch}", 0)


def diagnostic(records: list[Record]) -> str:
    """One entry per failed rank (its first record), in rank order: what every rank and the parent say."""
    first: dict[int, str] = {}
    for r in records:
        first.setdefault(r.rank, r.text)
    return "; ".join(f"rank {rank}: {text}" for rank, text in sorted(first.items()))


def is_consequence(e: BaseException) -> bool:
    """An error a rank gets because a peer failed (not a failure of its own)."""
    return isinstance(e, PeerFailed) or _is_consequence(str(e))


# ---------------------------------------------------------------- one rank's guard
class RankGuard:
    """This rank's side of the failure channel: the data group, its sections, the watchdog thread."""

    def __init__(self, store_addr: tuple[str, int], rank: int, world: int, device: torch.device,
                 grace_s: float = GRACE_S, on_stuck: Callable[[str], None] | None = None):
        self.rank, self.world, self.device, self.grace_s = rank, world, device, grace_s
        self.on_stuck = on_stuck or _exit_stuck  # ends this process with the text (2b)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.failures = FailureLog(_client(store_addr))
        self.control = dist.group.WORLD
        self.data = self._new_data_group()
        self.tp = None  # the model's TP object once bound: heal() rebinds its group
        self.epoch = 0
        self.aborted = False
        self._lock = threading.Lock()
        self._busy = False
        self._peers: list[tuple[float, Record]] = []  # (seen at, record) of other ranks
        self._posted = -1  # the epoch of this rank's last posted failure
        self._aborted_at: float | None = None
        self._closed = threading.Event()
        self._watch_log = FailureLog(_client(store_addr))  # NOTE: one store client per thread
        self._thread = threading.Thread(target=self._watch, name=f"tp-watchdog-{rank}", daemon=True)
        self._thread.start()

    def _new_data_group(self):
        if self.backend == "gloo":
            return dist.new_group(backend="gloo")
        kw = {"device_id": self.device} if "device_id" in inspect.signature(dist.new_group).parameters else {}
        return dist.new_group(backend="nccl", **kw)  # eager init: the communicator exists before a forward

    def bind(self, runner) -> GuardedRunner:
        """The runner's TP layers use the data group (on gloo, through a wait that gives up when a peer
        failed); returns the runner whose data-plane work runs in sections."""
        self.tp = runner.tp
        runner.tp.group = self.data
        if self.backend == "gloo":
            runner.tp.wait = self.wait
        return GuardedRunner(runner, self)

    # ------------------------------------------------------------ report, wait, abort
    def post(self, text: str, fatal: bool = False) -> None:
        """Tell every rank now, before this rank waits anywhere, that it failed (once per epoch; never
        for a failure that is the consequence of a peer's)."""
        with self._lock:
            if self.aborted or (self._posted == self.epoch and not fatal):
                return
            self._posted = self.epoch
            epoch = self.epoch
        try:
            self.failures.post(epoch, self.rank, text, fatal)
        except Exception as e:  # noqa: BLE001 - the parent's backstop still bounds the others
            log.error("could not post this rank's failure to the store: %s", _describe(e))
        log.error("rank %d failed: %s", self.rank, text)

    @contextmanager
    def section(self, what: str):
        """Work on the data group between two votes. Raises PeerFailed when the watchdog aborted it."""
        with self._lock:
            if self.aborted:
                raise PeerFailed(f"the data plane was aborted after {self.peer_text()}")
            self._busy = True
        try:
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # NOTE: the section's NCCL kernels end inside it
        except Exception as e:
            with self._lock:
                self._busy, aborted = False, self.aborted
            if aborted:
                raise PeerFailed(f"{what} stopped: {self.peer_text()}") from e
            if not is_consequence(e):
                self.post(_describe(e))
            raise
        finally:
            with self._lock:
                self._busy = False
        if self.aborted:  # it finished, but the data plane is gone: the vote must fail
            raise PeerFailed(f"{what} finished as the data plane was aborted after {self.peer_text()}")

    def wait(self, work) -> None:
        """Wait for a gloo data-plane collective in slices; give up when the watchdog aborted it."""
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError:
                if work.is_completed():  # the collective itself failed
                    raise
            if self.aborted:
                raise PeerFailed(f"stopped waiting in a collective: {self.peer_text()}")

    def peer_text(self) -> str:
        with self._lock:
            peers = [r for _, r in self._peers]
        return f"{diagnostic(peers)} (first to fail)" if peers else "a peer failed"

    def _watch(self) -> None:
        seen = 0
        while not self._closed.wait(POLL_S):
            try:
                n = self._watch_log.count()
                new = self._watch_log.read(seen + 1, n) if n > seen else []
                seen = n
            except Exception as e:  # noqa: BLE001 - the store lives in the parent: it is gone
                if self._closed.is_set():
                    return
                # NOTE: nobody collects this rank any more: end it as the parent's SIGTERM would (rank 0
                # of a server drains; the others end), never an orphan holding its GPU
                log.error("the launcher is gone (%s): this rank stops", _describe(e))
                os.kill(os.getpid(), signal.SIGTERM)
                return
            now = time.monotonic()
            abort = stuck = None
            with self._lock:
                self._peers += [(now, r) for r in new if r.rank != self.rank]
                relevant = [t for t, r in self._peers if r.fatal or r.epoch >= self.epoch]
                if relevant and self._busy and not self.aborted and now - min(relevant) >= self.grace_s:
                    self.aborted, self._aborted_at, abort = True, now, self.data
                elif self.aborted and self._busy and now - self._aborted_at >= STUCK_S:
                    stuck = diagnostic([r for _, r in self._peers])
            if abort is not None:
                log.error("rank %d: a peer failed while this rank waits in the data group: aborting it", self.rank)
                if self.backend == "nccl":  # NOTE: its own thread: ncclCommAbort can hang (2b)
                    threading.Thread(target=_abort_nccl, args=(abort,), name="tp-abort", daemon=True).start()
            if stuck is not None:
                log.error("rank %d: still waiting in the data group %.0f s after aborting it: ending this rank",
                          self.rank, STUCK_S)
                self.on_stuck(stuck)
                return

    def heal(self) -> None:
        """Collective, where every rank arrives together (each build, a failed serving step): if any rank
        aborted its data plane, every rank replaces it; the epoch's failures are resolved."""
        if memory.all_reduce_max(int(self.aborted), self.control):
            old = self.data
            if self.backend == "nccl" and not self.aborted:
                dist.distributed_c10d._abort_process_group(old)  # its peers' halves are gone: free its buffers
            # NOTE: an aborted gloo group keeps its stuck operation; it is dropped, never used again
            self.data = self._new_data_group()
            if self.tp is not None:
                self.tp.group = self.data
            log.warning("rank %d: the data group was replaced after an abort", self.rank)
        with self._lock:
            epoch = self.epoch
            self.epoch, self.aborted = epoch + 1, False
        self.failures.resolve(epoch)

    def diagnose(self, e: BaseException) -> str:
        """The text a rank ends with after an exception that reached its top level: the peers' failure if
        this is its consequence (PeerFailed, a dead peer's closed connection), else its own, posted first."""
        if is_consequence(e):
            deadline = time.monotonic() + 5.0  # the parent posts a dead rank within its poll interval
            while time.monotonic() < deadline:
                peers = [r for r in self.failures.read() if r.rank != self.rank]
                if peers:
                    return diagnostic(peers)
                time.sleep(0.1)
        self.post(_describe(e), fatal=True)
        return diagnostic(self.failures.read())

    def close(self) -> None:
        self._closed.set()


def _abort_nccl(group) -> None:
    try:
        dist.distributed_c10d._abort_process_group(group)
    except Exception as e:  # noqa: BLE001 - the stuck timer (2b) still bounds this rank
        log.error("aborting the NCCL communicator failed: %s", _describe(e))


def _exit_stuck(text: str) -> None:
    log.error("%s", text)
    logging.shutdown()
    os._exit(1)


class GuardedRunner:
    """A ModelRunner whose work on the data group runs in the guard's sections; every other attribute is
    the runner's, so the profiler and LLMEngine take it as the runner itself."""

    def __init__(self, runner, guard: RankGuard):
        self.runner, self.guard = runner, guard

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def build(self, kv_tokens: int, checkpoint=None) -> None:
        self.guard.heal()  # NOTE: collective; the profiler builds on every rank at the same point
        with self.guard.section("build"):
            self.runner.build(kv_tokens, checkpoint)

    def stress_prefill(self):
        with self.guard.section("prefill stress"):
            return self.runner.stress_prefill()

    def stress_decode(self):
        with self.guard.section("decode stress"):
            return self.runner.stress_decode()

    def execute(self, step):
        with self.guard.section("step"):
            return self.runner.execute(step)


# ---------------------------------------------------------------- serving: the step broadcast
def encode(step) -> tuple:
    """What a worker needs of a Step (requests stay on rank 0: only rank 0 samples for real)."""
    rows = [[(r.slot, r.start, r.ids, r.sample, r.params) for r in part] for part in (step.rows, step.decode)]
    return step.is_prefill, rows, step.page_writes, step.running, step.pages_used


def decode(msg: tuple):
    from autoprofile.engine.scheduler import Step, StepRow
    is_prefill, (rows, decode_rows), page_writes, running, pages_used = msg
    return Step(is_prefill, [StepRow(*r) for r in rows], page_writes, running, pages_used,
                decode=[StepRow(*r) for r in decode_rows])


def run_step(runner: GuardedRunner, step) -> list[int]:
    """Every rank: execute the step, then the error vote. Workers execute exactly what rank 0 does,
    sampling included (the memory the profile measured); their tokens are dropped: the LM head gathers
    the full logits on every rank, so rank 0's tokens are the step's tokens."""
    guard = runner.guard
    err, out = None, []
    try:
        out = runner.execute(step)
    except Exception as e:  # noqa: BLE001 - every failure goes to the vote
        err = _describe(e)
    if memory.all_ok(err is None, guard.control):
        return out
    text = "; ".join(_gather_errors(err, guard.control))
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


# ---------------------------------------------------------------- the parent
@dataclass(frozen=True)
class Outcome:
    rank: int
    ok: bool
    value: object  # what the rank's target returned, else the text it ended with
    ended: float  # time.time() when the rank ended


def launch(target: Callable, world: int, args: tuple = (), device: str = "cuda", bound_s: float = BOUND_S,
           env: dict[str, str] | None = None, timeout_s: float | None = None) -> list[Outcome]:
    """Spawn `world` ranks, each running target(guard, *args); return every rank's Outcome in rank order.

    Reads every result as it comes (a large one never blocks a rank), never waits on a dead rank (its exit
    is posted as its failure), and kills ranks that have not ended `bound_s` after an unresolved failure.
    The ranks run in their own process group: a Ctrl-C or a SIGTERM reaches this parent, which forwards
    it to rank 0 (it serves: it drains and stops the others) and gives the ranks 30 s to end;
    timeout_s (tests) ends every rank that far from the start, failure or not."""
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
    addr = ("127.0.0.1", store.port)
    failures = FailureLog(store)
    ctx = mp.get_context("spawn")
    procs, pipes = [], []
    for rank in range(world):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(rank, world, addr, device, target, args, send, env or {}),
                        name=f"autoprofile-rank{rank}")
        p.start()
        send.close()
        procs.append(p)
        pipes.append(recv)
    outcomes: dict[int, Outcome] = {}
    unresolved_since: float | None = None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    restore = _forward_sigterm()
    try:
        while len(outcomes) < world:
            try:
                waiting = [r for r in range(world) if r not in outcomes]
                connection.wait([pipes[r] for r in waiting] + [procs[r].sentinel for r in waiting], timeout=0.2)
                _collect(procs, pipes, outcomes, failures)
                unresolved_since = _unresolved_since(failures, world, unresolved_since)
                now = time.monotonic()
                if (unresolved_since is not None and now - unresolved_since > bound_s) or \
                        (deadline is not None and now > deadline):
                    _end(procs, pipes, outcomes, failures, bound_s)
            except (KeyboardInterrupt, _Terminated) as e:
                sig = signal.SIGTERM if isinstance(e, _Terminated) else signal.SIGINT
                deadline = time.monotonic() + 30.0
                log.warning("%s: rank 0 stops the others; waiting up to 30 s", sig.name)
                if procs[0].is_alive():
                    os.kill(procs[0].pid, sig)
    finally:
        restore()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [outcomes[r] for r in range(world)]


class _Terminated(Exception):
    """SIGTERM reached the parent (raised in its main thread, handled like a Ctrl-C)."""


def _forward_sigterm() -> Callable[[], None]:
    """While the parent waits for its ranks, SIGTERM raises _Terminated in it (the default action would
    kill the parent alone and leave the ranks, in their own process group, serving as orphans).
    Returns what restores the previous handler; a no-op off the main thread (no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_term(signum, frame):
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, on_term)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _collect(procs, pipes, outcomes: dict[int, Outcome], failures: FailureLog) -> None:
    for rank, (p, pipe) in enumerate(zip(procs, pipes)):
        if rank in outcomes:
            continue
        try:
            if pipe.poll():
                outcomes[rank] = pipe.recv()
                continue
        except (EOFError, OSError):
            pass
        if not p.is_alive():
            p.join()
            code = p.exitcode
            why = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"code {code}"
            text = f"the rank's process died ({why}) before reporting"
            failures.post(-1, rank, text, fatal=True)
            outcomes[rank] = Outcome(rank, False, diagnostic(failures.read()), time.time())


def _unresolved_since(failures: FailureLog, world: int, since: float | None) -> float | None:
    """When the parent first saw a failure that every rank has not yet voted past; None if none."""
    records = failures.read() if failures.count() else []
    open_ = [r for r in records if r.fatal or failures.resolved(r.epoch) < world]
    if not open_:
        return None
    return since if since is not None else time.monotonic()


def _end(procs, pipes, outcomes: dict[int, Outcome], failures: FailureLog, bound_s: float) -> None:
    text = diagnostic(failures.read()) or "no rank reported a failure"
    for rank, p in enumerate(procs):
        if rank not in outcomes and p.is_alive():
            log.error("rank %d has not ended %.0f s after a failure: killed", rank, bound_s)
            p.kill()
            p.join()
            outcomes[rank] = Outcome(rank, False, f"{text} (rank {rank} killed by the launcher: no end "
                                                  f"{bound_s:.0f} s after a failure, or past its deadline)",
                                     time.time())


def _client(addr: tuple[str, int]):
    return dist.TCPStore(addr[0], addr[1], is_master=False, timeout=STORE_TIMEOUT)


def _rank_main(rank: int, world: int, addr: tuple[str, int], device_kind: str, target: Callable, args: tuple,
               conn, env: dict[str, str]) -> None:
    os.environ.update({**RANK_ENV, **env})
    os.setpgrp()  # NOTE: a terminal's Ctrl-C goes to the parent only; it forwards it to rank 0
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    guard = None
    replied = threading.Lock()

    def reply(outcome: Outcome) -> bool:
        """The rank's one outcome (the main thread's, or the watchdog's when the main thread is wedged)."""
        if not replied.acquire(blocking=False):
            return False
        conn.send(outcome)
        conn.close()
        return True

    def give_up(text: str) -> None:  # the watchdog thread: the main thread is wedged in the data plane
        if reply(Outcome(rank, False, text, time.time())):
            _exit_stuck(text)

    try:
        device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", _client(addr)), rank=rank, world_size=world)
        guard = RankGuard(addr, rank, world, device, on_stuck=give_up)
        outcome = Outcome(rank, True, target(guard, *args), time.time())
    except (ProfileError, TPError) as e:  # a collective diagnostic: every rank has this same text
        outcome = Outcome(rank, False, str(e), time.time())
    except BaseException as e:  # noqa: BLE001 - every rank ends with a text, never a hang
        log.error("rank %d: %s", rank, traceback.format_exc())
        if guard is not None:
            text = guard.diagnose(e)
        else:
            text = f"rank {rank}: {_describe(e)}"
            FailureLog(_client(addr)).post(-1, rank, _describe(e), fatal=True)
        outcome = Outcome(rank, False, text, time.time())
    if not reply(outcome):
        return  # the watchdog answered for this rank and is ending the process
    if guard is not None:
        guard.close()
    logging.shutdown()
    if not outcome.ok:
        os._exit(1)  # NOTE: now: peers blocked on this rank's sockets see them close; no NCCL teardown to hang in
    dist.destroy_process_group()


# ---------------------------------------------------------------- profile and serve
def profile_rank(guard: RankGuard, cfg, checkpoint=None):
    """One rank of `autoprofile profile --tp N`: boot (load, probe, measure, rebuild, validate), tear down."""
    from autoprofile.profiler import boot
    runner, result = boot(cfg, guard.rank, guard.world, cpu_group=guard.control, guard=guard,
                          checkpoint=checkpoint, log_report=False)
    runner.teardown()
    result.cfg = cfg
    return result


def profile_tp(cfg, checkpoint=None):
    """`autoprofile profile --tp N`: rank 0's ProfileResult, or ProfileError with the ranks' diagnostic."""
    outcomes = launch(profile_rank, cfg.tp, (cfg, checkpoint))
    if all(o.ok for o in outcomes):
        return outcomes[0].value
    raise ProfileError(next(o.value for o in outcomes if not o.ok))


def profile_boot(cfg, guard: RankGuard):
    """This rank's share of the collective boot: load, probe, measure, rebuild, validate."""
    from autoprofile.profiler import boot
    return boot(cfg, guard.rank, guard.world, cpu_group=guard.control, guard=guard)


def serve_rank(guard: RankGuard, cfg, boot: Callable = profile_boot) -> None:
    """One rank of `autoprofile serve --tp N`. Rank 0 binds its port first (/health answers 503 "starting"
    while every rank boots; a port clash ends it at once, and its peers through the failure channel), then
    serves HTTP and ships steps; the others boot and run them. Ctrl-C reaches rank 0 (its server stops and
    sends stop); the workers ignore it. boot(cfg, guard) -> (runner, result) (tests: a CPU boot)."""
    if guard.rank:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        runner, _ = boot(cfg, guard)
        try:
            worker_loop(runner)
        finally:
            runner.teardown()
        return
    from autoprofile.server import run_server
    booted: dict = {}

    def boot_rank0(_cfg):  # run_server runs it on its boot thread, after binding
        try:
            booted["runner"], result = boot(cfg, guard)
        except ProfileError as e:  # every rank's same text: the launcher prints it, once (not run_server)
            raise TPError(str(e)) from None
        booted["broadcaster"] = StepBroadcaster(booted["runner"], on_fatal=_stop_serving)
        return booted["broadcaster"], result

    try:
        run_server(cfg, boot_rank0)
    finally:
        if "broadcaster" in booted:
            booted["broadcaster"].close()
        if "runner" in booted:
            booted["runner"].teardown()
    if booted["broadcaster"].fatal != "closed":
        raise TPError(booted["broadcaster"].fatal)


def _stop_serving(text: str) -> None:
    import _thread
    log.error("%s", text)
    _thread.interrupt_main()  # the server's loop ends as on Ctrl-C; serve_rank then raises the text


def serve_tp(cfg, device: str = "cuda", boot: Callable = profile_boot) -> int:
    """`autoprofile serve --tp N`: exit code 0 when rank 0 stopped cleanly, 1 with the diagnostic."""
    import sys
    outcomes = launch(serve_rank, cfg.tp, (cfg, boot), device=device)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        print(failed[0].value if outcomes[0].ok else outcomes[0].value, file=sys.stderr)
        return 1
    return 0
