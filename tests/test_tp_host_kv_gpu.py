"""The prefix cache's host tier (--host_kv) under --tp 2 on 2 GPUs: unit_tests/test_tp_host_kv.py's checks
with pinned pools, the page-transfer kernel on the copy streams, and each worker's forward waiting for its own
loads (Step.kv_ready) while rank 0 polls only its own.

Run on a 2-GPU host, from the repository root:
    NCCL_NVLS_ENABLE=0 python -m pytest tests/test_tp_host_kv_gpu.py -v -x
"""
from __future__ import annotations

import os

import pytest
import torch

from unit_tests.test_tp_host_kv import check_tp2_host_tier, check_tp2_host_tier_with_a_failed_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
# NVLink multicast off on the 2-GPU host (the ranks set it too)
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def test_tp2_ranks_each_keep_their_shard_of_the_host_tier_and_give_the_tp1_tokens_on_2_gpus(tmp_path):
    check_tp2_host_tier(tmp_path, "cuda")


def test_tp2_host_tier_with_a_step_that_fails_holding_ready_loads_gives_the_clean_tokens_on_2_gpus(tmp_path):
    check_tp2_host_tier_with_a_failed_step(tmp_path, "cuda")
