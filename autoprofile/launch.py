"""The parent and the entries: one process per rank, the TCPStore they share, the backstop, and
`autoprofile profile|serve --tp N`. At the CLI's level: it imports the profiler and the server.

Across hosts (--nnodes N), every host runs this parent for its --tp / N ranks: host 0's holds the store at
--dist_init_addr, the others join it (autoprofile.tp.rendezvous: fingerprints compared, liveness beats), and
the failure records, the backstop and the process group span every host."""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection

import torch
import torch.distributed as dist

from autoprofile.config import ConfigError, parse_dist_addr
from autoprofile.profiler import ProfileError, boot
from autoprofile.tp.broadcast import StepBroadcaster, worker_loop
from autoprofile.tp.channel import (BOUND_S, PEER_WAIT_S, RANK_ENV, STORE_TIMEOUT, FailureLog, RankGuard,
                                    TPError, client, diagnostic, exit_stuck)
from autoprofile.tp.rendezvous import HOST_LOST_S, Hosts, HostWatch, RendezvousError, fingerprint, meet
from autoprofile.tp.votes import describe

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the parent
@dataclass(frozen=True)
class Outcome:
    rank: int
    ok: bool
    value: object  # what the rank's target returned, else the text it ended with
    ended: float  # time.time() when the rank ended


def hosts_of(cfg) -> Hosts:
    addr = parse_dist_addr(cfg.dist_init_addr) if cfg.dist_init_addr else None
    return Hosts(cfg.nnodes, cfg.node_rank, addr, cfg.dist_timeout)


def local_gpus_problem(world: int, nnodes: int, visible: int) -> str | None:
    """Why this host cannot run its --tp / --nnodes ranks, one GPU each, on `visible` GPUs (None: it can)."""
    local = world // nnodes
    if visible >= local:
        return None
    where = f"--tp {world} over --nnodes {nnodes} runs {local} rank(s) on each host" if nnodes > 1 else \
        f"--tp {world} runs {world} rank(s)"
    fits = max(visible, 1) * nnodes
    return (f"{where}, one GPU each, and this host sees {visible} GPU(s) (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); try --tp {fits}"
            + (f" or more hosts: --nnodes {-(-world // max(visible, 1))}" if nnodes > 1 else ""))


def launch(target: Callable, world: int, args: tuple = (), device: str = "cuda", bound_s: float = BOUND_S,
           env: dict[str, str] | None = None, timeout_s: float | None = None, hosts: Hosts = Hosts(),
           fingerprint: dict | None = None) -> list[Outcome]:
    """Spawn `world` ranks, each running target(guard, *args); return every rank's Outcome in rank order.
    Under --nnodes, this host's ranks only (hosts.ranks(world)), after the rendezvous of every host (its
    fingerprint compared with host 0's: RendezvousError if they differ or a host never joins).

    Reads every result as it comes (a large one never blocks a rank), never waits on a dead rank (its exit
    is posted as its failure), and kills ranks that have not ended `bound_s` after an unresolved failure.
    The ranks run in their own process group: a Ctrl-C or a SIGTERM reaches this parent, which forwards
    it to rank 0 (it serves: it drains and stops the others) and gives the ranks 30 s to end;
    timeout_s (tests) ends every rank that far from the start, failure or not."""
    import torch.multiprocessing as mp

    if hosts.nnodes == 1:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
        addr, watch = ("127.0.0.1", store.port), None
    else:
        store = meet(hosts, fingerprint, world)
        addr, watch = hosts.addr, HostWatch(store, hosts, world)
        log.info("rendezvous at %s: %d hosts, this host (%d) runs ranks %d-%d", hosts.where, hosts.nnodes,
                 hosts.node_rank, hosts.ranks(world)[0], hosts.ranks(world)[-1])
    failures = FailureLog(store)
    ctx = mp.get_context("spawn")
    procs, pipes = {}, {}
    for local, rank in enumerate(hosts.ranks(world)):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main,
                        args=(rank, world, addr, device, target, args, send, env or {}, local, hosts.nnodes),
                        name=f"autoprofile-rank{rank}")
        p.start()
        send.close()
        procs[rank], pipes[rank] = p, recv
    outcomes: dict[int, Outcome] = {}
    unresolved_since: float | None = None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    restore = _forward_sigterm()

    def post_lost(rank: int, text: str) -> None:
        failures.post(-1, rank, text, fatal=True)

    try:
        while len(outcomes) < len(procs):
            try:
                waiting = [r for r in procs if r not in outcomes]
                connection.wait([pipes[r] for r in waiting] + [procs[r].sentinel for r in waiting],
                                timeout=0.2)
                try:
                    _collect(procs, pipes, outcomes, failures)
                    if watch is not None:
                        watch.tick(post_lost)
                    unresolved_since = _unresolved_since(failures, world, unresolved_since)
                except RuntimeError as e:  # the store is gone: host 0's launcher with it
                    if hosts.node_rank == 0:
                        raise
                    _end(procs, outcomes, f"host 0 (the rendezvous at {hosts.where}) is gone: {describe(e)}")
                    break
                now = time.monotonic()
                if (unresolved_since is not None and now - unresolved_since > bound_s) or \
                        (deadline is not None and now > deadline):
                    _backstop(procs, outcomes, failures, bound_s)
            except (KeyboardInterrupt, _Terminated) as e:
                sig = signal.SIGTERM if isinstance(e, _Terminated) else signal.SIGINT
                if hosts.node_rank:  # not the serving host: this host's ranks end, and every rank with them
                    _stop_host(procs, outcomes, failures, hosts, world, sig)
                    break
                deadline = time.monotonic() + 30.0
                log.warning("%s: rank 0 stops the others; waiting up to 30 s", sig.name)
                if procs[0].is_alive():
                    os.kill(procs[0].pid, sig)
    finally:
        restore()
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        if watch is not None:
            _leave(watch, hosts, post_lost)
    return [outcomes[r] for r in sorted(procs)]


