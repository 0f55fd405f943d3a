"""Local memory in the envelope, on the CPU: the stack-limit reading through a fake libcuda (the CUDA driver
API is the one thing mocked), the driver's reservation arithmetic, the profile's record and log, /metrics."""
from __future__ import annotations

import logging
import types

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from autoprofile import memory, profiler
from autoprofile.serving.metrics import ServerMetrics

MiB = 1 << 20


class FakeLibcuda:
    """cuDeviceGet / primary context / cuCtxGetLimit over ctypes by-reference arguments, recording the calls;
    `fail` names an entry point that returns an error (CUDA_ERROR_INVALID_VALUE)."""

    def __init__(self, limits: dict[int, int], fail: str | None = None):
        self.limits, self.fail, self.calls, self.current = limits, fail, [], []
        for name in ("cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2", "cuCtxGetLimit",
                     "cuCtxPopCurrent_v2", "cuDevicePrimaryCtxRelease_v2"):
            setattr(self, name, self._entry(name))

    def _entry(self, name):
        def call(*args):
            self.calls.append(name)
            if name == self.fail:
                return 1
            if name == "cuDeviceGet":
                args[0]._obj.value = args[1]
            elif name == "cuDevicePrimaryCtxRetain":
                args[0]._obj.value = 0x1000 + args[1].value
            elif name == "cuCtxPushCurrent_v2":
                self.current.append(args[0].value)
            elif name == "cuCtxPopCurrent_v2":
                self.current.pop()
            elif name == "cuCtxGetLimit":
                assert self.current, "cuCtxGetLimit without a current context"
                args[0]._obj.value = self.limits[args[1]]
            return 0
        return call


@pytest.fixture
def cuda(mocker):
    def install(lib):
        mocker.patch.object(torch.cuda, "is_available", return_value=True)
        mocker.patch.object(torch.cuda, "is_initialized", return_value=True)
        mocker.patch.object(torch.cuda, "current_device", return_value=0)
        mocker.patch.object(memory, "_libcuda", return_value=lib)
        mocker.patch.object(torch.version, "hip", None)
        return lib
    return install


def test_stack_limit_reads_the_primary_context_and_leaves_it_balanced(cuda):
    lib = cuda(FakeLibcuda({memory.CU_LIMIT_STACK_SIZE: 10912, 1: 7}))
    assert memory.stack_limit_bytes(1) == 10912
    assert lib.calls == ["cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2", "cuCtxGetLimit",
                         "cuCtxPopCurrent_v2", "cuDevicePrimaryCtxRelease_v2"]
    assert lib.current == []


@pytest.mark.parametrize("fail", ["cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2",
                                  "cuCtxGetLimit"])
def test_stack_limit_is_none_on_a_driver_error_and_releases_what_it_took(cuda, fail):
    lib = cuda(FakeLibcuda({memory.CU_LIMIT_STACK_SIZE: 1024}, fail=fail))
    assert memory.stack_limit_bytes() is None
    took = lib.calls.count("cuDevicePrimaryCtxRetain") - (fail == "cuDevicePrimaryCtxRetain")
    assert lib.calls.count("cuDevicePrimaryCtxRelease_v2") == took and lib.current == []


def test_stack_limit_is_none_without_cuda(cuda, mocker):
    if not torch.cuda.is_available():
        assert memory.stack_limit_bytes() is None  # this machine, unmocked
    lib = cuda(FakeLibcuda({memory.CU_LIMIT_STACK_SIZE: 1024}))
    mocker.patch.object(torch.version, "hip", "6.2")
    assert memory.stack_limit_bytes() is None and lib.calls == []
    mocker.patch.object(torch.version, "hip", None)
    mocker.patch.object(torch.cuda, "is_initialized", return_value=False)  # never initializes CUDA itself
    assert memory.stack_limit_bytes() is None and lib.calls == []
    mocker.patch.object(torch.cuda, "is_initialized", return_value=True)
    mocker.patch.object(memory, "_libcuda", return_value=None)
    assert memory.stack_limit_bytes() is None


def test_local_memory_is_the_limit_for_every_resident_thread():
    """The issue's H100 figure: 132 SMs x 2048 threads, 264 MiB per KiB of stack."""
    assert memory.local_memory_bytes(1024, 132, 2048) == 264 * MiB
    assert memory.local_memory_bytes(10912, 132, 2048) == 10912 * 132 * 2048


def test_the_profile_records_and_logs_the_stack_limit(cuda, mocker, caplog):
    cuda(FakeLibcuda({memory.CU_LIMIT_STACK_SIZE: 1024}))
    mocker.patch.object(torch.cuda, "get_device_properties",
                        return_value=types.SimpleNamespace(multi_processor_count=132,
                                                           max_threads_per_multi_processor=2048))
    with caplog.at_level(logging.INFO, logger="autoprofile.profiler"):
        assert profiler.local_memory_after_stress(0) == (1024, 264 * MiB)
    assert "stack limit 1024 B" in caplog.text and "0.26 GiB" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    cuda(FakeLibcuda({memory.CU_LIMIT_STACK_SIZE: 18704}))
    with caplog.at_level(logging.INFO, logger="autoprofile.profiler"):
        assert profiler.local_memory_after_stress(0) == (18704, 18704 * 132 * 2048)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "18704 B" in warned[0].getMessage() and "spills" in warned[0].getMessage()


def test_the_report_carries_the_stack_limit():
    from autoprofile.report import format_report, to_dict

    cfg = types.SimpleNamespace(model="m", tp=1, attention_backend="aiter_triton", kv_dtype_name="bfloat16")
    result = profiler.ProfileResult(cfg, 1024, 2, False, 1, 1024, 16, None, {}, [], [], [], 1024, 264 * MiB)
    assert to_dict(result)["stack_limit_bytes"] == 1024 and to_dict(result)["local_memory_bytes"] == 264 * MiB
    assert "stack limit 1024 B/thread" in format_report(result)
    none = profiler.ProfileResult(cfg, 1024, 2, False, 1, 1024, 16, None, {}, [], [], [])
    assert to_dict(none)["stack_limit_bytes"] is None and "stack limit" not in format_report(none)


def gauges(metrics: ServerMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_export_the_stack_limit_and_warn_once_when_serving_grows_it(mocker, caplog):
    m = ServerMetrics(lambda: None)
    now = mocker.patch.object(memory, "stack_limit_bytes", return_value=1024)
    m.add_profile(types.SimpleNamespace(tokens=64, kv_bytes=128, phases=[], stack_limit=1024))
    got = gauges(m)
    assert got["autoprofile_cuda_stack_limit_bytes"] == 1024
    assert got["autoprofile_cuda_stack_limit_profiled_bytes"] == 1024
    assert "grew" not in caplog.text
    now.return_value = 6592
    with caplog.at_level(logging.WARNING, logger="autoprofile.serving.metrics"):
        assert gauges(m)["autoprofile_cuda_stack_limit_bytes"] == 6592
        gauges(m)
    assert caplog.text.count("grew while serving") == 1
    now.return_value = None  # no reading: no current gauge, the profiled one stays
    got = gauges(m)
    assert "autoprofile_cuda_stack_limit_bytes" not in got
    assert got["autoprofile_cuda_stack_limit_profiled_bytes"] == 1024


def test_metrics_without_a_stack_reading_have_no_stack_gauges():
    m = ServerMetrics(lambda: None)
    m.add_profile(types.SimpleNamespace(tokens=64, kv_bytes=128, phases=[]))  # a CPU boot's result
    assert not [k for k in gauges(m) if "stack" in k]

