"""The failure channel: failure records in the TCPStore, one rank's guard (its sections and watchdog),
the runner whose data-group work runs in those sections. How a failure ends bounded: autoprofile.tp."""
from __future__ import annotations

import datetime
import inspect
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autoprofile import memory
from autoprofile.tp.votes import describe, is_consequence as is_consequence_text

log = logging.getLogger(__name__)

POLL_S = 0.05  # the watchdog reads the store this often
# a rank whose launcher is gone drains on its SIGTERM (rank 0 of a server), then ends this long after at the
# latest: its peers are gone with the launcher, nobody collects it, and a wait on them must not keep it alive
ORPHAN_GRACE_S = 10.0
GRACE_S = 1.0  # a rank still in its section this long after a peer failed is waiting for that peer
STUCK_S = 5.0  # still in its section this long after the abort: the abort did not free it (see 2b)
WAIT_SLICE = datetime.timedelta(milliseconds=100)  # gloo data-plane waits check for a peer failure this often
PEER_WAIT_S = 5.0  # a rank that lost a peer waits this long for the record naming why (a parent posts it)
BOUND_S = 60.0  # the parent ends ranks that have not agreed this long after a failure
HEARTBEAT_S = 60.0  # rank 0 pings idle workers: gloo ops fail after the group's 30-minute timeout
STORE_TIMEOUT = datetime.timedelta(minutes=5)
RANK_ENV = {"NCCL_NVLS_ENABLE": "0",  # NVLink multicast stays off (KINDS.md)
            # we abort communicators ourselves (torch's abort API asks for 0)
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


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
    return isinstance(e, PeerFailed) or is_consequence_text(str(e))


# ---------------------------------------------------------------- one rank's guard
class RankGuard:
    """This rank's side of the failure channel: the data group, its sections, the watchdog thread."""

    def __init__(self, store_addr: tuple[str, int], rank: int, world: int, device: torch.device,
                 grace_s: float = GRACE_S, on_stuck: Callable[[str], None] | None = None,
                 peer_wait_s: float = PEER_WAIT_S):
        self.rank, self.world, self.device, self.grace_s = rank, world, device, grace_s
        self.peer_wait_s = peer_wait_s
        self.on_stuck = on_stuck or exit_stuck  # ends this process with the text (2b)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.failures = FailureLog(client(store_addr))
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
        self._watch_log = FailureLog(client(store_addr))  # NOTE: one store client per thread
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
            log.error("could not post this rank's failure to the store: %s", describe(e))
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
                self.post(describe(e))
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
                if work.is_completed():  # it ended meanwhile: its own outcome (a failed collective raises)
                    # NOTE: a slice can time out just as the collective completes (a loaded host): not a failure
                    work.wait()
                    return
            if self.aborted:
                raise PeerFailed(f"stopped waiting in a collective: {self.peer_text()}")

    def fatal_peers(self) -> str | None:
        """The diagnostic of the peers that are ending (dead, or a whole host gone), as the watchdog saw them;
        None while there is none."""
        with self._lock:
            fatal = [r for _, r in self._peers if r.fatal]
        return diagnostic(fatal) if fatal else None

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
                log.error("the launcher is gone (%s): this rank stops (SIGTERM, and ends in %.0f s at the "
                          "latest)", describe(e), ORPHAN_GRACE_S)
                end_orphan_after(ORPHAN_GRACE_S)
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
                log.error("rank %d: a peer failed while this rank waits in the data group: aborting it",
                          self.rank)
                if self.backend == "nccl":  # NOTE: its own thread: ncclCommAbort can hang (2b)
                    threading.Thread(target=_abort_nccl, args=(abort,), name="tp-abort", daemon=True).start()
            if stuck is not None:
                log.error("rank %d: still waiting in the data group %.0f s after aborting it: ending this "
                          "rank",
                          self.rank, STUCK_S)
                self.on_stuck(stuck)
                return

    def heal(self) -> None:
        """Collective, where every rank arrives together (each build, a failed serving step): if any rank
        aborted its data plane, every rank replaces it; the epoch's failures are resolved."""
        if memory.all_reduce_max(int(self.aborted), self.control):
            old = self.data
            if self.backend == "nccl" and not self.aborted:
                # its peers' halves are gone: free its buffers
                dist.distributed_c10d._abort_process_group(old)
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
            deadline = time.monotonic() + self.peer_wait_s
            while time.monotonic() < deadline:
                peers = [r for r in self.failures.read() if r.rank != self.rank]
                if peers:
                    return diagnostic(peers)
                time.sleep(0.1)
        self.post(describe(e), fatal=True)
        return diagnostic(self.failures.read())

    def close(self) -> None:
        self._closed.set()


def _abort_nccl(group) -> None:
    try:
        dist.distributed_c10d._abort_process_group(group)
    except Exception as e:  # noqa: BLE001 - the stuck timer (2b) still bounds this rank
        log.error("aborting the NCCL communicator failed: %s", describe(e))


def exit_stuck(text: str) -> None:
    log.error("%s", text)
    logging.shutdown()
    os._exit(1)


def _through(name: str, settable: bool = False) -> property:
    """The wrapped runner's attribute `name`, read there (and, settable, written there: a flag the profiler
    changes after the bind, such as `cfg`, must reach the runner that builds)."""
    def write(self, value) -> None:
        setattr(self.runner, name, value)
    return property(lambda self: getattr(self.runner, name), write if settable else None)


class GuardedRunner:
    """A ModelRunner whose work on the data group runs in the guard's sections. It declares what the
    profiler, the launcher and the step broadcast read (engine.step_runner.StepRunner and the profile's
    members), each read from the runner; nothing passes through unnamed. It does not overlap: a launched
    step would leave its section before the GPU is done."""

    overlaps = False
    envelope = _through("envelope")
    kv = _through("kv")
    model_config = _through("model_config")
    clock = _through("clock")
    host_kv = _through("host_kv", settable=True)
    cfg = _through("cfg", settable=True)
    device = _through("device")
    dtype = _through("dtype")
    tp = _through("tp")
    sizing = _through("sizing")
    kv_bytes = _through("kv_bytes")
    built_tokens = _through("built_tokens")
    kv_buffer = _through("kv_buffer")
    kv_scale_source = _through("kv_scale_source")
    forced_routings = _through("forced_routings")
    weight_bytes = _through("weight_bytes")
    vision_weight_bytes = _through("vision_weight_bytes")
    mm_buffer = _through("mm_buffer")

    def __init__(self, runner, guard: RankGuard):
        self.runner, self.guard = runner, guard

    def build(self, kv_tokens: int, checkpoint=None) -> None:
        self.guard.heal()  # NOTE: collective; the profiler builds on every rank at the same point
        with self.guard.section("build"):
            self.runner.build(kv_tokens, checkpoint)

    def forget_warm_ups(self) -> None:
        self.runner.forget_warm_ups()  # local: every rank calls it at the same point of the profiler

    def stress_prefill(self):
        with self.guard.section("prefill stress"):
            return self.runner.stress_prefill()

    def stress_decode(self):
        with self.guard.section("decode stress"):
            return self.runner.stress_decode()

    def execute(self, step):
        with self.guard.section("step"):
            return self.runner.execute(step)

    def launch(self, step):
        raise RuntimeError("a GuardedRunner does not overlap (overlaps is False): call execute(step)")

    def wait_load(self, load_id: int) -> None:
        self.runner.wait_load(load_id)

    def loads_ready(self, ids: list[int]) -> set[int]:
        return self.runner.loads_ready(ids)

    def cut_context(self, cfg) -> None:
        self.runner.cut_context(cfg)

    def fingerprint(self) -> dict | None:
        return self.runner.fingerprint()

    def take_boot_steps(self) -> list[tuple[str, float]]:
        return self.runner.take_boot_steps()

    def teardown(self) -> None:
        self.runner.teardown()


def client(addr: tuple[str, int]):
    """A client of the launcher's TCPStore (one per thread that uses it)."""
    return dist.TCPStore(addr[0], addr[1], is_master=False, timeout=STORE_TIMEOUT)


def end_orphan_after(seconds: float) -> None:
    """Exit the process `seconds` from now, whatever its threads are doing (a daemon timer: os._exit skips
    the interpreter's shutdown, which would join threads blocked on the dead launcher's store or sockets)."""
    timer = threading.Timer(seconds, os._exit, args=(1,))
    timer.daemon = True
    timer.start()
