"""The engine loop in a process of its own (`serve` with one CUDA GPU, or `--engine_process`), as vLLM's
EngineCore and SGLang's scheduler run: the HTTP server's event loop (parsing, tokenizing, the streams'
chunks) and the engine loop (scheduling, launching, sampling) each hold a GIL of their own.

In one process they share one: every torch op and Triton launch of the engine thread lets the GIL go, and
each time the event loop may keep it for up to the switch interval. At c256 on an H200 a served FP8 prefill
step took 166 ms for 113 ms of kernels (the GPU idle 32% inside it) while the same step in the engine alone
took 96 ms, its GPU busy throughout (scripts/engine_host_profile.py; docs/measurements.md).

    server process                                engine process (spawned; CUDA only here)
    HTTP, tokenizer, grammar checks   -- Pipe --  boot (load, probe, measure, rebuild, validate), then
    AsyncEngine (event-loop side)                 EngineLoop (serving.engine_loop) over the LLMEngine

What crosses the pipe (pickled): the commands of EngineLoop's inbox; its posts ("dispatch", "fail", "added",
"profiled") and snapshots; at the boot, ("ready", ProfileResult, Envelope) or ("boot_failed", kind, text).
A grammar crosses as a GrammarRequest (an xgrammar matcher does not pickle): the server compiled its spec
already (a bad one was a 400 there); the engine process compiles it again into a cache of its own
(serving.structured.Grammars), a first-seen spec on a compile thread of its own, before the request reaches
the loop. The pulse
(the watchdog's beat and progress) is shared memory; the engine process's allocator and CUDA stack limit come
with its snapshots (Snapshot.device_memory), so that the server process never touches CUDA: a context there
would take GPU memory the profile never counted.

The engine process ends when it is told to stop, or when the server's end of the pipe closes (the server
died): its reader puts STOP in the loop's inbox. It ignores SIGINT (a terminal's Ctrl-C reaches the whole
process group; the server stops it). Not with --tp > 1 (rank 0's engine serves the ranks' step broadcast in
the server's process).
"""
from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing as mp
import signal
import threading
import time
import traceback
import importlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger(__name__)
DEVICE_MEMORY_EVERY_S = 0.5  # the engine process reads its allocator for /metrics at most this often
STOP_WAIT_S = 60.0  # a stopped engine process that has not ended by then is killed


# NOTE: no torch here at import (the engine loop's modules come in where they run): `serve` spawns the engine
# process before it imports torch and the server, so that both processes' imports overlap


@dataclass(frozen=True)
class BootRef:
    """A boot function by module and name (`autoprofile.profiler`, `boot`): pickled to the engine process
    without importing its module here first."""

    module: str
    name: str

    def __call__(self, cfg):
        return getattr(importlib.import_module(self.module), self.name)(cfg)


class EngineBootError(RuntimeError):
    """The engine process failed to boot (not a ProfileError): its traceback is in the text."""


@dataclass(frozen=True)
class GrammarRequest:
    """A request's constraint as it crosses to the engine process: its spec (serving.structured.Spec) and/or
    allowed token ids; the engine process builds the matcher (and AllowedTokens) from it."""

    spec: object | None
    allowed: tuple[int, ...] = ()
    vocab_size: int = 0


def _shared(i: int) -> property:
    """Slot i of the shared array as a float or None (NaN)."""
    return property(lambda self: None if math.isnan(v := self.array[i]) else v,
                    lambda self, v: self.array.__setitem__(i, math.nan if v is None else v))


class SharedPulse:
    """engine_loop.Pulse over shared memory: the engine process writes, the server's watchdog reads."""

    beat = _shared(0)
    progress = _shared(1)

    def __init__(self, array):
        self.array = array


