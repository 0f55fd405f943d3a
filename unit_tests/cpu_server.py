"""`autoprofile serve` on a CPU, for the tests: the tiny model with random weights, the real engine and
server; the profiler is skipped (it reads CUDA memory), the KV cache is built at a fixed size.

    python3 -m unit_tests.cpu_server --model tiny --dtype float32 --attention_backend torch --port 0 ...
"""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, field

from autoprofile.config import ServerConfig, add_server_args, config_from_args

KV_TOKENS = 2048
WEIGHT_STD = 0.08  # larger than the default 0.02: less degenerate greedy text


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


def boot_cpu(cfg: ServerConfig, kv_tokens: int = KV_TOKENS):
    from autoprofile.engine.runner import ModelRunner
    from autoprofile.engine.weights import init_random
    runner = ModelRunner(cfg)
    init_random(runner.model, seed=1, std=WEIGHT_STD)
    runner.build(kv_tokens)
    return runner, CPUResult(cfg, runner.built_tokens, runner.sizing.cell_bytes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    add_server_args(p)
    cfg = config_from_args(p.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from autoprofile.server import run_server
    return run_server(cfg, boot_cpu)


if __name__ == "__main__":
    sys.exit(main())
