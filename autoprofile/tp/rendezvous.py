"""TP across hosts: the rendezvous of the hosts' launchers and their liveness, in host 0's TCPStore.

Host 0's launcher hosts the store at --dist_init_addr; every other launcher joins it, claims its --node_rank
and posts its fingerprint (the flags every rank runs with, the model, the code). Host 0 waits for every host
(--dist_timeout), compares each fingerprint with its own and posts one verdict: "ok", or the refusal naming
the difference, which every launcher ends with. Then each launcher starts its ranks (global rank = node_rank
x ranks per host + local rank), which join the one process group through the same store.

Liveness: each launcher beats every BEAT_S (`tp/host/<n>/beat`) and watches the others' beats; a host silent
for HOST_LOST_S is posted once as a fatal failure record, which ends every rank as a dead rank's does. A
launcher that ends posts `tp/host/<n>/done` first, so that its silence then is no failure.
Base layer: imports the code fingerprint (profile_cache) and torch.distributed only.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import socket
import subprocess
import time
from dataclasses import dataclass

import torch.distributed as dist

from autoprofile import __version__
from autoprofile.profile_cache import ROOT, code_hash
from autoprofile.tp.votes import describe

BEAT_S = 1.0
HOST_LOST_S = 10.0  # a host whose launcher has not beaten this long is gone
POLL_S = 0.1
# flags that only host 0 (HTTP) or this host (paths, its own index) reads: never compared across hosts
HOST_LOCAL = frozenset({"node_rank", "host", "port", "max_waiting_requests", "allowed_media_domains",
                        "served_model_name", "api_key", "report_dir", "profile_cache", "tokenizer", "model",
                        "dist_timeout"})


class RendezvousError(RuntimeError):
    """The hosts did not meet: one clear text, the same on every launcher that got that far."""


@dataclass(frozen=True)
class Hosts:
    """This launcher's place among the hosts (--nnodes, --node_rank, --dist_init_addr, --dist_timeout)."""

    nnodes: int = 1
    node_rank: int = 0
    addr: tuple[str, int] | None = None
    timeout_s: float = 300.0

    def ranks(self, world: int) -> range:
        """The global ranks this host runs."""
        local = world // self.nnodes
        return range(self.node_rank * local, (self.node_rank + 1) * local)

    def of_rank(self, rank: int, world: int) -> int:
        return rank // (world // self.nnodes)

    @property
    def where(self) -> str:
        return "" if self.addr is None else f"{self.addr[0]}:{self.addr[1]}"


def host_text(n: int, world: int, nnodes: int) -> str:
    r = Hosts(nnodes, n).ranks(world)
    return f"host {n} (rank {r[0]})" if len(r) == 1 else f"host {n} (ranks {r[0]}-{r[-1]})"