class EngineProcess:
    """The server's end: boot() spawns the engine process and waits for its profile; attach() starts reading
    its messages; send() a command; stop()."""

    remote = True

    def __init__(self, cfg, boot):
        """boot(cfg) -> (runner, result), run in the engine process: pickled there by name (a module-level
        function, or a BootRef, whose module this process need not have imported)."""
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        now = time.monotonic()
        self.pulse = SharedPulse(ctx.RawArray("d", [now, now]))
        self.boot_fn = boot
        self.proc = ctx.Process(target=engine_main, args=(cfg, boot, child, self.pulse.array),
                                name="autoprofile-engine")
        self._child_end = child
        self._stopping = False
        self._reader: threading.Thread | None = None
        self.envelope = None

    def start(self) -> EngineProcess:
        """Spawn it (its boot begins there); boot() waits for it."""
        if self.proc.pid is None:
            self.proc.start()
            self._child_end.close()  # NOTE: ours closed, the child's end alone holds it: its exit is our EOF
        return self

    def boot(self):
        """Start the engine process (unless started) and wait for its boot: its ProfileResult. ProfileError
        (its diagnostic) or EngineBootError when the boot failed; EngineBootError when the process died
        during it."""
        from autoprofile.profiler import ProfileError
        self.start()
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise EngineBootError(f"the engine process exited with code {self.proc.exitcode} during the boot "
                                  "(its log is above); to boot in the server's own process, serve with "
                                  "--engine_thread") from None
        if msg[0] == "ready":
            _, result, self.envelope = msg
            return result
        self.proc.join(STOP_WAIT_S)
        raise (ProfileError if msg[1] == "profile" else EngineBootError)(msg[2])

    def attach(self, post, take_snapshot, lost) -> None:
        """Read the engine process's messages on a thread: posts to post(kind, *args), snapshots to
        take_snapshot; lost(reason) once if it ends without being stopped."""
        def read() -> None:
            while True:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    break
                if msg[0] == "snapshot":
                    take_snapshot(msg[1])
                else:
                    post(*msg)
            if not self._stopping:
                self.proc.join(5)
                lost(f"the engine process ended (exit code {self.proc.exitcode}) without being stopped")
        self._reader = threading.Thread(target=read, name="engine-reader", daemon=True)
        self._reader.start()

    def send(self, cmd) -> None:
        try:
            self.conn.send(cmd)
        except (BrokenPipeError, OSError):  # it died: the reader reports it
            pass

    async def stop(self, wait: bool = True) -> None:
        """Tell it to stop (its live requests aborted, the runner torn down) and wait for its exit; killed
        past STOP_WAIT_S, or at once when not `wait` (a wedged loop never reads STOP)."""
        from autoprofile.serving.engine_loop import STOP
        self._stopping = True
        if not self.proc.is_alive():
            return
        if wait:
            self.send(STOP)
            await asyncio.to_thread(self.proc.join, STOP_WAIT_S)
        if self.proc.is_alive():
            log.error("the engine process did not stop: killing it")
            self.proc.kill()
            await asyncio.to_thread(self.proc.join, 10)

    def kill(self) -> None:
        """At once (the server stopped during the boot, or found no GPU)."""
        self._stopping = True
        if self.proc.pid is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)

    def cpu_seconds(self) -> float | None:
        """The engine process's CPU seconds (all its threads), or None once it has ended."""
        import psutil
        try:
            t = psutil.Process(self.proc.pid).cpu_times()
        except (psutil.Error, ValueError, TypeError):
            return None
        return t.user + t.system


# ---------------------------------------------------------------- the engine process
def engine_main(cfg, boot, conn, pulse_array) -> None:
    """The engine process: boot, tell the server, run the engine loop until STOP, tear down."""
    if cfg.device != "cpu":
        from autoprofile.kernels import triton_key
        triton_key.start()  # beside torch's import
    import torch

    from autoprofile.engine.engine import LLMEngine
    from autoprofile.profiler import ProfileError
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    try:
        runner, result = boot(cfg)
    except ProfileError as e:
        conn.send(("boot_failed", "profile", str(e)))
        return
    except BaseException:  # noqa: BLE001 - the server prints it and exits 1
        conn.send(("boot_failed", "error", traceback.format_exc()))
        raise SystemExit(1) from None
    if getattr(runner, "device", torch.device("cpu")).type == "cuda":
        # NOTE: the loop's host ops are small; an OpenMP pool that spins after each one (15 threads on a
        # 16-core H200 host, 1.6 s of CPU each in a 6 s JSON-schema run) takes the cores this loop and the
        # HTTP process run on. The boot above keeps the pool (vLLM pins its workers' to one thread too)
        torch.set_num_threads(1)
    try:
        engine = LLMEngine.from_config(runner, cfg)
        conn.send(("ready", result, engine.envelope))
        _serve(engine, cfg, conn, SharedPulse(pulse_array))
    finally:
        runner.teardown()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()


def _serve(engine, cfg, conn, pulse: SharedPulse) -> None:
    from autoprofile.serving.engine_loop import EngineLoop
    lock = threading.Lock()  # the loop's thread and the reader's both send

    def send(msg) -> None:
        with lock:
            conn.send(msg)
    memory = _DeviceMemory(getattr(engine.runner, "device", None))
    looper = EngineLoop(engine, lambda kind, *args: send((kind, *args)),
                        lambda snap: send(("snapshot", snap)), pulse, profile_dir=cfg.profile_dir,
                        device_memory=memory.reading)
    reader = _Reader(conn, looper.inbox, _Grammars(cfg, engine.runner.model_config.vocab_size), send)
    threading.Thread(target=reader.run, name="engine-inbox", daemon=True).start()
    looper.run()