def _leave(watch: HostWatch, hosts: Hosts, post_lost: Callable) -> None:
    """This host is done; host 0 keeps the store up until the other hosts are done too (or lost)."""
    try:
        watch.done()
        if hosts.node_rank == 0:
            watch.wait_others(HOST_LOST_S + 5.0, post_lost)
    except RuntimeError as e:  # the store is gone already: nothing to tell
        log.info("the rendezvous store is gone (%s)", describe(e))


def _stop_host(procs, outcomes: dict[int, Outcome], failures: FailureLog, hosts: Hosts, world: int,
               sig: signal.Signals) -> None:
    text = f"host {hosts.node_rank}'s launcher was stopped ({sig.name}): its ranks ended, and every rank " \
           "with them"
    try:
        failures.post(-1, hosts.ranks(world)[0], text, fatal=True)
    except RuntimeError as e:
        log.error("could not tell the other hosts (%s)", describe(e))
    _end(procs, outcomes, text)


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
    for rank, p in procs.items():
        pipe = pipes[rank]
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


def _backstop(procs, outcomes: dict[int, Outcome], failures: FailureLog, bound_s: float) -> None:
    text = diagnostic(failures.read()) or "no rank reported a failure"
    for rank, p in procs.items():
        if rank not in outcomes and p.is_alive():
            log.error("rank %d has not ended %.0f s after a failure: killed", rank, bound_s)
            p.kill()
            p.join()
            outcomes[rank] = Outcome(rank, False, f"{text} (rank {rank} killed by the launcher: no end "
                                                  f"{bound_s:.0f} s after a failure, or past its deadline)",
                                     time.time())


def _end(procs, outcomes: dict[int, Outcome], text: str) -> None:
    """Kill this host's ranks that have not reported; each ends with `text`."""
    log.error("%s", text)
    for rank, p in procs.items():
        if rank not in outcomes:
            p.kill()
            p.join()
            outcomes[rank] = Outcome(rank, False, text, time.time())


