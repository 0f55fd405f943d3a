"""The two-pass auto-profiler: probe, measure, rebuild, validate.

`run_profile` reads top to bottom as the four phases. Every decision (target, retry, give-up, leak)
is collective over the TP group, so all ranks end with the same size or the same error.

Above the house's 500 lines on purpose: one owner of the four phases and of every collective decision in
them (the Profiler class alone is 350 lines); boot() and profile() are its two callers.
"""
from __future__ import annotations

import gc
import logging
import re
import time
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autoprofile import budget, memory, profile_cache
from autoprofile.tp.votes import describe, gather, gather_errors, is_consequence
from autoprofile.budget import gib
from autoprofile.config import ConfigError, ServerConfig, with_context_cut

log = logging.getLogger(__name__)

Checkpoint = Callable[[str], None]


class ProfileError(RuntimeError):
    """The profiler gave up (every rank raises the same text)."""


class LeakError(ProfileError):
    """Teardown did not return the probe's memory: a hard error, never retried."""


# ---------------------------------------------------------------- records
@dataclass(frozen=True)
class Sample:
    t: float
    label: str
    reserved: int
    free: int
    total: int


@dataclass
class Recorder:
    """Phase durations and a timeline of reserved/free memory (for the report and its PNG)."""

    device: torch.device
    t0: float = field(default_factory=time.perf_counter)
    phases: list[tuple[str, float]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    # what a phase spent on its timed steps (phase, step, seconds): the runner's take_boot_steps
    steps: list[tuple[str, str, float]] = field(default_factory=list)
    take_steps: Callable[[], list[tuple[str, float]]] = lambda: []

    def sample(self, label: str) -> None:
        free, total = memory.free_and_total(self.device)
        self.samples.append(Sample(time.perf_counter() - self.t0, label, memory.reserved(self.device), free,
                                   total))

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        self.sample(f"{name}:start")
        log.info("phase %s: start", name)
        try:
            yield
        finally:
            took = time.perf_counter() - start
            self.phases.append((name, took))
            self.steps.extend((name, step, s) for step, s in self.take_steps())
            self.sample(f"{name}:end")
            log.info("phase %s: %.2f s", name, took)


@dataclass(frozen=True)
class Measurement:
    """Everything the measure phase read and derived (bytes unless named tokens)."""

    total: int
    free: int
    reserved: int
    peak_reserved: int
    own_non_torch: int
    peers: int
    probe_tokens: int
    probe_sized: int
    non_kv_peak: int
    available: int
    local_target: int
    target: int  # MIN over ranks


@dataclass
class ProfileResult:
    cfg: ServerConfig
    tokens: int
    cell_bytes: int
    pinned: bool
    attempts: int
    initial_target: int
    probe_tokens: int | None
    measurement: Measurement | None
    terms: dict[str, int]
    phases: list[tuple[str, float]]
    samples: list[Sample]
    errors: list[str]
    stack_limit: int | None = None  # per-thread CUDA stack limit after the stress (None without CUDA)
    local_memory: int | None = None  # what the driver reserves for it (memory.local_memory_bytes)
    kv_scales: str | None = None  # an FP8 cache's scale source (runner.kv_scale_source); None otherwise
    reused_probe: str | None = None  # the profile cache's probe time, when this boot reused it
    forced_routings: tuple[str, ...] = ()  # an MoE model's: the routings the stress forced (layers.moe)
    context_cut_from: int | None = None  # --max_req_total_len auto: the model's context, when it was cut
    host_kv_pages: int = 0  # the prefix cache's host tier (--host_kv), this rank's pages (host memory)
    host_kv_bytes: int = 0
    state_slots: int = 0  # a hybrid model's state slots (its request slots); 0: no state cache
    phase_steps: tuple[tuple[str, str, float], ...] = ()  # (phase, graphs / stress ..., seconds)

    @property
    def kv_bytes(self) -> int:
        return self.tokens * self.cell_bytes

    def report_text(self) -> str:
        from autoprofile.report import format_report
        return format_report(self)


def host_tier_size(pool) -> dict[str, int]:
    """ProfileResult's host tier fields of a runner's HostKVPool (None: off)."""
    if pool is None:
        return {}
    return {"host_kv_pages": pool.num_pages, "host_kv_bytes": pool.num_pages * pool.page_bytes}


# ---------------------------------------------------------------- failure texts
MEMORY_FAILURES = ("OutOfMemoryError:", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def _unranked(err: str) -> str:
    return re.sub(r"^rank \d+: ", "", err)


def is_memory_failure(err: str) -> bool:
    """An error text (this rank's, or a gathered "rank N: ...") that a smaller cache or a memory knob can
    fix: torch's OutOfMemoryError, or a CUDA/cuBLAS allocation failure raised as another type."""
    return any(m in _unranked(err) for m in MEMORY_FAILURES)


def not_memory_failures(errors: list[str]) -> list[str]:
    """The gathered errors that are not memory failures (a peer's consequence of another rank's failure
    aside): non-empty means the memory diagnostic does not apply and no retry can help."""
    return [e for e in errors if not is_memory_failure(e) and not is_consequence(_unranked(e))]


def failure_text(stage: str, tokens: int, errors: list[str]) -> str:
    """The give-up text for an error that is not a memory failure: what it is, not a knob to turn."""
    return (f"autoprofile: the {stage} at {tokens} KV tokens failed with an error that is not a memory "
            "failure, so no memory knob or smaller cache can fix it:\n  " + "\n  ".join(errors)
            + "\nIts traceback is in the log above (under --tp, in that rank's log).")


def _log_failure(what: str, e: BaseException) -> str:
    """Log this rank's failure (with its traceback unless it is a memory failure); return its text."""
    err = describe(e)
    if is_memory_failure(err):
        log.warning("%s failed: %s", what, err)
    else:
        log.error("%s failed with an error that is not a memory failure: %s", what, err, exc_info=e)
    return err


# ---------------------------------------------------------------- the profiler
class Profiler:
    """Owns the canary; drives a ModelRunner through the four phases."""

    def __init__(self, cfg: ServerConfig, runner, group=None, checkpoint: Checkpoint | None = None,
                 on_error: Callable[[str], None] | None = None):
        self.cfg, self.runner, self.group = cfg, runner, group
        self.device = getattr(runner, "device", torch.device("cuda"))
        self.fault = checkpoint or (lambda point: None)
        # TP: posts this rank's failure at once, before it votes, so that peers waiting for it in a
        # collective are freed (autoprofile.tp.channel)
        self.on_error = on_error or (lambda text: None)
        self.rec = Recorder(self.device, take_steps=getattr(runner, "take_boot_steps", lambda: []))
        self.sizing: budget.Sizing = runner.sizing
        self.canary: torch.Tensor | None = None
        self.errors: list[str] = []
        # the KV buffer of the current build as last seen at a checkpoint: a build that fails after
        # allocating it drops it itself, and it must still be gone after release()
        self.kv_seen: weakref.ref | None = None
        # when the measurement came from the profile cache: its probe's time
        self.reused_probe: str | None = None
        self.context_cut_from: int | None = None  # --max_req_total_len auto cut the model's context

    def checkpoint(self, point: str) -> None:
        """Timeline sample + test-only fault injection at a named point; remembers the KV buffer built so
        far, so that a build that fails after allocating it is still leak-checked."""
        kv = self.runner.kv_buffer
        if kv is not None:
            self.kv_seen = weakref.ref(kv)
        del kv
        self.rec.sample(point)
        self.fault(point)

    # ------------------------------------------------------------ phases
    def run(self) -> ProfileResult:
        if self.cfg.max_total_token_num is not None:
            return self.run_pinned(self.cfg.max_total_token_num)
        name = self.cache_name()
        entry = profile_cache.load(self.cfg.profile_cache, name) if name else None
        if memory.all_ok(entry is not None, self.group):  # every rank has its entry: none probes
            with self.rec.phase("measure (profile cache)"):
                m = self.measure_cached(entry)
            self.reused_probe = entry.measured_at
        else:
            with self.rec.phase("probe"):
                probe = self.probe()
            with self.rec.phase("measure"):
                m = self.measure(probe)
        self.checkpoint("after_measure")
        sizes = budget.shrink_schedule(m.target, self.cfg.shrink_ratio, self.cfg.max_retries,
                                       self.cfg.page_size,
                                       floor=self.min_tokens())
        try:
            tokens, attempts = self.fit(sizes, m)
        except ProfileError:
            if name:
                profile_cache.drop(self.cfg.profile_cache, name)
            raise
        if name and attempts > 1:  # the measurement needed a shrink: the next boot probes again
            profile_cache.drop(self.cfg.profile_cache, name)
        elif name and self.reused_probe is None:
            profile_cache.store(self.cfg.profile_cache, name, profile_cache.Entry(
                m.non_kv_peak, m.own_non_torch, m.probe_tokens, m.probe_sized, profile_cache.now()))
        return self.result(tokens, attempts, sizes[0], m, pinned=False)

    def cache_name(self) -> str | None:
        """This rank's profile cache entry, or None (no cache folder, or a runner without a GPU
        fingerprint)."""
        fingerprint = getattr(self.runner, "fingerprint", lambda: None)()
        if self.cfg.profile_cache is None or fingerprint is None:
            return None
        rank, world = (dist.get_rank(self.group), dist.get_world_size(self.group)) if self.group else (0, 1)
        return profile_cache.key(self.cfg, self.cfg.model_config, fingerprint, rank, world)

    def run_pinned(self, tokens: int) -> ProfileResult:
        """--max_total_token_num: one build at N, validated; never shrunk silently."""
        self.cut_context(tokens)
        memory.reset_peak(self.device)
        with self.rec.phase("build+validate"):
            err = self.attempt(tokens)
        if memory.all_ok(err is None, self.group):
            return self.result(tokens, 1, tokens, None, pinned=True)
        errors = gather_errors(err, self.group)
        self.release()
        if not_memory_failures(errors):
            raise ProfileError(failure_text("validation", tokens, not_memory_failures(errors)))
        fits = self.what_fits()
        floor = self.min_tokens()
        hint = (f"The measured budget fits {fits} tokens: try --max_total_token_num {fits}, or leave it "
                f"unset "
                "to auto-profile." if fits >= floor else
                f"The measured budget does not fit the smallest usable cache ({floor} tokens) either: leave "
                "--max_total_token_num unset and see the knobs `autoprofile profile` names, or lower "
                "--max_req_total_len / --batch_max_tokens / --graph_max_batch_size.")
        raise ProfileError(f"--max_total_token_num {tokens} does not survive the worst-case stress "
                           f"({'; '.join(errors)}). {hint}")

    def probe(self) -> int:
        tokens = budget.probe_tokens(self.cfg.batch_max_tokens, self.cfg.graph_max_batch_size,
                                     self.cfg.page_size)
        memory.reset_peak(self.device)
        err = None
        try:
            self.runner.build(tokens, self.checkpoint)
            self.checkpoint("probe_prefill")
            self.runner.stress_prefill()
            self.checkpoint("probe_decode")
            self.runner.stress_decode()
        except Exception as e:  # noqa: BLE001 - any failure ends in the collective diagnostic
            err = _log_failure(f"probe at {tokens} tokens", e)
            self.on_error(err)
        if not memory.all_ok(err is None, self.group):
            errors = gather_errors(err, self.group)
            if not_memory_failures(errors):
                raise ProfileError(failure_text("probe", tokens, not_memory_failures(errors))
                                   + self.release_after_give_up())
            raise ProfileError(self.diagnostic(tokens, tokens, 0, "; ".join(errors), stage="probe")
                               + self.release_after_give_up())
        log.info("probe: %d tokens (%.2f GiB KV), stresses passed", tokens, gib(self.runner.kv_bytes))
        return tokens

    def measure(self, probe: int) -> Measurement:
        s = memory.snapshot(self.device)
        probe_sized = self.runner.kv_bytes + self.sizing.overhead(probe)
        non_kv = budget.non_kv_peak(s.peak_reserved, probe_sized)
        own_nt = budget.own_non_torch(s.process_used, s.reserved, s.total, s.free)
        peers = budget.peer_bytes(s.total, s.free, s.reserved, own_nt)
        return self.solve(s, probe, probe_sized, non_kv, own_nt, peers)

    def measure_cached(self, entry: profile_cache.Entry) -> Measurement:
        """An earlier probe's non-KV peak and non-torch memory (the larger of then and now: the stress's local
        memory is not reserved yet) with the GPU's state now (free memory, peers)."""
        s = memory.snapshot(self.device)
        own_now = budget.own_non_torch(s.process_used, s.reserved, s.total, s.free)
        peers = budget.peer_bytes(s.total, s.free, s.reserved, own_now)
        log.info("measure: reusing the probe of %s from the profile cache (%s; --profile_cache '' probes)",
                 entry.measured_at, self.cfg.profile_cache)
        return self.solve(s, entry.probe_tokens, entry.probe_sized, entry.non_kv_peak,
                          max(own_now, entry.own_non_torch), peers)

    def solve(self, s: memory.MemorySnapshot, probe: int, probe_sized: int, non_kv: int, own_nt: int,
              peers: int) -> Measurement:
        """The target from the measured terms: this rank's, then the MIN over ranks."""
        available = budget.available_bytes(s.total, own_nt, non_kv, peers, self.cfg.canary_bytes)
        local = budget.solve_target_tokens(available, self.sizing, self.cfg.mem_fraction)
        target = memory.all_reduce_min(local, self.group)
        m = Measurement(s.total, s.free, s.reserved, s.peak_reserved, own_nt, peers, probe, probe_sized,
                        non_kv,
                        available, local, target)
        log.info("measure: total %.2f GiB, peak reserved %.2f GiB, non-KV peak %.2f GiB, non-torch %.2f GiB, "
                 "peers %.2f GiB -> target %d tokens (%.2f GiB KV; this rank %d)", gib(s.total),
                 gib(s.peak_reserved), gib(non_kv), gib(own_nt), gib(peers), target,
                 gib(target * self.sizing.cell_bytes), local)
        if local == self.sizing.max_tokens:
            log.warning("the KV cache is capped at %d tokens: one layer's K view past it is beyond the "
                        "attention "
                        "kernels' 32-bit offsets (the memory would fit more)", local)
        if target < self.min_tokens():
            # NOTE: --max_req_total_len auto: the longest requests the target holds; the retries cannot
            # shrink below one such request (shrink_schedule's floor), so a failed validation gives up
            self.cut_context(target)
        if target < self.min_tokens():
            raise ProfileError(self.diagnostic(target, target, 0,
                                               f"the measured budget fits {target} tokens, fewer than the "
                                               f"{self.min_tokens()} of the smallest usable cache", m=m,
                                               stage="measure") + self.release_after_give_up())
        return m

    def cut_context(self, tokens: int) -> None:
        """--max_req_total_len auto: serve the longest requests a cache of `tokens` holds. Every rank cuts
        to the same length (`tokens` follows the MIN over ranks); the rebuild and the stress run the shorter
        envelope, whose steps the measurement at the model's context bounds."""
        try:
            cut = with_context_cut(self.cfg, tokens)
        except ConfigError as e:
            raise ProfileError(f"--max_req_total_len auto: a cache of {tokens} tokens holds shorter requests "
                               f"only, and then {e}" + self.release_after_give_up()) from None
        if cut is not self.cfg:
            self.context_cut_from = self.cfg.context_len
            self.cfg = cut
            if self.runner.kv_buffer is not None:  # measured after a probe: its build goes first (collective)
                self.release()
            self.runner.cut_context(cut)
            self.sizing = self.runner.sizing

    def fit(self, sizes: list[int], m: Measurement) -> tuple[int, int]:
        """Rebuild + validate at each size until every rank passes; collective give-up at the end. Every
        teardown (the probe's, and each failed attempt's) is leak-checked: a leak is never retried."""
        self.release()
        for attempt, tokens in enumerate(sizes, 1):
            with self.rec.phase(f"rebuild+validate#{attempt}"):
                err = self.attempt(tokens)
            if memory.all_ok(err is None, self.group):
                return tokens, attempt
            errors = gather_errors(err, self.group)
            self.errors.extend(errors)
            log.warning("attempt %d at %d tokens failed on some rank: %s", attempt, tokens, self.errors[-1])
            self.release()  # a leak raises here, outside any retry
            self.runner.forget_warm_ups()  # every rank alike: the next attempt warms every graph again
            if not_memory_failures(errors):  # a shape error or an assertion: shrinking cannot fix it
                raise ProfileError(failure_text("validation", tokens, not_memory_failures(errors)))
        last = self.errors[-1] if self.errors else "no size at or above the smallest usable cache to try"
        raise ProfileError(self.diagnostic(sizes[0] if sizes else m.target, sizes[-1] if sizes else m.target,
                                           len(sizes), last, m=m))

    def attempt(self, tokens: int) -> str | None:
        """Build at `tokens`, hold the canary, run both stresses. Returns this rank's error or None; what a
        failed attempt built is torn down by the caller's release(), leak-checked, on every rank."""
        try:
            self.runner.build(tokens, self.checkpoint)
            self.checkpoint("canary")
            self.canary = torch.empty(self.cfg.canary_bytes, dtype=torch.uint8, device=self.device)
            self.checkpoint("validate_prefill")
            self.runner.stress_prefill()
            self.checkpoint("validate_decode")
            self.runner.stress_decode()
            self.checkpoint("validated")
        except Exception as e:  # noqa: BLE001 - the caller's collective vote decides (retry or not)
            err = _log_failure(f"build/validate at {tokens} tokens", e)
            self.on_error(err)
            self.canary = None
            return err
        self.canary = None  # released into this process's cache: headroom for serving
        return None

    def release(self) -> None:
        """One teardown: canary, graphs, attention state, request table, KV; then empty_cache. Collective.

        Afterwards the KV buffer (the live one, or the one a failed build dropped itself) must be
        unreachable, and reserved memory must have fallen by the KV that was live; else LeakError naming
        what still holds it. A teardown that raises ends in a ProfileError with the
        same text on every rank (never a traceback on one rank and a closed connection on the other)."""
        leak, broken = self._teardown_and_check()
        if not memory.all_ok(leak is None and broken is None, self.group):
            broken_all = gather_errors(broken, self.group)
            leaks = gather_errors(leak, self.group)
            if broken_all:
                raise ProfileError(self.diagnostic(0, 0, len(self.errors), "; ".join(broken_all + leaks),
                                                   stage="teardown"))
            raise LeakError("teardown leak: " + "; ".join(leaks))

    def release_after_give_up(self) -> str:
        """release() on a path that already gives up: a leak or teardown error is appended, not raised."""
        try:
            self.release()
        except ProfileError as e:
            return f"\nAlso, while releasing: {str(e).splitlines()[0]}"
        return ""

    def _teardown_and_check(self) -> tuple[str | None, str | None]:
        """(leak, teardown error) of this rank."""
        kv = self.runner.kv_buffer
        refs = [r for r in (weakref.ref(kv) if kv is not None else None, self.kv_seen) if r is not None]
        kv_bytes = self.runner.kv_bytes if kv is not None else 0
        del kv
        before, before_alloc = memory.reserved(self.device), memory.allocated(self.device)
        self.canary, self.kv_seen = None, None
        broken = None
        try:
            self.runner.teardown()
        except Exception as e:  # noqa: BLE001 - becomes the collective diagnostic
            broken = f"teardown raised {describe(e)}"
            log.error("%s", broken)
        gc.collect()
        try:
            memory.release_cached(self.device)
        except Exception as e:  # noqa: BLE001
            broken = broken or f"releasing cached memory raised {describe(e)}"
        after, after_alloc = memory.reserved(self.device), memory.allocated(self.device)
        self.rec.sample("teardown")
        leak = None
        alive = next((o for o in (r() for r in refs) if o is not None), None)
        if alive is not None:
            leak = f"the KV buffer ({gib(alive.nbytes):.2f} GiB) is still referenced by {_holders(alive)}"
        elif kv_bytes and min(before - after, before_alloc - after_alloc) < kv_bytes:
            leak = (f"reserved memory fell by {gib(before - after):.2f} GiB and allocated memory by "
                    f"{gib(before_alloc - after_alloc):.2f} GiB after teardown, less than the "
                    f"{gib(kv_bytes):.2f} GiB KV buffer: something outside Python (a CUDA graph or "
                    "a C++ holder) still holds it")
        del alive
        return leak, broken

    def what_fits(self) -> int:
        """After a pinned size failed: probe and measure once to say what would fit (0 if nothing)."""
        try:
            probe = self.probe()
            m = self.measure(probe)
        except ProfileError:
            return 0
        finally:
            self.release_after_give_up()
        return m.target

    # ------------------------------------------------------------ results and diagnostics
    def min_tokens(self) -> int:
        return self.cfg.min_usable_tokens

    def diagnostic(self, initial: int, last: int, attempts: int, last_error: str,
                   m: Measurement | None = None,
                   stage: str = "validate") -> str:
        """The give-up text. Collective under TP (every rank calls it at the same point): the figures of
        every rank are gathered, so every rank raises the very same text."""
        s = memory.snapshot(self.device) if m is None else None
        if m is not None:
            mine = (m.peak_reserved, m.total, m.peers)
        else:  # before (or without) a measurement: what the GPU shows now
            own_nt = budget.own_non_torch(s.process_used, s.reserved, s.total, s.free)
            mine = (s.peak_reserved, s.total, budget.peer_bytes(s.total, s.free, s.reserved, own_nt))
        ranks = gather(mine, self.group)
        g = budget.GiveUp(
            initial_tokens=initial, last_tokens=last, attempts=attempts, cell_bytes=self.sizing.cell_bytes,
            peak_reserved=max(r[0] for r in ranks), total=min(r[1] for r in ranks),
            canary=self.cfg.canary_bytes,
            peers=max(r[2] for r in ranks), last_error=last_error, flags=_flags(self.cfg),
            min_tokens=self.min_tokens(), stage=stage, ranks=tuple(ranks) if len(ranks) > 1 else ())
        return budget.give_up_diagnostic(g)

    def result(self, tokens: int, attempts: int, initial: int, m: Measurement | None,
               pinned: bool) -> ProfileResult:
        after = memory.snapshot(self.device)
        terms = {
            "total": after.total,
            "weights": self.runner.weight_bytes,
            "cuda_context_non_torch": budget.own_non_torch(after.process_used, after.reserved, after.total,
                                                           after.free),
            "non_kv_peak": m.non_kv_peak if m else 0,
            "graph_pools": _graph_pool_bytes(self.rec.samples),
            "workspace_declared": self.sizing.workspace_reserved(tokens),
            "request_table": self.sizing.table_reserved(tokens),
            "state_cache": sum(map(budget.reserved_bytes, self.sizing.state)),
            "vision_weights": self.runner.vision_weight_bytes,
            "encoder_buffer": self.runner.mm_buffer.nbytes if self.runner.mm_buffer is not None else 0,
            "peers": m.peers if m else budget.peer_bytes(after.total, after.free, after.reserved, 0),
            "canary": self.cfg.canary_bytes,
            "driver_reserve": budget.DRIVER_RESERVE,
            "kv": self.runner.kv_bytes,
            "reserved_after": after.reserved,
            "free_after": after.free,
        }
        log.info("KV cache: %d tokens, %.2f GiB after %d attempt(s)%s", tokens, gib(self.runner.kv_bytes),
                 attempts,
                 " (pinned by --max_total_token_num)" if pinned else "")
        stack, local = local_memory_after_stress(self.device)
        return ProfileResult(self.cfg, tokens, self.sizing.cell_bytes, pinned, attempts, initial,
                             m.probe_tokens if m else None, m, terms, list(self.rec.phases),
                             list(self.rec.samples),
                             list(self.errors), stack, local,
                             kv_scales=getattr(self.runner, "kv_scale_source", None),
                             reused_probe=self.reused_probe,
                             forced_routings=tuple(getattr(self.runner, "forced_routings", ())),
                             context_cut_from=self.context_cut_from,
                             state_slots=self.sizing.running_reqs if any(self.sizing.state) else 0,
                             phase_steps=tuple(self.rec.steps),
                             **host_tier_size(getattr(self.runner, "host_kv", None)))


def local_memory_after_stress(device) -> tuple[int | None, int | None]:
    """The stack limit the stress left and the local memory the driver holds for it, logged; a warning past
    memory.STACK_BOUND: a kernel that ran spills, and its reservation is lost to the KV cache."""
    got = memory.local_memory_reserved(device)
    if got is None:
        return None, None
    stack, local = got
    log.info("local memory: per-thread stack limit %d B after the stress, %.2f GiB reserved by the driver",
             stack, gib(local))
    if stack > memory.STACK_BOUND:
        log.warning("a kernel of the serving path spills: the stack limit grew to %d B (> %d B), %.2f GiB "
                    "of local memory are reserved for the life of the process", stack, memory.STACK_BOUND,
                    gib(local))
    return stack, local


def _flags(cfg: ServerConfig) -> dict:
    keys = ("batch_max_tokens", "graph_max_batch_size", "running_max_req_size", "mem_fraction", "canary_mb",
            "shrink_ratio", "max_retries", "tp", "page_size")
    flags = {k: getattr(cfg, k) for k in keys}
    flags["max_req_total_len"] = cfg.context_len
    return flags


def _holders(obj) -> str:
    """Name what still references a leaked tensor (gc referrers, frames and the profiler excluded)."""
    names = []
    for r in gc.get_referrers(obj):
        if isinstance(r, dict):
            owners = [o for o in gc.get_referrers(r) if hasattr(o, "__dict__") and o.__dict__ is r]
            keys = [k for k, v in r.items() if v is obj]
            names += [f"{type(o).__name__}.{k}" for o in owners for k in keys] or [f"a dict under key {keys}"]
        elif isinstance(r, (list, tuple)):
            names.append(f"a {type(r).__name__} of {len(r)} items")
        elif not hasattr(r, "f_code") and type(r).__name__ != "cell":
            names.append(type(r).__name__)
    return ", ".join(names) or "an object outside Python's view (a C++ holder or a CUDA graph)"


def _graph_pool_bytes(samples: list[Sample]) -> int:
    """Reserved growth across the last graph capture (from its checkpoint to the end of that build)."""
    idx = [i for i, s in enumerate(samples) if s.label == "graph_capture"]
    if not idx or idx[-1] + 1 >= len(samples):
        return 0
    i = idx[-1]
    return max(samples[i + 1].reserved - samples[i].reserved, 0)


# ---------------------------------------------------------------- entry points
def agree_host_tier(runner, world_size: int, group) -> None:
    """Under --tp: one host tier page count on every rank (rank 0's scheduler hands out the pages every rank
    copies), the smallest; none on any rank if a rank has none (--host_kv auto reads each rank's available
    memory at its own moment: near the threshold one rank's tier may be empty). Every rank joins the
    collective whenever --host_kv is not off, with or without a pool of its own: a rank that skipped it would
    pair the others' reduction with its next collective."""
    if world_size == 1 or runner.cfg.host_kv == "off":
        return
    pool = runner.host_kv
    pages = memory.all_reduce_min(pool.num_pages if pool is not None else 0, group)
    if pages == 0:
        if pool is not None:
            log.info("host KV tier: off on every rank (another rank's tier holds no page)")
        runner.host_kv = None
    else:
        pool.num_pages = pages


def boot(cfg: ServerConfig, rank: int = 0, world_size: int = 1, group=None, cpu_group=None,
         checkpoint: Checkpoint | None = None, log_report: bool = True, guard=None, plot_later: bool = True):
    """The server's startup hook: load the model once, then probe, measure, rebuild, validate.

    guard: this rank's autoprofile.tp.channel.RankGuard under TP (its data group replaces `group`; the
    returned
    runner runs its data-plane work in the guard's sections). Returns (runner, result); the runner is
    built at the validated size and ready to serve. plot_later: the report's PNG drawn on a thread
    (report.write_report)."""
    from autoprofile.engine.runner import runner_device
    from autoprofile.kernels.compile_ahead import CompileAhead
    from autoprofile.kernels.compile_watch import watch_after_boot

    before = start_phase()
    t0 = time.perf_counter()
    device = runner_device(rank, cfg.device)
    # the Triton compiles we can name before the first launch run in a pool beside the weights and graphs
    with CompileAhead(device) as ahead:
        ahead.dry(compile_ahead, cfg, device)
        before.append(("init", time.perf_counter() - t0))
        booted = _boot(cfg, rank, world_size, group, cpu_group, checkpoint, log_report, guard, plot_later,
                       before)
    if device.type == "cuda":  # from here a compile is a served step outside the stress's specializations
        watch_after_boot()
    return booted


_started = False  # start_phase() counted this process's start already


def start_phase() -> list[tuple[str, float]]:
    """[("start", seconds from this process's creation to now)] at its first boot: the interpreter, the
    imports and, in an engine process, its spawn (none of it inside the boot's own phases); [] at a later
    boot in the same process (a test's), whose start is not its own."""
    global _started
    if _started:
        return []
    _started = True
    import psutil
    return [("start", max(0.0, time.time() - psutil.Process().create_time()))]


def compile_ahead(cfg: ServerConfig, device: torch.device) -> None:
    """The boot's launches known from the configuration alone, compile-only (kernels.compile_ahead): the
    sampler's and structured output's mask (every stress corner masks), for the model's vocabulary and logits
    dtype."""
    from autoprofile.engine.grammar import compile_ahead as mask
    from autoprofile.engine.runner import TORCH_DTYPES
    from autoprofile.engine.sampling import compile_ahead as sampler
    vocab, dtype = cfg.model_config.vocab_size, TORCH_DTYPES[cfg.dtype]
    with torch.cuda.device(device):  # Triton specializes for the current device: this rank's GPU
        sampler(vocab, dtype, device)
        mask(vocab, dtype, device)


def _boot(cfg, rank, world_size, group, cpu_group, checkpoint, log_report, guard, plot_later, before=()):
    from autoprofile.engine.runner import ModelRunner
    from autoprofile.report import write_report

    t0 = time.perf_counter()
    runner = ModelRunner(cfg, rank=rank, world_size=world_size, group=guard.data if guard else group)
    agree_host_tier(runner, world_size, cpu_group)
    if guard is not None:
        runner = guard.bind(runner)
    load_s = time.perf_counter() - t0
    log.info("weights loaded in %.2f s (%.2f GiB)", load_s, gib(runner.weight_bytes))
    cfg = choose_state_slots(cfg, runner, cpu_group)
    try:
        result = Profiler(cfg, runner, group=cpu_group, checkpoint=checkpoint,
                          on_error=guard.post if guard else None).run()
    except BaseException:
        try:
            runner.teardown()
        except Exception as e:  # noqa: BLE001 - the profiler's own error is the one to report
            log.error("teardown after a failed profile also failed: %s", describe(e))
        raise
    result.phases[:0] = [*before, ("load_weights", load_s)]  # before: start_phase() and the init
    if rank == 0:
        if log_report:
            log.info("\n%s", result.report_text())
        if cfg.report_dir:
            write_report(result, cfg.report_dir, plot_later)
    return runner, result


def choose_state_slots(cfg: ServerConfig, runner, group) -> ServerConfig:
    """A hybrid model without --running_max_req_size: its request slots, each holding a state
    (budget.state_slots over the memory free after the weights, the MIN over TP ranks), set as
    --running_max_req_size (and the graphs' batch capped by it) before the probe; the log says why. Any
    other model: cfg unchanged."""
    mc = cfg.model_config
    if not mc.is_hybrid or cfg.running_max_req_size is not None or runner.device.type != "cuda":
        return cfg
    default = budget.running_reqs(None, cfg.graph_max_batch_size)
    per_slot = mc.state_bytes(runner.tp.size, runner.dtype.itemsize)
    free = torch.cuda.mem_get_info(runner.device)[0]
    slots = min(gather(budget.state_slots(default, free, per_slot), group))
    if slots < default:
        log.info("state slots: %d (of the %d decode rows the envelope would run): %d x %.1f MiB of state "
                 "would take more than %.0f%% of the %.2f GiB free after the weights; --running_max_req_size "
                 "sets it",
                 slots, default, default, per_slot / 2**20, budget.STATE_SHARE * 100, gib(free))
    else:
        log.info("state slots: %d, one per decode row (%.2f GiB of state)", slots, gib(slots * per_slot))
    cfg = cfg.replace(running_max_req_size=slots, graph_max_batch_size=min(cfg.graph_max_batch_size, slots))
    runner.cfg = cfg
    return cfg


def profile(cfg: ServerConfig, checkpoint: Checkpoint | None = None) -> ProfileResult:
    """`autoprofile profile` in this process (--tp 1; --tp N runs autoprofile.launch.profile_tp): run the
    profiler alone and return its report (the runner is dropped)."""
    if cfg.tp > 1:
        raise ValueError("profile() runs one process: --tp > 1 goes through autoprofile.launch.profile_tp")
    # the caller prints the report; the PNG is drawn before the command returns
    runner, result = boot(cfg, checkpoint=checkpoint, log_report=False, plot_later=False)
    runner.teardown()
    return result
