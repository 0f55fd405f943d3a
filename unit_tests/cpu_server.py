"""`autoprofile serve --device cpu` (autoprofile.cpu) for the tests: the KV cache at a fixed size (KV_TOKENS),
random weights of a larger spread (WEIGHT_STD), and faults to inject.

    python3 -m unit_tests.cpu_server --model tiny --dtype float32 --attention_backend torch --port 0 ...

--inject_fault abort: the engine's abort raises (the engine loop thread dies on the first disconnect);
--inject_fault wedge: a step never returns once a request has run 8 steps (the loop wedges), with
--wedged_after_s S as the watchdog's limit.
"""
from __future__ import annotations

import argparse
import logging
import sys

from autoprofile.config import ServerConfig, add_server_args, config_from_args
from autoprofile.cpu import CPUResult, build_cpu, load_cpu

__all__ = ["CPUResult", "KV_TOKENS", "boot_cpu", "bound_url", "main"]

KV_TOKENS = 2048
WEIGHT_STD = 0.08  # larger than the default 0.02: less degenerate greedy text


def booted_fixture(cfg: ServerConfig):
    """A test module's `booted` fixture (`booted = booted_fixture(CFG)`): boot_cpu(cfg)'s (runner, result) for
    the module, torn down after it."""
    import pytest

    @pytest.fixture(scope="module")
    def booted():
        runner, result = boot_cpu(cfg)
        yield runner, result
        runner.teardown()
    return booted


def boot_cpu(cfg: ServerConfig, kv_tokens: int = KV_TOKENS):
    from autoprofile.engine.weights import init_random
    runner = load_cpu(cfg)
    init_random(runner.model, seed=1, std=WEIGHT_STD)
    return build_cpu(runner, kv_tokens)


def bound_url(lines) -> str | None:
    """Read a server's log lines until it logs `serving on http://...`; its URL (None if it never bound)."""
    for line in lines:
        if "serving on" in line:
            return line.split("serving on ")[1].split(",")[0].strip()
    return None


FAULTS = ("abort", "wedge")


def inject_fault(kind: str, wedged_after_s: float) -> None:
    """For this process only: make the engine loop die (abort raises) or wedge (a step never returns)."""
    import threading
    from autoprofile.engine.engine import LLMEngine
    from autoprofile.serving import async_engine
    async_engine.WEDGED_AFTER_S = wedged_after_s
    if kind == "abort":
        def abort(self, request_id):
            raise RuntimeError(f"injected fault: abort of {request_id}")
        LLMEngine.abort = abort
        return
    real_step, never = LLMEngine.step, threading.Event()

    def step(self):
        if self.stats.steps >= 8:
            never.wait()
        return real_step(self)
    LLMEngine.step = step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    add_server_args(p)
    p.add_argument("--inject_fault", choices=FAULTS, default=None)
    p.add_argument("--wedged_after_s", type=float, default=60.0)
    ns = p.parse_args(argv)
    cfg = config_from_args(ns)
    if cfg.engine_process is None:  # it boots on the CPU: the engine thread, as `serve --device cpu` runs it
        cfg = cfg.replace(engine_process=False)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ns.inject_fault:
        inject_fault(ns.inject_fault, ns.wedged_after_s)
    from autoprofile.server import run_server
    return run_server(cfg, boot_cpu)


if __name__ == "__main__":
    sys.exit(main())