def _end_with_the_launcher() -> None:
    """Linux: the kernel sends this rank SIGTERM when the launcher dies, in any phase. The watchdog sees
    a vanished store only once it runs; before that (the gloo group, the store clients) a rank would retry
    the dead store for STORE_TIMEOUT, an orphan holding its GPU."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def _rank_main(rank: int, world: int, addr: tuple[str, int], device_kind: str, target: Callable, args: tuple,
               conn, env: dict[str, str], local_rank: int | None = None, nnodes: int = 1) -> None:
    local_rank = rank if local_rank is None else local_rank
    os.environ.update({**RANK_ENV, **env, "LOCAL_RANK": str(local_rank)})
    os.setpgrp()  # NOTE: a terminal's Ctrl-C goes to the parent only; it forwards it to rank 0
    _end_with_the_launcher()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    guard = None
    replied = threading.Lock()

    def reply(outcome: Outcome) -> bool:
        """The rank's one outcome (the main thread's, or the watchdog's when the main thread is wedged). A
        launcher that is gone (the pipe is closed) collects nothing: the rank ends now."""
        if not replied.acquire(blocking=False):
            return False
        try:
            conn.send(outcome)
            conn.close()
        except OSError:
            os._exit(1)
        return True

    def give_up(text: str) -> None:  # the watchdog thread: the main thread is wedged in the data plane
        if reply(Outcome(rank, False, text, time.time())):
            exit_stuck(text)

    try:
        device = torch.device("cuda", local_rank) if device_kind == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", client(addr)), rank=rank,
                                world_size=world)
        # a peer on another host is posted by a launcher's liveness watch, within HOST_LOST_S
        guard = RankGuard(addr, rank, world, device, on_stuck=give_up,
                          peer_wait_s=PEER_WAIT_S + (HOST_LOST_S if nnodes > 1 else 0.0))
        outcome = Outcome(rank, True, target(guard, *args), time.time())
    except (ProfileError, TPError) as e:  # a collective diagnostic: every rank has this same text
        outcome = Outcome(rank, False, str(e), time.time())
    except BaseException as e:  # noqa: BLE001 - every rank ends with a text, never a hang
        log.error("rank %d: %s", rank, traceback.format_exc())
        if guard is not None:
            text = guard.diagnose(e)
        else:
            text = f"rank {rank}: {describe(e)}"
            FailureLog(client(addr)).post(-1, rank, describe(e), fatal=True)
        outcome = Outcome(rank, False, text, time.time())
    if not reply(outcome):
        return  # the watchdog answered for this rank and is ending the process
    if guard is not None:
        guard.close()
    logging.shutdown()
    if not outcome.ok:
        # NOTE: now: peers blocked on this rank's sockets see them close; no NCCL teardown to hang in
        os._exit(1)
    dist.destroy_process_group()


# ---------------------------------------------------------------- profile and serve
def profile_rank(guard: RankGuard, cfg, checkpoint=None):
    """One rank of `autoprofile profile --tp N`: boot (load, probe, measure, rebuild, validate), tear down."""
    runner, result = boot(cfg, guard.rank, guard.world, cpu_group=guard.control, guard=guard,
                          checkpoint=checkpoint, log_report=False)
    runner.teardown()
    result.cfg = cfg.replace(max_req_total_len=result.cfg.max_req_total_len)  # a cut context (auto) stays
    return result


def launch_hosts(target: Callable, cfg, args: tuple, device: str = "cuda") -> list[Outcome]:
    """launch() of this host's ranks of `autoprofile serve|profile --tp N [--nnodes M]`. ConfigError when the
    host lacks GPUs for its ranks, RendezvousError when the hosts did not meet: both before any GPU work."""
    hosts = hosts_of(cfg)
    if device == "cuda":
        problem = local_gpus_problem(cfg.tp, cfg.nnodes, torch.cuda.device_count())
        if problem:
            raise ConfigError("tp", problem)
    command = "profile" if target is profile_rank else "serve"
    fp = fingerprint(cfg, command) if hosts.nnodes > 1 else None
    return launch(target, cfg.tp, args, device=device, hosts=hosts, fingerprint=fp)


def profile_tp(cfg, checkpoint=None):
    """`autoprofile profile --tp N`: this host's first rank's ProfileResult (rank 0's on host 0), or
    ProfileError with the ranks' diagnostic."""
    try:
        outcomes = launch_hosts(profile_rank, cfg, (cfg, checkpoint))
    except (ConfigError, RendezvousError) as e:
        raise ProfileError(f"error: {e}") from None
    if all(o.ok for o in outcomes):
        return outcomes[0].value
    raise ProfileError(next(o.value for o in outcomes if not o.ok))


def profile_boot(cfg, guard: RankGuard):
    """This rank's share of the collective boot: load, probe, measure, rebuild, validate."""
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
    """`autoprofile serve --tp N [--nnodes M]`: exit code 0 when rank 0 stopped cleanly (this host's ranks,
    on every host), 1 with the diagnostic, 2 when this host lacks GPUs for its ranks."""
    try:
        outcomes = launch_hosts(serve_rank, cfg, (cfg, boot), device=device)
    except (ConfigError, RendezvousError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    failed = [o for o in outcomes if not o.ok]
    if failed:
        print(failed[0].value if outcomes[0].ok else outcomes[0].value, file=sys.stderr)
        return 1
    return 0
