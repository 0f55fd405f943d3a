"""memory.py on the CPU: torch.cuda readings mocked, a fake pynvml, and the MIN/agreement collectives
over two real gloo processes."""
from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autoprofile import memory

GiB = 1 << 30
UUID = "8f1c2d3e-0000-4000-8000-123456789abc"


# ---------------------------------------------------------------- fake NVML
class FakeNVMLError(Exception):
    pass


def fake_pynvml(procs_by_index: dict[int, list], uuids: list[str],
                fail: str | None = None) -> types.ModuleType:
    """A pynvml stand-in: GPUs by NVML index with their UUIDs and running compute processes.
    `fail` names a call that raises NVMLError."""
    mod = types.ModuleType("pynvml")
    mod.NVMLError = FakeNVMLError
    calls: list[str] = []
    mod.calls = calls

    def call(name, result=None):
        def f(*args):
            calls.append(name)
            if name == fail:
                raise FakeNVMLError(f"{name} failed")
            return result(*args) if callable(result) else result
        return f

    mod.nvmlInit = call("nvmlInit")
    mod.nvmlShutdown = call("nvmlShutdown")
    mod.nvmlDeviceGetCount = call("nvmlDeviceGetCount", len(uuids))
    mod.nvmlDeviceGetHandleByIndex = call("nvmlDeviceGetHandleByIndex", lambda i: ("handle", i))
    mod.nvmlDeviceGetUUID = call("nvmlDeviceGetUUID", lambda h: uuids[h[1]].encode())
    mod.nvmlDeviceGetComputeRunningProcesses = call(
        "nvmlDeviceGetComputeRunningProcesses", lambda h: procs_by_index.get(h[1], []))
    return mod


def proc(pid: int, used: int | None):
    return types.SimpleNamespace(pid=pid, usedGpuMemory=used)


@pytest.fixture
def device_uuid(mocker):
    return mocker.patch("torch.cuda.get_device_properties", return_value=types.SimpleNamespace(uuid=UUID))


def test_nvml_reports_this_process(mocker, device_uuid):
    nv = fake_pynvml({0: [proc(1, 5 * GiB), proc(os.getpid(), 3 * GiB)]}, ["GPU-" + UUID])
    mocker.patch.dict(sys.modules, {"pynvml": nv})
    assert memory.process_used_bytes(0) == 3 * GiB
    assert nv.calls[0] == "nvmlInit" and nv.calls[-1] == "nvmlShutdown"


def test_nvml_matches_by_uuid_not_index(mocker, device_uuid):
    """CUDA_VISIBLE_DEVICES=2: torch's device 0 is NVML's device 2."""
    nv = fake_pynvml({0: [proc(os.getpid(), 1 * GiB)], 2: [proc(os.getpid(), 7 * GiB)]},
                     ["GPU-aaaa", "GPU-bbbb", "GPU-" + UUID])
    mocker.patch.dict(sys.modules, {"pynvml": nv})
    assert memory.process_used_bytes(0) == 7 * GiB


def test_nvml_missing_pid_is_none(mocker, device_uuid):
    """In a container NVML lists host pids: ours is not there, so the caller falls back."""
    nv = fake_pynvml({0: [proc(os.getpid() + 1, 3 * GiB)]}, ["GPU-" + UUID])
    mocker.patch.dict(sys.modules, {"pynvml": nv})
    assert memory.process_used_bytes(0) is None


def test_nvml_unavailable_value_is_none(mocker, device_uuid):
    nv = fake_pynvml({0: [proc(os.getpid(), None)]}, ["GPU-" + UUID])
    mocker.patch.dict(sys.modules, {"pynvml": nv})
    assert memory.process_used_bytes(0) is None


@pytest.mark.parametrize("fail", ["nvmlInit", "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetUUID"])
def test_nvml_error_is_none(mocker, device_uuid, fail):
    nv = fake_pynvml({0: [proc(os.getpid(), 3 * GiB)]}, ["GPU-" + UUID], fail=fail)
    mocker.patch.dict(sys.modules, {"pynvml": nv})
    assert memory.process_used_bytes(0) is None
    if fail != "nvmlInit":
        assert nv.calls[-1] == "nvmlShutdown"  # initialised NVML is shut down on the error path too


