"""GPU: teardown() gives back everything build() and the stresses took (graphs, pool, attention state,
request table, KV), also after a real OOM in the middle of a build; build -> teardown -> build works."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.runner import ModelRunner
from tests.conftest import release_gpu, require_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MiB = 1 << 20
KV_TOKENS = 262144  # 256 MiB of KV for the tiny model in bf16: a leak of it cannot hide


def tiny_runner(backend: str, graphs: bool) -> ModelRunner:
    require_backend(backend)
    return ModelRunner(validate(ServerConfig(model="tiny", attention_backend=backend, max_req_total_len=2048,
                                             batch_max_tokens=4096, graph_max_batch_size=32,
                                             disable_cudagraph=not graphs, report_dir=None)))


def reserved_after_release() -> int:
    release_gpu()
    return torch.cuda.memory_reserved()


@pytest.mark.parametrize("backend", ["aiter_triton", "torch"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_teardown_returns_reserved_memory_to_its_pre_build_level(backend, graphs):
    runner = tiny_runner(backend, graphs)
    before = reserved_after_release()
    outputs = []
    for cycle in range(2):  # build -> teardown -> build works, and gives the same answers
        runner.build(KV_TOKENS)
        runner.stress_prefill()
        runner.stress_decode()
        outputs.append(LLMEngine(runner).generate([[1, 2, 3], [4] * 50], max_tokens=8))
        kv = weakref.ref(runner.kv_buffer)
        built = torch.cuda.memory_reserved()
        runner.teardown()
        after = reserved_after_release()
        print(f"\ncycle {cycle}: reserved before build {before / MiB:.1f} MiB, built {built / MiB:.1f} MiB, "
              f"after teardown {after / MiB:.1f} MiB")
        assert kv() is None
        assert built - before >= KV_TOKENS * runner.sizing.cell_bytes
        assert abs(after - before) <= 0.01 * before, (before, after)
    assert outputs[0] == outputs[1]


class Ballast:
    """Takes every free byte so the runtime's next allocation is a real CUDA OOM."""

    def __init__(self):
        self.chunks: list[torch.Tensor] = []

    def fill(self, point: str) -> None:
        if point != "graph_capture":
            return
        release_gpu()
        free, _ = torch.cuda.mem_get_info()
        self.chunks.append(torch.empty(max(free - 64 * MiB, 0), dtype=torch.uint8, device="cuda"))
        while True:
            try:
                self.chunks.append(torch.empty(2 * MiB, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break


def test_real_oom_during_graph_capture_tears_everything_down():
    runner = tiny_runner("aiter_triton", graphs=True)
    before = reserved_after_release()
    ballast = Ballast()
    with pytest.raises(torch.OutOfMemoryError):
        runner.build(KV_TOKENS, ballast.fill)
    assert ballast.chunks, "the checkpoint never ran"
    ballast.chunks.clear()
    gc.collect()
    assert runner.kv is None and runner.graphs is None and runner.built_tokens is None
    # the failed capture was ended cleanly: no capture underway, the default stream is current again
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    after = reserved_after_release()
    print(f"\nafter a real OOM in capture: reserved {before / MiB:.1f} -> {after / MiB:.1f} MiB")
    assert abs(after - before) <= 0.01 * before, (before, after)
    runner.build(KV_TOKENS)  # the capture stream and the allocator are usable again
    try:
        runner.stress_decode()
        assert len(LLMEngine(runner).generate([[5, 6, 7]], max_tokens=4)[0]) == 4
    finally:
        runner.teardown()
