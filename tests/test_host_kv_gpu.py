"""GPU: the prefix cache's host tier (--host_kv). Its copies move KV pages exactly, in stream order (a page
written just before its save is saved as written), without a GPU allocation and without a host sync; their
rate against a plain pinned copy of the same bytes; and on a llama-shaped model under --deterministic, a
returning conversation served from host-tier pages gets the tokens of the tier off and of a recompute."""
from __future__ import annotations

import json
import time

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.host_kv import HostKVPool
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.weights import init_random
from tests.conftest import require_backend
from tests.test_deterministic_gpu import SMALL_LLAMA

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PAGE = (2, 32, 8, 16, 128)  # llama-3.1-8b's page on one rank: K and V, 32 layers, 8 heads, 16 tokens, 128


def test_copies_move_pages_exactly_in_stream_order_without_gpu_memory_or_a_sync():
    dev = torch.device("cuda")
    gpu = torch.randn((PAGE[0], PAGE[1], 64, *PAGE[2:]), dtype=torch.bfloat16, device=dev)
    pool = HostKVPool(32, PAGE, torch.bfloat16, pin=True)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    torch.cuda._sleep(50_000_000)  # a long kernel, then a write the save must see (stream order)
    gpu[:, :, 6].fill_(3.0)
    want = gpu[:, :, [5, 6, 9]].clone()
    allocated_want = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        pool.transfer(gpu, [(5, 0), (6, 1), (9, 2)], [])
        gpu[:, :, 5:7].zero_()  # the next step writes into the saved pages: after the save
        gpu[:, :, 9].zero_()
        pool.transfer(gpu, [], [(0, 20), (1, 21), (2, 40)])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.equal(gpu[:, :, [20, 21, 40]], want)
    assert torch.equal(gpu[:, :, 21], torch.full_like(gpu[:, :, 21], 3.0))
    assert not gpu[:, :, [5, 6, 9]].any()
    # the index writes above allocate their own temporaries; the copies add nothing that stays
    assert torch.cuda.memory_allocated(dev) == allocated_want
    assert allocated_want - allocated == want.nbytes
    pool.transfer(gpu, [], [])
    assert pool.bytes_moved == 6 * pool.page_bytes and pool.copy_seconds > 0


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def test_copy_rate_against_a_plain_pinned_copy():
    """One run of 512 pages saved (the page-transfer kernel: one launch) against one pinned copy of the same
    bytes: within 2x of it. Scattered pages back (lone pages, host -> device): the kernel against the per-run
    copies (one cudaMemcpyAsync per page, part and layer: 64 KiB each), faster. All printed."""
    dev = torch.device("cuda")
    pages = 512  # 1 GiB of llama-3.1-8b pages
    gpu = torch.empty((PAGE[0], PAGE[1], pages, *PAGE[2:]), dtype=torch.bfloat16, device=dev)
    pool = HostKVPool(pages, PAGE, torch.bfloat16, pin=True)
    assert pool.use_kernel
    plain = torch.empty(gpu.numel(), dtype=torch.bfloat16, pin_memory=True)
    pairs = [(p, p) for p in range(pages)]
    scattered = [(2 * p, p) for p in range(pages // 2)]
    for _ in range(2):  # the first round compiles the kernel
        tier = _timed(lambda: pool.transfer(gpu, pairs, []))
        link = _timed(lambda: plain.copy_(gpu.view(-1), non_blocking=True))
        up = _timed(lambda: gpu.view(-1).copy_(plain, non_blocking=True))
        kernel = _timed(lambda: pool.transfer(gpu, [], scattered))
    pool.use_kernel = False
    runs = _timed(lambda: pool.transfer(gpu, [], scattered))
    runs_save = _timed(lambda: pool.transfer(gpu, pairs, []))
    gib = gpu.nbytes / 2**30
    print(f"host tier save (kernel): {gib / tier:.1f} GiB/s, per-run copies {gib / runs_save:.1f} GiB/s; one "
          f"pinned copy: {gib / link:.1f} GiB/s device -> host, {gib / up:.1f} GiB/s host -> device; "
          f"scattered pages back: kernel {gib / 2 / kernel:.1f} GiB/s, per-run copies "
          f"{gib / 2 / runs:.1f} GiB/s")
    assert tier < 2 * link
    assert kernel < runs


def test_kernel_and_per_run_copies_move_the_same_bytes():
    """Random scattered saves and loads (runs and lone pages, both directions in one transfer) through the
    kernel and through the per-run copies: the same host and GPU contents."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    gpu = torch.randn((PAGE[0], 4, 96, *PAGE[2:]), dtype=torch.bfloat16, device=dev)
    pools = [HostKVPool(40, (PAGE[0], 4, *PAGE[2:]), torch.bfloat16, pin=True) for _ in range(2)]
    pools[1].use_kernel = False
    gpus = [gpu.clone(), gpu.clone()]
    for pool in pools:
        pool.buffer.zero_()
    src = torch.randperm(95, generator=g)[:30].add(1).tolist()
    dst = torch.randperm(35, generator=g)[:30].tolist()  # host pages 35-39 take the run: no page written twice
    saves = list(zip(src, dst)) + [(90 + i, 35 + i) for i in range(5)]
    loads = list(zip(dst[:10], torch.randperm(95, generator=g)[:10].add(1).tolist()))
    for pool, cache in zip(pools, gpus):
        pool.transfer(cache, saves, [])
        event = pool.transfer(cache, [], loads)
        event.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(pools[0].buffer, pools[1].buffer)
    assert torch.equal(gpus[0], gpus[1])
    assert torch.equal(pools[0].buffer[:, :, 35:40], gpu[:, :, 90:95].cpu())


def test_loads_run_beside_the_compute_stream():
    """The current stream waits for a transfer's saves, never for its loads: a long kernel queued on the save
    stream (the loads wait for it) leaves the compute stream free: the loads' event is not done while the
    compute stream's work is."""
    dev = torch.device("cuda")
    gpu = torch.randn((PAGE[0], 2, 16, *PAGE[2:]), dtype=torch.bfloat16, device=dev)
    pool = HostKVPool(8, (PAGE[0], 2, *PAGE[2:]), torch.bfloat16, pin=True)
    pool.transfer(gpu, [(1, 0)], [])  # the copy stream exists, the kernel is compiled
    torch.cuda.synchronize()
    with torch.cuda.stream(pool.stream):
        torch.cuda._sleep(200_000_000)  # the copy stream is busy
    event = pool.transfer(gpu, [], [(0, 5)])
    compute_done = torch.cuda.Event()
    compute_done.record()
    compute_done.synchronize()  # the compute stream's work ran without the loads
    assert not event.query()
    event.synchronize()
    assert torch.equal(gpu[:, :, 5], gpu[:, :, 1])


def _conversations(engine, max_tokens=16):
    """A, then B and C (their pages evict A's), then A again with its answer and more."""
    a, b, c = ([(k * j) % 31000 + 3 for j in range(900)] for k in (37, 41, 43))
    out = [engine.generate([p], max_tokens=max_tokens)[0] for p in (a, b, c)]
    out.append(engine.generate([a + out[0] + [5, 6, 7]], max_tokens=max_tokens)[0])
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small-llama")
    (folder / "config.json").write_text(json.dumps(SMALL_LLAMA))
    return str(folder)


def _runner(model_dir: str, kv_tokens: int, **kw) -> ModelRunner:
    cfg = validate(ServerConfig(model=model_dir, load_format="dummy", attention_backend="aiter_triton",
                                max_req_total_len=2048, batch_max_tokens=512, graph_max_batch_size=8,
                                running_max_req_size=8, report_dir=None, deterministic=True, **kw))
    r = ModelRunner(cfg)
    init_random(r.model, seed=1, std=0.02)
    r.build(kv_tokens)
    return r


@pytest.mark.parametrize("overlap", [False, True])
def test_host_tier_hits_give_the_tokens_of_a_recompute_under_deterministic(model_dir, overlap):
    require_backend("aiter_triton")
    got = {}
    for name, kv_tokens, kw, caching in (("fresh", 16384, {}, False), ("off", 2048, {}, True),
                                         ("tier", 2048, {"host_kv": "1"}, True)):
        r = _runner(model_dir, kv_tokens, **kw)
        try:
            engine = LLMEngine(r, prefix_caching=caching, overlap=overlap)
            got[name] = _conversations(engine)
            stats = engine.stats
        finally:
            r.teardown()
    assert got["tier"] == got["off"] == got["fresh"]
    # the returning conversation took pages back from the host tier (A's pages that B and C evicted)
    assert stats.host.loaded > 0 and stats.host.hit_tokens == stats.host.loaded * 16
    assert stats.ooms == 0 and stats.pages_used == 0
    print(f"host tier: {stats.host}")