def test_no_pynvml_is_none(mocker, device_uuid):
    mocker.patch.dict(sys.modules, {"pynvml": None})  # import raises ImportError
    assert memory.process_used_bytes(0) is None


# ---------------------------------------------------------------- snapshot with torch.cuda mocked
@pytest.fixture
def cuda_memory(mocker, device_uuid):
    m = types.SimpleNamespace(
        mem_get_info=mocker.patch("torch.cuda.mem_get_info", return_value=(30 * GiB, 80 * GiB)),
        reserved=mocker.patch("torch.cuda.memory_reserved", return_value=40 * GiB),
        allocated=mocker.patch("torch.cuda.memory_allocated", return_value=35 * GiB),
        peak=mocker.patch("torch.cuda.max_memory_reserved", return_value=45 * GiB),
        current=mocker.patch("torch.cuda.current_device", return_value=1),
    )
    nv = fake_pynvml({1: [proc(os.getpid(), 41 * GiB)]}, ["GPU-x", "GPU-" + UUID])
    mocker.patch.dict(sys.modules, {"pynvml": nv})
    return m


def test_snapshot_reads_every_figure(cuda_memory):
    s = memory.snapshot()
    assert s == memory.MemorySnapshot(total=80 * GiB, free=30 * GiB, reserved=40 * GiB, allocated=35 * GiB,
                                      peak_reserved=45 * GiB, process_used=41 * GiB)
    cuda_memory.mem_get_info.assert_called_once_with(1)  # the current device
    cuda_memory.peak.assert_called_once_with(1)


@pytest.mark.parametrize("device, index", [(3, 3), (torch.device("cuda", 2), 2), (None, 1)])
def test_snapshot_device_argument(cuda_memory, device, index):
    memory.snapshot(device)
    cuda_memory.mem_get_info.assert_called_once_with(index)
    cuda_memory.reserved.assert_called_once_with(index)


def test_snapshot_without_nvml_entry(cuda_memory, mocker):
    mocker.patch.dict(sys.modules, {"pynvml": fake_pynvml({}, ["GPU-" + UUID])})
    assert memory.snapshot(0).process_used is None


def test_reset_peak_and_release_cached(mocker):
    sync = mocker.patch("torch.cuda.synchronize")
    reset = mocker.patch("torch.cuda.reset_peak_memory_stats")
    empty = mocker.patch("torch.cuda.empty_cache")
    memory.reset_peak(2)
    sync.assert_called_with(2)
    reset.assert_called_once_with(2)
    memory.release_cached(torch.device("cuda", 1))
    sync.assert_called_with(1)
    empty.assert_called_once_with()


# ---------------------------------------------------------------- collectives
def test_collectives_without_a_process_group_are_identity():
    assert not dist.is_initialized()
    assert memory.all_reduce_min(7) == 7
    assert memory.all_reduce_max(7) == 7
    assert memory.all_ok(True) is True and memory.all_ok(False) is False


# (min input, max input, ok) per rank
RANK_INPUTS = [(1_000_000, 5, True), (987_654, 9, False)]


def _gloo_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        value, other, ok = RANK_INPUTS[rank]
        result = {
            "min": memory.all_reduce_min(value),
            "max": memory.all_reduce_max(other),
            "all_ok_mixed": memory.all_ok(ok),
            "all_ok_true": memory.all_ok(True),
        }
        group = dist.new_group(backend="gloo")  # an explicit (CPU) TP group
        result["min_group"] = memory.all_reduce_min(value, group)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_min_and_agreement_across_two_gloo_ranks(tmp_path):
    mp.spawn(_gloo_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["min"] == 987_654 and r["min_group"] == 987_654
        assert r["max"] == 9
        assert r["all_ok_mixed"] is False
        assert r["all_ok_true"] is True
