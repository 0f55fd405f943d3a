"""The test session's own settings (unit_tests/conftest.py)."""
from __future__ import annotations

import os

import pytest
import torch

from unit_tests.conftest import cpu_threads_per_worker, usable_cores


def test_a_worker_gets_its_share_of_the_cores_and_at_least_one():
    assert cpu_threads_per_worker(2, 2) == 1
    assert cpu_threads_per_worker(16, 4) == 4
    assert cpu_threads_per_worker(2, 8) == 1


@pytest.mark.skipif(not os.environ.get("PYTEST_XDIST_WORKER"), reason="runs under pytest-xdist (-n N)")
def test_under_xdist_torch_and_what_a_test_spawns_use_the_workers_share():
    want = cpu_threads_per_worker(usable_cores(), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    assert os.environ["OMP_NUM_THREADS"] == str(want)
    assert torch.get_num_threads() == want