class _Reader:
    """The engine process's end of the pipe: commands into the loop's inbox, in order, but for an add whose
    grammar is not compiled here yet: that one is built on a compile thread and joins the inbox once built, so
    a first-seen schema holds up nobody else's commands (an abort that comes meanwhile drops it)."""

    def __init__(self, conn, inbox, grammars: _Grammars, send):
        self.conn, self.inbox, self.grammars, self.send = conn, inbox, grammars, send
        self.lock = threading.Lock()  # NOTE: the inbox's order between this thread and the compile threads
        self.pending: dict[str, bool] = {}  # adds compiling: request id -> aborted meanwhile
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="engine-grammar")
        from autoprofile.serving.engine_loop import PREPARE_GRAMMARS, STOP, EngineFailure
        self.stop, self.failure, self.prepare = STOP, EngineFailure, PREPARE_GRAMMARS

    def run(self) -> None:
        while True:
            try:
                cmd = self.conn.recv()
            except (EOFError, OSError):  # the server is gone
                log.error("the server's end of the pipe closed: stopping")
                cmd = self.stop
            if cmd == self.stop:
                self.inbox.put(cmd)
                return
            if cmd[0] == self.prepare:  # the server compiles a first grammar: build ours beside it
                self.grammars.start()
                continue
            if cmd[0] == "add" and isinstance(cmd[2][5], GrammarRequest):
                if not self.grammars.compiled(cmd[2][5]):
                    with self.lock:
                        self.pending[cmd[1]] = False
                    self.pool.submit(self._add_later, cmd)
                    continue
                cmd = self._built(cmd)
            with self.lock:
                if cmd is None:
                    continue
                if cmd[0] == "abort" and cmd[1] in self.pending:
                    self.pending[cmd[1]] = True
                    continue
                self.inbox.put(cmd)

    def _built(self, cmd):
        """The add with its matcher; None when it did not build (the server hears a 500)."""
        rid, payload = cmd[1], cmd[2]
        try:
            return ("add", rid, (*payload[:5], self.grammars.build(payload[5])))
        except Exception:  # noqa: BLE001 - the server compiled it: this is ours, a 500
            log.exception("the grammar of %s did not build in the engine process", rid)
            self.send(("added", rid, self.failure("internal")))
            return None

    def _add_later(self, cmd) -> None:
        built = self._built(cmd)
        with self.lock:
            aborted = self.pending.pop(cmd[1])
            if built is not None and not aborted:
                self.inbox.put(built)


class _DeviceMemory:
    """metrics.device_memory of this process's device, read at most every DEVICE_MEMORY_EVERY_S
    (torch.cuda.memory_stats builds a dict of a few hundred entries); None off CUDA."""

    def __init__(self, device):
        self.device, self.last, self.value = device, -math.inf, None

    def reading(self):
        if self.device is None or self.device.type != "cuda":
            return None
        now = time.monotonic()
        if now - self.last >= DEVICE_MEMORY_EVERY_S:
            from autoprofile.serving.metrics import device_memory
            self.last, self.value = now, device_memory(None, self.device)
        return self.value


class _Grammars:
    """The engine process's grammar compiler (serving.structured.Grammars), built on a thread that the first
    request with a grammar starts (vLLM builds its grammar backend at the first such request): the server's
    PREPARE_GRAMMARS as it begins compiling that request's grammar, so that both processes' builds overlap
    (one after the other, llama-3.1-8b's first JSON request took 7.1-8.2 s, H200); build() waits for it.
    xgrammar's import (transformers', seconds of the GIL) is paid where grammars are used: beside the boot it
    cost llama-3.1-8b's warm boot 3.7-5.1 s, beside the first served steps after `ready` it slowed a
    host-bound hybrid MoE's prefill steps 3x (H200, docs/measurements.md)."""

    def __init__(self, cfg, vocab_size: int):
        self.cfg, self.vocab_size, self.ready = cfg, vocab_size, threading.Event()
        self.grammars = self.error = None
        self.started, self._lock = False, threading.Lock()

    def start(self) -> None:
        """Start the build (once); PREPARE_GRAMMARS or the first request with a grammar."""
        with self._lock:
            if self.started:
                return
            self.started = True
        threading.Thread(target=self._load, name="grammars", daemon=True).start()

    def _load(self) -> None:
        try:
            from autoprofile.serving.structured import Grammars
            from autoprofile.serving.tokenizer import load_tokenizer
            self.grammars = Grammars(load_tokenizer(self.cfg), self.vocab_size)
        except Exception as e:  # noqa: BLE001 - a grammar request then fails with a 500
            self.error = e
        finally:
            self.ready.set()

    def compiled(self, req: GrammarRequest) -> bool:
        """Whether build(req) is quick: no spec, or its grammar compiled here already."""
        if req.spec is None:
            return True
        self.start()
        if not self.ready.is_set() or self.grammars is None:
            return False
        return self.grammars.cached(req.spec)

    def build(self, req: GrammarRequest):
        from autoprofile.engine.grammar import AllowedTokens
        matcher = None
        if req.spec is not None:
            self.start()
            self.ready.wait()
            if self.grammars is None:
                raise RuntimeError(f"xgrammar did not load in the engine process: {self.error}")
            matcher = self.grammars.new_matcher(req.spec)
        if req.allowed:
            return AllowedTokens.of(list(req.allowed), req.vocab_size, matcher)
        return matcher
