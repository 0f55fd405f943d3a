"""Prometheus metrics of one app: its own CollectorRegistry (two servers in a process never share one).

Latencies are observed as first tokens arrive and requests finish; engine state (running, waiting,
preemptions, KV
pages, OOMs while serving) is read from the engine loop's last snapshot at scrape time, and so is the CUDA
caching allocator (reserved bytes and segments, against the validated profile's reserved bytes: fragmentation
shows as reserved memory growing past it; 0 on a CPU).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

import torch

from autoprofile.engine.step_clock import HOST_PARTS
from autoprofile.serving.async_engine import Snapshot, Timing

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)


class EngineCollector:
    """Engine gauges and counters from the loop's latest Snapshot (None before the engine starts)."""

    def __init__(self, snapshot: Callable[[], Snapshot | None],
                 cpu: Callable[[], dict[str, float]] = lambda: {}):
        self.snapshot, self.cpu = snapshot, cpu

    def collect(self):
        s = self.snapshot() or Snapshot()
        cpu = CounterMetricFamily("autoprofile_thread_cpu_seconds",
                                  "CPU seconds of the server's event loop thread and its engine loop thread "
                                  "(they share the GIL), or its engine process (--engine_process)",
                                  labels=["thread"])
        for thread, seconds in self.cpu().items():
            cpu.add_metric([thread], seconds)
        yield cpu
        for name, doc, value in (
                ("autoprofile_num_requests_running", "requests running in the engine", s.running),
                ("autoprofile_num_requests_waiting", "requests waiting for the engine (incl. preempted)",
                 s.waiting),
                ("autoprofile_kv_pages_used", "KV cache pages held by requests", s.pages_used),
                ("autoprofile_kv_pages_total", "KV cache pages that requests can hold", s.pages_total)):
            yield GaugeMetricFamily(name, doc, value=value)
        if s.state_slots:  # a hybrid model's second cache
            yield GaugeMetricFamily("autoprofile_state_slots_used", "state slots held by requests (hybrid models)",
                                    value=s.state_slots_used)
            yield GaugeMetricFamily("autoprofile_state_slots_total", "state slots: one per request slot",
                                    value=s.state_slots)
        for name, doc, value in (
                ("autoprofile_num_preemptions", "requests preempted (pages freed, recomputed later)",
                 s.preemptions),
                ("autoprofile_serving_oom", "torch.OutOfMemoryError caught in the engine loop (must stay 0)",
                 s.ooms),
                ("autoprofile_engine_failed_steps", "engine steps that raised (their requests failed)",
                 s.errors),
                ("autoprofile_engine_steps", "engine steps run", s.steps),
                ("autoprofile_prefix_cache_hit_tokens", "prompt tokens whose K/V came from the prefix cache",
                 s.prefix_hit_tokens)):
            yield CounterMetricFamily(name, doc, value=value)
        yield from host_tier_families(s.host)
        yield from step_time_families(s.step_times)


def host_tier_families(t):
    """The prefix cache's host tier (--host_kv; autoprofile.engine.host_kv.HostTierStats), if on."""
    if t is None:
        return
    for name, doc, value in (
            ("autoprofile_host_kv_pages_total", "pages of the prefix cache's host tier (this rank)", t.pages),
            ("autoprofile_host_kv_pages_cached", "host tier pages holding an evicted prefix page now",
             t.cached)):
        yield GaugeMetricFamily(name, doc, value=value)
    for name, doc, value in (
            ("autoprofile_host_kv_saved_pages", "cached GPU pages copied to the host tier on eviction",
             t.saved),
            ("autoprofile_host_kv_loaded_pages", "host tier pages copied back to the GPU (prefix hits)",
             t.loaded),
            ("autoprofile_host_kv_dropped_pages", "host tier pages dropped (its LRU, a failed step's copies)",
             t.dropped),
            ("autoprofile_host_kv_hit_tokens", "prompt tokens whose K/V came back from the host tier",
             t.hit_tokens),
            ("autoprofile_host_kv_moved_bytes", "bytes copied between the GPU and the host tier (this rank)",
             t.bytes_moved),
            ("autoprofile_host_kv_copy_seconds", "time of the host tier's copies (CUDA events on the copy "
             "stream; wall time on a CPU)", t.copy_seconds)):
        yield CounterMetricFamily(name, doc, value=value)


