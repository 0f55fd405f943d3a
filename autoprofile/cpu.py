"""`autoprofile serve --device cpu`: the real engine and server on the host's CPU, to try the API without a
GPU.

There is no probe (it measures CUDA memory). The KV cache is the smallest usable cache of the served context
(config.min_usable_tokens: one request of the whole context, one prefill batch, a page per running request),
or --max_total_token_num; it must fit the host memory psutil reports available after the weights, less
CPU_HEADROOM_BYTES and times --mem_fraction. When it does not, --max_req_total_len auto cuts the context to
what fits (config.with_context_cut logs it); otherwise startup stops naming the flag to change.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from autoprofile.budget import gib, round_down, running_reqs
from autoprofile.config import CPU_MODEL, DTYPE_BYTES, ServerConfig, context_cut, with_context_cut
from autoprofile.profiler import ProfileError

log = logging.getLogger(__name__)

CPU_HEADROOM_BYTES = 1 << 30  # activations, the tokenizer and the server beside the weights and the cache
# one intra-op thread per this many bytes of weights, up to the cores: a decode step of a small model is many
# small ops, whose threads wait for each other (measured, tiny model on a shared 2-core host: 16 tokens in
# 0.10 s with one thread, 1.0-2.9 s with two)
BYTES_PER_THREAD = 256 << 20


class CPUSizeError(ProfileError):
    """The cache does not fit the host's memory: names the flag to change and a value that fits."""


@dataclass
class CPUResult:
    """What the server reads of a ProfileResult."""

    cfg: ServerConfig
    tokens: int
    cell_bytes: int
    phases: list = field(default_factory=lambda: [("load_weights", 0.0), ("build", 0.0)])

    @property
    def kv_bytes(self) -> int:
        return self.tokens * self.cell_bytes


def cpu_threads(weight_bytes: int, cores: int) -> int:
    """Intra-op threads for a model of `weight_bytes` on `cores`: one per BYTES_PER_THREAD, at least one."""
    return max(1, min(cores, weight_bytes // BYTES_PER_THREAD))


def cpu_kv_tokens(cfg: ServerConfig, cell_bytes: int, state_bytes: int, available: int) -> int:
    """The cache to build, in whole pages: --max_total_token_num, else the smallest usable cache of the served
    context; capped by what `available` host bytes hold beside `state_bytes` (a hybrid model's state slots)
    and CPU_HEADROOM_BYTES, times --mem_fraction. Raises CPUSizeError when the result cannot serve."""
    want = cfg.max_total_token_num or cfg.min_usable_tokens
    room = int((available - state_bytes - CPU_HEADROOM_BYTES) * cfg.mem_fraction)
    fits = round_down(room // cell_bytes, cfg.page_size)
    if fits >= want:
        return want
    held = f"{gib(available):.2f} GiB of host memory is available after the weights"
    if cfg.max_total_token_num is not None:
        raise CPUSizeError(f"--max_total_token_num: {want} tokens of KV ({gib(want * cell_bytes):.2f} GiB) "
                           f"do not fit: {held}; try --max_total_token_num {fits}")
    if context_cut(cfg, fits) is not None:
        return fits  # with_context_cut serves the shorter context, and logs it
    rows = running_reqs(cfg.running_max_req_size, cfg.graph_max_batch_size)
    raise CPUSizeError(f"--batch_max_tokens: {held}, room for {fits} KV tokens, less than one prefill batch "
                       f"of {cfg.batch_max_tokens} tokens and a page for each of {rows} requests need; try "
                       f"--batch_max_tokens {max(cfg.page_size, fits // 2)} --running_max_req_size 4")


def weights_problem(cfg: ServerConfig, available: int) -> str | None:
    """Why the weights cannot load into `available` host bytes beside CPU_HEADROOM_BYTES (plan.weight_bytes
    at --dtype), naming the flag to change; None when they fit. Checked before anything is loaded."""
    from autoprofile.plan import weight_bytes

    mc, room = cfg.model_config, available - CPU_HEADROOM_BYTES
    need = weight_bytes(mc, DTYPE_BYTES[cfg.dtype], 1)
    if need <= room:
        return None
    held = (f"{mc.name}'s weights take {gib(need):.2f} GiB in {cfg.dtype}, and {gib(available):.2f} GiB of "
            f"host memory is available ({gib(CPU_HEADROOM_BYTES):.0f} GiB kept for the rest)")
    if cfg.dtype == "float32" and weight_bytes(mc, 2, 1) <= room:
        return f"--dtype: {held}; try --dtype bfloat16"
    return f"--model: {held}; try --model {CPU_MODEL} (random weights) or a smaller checkpoint"


def load_cpu(cfg: ServerConfig):
    """The model on the CPU (a ModelRunner, not built yet): the checkpoint's weights, or random ones."""
    from autoprofile.engine.runner import ModelRunner
    return ModelRunner(cfg)


def build_cpu(runner, kv_tokens: int | None = None, available: int | None = None, load_s: float = 0.0):
    """Size the cache (cpu_kv_tokens over psutil's available memory, or kv_tokens when given) and build it,
    with --max_req_total_len auto's cut if the context does not fit. Returns (runner, CPUResult)."""
    import psutil

    cfg, mc = runner.cfg, runner.model_config
    rows = running_reqs(cfg.running_max_req_size, cfg.graph_max_batch_size)
    state = rows * mc.state_bytes(1, runner.dtype.itemsize) if mc.is_hybrid else 0
    available = psutil.virtual_memory().available if available is None else available
    cell = runner.sizing.cell_bytes
    tokens = kv_tokens or cpu_kv_tokens(cfg, cell, state, available)
    cut = with_context_cut(cfg, tokens)  # --max_req_total_len auto, as Profiler.run_pinned
    if cut is not cfg:
        runner.cut_context(cut)
    t0 = time.perf_counter()
    runner.build(tokens)
    log.info("cpu: %d KV tokens (%.3f GiB) for requests of %d tokens (%s); %.2f GiB of host memory available "
             "after %.2f GiB of %s weights", runner.built_tokens, gib(tokens * cell), cut.context_len,
             "pinned" if kv_tokens or cfg.max_total_token_num else
             "one request of the whole context, one prefill batch, a page per running request",
             gib(available), gib(runner.weight_bytes), cfg.dtype)
    phases = [("load_weights", load_s), ("build", time.perf_counter() - t0)]
    return runner, CPUResult(cut, runner.built_tokens, cell, phases)


def boot_cpu(cfg: ServerConfig):
    """The server's startup hook for --device cpu: load, pick the torch threads (cpu_threads; OMP_NUM_THREADS
    wins), size and build. Returns (runner, CPUResult)."""
    import psutil
    import torch

    from autoprofile.profiler import start_phase
    before = start_phase()
    problem = weights_problem(cfg, psutil.virtual_memory().available)
    if problem:
        raise CPUSizeError(problem)
    t0 = time.perf_counter()
    runner = load_cpu(cfg)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpu_threads(runner.weight_bytes, psutil.cpu_count(logical=False) or 1))
    log.info("cpu: %d torch threads for %.2f GiB of weights", torch.get_num_threads(),
             gib(runner.weight_bytes))
    runner, result = build_cpu(runner, load_s=time.perf_counter() - t0)
    result.phases[:0] = before
    return runner, result
