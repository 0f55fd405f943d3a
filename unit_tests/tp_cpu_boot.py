"""`autoprofile serve --tp 2` on a CPU, for the tests: autoprofile.launch.serve_tp with gloo ranks, the
tiny model
with seeded random weights and a fixed KV size in place of the profile (it reads CUDA memory).

    python3 -m unit_tests.tp_cpu_boot PORT    # serves until SIGTERM; exit code as `autoprofile serve`
    python3 -m unit_tests.tp_cpu_boot PORT --nnodes 2 --node_rank R --dist_init_addr 127.0.0.1:P   # a host

While the file named by $AUTOPROFILE_TEST_RELEASE does not exist, rank 0's boot waits (up to BOOT_WAIT_S) and
the other rank waits for it in a collective, as during a profile: the test sees /health while ranks boot.
"""
from __future__ import annotations

import os
import sys
import time

from autoprofile.config import ServerConfig, validate
from unit_tests.cpu_server import KV_TOKENS, CPUResult

RELEASE_ENV = "AUTOPROFILE_TEST_RELEASE"
FAIL_ENV = "AUTOPROFILE_TEST_BOOT_FAILS"  # set: every rank's profile gives up (ProfileError) with this text
BOOT_WAIT_S = 120.0
FLAGS = dict(model="tiny", tp=2, dtype="float32", attention_backend="torch", max_req_total_len=256,
             batch_max_tokens=64, graph_max_batch_size=4, running_max_req_size=8, report_dir=None)


def boot_cpu_tp(cfg: ServerConfig, guard):
    from autoprofile import memory
    from autoprofile.engine.runner import ModelRunner
    release = os.environ.get(RELEASE_ENV)
    deadline = time.monotonic() + BOOT_WAIT_S
    while guard.rank == 0 and release and not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
    memory.all_ok(True, guard.control)  # the profile's collectives: every rank waits for rank 0
    if os.environ.get(FAIL_ENV):
        from autoprofile.profiler import ProfileError
        raise ProfileError(os.environ[FAIL_ENV])
    runner = guard.bind(ModelRunner(cfg, rank=guard.rank, world_size=guard.world, group=guard.data))
    runner.build(KV_TOKENS)
    return runner, CPUResult(cfg, runner.built_tokens, runner.sizing.cell_bytes)


def main(argv: list[str]) -> int:
    """PORT [--tp N] [--nnodes M --node_rank R --dist_init_addr HOST:PORT] (simulated hosts on one machine)."""
    from autoprofile import launch
    flags = dict(zip(argv[1::2], argv[2::2]))
    hosts = {k: int(flags[f"--{k}"]) for k in ("tp", "nnodes", "node_rank") if f"--{k}" in flags}
    cfg = validate(ServerConfig(**{**FLAGS, **hosts}, port=int(argv[0]),
                                dist_init_addr=flags.get("--dist_init_addr")))
    return launch.serve_tp(cfg, device="cpu", boot=boot_cpu_tp)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