def step_time_families(t):
    """Where the engine's steps spent their time (autoprofile.engine.step_clock.StepTimes) as counters."""
    steps = CounterMetricFamily("autoprofile_engine_step_kind_steps",
                                "engine steps by kind (prefill: with prompt tokens; decode: decode rows only)",
                                labels=["kind"])
    tokens = CounterMetricFamily("autoprofile_engine_step_kind_tokens",
                                 "tokens the steps' forwards ran (prompt tokens + decode rows), by step kind",
                                 labels=["kind"])
    for kind in ("prefill", "decode"):
        steps.add_metric([kind], t.steps[kind])
        tokens.add_metric([kind], t.tokens[kind])
    host = CounterMetricFamily("autoprofile_engine_host_seconds",
                               "engine-thread wall seconds by part (inbox, schedule, execute: inputs and "
                               "launches, and without the overlap the wait for the sampled tokens; wait: the "
                               "overlapped engine's wait for them; update; post: outputs to the event loop)",
                               labels=["part"])
    for part in HOST_PARTS:
        host.add_metric([part], t.host[part])
    gpu = CounterMetricFamily("autoprofile_engine_gpu_seconds",
                              "CUDA-event seconds of the steps by kind and part (prepare: inputs before the "
                              "forward's first launch; forward: forward and sampler); idle: the GPU waiting for "
                              "the host between steps", labels=["kind", "part"])
    for kind in ("prefill", "decode"):
        for part in ("prepare", "forward"):
            gpu.add_metric([kind, part], t.gpu[(kind, part)])
    gpu.add_metric(["", "idle"], t.gpu["idle"])
    yield from (steps, tokens, host, gpu)


def allocator_reading(device: torch.device | None) -> tuple[int, int]:
    """(reserved bytes, segments) of the CUDA caching allocator on device; (0, 0) without CUDA in use."""
    if device is None or device.type != "cuda" or not torch.cuda.is_initialized():
        return 0, 0
    stats = torch.cuda.memory_stats(device)
    return torch.cuda.memory_reserved(device), stats.get("segment.all.current", 0)


def profile_reserved(result) -> int:
    """The validated profile's reserved bytes (read after its last stress: the caching allocator keeps its
    peak); 0 without a profile (the CPU test server, --max_total_token_num without terms)."""
    return (getattr(result, "terms", None) or {}).get("reserved_after", 0)


def device_memory(snapshot: Snapshot | None, device: torch.device | None) -> tuple[int, int, int | None]:
    """(reserved bytes, segments, CUDA stack limit): an engine process's, as its last snapshot carries them,
    else read in this process now."""
    if snapshot is not None and snapshot.device_memory is not None:
        return snapshot.device_memory
    from autoprofile import memory  # None in a process that never touched CUDA (an engine process's server)
    return (*allocator_reading(device), memory.stack_limit_bytes(device))


class AllocatorCollector:
    """The caching allocator, read at scrape time (an engine process's: from its last snapshot)."""

    def __init__(self, device: Callable[[], torch.device | None], profile_peak: Callable[[], int],
                 snapshot: Callable[[], Snapshot | None] = lambda: None):
        self.device, self.profile_peak, self.snapshot = device, profile_peak, snapshot

    def collect(self):
        reserved, segments, _ = device_memory(self.snapshot(), self.device())
        for name, doc, value in (
                ("autoprofile_cuda_memory_reserved_bytes", "torch.cuda.memory_reserved now", reserved),
                ("autoprofile_cuda_memory_segments", "caching-allocator segments now (segment.all.current)",
                 segments),
                ("autoprofile_profile_peak_reserved_bytes",
                 "reserved bytes of the validated profile after its last stress (serving stays below it)",
                 self.profile_peak())):
            yield GaugeMetricFamily(name, doc, value=value)