# ---------------------------------------------------------------- the fingerprint
@functools.cache
def git_describe() -> str | None:
    """`git describe --always --dirty` of the checkout the code runs from; None outside one."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"], cwd=ROOT, text=True,
                             capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _plain(value):
    """JSON's view of a value (tuples as lists), so that two hosts' fingerprints compare as sent."""
    return json.loads(json.dumps(value, default=str))


def fingerprint(cfg, command: str = "serve") -> dict:
    """What every host must run alike: the command, the flags (but HOST_LOCAL), the model's config and weight
    files (not its path), the code (package version, git describe, a hash of every source file)."""
    m = cfg.model_config
    flags = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in HOST_LOCAL}
    model = {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.name != "path"}
    weights = sorted((p.name, p.stat().st_size) for p in cfg.checkpoint_files)
    code = {"version": __version__, "git": git_describe(), "sources": code_hash()[:16]}
    return _plain({"command": command, "code": code, "flags": flags, "model": model, "weights": weights})


def difference(mine: dict, theirs: dict, me: int, them: int) -> str | None:
    """The first differences between two hosts' fingerprints, named as the user would fix them; None if
    none."""
    out = []
    if mine.get("command") != theirs.get("command"):
        out.append(f"host {me} runs `autoprofile {mine.get('command')}`, host {them} `autoprofile "
                   f"{theirs.get('command')}`; run the same command on every host")
    code = [k for k in ("version", "git", "sources") if mine["code"][k] != theirs["code"][k]]
    if code:
        shown = lambda c: f"autoprofile {c['version']} (git {c['git'] or 'unknown'}, sources {c['sources']})"
        out.append(f"the code differs: host {me} runs {shown(mine['code'])}, host {them} "
                   f"{shown(theirs['code'])}; install the same version on every host")
    for name in sorted(set(mine["flags"]) | set(theirs["flags"])):
        a, b = mine["flags"].get(name), theirs["flags"].get(name)
        if a != b:
            out.append(f"--{name} is {a} on host {me} but {b} on host {them}")
    fields = [k for k in sorted(set(mine["model"]) | set(theirs["model"]))
              if mine["model"].get(k) != theirs["model"].get(k)]
    if fields:
        k = fields[0]
        out.append(f"--model differs: its config's {k} is {mine['model'].get(k)} on host {me} but "
                   f"{theirs['model'].get(k)} on host {them}" + (f" ({len(fields) - 1} more keys differ)"
                                                                  if len(fields) > 1 else ""))
    elif mine["weights"] != theirs["weights"]:
        out.append(f"--model's weight files differ (names or sizes) between host {me} and host {them}")
    if not out:
        return None
    return "; ".join(out[:4]) + ("" if len(out) <= 4 else f"; and {len(out) - 4} more")


# ---------------------------------------------------------------- the rendezvous
def meet(hosts: Hosts, mine: dict, world: int):
    """Every launcher: the store (host 0 hosts it) once every host joined with the same fingerprint, else
    RendezvousError within about hosts.timeout_s."""
    if hosts.node_rank == 0:
        return _host_zero(hosts, mine, world)
    return _join(hosts, mine)


def _host_zero(hosts: Hosts, mine: dict, world: int):
    host, port = hosts.addr
    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=max(hosts.timeout_s, 30)))
    except RuntimeError as e:
        raise RendezvousError(f"--dist_init_addr: host 0 cannot hold the rendezvous on port {port} "
                              f"({describe(e)}): another program (or another host 0) holds it; try another "
                              f"free port, the same on every host") from None
    store.set("rdzv/host/0", json.dumps(mine))
    deadline = time.monotonic() + hosts.timeout_s
    missing = list(range(1, hosts.nnodes))
    while missing and time.monotonic() < deadline:
        missing = [n for n in missing if not store.check([f"rdzv/host/{n}"])]
        time.sleep(POLL_S)
    if missing:
        names = ", ".join(host_text(n, world, hosts.nnodes) for n in missing)
        text = (f"{names} never joined the rendezvous at {hosts.where} within {hosts.timeout_s:g} s "
                f"(--dist_timeout); start `autoprofile` with the same flags and --node_rank "
                f"{missing[0]} there, or give the hosts longer: --dist_timeout {2 * hosts.timeout_s:g}")
        store.set("rdzv/verdict", text)
        raise RendezvousError(text)
    diffs = [d for n in range(1, hosts.nnodes)
             if (d := difference(mine, json.loads(store.get(f"rdzv/host/{n}")), 0, n))]
    verdict = f"host refused at the rendezvous: {diffs[0]}" if diffs else "ok"
    store.set("rdzv/verdict", verdict)
    if diffs:
        raise RendezvousError(verdict)
    return store


def _join(hosts: Hosts, mine: dict):
    try:
        return _joined(hosts, mine)
    except RendezvousError:
        raise
    except RuntimeError as e:  # the store went away: host 0 ended (its own error) or died
        raise RendezvousError(f"host 0 at {hosts.where} went away during the rendezvous ({describe(e)}); its "
                              f"log says why") from None


def _joined(hosts: Hosts, mine: dict):
    host, port = hosts.addr
    deadline = time.monotonic() + hosts.timeout_s
    if not wait_for_listener(host, port, deadline):
        raise RendezvousError(f"--dist_init_addr: nothing answered at {hosts.where} within "
                              f"{hosts.timeout_s:g} s (--dist_timeout): start host 0 (--node_rank 0) with "
                              f"this address first, check the address and that the port is open, or wait "
                              f"longer: --dist_timeout {2 * hosts.timeout_s:g}")
    store = dist.TCPStore(host, port, is_master=False,
                          timeout=datetime.timedelta(seconds=max(hosts.timeout_s, 30)))
    n = hosts.node_rank
    if store.add(f"rdzv/claim/{n}", 1) != 1:
        raise RendezvousError(f"--node_rank: another host joined the rendezvous at {hosts.where} as "
                              f"--node_rank {n} already; give each host its own --node_rank in "
                              f"[0, {hosts.nnodes - 1}]")
    store.set(f"rdzv/host/{n}", json.dumps(mine))
    own = difference(json.loads(store.get("rdzv/host/0")), mine, 0, n)
    if own:  # host 0 finds it too (and tells every host); this host need not wait for it
        raise RendezvousError(f"host refused at the rendezvous: {own}")
    while not store.check(["rdzv/verdict"]):
        if time.monotonic() > deadline + hosts.timeout_s:
            raise RendezvousError(f"host 0 at {hosts.where} gave no verdict within {2 * hosts.timeout_s:g} s "
                                  f"(--dist_timeout): is it still starting?")
        time.sleep(POLL_S)
    verdict = store.get("rdzv/verdict").decode()
    if verdict != "ok":
        raise RendezvousError(verdict)
    return store


def wait_for_listener(host: str, port: int, deadline: float) -> bool:
    """Whether something accepts TCP connections at host:port before the monotonic deadline."""
    while True:
        try:
            left = max(deadline - time.monotonic(), 0.1)
            with socket.create_connection((host, port), timeout=min(2.0, left)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


# ---------------------------------------------------------------- liveness
class HostWatch:
    """One launcher's beat, and its view of the other hosts' beats (call tick() often)."""

    def __init__(self, store, hosts: Hosts, world: int, lost_s: float = HOST_LOST_S):
        self.store, self.hosts, self.world, self.lost_s = store, hosts, world, lost_s
        self._next_beat = 0.0
        now = time.monotonic()
        self._seen = {n: (-1, now) for n in range(hosts.nnodes) if n != hosts.node_rank}

    def tick(self, post) -> None:
        """Beat (every BEAT_S); post(rank, text) once, by one launcher, for each host silent lost_s."""
        now = time.monotonic()
        if now >= self._next_beat:
            self.store.add(f"tp/host/{self.hosts.node_rank}/beat", 1)
            self._next_beat = now + BEAT_S
        for n, (beats, since) in list(self._seen.items()):
            count = self.store.add(f"tp/host/{n}/beat", 0)
            if count != beats:
                self._seen[n] = (count, now)
            elif now - since >= self.lost_s and not self._over(n):
                del self._seen[n]
                if self.store.add(f"tp/host/{n}/lost", 1) == 1:
                    post(Hosts(self.hosts.nnodes, n).ranks(self.world)[0],
                         f"{host_text(n, self.world, self.hosts.nnodes)} is gone: its launcher sent no "
                         f"heartbeat for {self.lost_s:g} s (the host died, its launcher was killed, or the "
                         f"network to it failed)")

    def _over(self, n: int) -> bool:
        return self.store.check([f"tp/host/{n}/done"])

    def done(self) -> None:
        self.store.set(f"tp/host/{self.hosts.node_rank}/done", "1")

    def wait_others(self, timeout_s: float, post) -> None:
        """Host 0, before its store goes: until every other host is done or lost (bounded)."""
        deadline = time.monotonic() + timeout_s
        others = range(1, self.hosts.nnodes)
        while time.monotonic() < deadline:
            if all(self._over(n) or self.store.check([f"tp/host/{n}/lost"]) for n in others):
                return
            self.tick(post)
            time.sleep(POLL_S)
