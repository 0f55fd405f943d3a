"""Collective decisions with two real gloo processes: one rank's failure makes both retry together."""
from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest
import torch
import torch.distributed as dist

from autoprofile.config import ServerConfig
from autoprofile.profiler import Profiler, ProfileError
from unit_tests.fakes import GiB, FakeGPU, FakeRunner, llama8b_sizing

CFG = ServerConfig(model="llama-3.1-8b", max_req_total_len=8192, canary_mb=1, report_dir=None, tp=2)


def _worker(rank: int, init: str, fail_attempts: int, queue, point: str = "validate_decode") -> None:
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        gpu = FakeGPU(peers=rank * 3 * GiB)  # rank 1 shares its GPU with a peer: smaller local target
        with gpu.patched():
            runner = FakeRunner(gpu, llama8b_sizing(CFG.page_size, CFG.context_len))
            seen = {"n": 0}

            def fault(where):
                if where == point and rank == 1:
                    seen["n"] += 1
                    if seen["n"] <= fail_attempts:
                        raise torch.OutOfMemoryError(f"injected on rank 1, attempt {seen['n']}")

            try:
                res = Profiler(CFG, runner, group=dist.group.WORLD, checkpoint=fault).run()
                queue.put((rank, "ok", res.tokens, res.attempts,
                           [e[1] for e in runner.events if e[0] == "build"], res.measurement.local_target))
            except ProfileError as e:
                queue.put((rank, "error", str(e), None, [e[1] for e in runner.events if e[0] == "build"],
                           None))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - report to the parent instead of hanging it
        queue.put((rank, "crash", traceback.format_exc(), None, None, None))


def _run_two(tmp_path, fail_attempts: int, point: str = "validate_decode") -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_worker, args=(r, init, fail_attempts, queue, point)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        rank, *rest = queue.get(timeout=120)  # a hang fails the test instead of blocking CI
        out[rank] = rest
    for p in procs:
        p.join(timeout=60)
    assert all(v[0] != "crash" for v in out.values()), out
    return out


@pytest.mark.slow
def test_one_rank_fails_once_both_retry_and_agree(tmp_path):
    out = _run_two(tmp_path, fail_attempts=1)
    (s0, t0, a0, b0, local0), (s1, t1, a1, b1, local1) = out[0], out[1]
    assert s0 == s1 == "ok"
    assert local1 < local0  # the ranks measured different budgets ...
    assert b0[1] == b1[1] == local1  # ... and both built the MIN
    assert t0 == t1 and a0 == a1 == 2  # rank 0 passed attempt 1 itself, yet retried with rank 1
    assert b0 == b1


@pytest.mark.slow
def test_one_rank_always_fails_both_raise_the_same_error(tmp_path):
    out = _run_two(tmp_path, fail_attempts=99)
    assert out[0][0] == out[1][0] == "error"
    assert out[0][1] == out[1][1]  # the very same diagnostic on every rank
    assert "rank 1: OutOfMemoryError: injected on rank 1" in out[0][1]
    assert len(out[0][3]) == len(out[1][3]) == 1 + 1 + CFG.max_retries


@pytest.mark.slow
def test_a_probe_failure_on_one_rank_gives_every_rank_the_same_text_with_every_ranks_figures(tmp_path):
    out = _run_two(tmp_path, fail_attempts=1, point="probe_decode")
    assert out[0][0] == out[1][0] == "error"
    text = out[0][1]
    assert out[1][1] == text  # gathered figures, one text
    assert "rank 1: OutOfMemoryError: injected on rank 1" in text
    assert "measured peak       : rank 0 " in text and "peers on the GPU    : rank 0 " in text  # every rank's