class LocalMemoryCollector:
    """The CUDA stack limit now (read at scrape) and after the profile's stress: serving must never grow it
    (a kernel the stress never ran that spills; the driver keeps its reservation for good)."""

    def __init__(self, profiled: int, now: Callable[[], int | None]):
        self.profiled, self.now, self.warned = profiled, now, False

    def collect(self):
        now = self.now()
        if now is not None and now > self.profiled and not self.warned:
            self.warned = True
            log.warning("the CUDA stack limit grew while serving: %d B/thread, %d B after the profile's "
                        "stress", now, self.profiled)
        if now is not None:
            yield GaugeMetricFamily("autoprofile_cuda_stack_limit_bytes", "per-thread CUDA stack limit "
                                    "now (local memory; must not grow while serving)", value=now)
        yield GaugeMetricFamily("autoprofile_cuda_stack_limit_profiled_bytes",
                                "per-thread CUDA stack limit after the profile's stress", value=self.profiled)


class GrammarCollector:
    """Structured output's grammar compiles (serving.structured.CompileStats; None: no compiler)."""

    def __init__(self, stats: Callable[[], object | None]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        if s is None:
            return
        for name, doc, value in (
                ("autoprofile_grammar_compiles", "grammars compiled (cache misses that compiled)",
                 s.compiles),
                ("autoprofile_grammar_compile_seconds", "time spent compiling grammars", s.seconds),
                ("autoprofile_grammar_cache_hits", "requests whose grammar was cached or compiling already",
                 s.hits),
                ("autoprofile_grammar_invalid", "grammars refused by the compiler (400)", s.invalid),
                ("autoprofile_grammar_compile_timeouts", "requests whose compile passed the deadline (408)",
                 s.timeouts)):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("autoprofile_grammar_compiles_running", "grammar compiles in flight",
                                value=s.running)
        yield GaugeMetricFamily("autoprofile_grammar_compiles_overdue",
                                "grammar compiles in flight past their deadline", value=s.overdue)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], Snapshot | None],
                 device: Callable[[], torch.device | None] = lambda: None,
                 grammars: Callable[[], object | None] = lambda: None,
                 cpu: Callable[[], dict[str, float]] = lambda: {}):
        reg = self.registry = CollectorRegistry()
        self.profile_peak = 0
        reg.register(EngineCollector(snapshot, cpu))
        self.reading = lambda: device_memory(snapshot(), device())
        reg.register(AllocatorCollector(device, lambda: self.profile_peak, snapshot))
        reg.register(GrammarCollector(grammars))
        self.ttft = Histogram("autoprofile_time_to_first_token_seconds", "time to the first output token",
                              buckets=LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram("autoprofile_time_per_output_token_seconds",
                              "(end - first token) / (output tokens - 1), per request", buckets=TPOT_BUCKETS,
                              registry=reg)
        self.e2e = Histogram("autoprofile_e2e_request_latency_seconds", "submit to last token",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.requests = Counter("autoprofile_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=reg)
        self.finished = Counter("autoprofile_requests_finished", "completed requests by finish reason",
                                ["finish_reason"], registry=reg)
        self.prompt_tokens = Counter("autoprofile_prompt_tokens", "prompt tokens of accepted requests",
                                     registry=reg)
        self.generated_tokens = Counter("autoprofile_generated_tokens", "tokens generated", registry=reg)

    def add_profile(self, result) -> None:
        """KV size and startup phase durations of the validated profile."""
        reg = self.registry
        self.profile_peak = profile_reserved(result)
        Gauge("autoprofile_kv_cache_tokens", "KV cache size in tokens", registry=reg).set(result.tokens)
        Gauge("autoprofile_kv_cache_bytes", "KV cache size in bytes (this rank)",
              registry=reg).set(result.kv_bytes)
        phases = Gauge("autoprofile_profile_phase_seconds", "duration of each startup profile phase",
                       ["phase"],
                       registry=reg)
        for name, seconds in result.phases:
            phases.labels(phase=name).set(seconds)
        if getattr(result, "stack_limit", None) is not None:
            reg.register(LocalMemoryCollector(result.stack_limit, lambda: self.reading()[2]))

    def first_token(self, timing: Timing) -> None:
        self.ttft.observe(timing.first - timing.submitted)

    def request_finished(self, timing: Timing, completion_tokens: int, finish_reason: str) -> None:
        now = time.perf_counter()
        self.e2e.observe(now - timing.submitted)
        if timing.first is not None and completion_tokens > 1:
            self.tpot.observe((now - timing.first) / (completion_tokens - 1))
        self.finished.labels(finish_reason=finish_reason).inc()
        self.generated_tokens.inc(completion_tokens)
