"""CPU test session settings: under pytest-xdist (`-n N`), each worker's torch gets its share of the cores."""
from __future__ import annotations

import os
import sys


def usable_cores() -> int:
    """The cores this process may run on (taskset limits them; os.cpu_count() counts the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads_per_worker(cores: int, workers: int) -> int:
    return max(1, cores // max(1, workers))


# NOTE: N workers each running torch's default of one intra-op thread a core oversubscribe the cores, and
# OpenMP threads spin while they wait for each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    threads = cpu_threads_per_worker(usable_cores(), workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # the ranks and servers a test spawns inherit it
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
