"""GPU: teardown() gives back everything build() and the stresses took (graphs, pool, attention state,
request table, KV), also after a real OOM in the middle of a build; build -> teardown -> build works."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.cuda_graph import release_cublas_workspaces
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
    """Reserved bytes with the caching allocator's free blocks and cuBLAS's workspaces given back, as teardown
    gives them back (a workspace made by a matmul before the build, e.g. the weights' init, would otherwise
    count before and not after: 32 MiB on an H100)."""
    release_gpu()
    release_cublas_workspaces()
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
        # aiter_triton with graphs: the piecewise graphs too, and the prefill stress runs their corner
        assert (runner.pieces is not None) == (backend == "aiter_triton" and graphs)
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


def new_blocks(old: dict[int, dict]) -> list[tuple[int, str]]:
    """(size, allocating Python frames) of every live block in segments reserved since `old` (recorded)."""
    out = []
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if seg["address"] not in old:
            for b in seg["blocks"]:
                if b["state"] == "active_allocated":
                    frames = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
                              for f in b.get("frames", ()) if f["filename"].endswith(".py")]
                    out.append((b["size"], " <- ".join(frames[:6])))
    return out


def segments() -> dict[int, dict]:
    return {s["address"]: s for s in torch.cuda.memory._snapshot()["segments"]}


def test_real_oom_during_graph_capture_tears_everything_down():
    """After the OOM, only torch's own graph-safe generator state may stay: CUDAGeneratorState allocates two
    8-byte tensors in capture_begin when a first graph registers, and keeps them (H100, torch 2.11: still
    there after the next build's teardown). On the full card they opened a segment of their own: 2 MiB for
    two 512-byte blocks, once per process. Everything else comes back, after the OOM and after the next
    build's teardown."""
    runner = tiny_runner("aiter_triton", graphs=True)
    torch.cuda.memory._record_memory_history(max_entries=100000)  # where a block that stays came from
    before = reserved_after_release()
    old_segments = segments()
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
    left = new_blocks(old_segments)
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"\nafter a real OOM in capture: reserved {before / MiB:.1f} -> {after / MiB:.1f} MiB; new blocks "
          f"{left}")
    assert len(left) <= 2 and all(size <= 512 and "capture_begin" in frames for size, frames in left), left
    assert after - before <= (2 * MiB if left else 0) + 0.01 * before, (before, after, left)
    runner.build(KV_TOKENS)  # the capture stream and the allocator are usable again
    try:
        runner.stress_decode()
        assert len(LLMEngine(runner).generate([[5, 6, 7]], max_tokens=4)[0]) == 4
    finally:
        runner.teardown()
    final = reserved_after_release()
    print(f"after the next build and its teardown: reserved {final / MiB:.1f} MiB")
    assert abs(final - after) <= 0.01 * before, (before, after, final)  # the rebuild left nothing either
