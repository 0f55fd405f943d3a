"""GPU: every CUDA backend against the float64 reference on fresh random bf16 inputs.

Every torch.empty is NaN-filled while a kernel runs, so an element it forgets to write shows up; decode
is also captured in a CUDA graph and replayed on new inputs, and must equal the eager call bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from autoprofile.kernels import launch_rules
from autoprofile.kernels.aiter_loader import aiter_installed
from autoprofile.engine.attention import BACKENDS, AttentionMetadata
from autoprofile.engine.attention.aiter_triton import AiterTritonBackend, use_v1
from autoprofile.layers.attention import FP8_MAX, KVLayer, dequantize, quantize
from scripts.cuda_timing import capture
from unit_tests.test_attention_cpu import ref_attention, ref_rms_norm, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HQ, HKV, D, PAGE = 32, 8, 128, 16
BF16_TOL = 2e-2
NAMES = ["torch", "aiter_triton"]


def make(name: str, hq: int = HQ, hkv: int = HKV):
    if name.startswith("aiter") and not aiter_installed():
        pytest.skip("amd-aiter not installed")
    return BACKENDS[name](hq, hkv, D, PAGE, torch.bfloat16, torch.device("cuda"))


@pytest.fixture
def nan_empty(monkeypatch):
    """Every torch.empty/empty_like (backends' outputs, AITER's scratch) starts as NaN, so an element a
    kernel forgets to write shows up as NaN."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(real_empty_like(*a, **k)))
    assert torch.empty(3, device="cuda").isnan().all()


def packed_qkv(t: int, gen: torch.Generator):
    """q, k, v as strided views of one [T, (Hq+2Hkv)*D] tensor, the way the model hands them over."""
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=gen, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=1)
    return q.view(t, HQ, D), k.view(t, HKV, D), v.view(t, HKV, D)


def paged(seq_lens: list[int], max_seq_len: int, gen: torch.Generator):
    """A shuffled page pool; unused table columns point at page 0 (what padded rows do)."""
    b, cols = len(seq_lens), -(-max_seq_len // PAGE)
    used = [-(-n // PAGE) for n in seq_lens]
    perm = torch.randperm(sum(used) + 1, generator=gen, device="cuda").to(torch.int32)
    tables = torch.zeros(b, cols, dtype=torch.int32, device="cuda")
    at = 0
    for i, u in enumerate(used):
        tables[i, :u] = perm[at: at + u]
        at += u
    kc = torch.randn(sum(used) + 1, HKV, PAGE, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(sum(used) + 1, HKV, PAGE, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(b, dtype=torch.int64, device="cuda"),
                             block_tables=tables, max_seq_len=max_seq_len,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"))
    return kc, vc, meta


def ref_decode_one(q, kc, vc, tables, n):
    pages = tables[: -(-n // PAGE)].long()
    k = kc[pages].permute(0, 2, 1, 3).reshape(-1, HKV, D)[:n]
    v = vc[pages].permute(0, 2, 1, 3).reshape(-1, HKV, D)[:n]
    return ref_attention(q[None], k, v, False)[0]


def ref_causal(q, k, v, rows: int = 1024) -> torch.Tensor:
    """float64 causal attention of one request, by blocks of query rows (a full 8192^2 map is 17 GB)."""
    return torch.cat([ref_attention(q[r:r + rows], k[: r + rows], v[: r + rows], True)
                      for r in range(0, q.shape[0], rows)])


def mixed_lens(b: int, longest: int, gen: torch.Generator) -> list[int]:
    lens = torch.randint(1, longest + 1, (b,), generator=gen, device="cuda").tolist()
    lens[:3] = [1, PAGE, longest][: b]  # a one-token request, an exactly full page, the longest
    return lens


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("lens", [[1, 17, 300, 1024, 2500, 77], [8192]])
def test_prefill_varlen(name, lens, nan_empty):
    gen = torch.Generator(device="cuda").manual_seed(sum(lens))
    be = make(name)
    q, k, v = packed_qkv(sum(lens), gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(is_prefill=True, cu_seqlens=cu, max_seqlen=max(lens),
                             slot_mapping=torch.zeros(sum(lens), dtype=torch.int64, device="cuda"))
    out = be.prefill(q, k, v, meta)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert not out.isnan().any()
    b = cu.tolist()
    for i, (s, e) in enumerate(zip(b[:-1], b[1:])):
        err = rel_err(out[s:e], ref_causal(q[s:e], k[s:e], v[s:e]))
        assert err < BF16_TOL, f"{name} request {i} (len {e - s}): rel err {err:.2e}"


@pytest.mark.parametrize("config", ["default", "long", "short"])
@pytest.mark.parametrize("chunks", [[(0, 1), (0, 17), (0, 1024), (0, 2500), (300, 77), (4000, 1)],
                                    [(0, 8192)], [(30000, 2048)]])
def test_triton_prefill_configs(config, chunks, nan_empty):
    """Our varlen prefill at each of its configs on this GPU (the untuned default: plain loads; this GPU's
    long and short entries: TMA on Hopper), (prefix, new) rows with K/V contiguous after the gather, into the
    rows of a larger output (a mixed step's), against the float64 reference."""
    from autoprofile.kernels import triton_prefill

    cap = triton_prefill.capability()
    cfg = {"default": triton_prefill.CONFIG, "long": triton_prefill.CONFIGS.get(cap),
           "short": triton_prefill.CONFIGS_SHORT.get(cap)}[config]
    if cfg is None:
        pytest.skip(f"no {config} config for {cap}")
    gen = torch.Generator(device="cuda").manual_seed(len(chunks))
    kv_lens, new = [p + n for p, n in chunks], [n for _, n in chunks]
    q, _, _ = packed_qkv(sum(new), gen)
    k, v = (torch.randn(sum(kv_lens), HKV, D, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for n in (new, kv_lens))
    out = torch.empty(sum(new) + 5, HQ, D, device="cuda", dtype=torch.bfloat16)
    triton_prefill.prefill(out[:sum(new)], q, k, v, cu_q, cu_k, max(new), max(kv_lens), D ** -0.5, dict(cfg))
    torch.cuda.synchronize()
    assert not out[:sum(new)].isnan().any() and out[sum(new):].isnan().all()  # its rows, and only those
    qb, kb = cu_q.tolist(), cu_k.tolist()
    for i, (p, n) in enumerate(chunks):
        last = min(n, 64)
        want = ref_attention(q[qb[i + 1] - last:qb[i + 1]], k[kb[i]:kb[i + 1]], v[kb[i]:kb[i + 1]], True)
        err = rel_err(out[qb[i + 1] - last:qb[i + 1]], want)
        assert err < BF16_TOL, f"{config} row {i} (prefix {p}, new {n}): rel err {err:.2e}"
        if n > last:
            want = ref_attention(q[qb[i]:qb[i] + 32], k[kb[i]:kb[i] + p + 32], v[kb[i]:kb[i] + p + 32], True)
            assert rel_err(out[qb[i]:qb[i] + 32], want) < BF16_TOL


DECODE_CASES = [  # (batch, longest seq_len, static max_seq_len)
    (8, 3000, 4096),       # v2: 256 rows, 4 partitions
    (64, 5000, 8192),      # v1: 2048 rows
    (64, 20000, 32768),    # v2: past 8192
    (4, 131072, 131072),   # v2 with 128 partitions: llama-3.1's full context
]


# aiter_triton: AITER's partitions, or a graph's finer ones
@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("b,longest,max_seq_len", DECODE_CASES)
def test_paged_decode(name, b, longest, max_seq_len, captured, nan_empty):
    gen = torch.Generator(device="cuda").manual_seed(b * longest)
    be = make(name)
    lens = mixed_lens(b, longest, gen)
    kc, vc, meta = paged(lens, max_seq_len, gen)
    meta.captured = captured
    q = packed_qkv(b, gen)[0]  # strided, like the model's
    out = be.decode(q, KVLayer(kc, vc), meta)
    torch.cuda.synchronize()
    assert out.shape == q.shape and not out.isnan().any()
    for i, n in enumerate(lens):
        err = rel_err(out[i], ref_decode_one(q[i], kc, vc, meta.block_tables[i], n))
        path = "v1" if use_v1(b, HQ, max_seq_len) else "v2"
        assert err < BF16_TOL, f"{name} request {i} (len {n}, aiter path {path}): rel err {err:.2e}"


def test_decode_cases_cover_both_aiter_paths():
    paths = {use_v1(b, HQ, m) for b, _, m in DECODE_CASES}
    assert paths == {True, False}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("b,max_seq_len", [(64, 2048), (32, 16384)])  # v1, v2 (scratch in the graph pool)
def test_decode_graph_replay_equals_eager(name, b, max_seq_len):
    gen = torch.Generator(device="cuda").manual_seed(b + max_seq_len)
    be = make(name)
    kc, vc, meta = paged([max_seq_len] * b, max_seq_len, gen)  # every page valid for any later length
    q = torch.randn(b, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    graph, out = capture(lambda: be.decode(q, KVLayer(kc, vc), meta))
    for trial in range(2):  # new inputs into the static buffers, then replay
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda", dtype=torch.bfloat16))
        meta.seq_lens.copy_(torch.randint(1, max_seq_len + 1, (b,), generator=gen, device="cuda"))
        graph.replay()
        eager = be.decode(q, KVLayer(kc, vc), meta)
        torch.cuda.synchronize()
        assert not out.isnan().any()
        assert torch.equal(out, eager), f"{name} trial {trial}: replay differs from eager"
        i = int(meta.seq_lens.argmax())
        n = int(meta.seq_lens[i])
        assert rel_err(out[i], ref_decode_one(q[i], kc, vc, meta.block_tables[i], n)) < BF16_TOL


@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("b,max_seq_len", [(64, 2048), (8, 4096), (32, 16384), (4, 131072)])
def test_decode_scratch_is_per_call_workspace_bytes(b, max_seq_len, captured):
    """What one aiter_triton decode through AITER's kernels allocates besides its output is
    per_call_workspace_bytes (v2: the budget's triton_decode_workspace_bytes, in AITER's partitions eager and
    in triton_decode_partition's inside a graph; v1: nothing), up to the allocator's 512-byte rounding. (bf16
    rows up to split_decode_rows take our split decode: tests/test_split_decode_gpu.py.)"""
    be = make("aiter_triton")
    be.split_decode_rows = 0
    kc, vc, meta = paged([17] * b, max_seq_len, torch.Generator(device="cuda").manual_seed(b))
    meta.captured = captured
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    be.decode(q, KVLayer(kc, vc), meta)  # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    be.decode(q, KVLayer(kc, vc), meta)
    torch.cuda.synchronize()
    scratch = torch.cuda.max_memory_allocated() - before - -(-q.numel() * 2 // 512) * 512
    partition = be.decode_partition(b, max_seq_len) if captured else launch_rules.TRITON_PARTITION
    expected = AiterTritonBackend.per_call_workspace_bytes(b, HQ, D, max_seq_len, 2, partition)
    assert (expected == 0) is use_v1(b, HQ, max_seq_len)
    assert expected <= scratch <= expected + 3 * 512, (scratch, expected)


@pytest.mark.parametrize("name", NAMES)
def test_store_kv_then_decode(name):
    """The runner's path: K/V written by store_kv at slot_mapping are what decode reads."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    be = make(name)
    n = 1000
    kc = torch.zeros(80, HKV, PAGE, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    pages = torch.randperm(80, generator=gen, device="cuda")[: -(-n // PAGE)].to(torch.int32)
    slots = (pages.long()[:, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)[:n]
    k, v = (torch.randn(n, HKV, D, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    be.store_kv(k, v, KVLayer(kc, vc), slots)
    q = torch.randn(1, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots[-1:], block_tables=pages[None],
                             seq_lens=torch.tensor([n], dtype=torch.int32, device="cuda"), max_seq_len=n)
    assert rel_err(be.decode(q, KVLayer(kc, vc), meta), ref_attention(q, k, v, False)) < BF16_TOL


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(37, 4096), (300, HQ, D), (1, 4096)])
def test_rms_norm(name, shape, nan_empty):
    gen = torch.Generator(device="cuda").manual_seed(shape[0])
    be = make(name)
    x = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16) * 4
    w = torch.randn(shape[-1], generator=gen, device="cuda", dtype=torch.bfloat16)
    out = be.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == x.dtype and not out.isnan().any()
    assert rel_err(out, ref_rms_norm(x, w, 1e-6)) < BF16_TOL


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("chunks", [[(0, 300), (1000, 24), (4000, 1)], [(131071 - 8192, 8192)]])
def test_prefill_chunks_over_cached_prefixes(name, chunks, nan_empty):
    """(prefix, new) rows: the new tokens' K/V are in the paged cache beside their prefix; the backend
    attends through gather_kv + the varlen kernel with cu_seqlens_k (causal aligned bottom-right),
    against the float64 reference over the whole sequence. The last case is the stress corner at
    llama-3.1's context: an 8192-token chunk over a 122,879-token prefix."""
    gen = torch.Generator(device="cuda").manual_seed(len(chunks))
    be = make(name)
    kv_lens = [p + n for p, n in chunks]
    kc, vc, meta = paged(kv_lens, max(kv_lens), gen)
    tables, starts = meta.block_tables.long(), [0, *torch.tensor(kv_lens).cumsum(0).tolist()]
    pos = [torch.arange(n, device="cuda") for n in kv_lens]
    slots = torch.cat([tables[i, p // PAGE] * PAGE + p % PAGE for i, p in enumerate(pos)])
    q = torch.randn(sum(n for _, n in chunks), HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.tensor([0, *torch.tensor([n for _, n in chunks]).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    pmeta = AttentionMetadata(is_prefill=True, cu_seqlens=cu_q, max_seqlen=max(n for _, n in chunks),
                              slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64, device="cuda"),
                              kv_slots=slots, cu_seqlens_k=torch.tensor(starts, dtype=torch.int32,
                                                                        device="cuda"),
                              max_seqlen_k=max(kv_lens))
    k, v = be.gather_kv(KVLayer(kc, vc), slots)
    out = be.prefill(q, k, v, pmeta)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    qb = cu_q.tolist()
    for i, (p, n) in enumerate(chunks):
        ks, ke = starts[i], starts[i + 1]
        last = min(n, 64)  # the float64 reference of the last rows (a full 8192 x 131071 map is 275 GB)
        want = ref_attention(q[qb[i + 1] - last:qb[i + 1]], k[ks:ke], v[ks:ke], True)
        err = rel_err(out[qb[i + 1] - last:qb[i + 1]], want)
        assert err < BF16_TOL, f"{name} row {i} (prefix {p}, new {n}): rel err {err:.2e}"
        if n > last:  # and the first rows, which see the shortest keys
            want = ref_attention(q[qb[i]:qb[i] + 32], k[ks:ks + p + 32], v[ks:ks + p + 32], True)
            assert rel_err(out[qb[i]:qb[i] + 32], want) < BF16_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("n", [37, 8192, 131072])
def test_kv_gather_equals_torch_indexing(n, dtype):
    """aiter_triton's one-launch K/V gather (triton_kv_gather) against the base class's advanced indexing,
    bit for bit, on pages spread over the pool (131,072: the stress's longest corner at llama-3.1's
    context); an FP8 cache's K/V come back dequantised to bf16 as before."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    be, ref = make("aiter_triton"), make("torch")
    pages = 2 * (n // PAGE + 1)
    kc = torch.randn(pages, HKV, PAGE, D, generator=gen, device="cuda").to(dtype)
    vc = torch.randn(pages, HKV, PAGE, D, generator=gen, device="cuda").to(dtype)
    slots = torch.randperm(pages * PAGE, generator=gen, device="cuda")[:n]
    scales = None if dtype == torch.bfloat16 else torch.tensor([0.5, 2.0], device="cuda")
    got, want = be.gather_kv(KVLayer(kc, vc, scales), slots), ref.gather_kv(KVLayer(kc, vc, scales), slots)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.bfloat16 and torch.equal(g, w)


@pytest.mark.parametrize("t", [1, 256, 8192])
def test_fused_rope_store_equals_the_torch_ops(t):
    """aiter_triton's one-kernel RoPE + KV store against the base class's torch ops (bf16: within one
    rounding), on a packed projection and shuffled cache slots; the q/k/v it returns are views."""
    gen = torch.Generator(device="cuda").manual_seed(t)
    be, ref = make("aiter_triton"), make("torch")
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=gen, device="cuda", dtype=torch.bfloat16)
    table = torch.randn(16384, D, generator=gen, device="cuda")
    cos, sin = (x.unsqueeze(1) for x in table[torch.randint(0, 16384, (t,), generator=gen, device="cuda")]
                .chunk(2, dim=-1))
    pages = -(-t // PAGE) + 1
    slots = torch.randperm((pages - 1) * PAGE, generator=gen, device="cuda")[:t] + PAGE
    caches = [torch.zeros(pages, HKV, PAGE, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    got_qkv, want_qkv = qkv.clone(), qkv.clone()
    got = be.rope_store(got_qkv, cos, sin, KVLayer(caches[0], caches[1]), slots)
    want = ref.rope_store(want_qkv, cos, sin, KVLayer(caches[2], caches[3]), slots)
    assert got[0].data_ptr() == got_qkv.data_ptr()
    for a, b in zip([*got, got_qkv, caches[0]], [*want, want_qkv, caches[2]]):
        assert rel_err(a, b) < 1e-2
    assert torch.equal(caches[1], caches[3])  # V is copied


def compiled(kernel) -> int:
    """Kernels Triton compiled for this JIT function in this process (its per-device kernel caches)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_no_compile_for_a_new_step_shape_once_warm():
    """Our prefill (triton_prefill) over any tokens, longest request and request count reuses the kernel of
    its config (the short one and the long one: both warmed first); our RMSNorm compiles once for every row
    count."""
    be = make("aiter_triton")
    from autoprofile.kernels.triton_prefill import _prefill_kernel, _prefill_kernel_tma
    from autoprofile.kernels.triton_norm import _rms_norm_kernel
    gen = torch.Generator(device="cuda").manual_seed(5)

    def compiled_prefill() -> int:
        return compiled(_prefill_kernel) + compiled(_prefill_kernel_tma)

    def prefill(lens):
        q, k, v = packed_qkv(sum(lens), gen)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        meta = AttentionMetadata(is_prefill=True, cu_seqlens=cu, max_seqlen=max(lens),
                                 slot_mapping=torch.zeros(sum(lens), dtype=torch.int64, device="cuda"))
        out = be.prefill(q, k, v, meta)
        b = cu.tolist()
        for s, e in zip(b[:-1], b[1:]):
            assert rel_err(out[s:e], ref_causal(q[s:e], k[s:e], v[s:e])) < BF16_TOL, lens

    prefill([1024, 1024])
    prefill([3000])
    before = compiled_prefill()
    assert before >= 1
    for lens in ([1], [16], [17, 33], [1000], [16] * 16, [7] * 3, [2048, 5], [3000], [1025, 64]):
        prefill(lens)
    assert compiled_prefill() == before, "a prefill shape compiled triton_prefill again"
    w = torch.randn(4096, generator=gen, device="cuda", dtype=torch.bfloat16)
    be.rms_norm(torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16), w, 1e-6)
    before = compiled(_rms_norm_kernel)
    for rows in (1, 5, 77, 300, 1001, 8192):
        x = torch.randn(rows, 4096, generator=gen, device="cuda", dtype=torch.bfloat16) * 4
        assert rel_err(be.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6)) < BF16_TOL
    assert compiled(_rms_norm_kernel) == before, "RMSNorm compiled again for a new row count"


def test_partition_reduce_compiles_once_for_every_v2_shape():
    """triton_reduce: rows, max_seq_len and the partition size follow the step; one compile serves them all
    (max_parts and partition unspecialized), eager and captured partitions alike."""
    from autoprofile.kernels.triton_reduce import _reduce_partitions_kernel
    be = make("aiter_triton")
    gen = torch.Generator(device="cuda").manual_seed(11)
    counts = []
    shapes = [(1, 131072, True), (4, 131072, False), (3, 16384, True), (8, 4096, False), (2, 40000, True),
              (16, 9000, False)]
    for b, max_seq_len, captured in shapes:
        assert not use_v1(b, HQ, max_seq_len)
        kc, vc, meta = paged(mixed_lens(b, max_seq_len, gen), max_seq_len, gen)
        meta.captured = captured
        q = torch.randn(b, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
        out = be.decode(q, KVLayer(kc, vc), meta)
        i = int(meta.seq_lens.argmax())
        want = ref_decode_one(q[i], kc, vc, meta.block_tables[i], int(meta.seq_lens[i]))
        assert rel_err(out[i], want) < BF16_TOL
        counts.append(compiled(_reduce_partitions_kernel))
    assert len(set(counts)) == 1, f"the reduce compiled again for a new shape: {counts}"


@pytest.mark.parametrize("captured", [False, True])
def test_paged_decode_v2_mha(captured, nan_empty):
    """One query head per KV head: AITER's wo_dot partition kernel, then the same reduce (its [rows, heads,
    partitions] scratch layout)."""
    h, b, max_seq_len = 8, 3, 20000
    gen = torch.Generator(device="cuda").manual_seed(h)
    be = make("aiter_triton", hq=h, hkv=h)
    lens = [1, 5000, 20000]
    cols = -(-max_seq_len // PAGE)
    tables = torch.randperm(b * cols, generator=gen, device="cuda").to(torch.int32).view(b, cols)
    kc = torch.randn(b * cols, h, PAGE, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(b, dtype=torch.int64, device="cuda"),
                             block_tables=tables, max_seq_len=max_seq_len,
                             seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"))
    meta.captured = captured
    q = torch.randn(b, h, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    assert not use_v1(b, h, max_seq_len)
    out = be.decode(q, KVLayer(kc, vc), meta)
    assert not out.isnan().any()
    for i, n in enumerate(lens):
        pages = tables[i, : -(-n // PAGE)].long()
        k = kc[pages].permute(0, 2, 1, 3).reshape(-1, h, D)[:n]
        v = vc[pages].permute(0, 2, 1, 3).reshape(-1, h, D)[:n]
        assert rel_err(out[i], ref_attention(q[i][None], k, v, False)[0]) < BF16_TOL, (i, n)


# ---------------------------------------------------------------- FP8 KV cache (--kv_cache_dtype fp8_e4m3)
FP8 = torch.float8_e4m3fn


def fp8_pages(kc: torch.Tensor, vc: torch.Tensor) -> KVLayer:
    """The bf16 pages quantised per tensor (scale = amax / 448, as a checkpoint's scales would be)."""
    scales = torch.stack([kc.abs().max(), vc.abs().max()]).float() / FP8_MAX
    return KVLayer(quantize(kc, scales[0], FP8), quantize(vc, scales[1], FP8), scales)


@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("b,longest,max_seq_len", DECODE_CASES)
def test_paged_decode_over_fp8_pages(name, b, longest, max_seq_len, captured, nan_empty):
    """FP8 pages: the backends' decode (aiter_triton: our split decode, kernels.triton_decode, the scales read
    from their device tensor) against the float64 reference over the dequantised pages."""
    gen = torch.Generator(device="cuda").manual_seed(b * longest + 1)
    be = make(name)
    lens = mixed_lens(b, longest, gen)
    kc, vc, meta = paged(lens, max_seq_len, gen)
    layer = fp8_pages(kc * 3, vc * 0.05)
    meta.captured = captured
    q = packed_qkv(b, gen)[0]
    out = be.decode(q, layer, meta)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and not out.isnan().any()
    kd, vd = dequantize(layer.k, layer.scales[0], torch.float32), dequantize(layer.v, layer.scales[1],
                                                                             torch.float32)
    for i, n in enumerate(lens):
        err = rel_err(out[i], ref_decode_one(q[i], kd, vd, meta.block_tables[i], n))
        assert err < BF16_TOL, f"{name} fp8 request {i} (len {n}): rel err {err:.2e}"


@pytest.mark.parametrize("t", [1, 256, 8192])
def test_fused_rope_store_into_fp8_pages_equals_the_torch_ops(t):
    """The fused kernel's FP8 store (K/V divided by the scales, saturated) against the torch ops: the
    same rounding but where the rotated K differs by a bf16 rounding (an FMA), then at most one FP8 step."""
    gen = torch.Generator(device="cuda").manual_seed(t + 1)
    be, ref = make("aiter_triton"), make("torch")
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=gen, device="cuda", dtype=torch.bfloat16) * 4
    qkv[0, -D:] = 1e4  # past the FP8 range at scale 1/64: saturates, never NaN
    table = torch.randn(16384, D, generator=gen, device="cuda")
    cos, sin = (x.unsqueeze(1) for x in table[torch.randint(0, 16384, (t,), generator=gen, device="cuda")]
                .chunk(2, dim=-1))
    pages = -(-t // PAGE) + 1
    slots = torch.randperm((pages - 1) * PAGE, generator=gen, device="cuda")[:t] + PAGE
    caches = [torch.zeros(pages, HKV, PAGE, D, device="cuda", dtype=FP8) for _ in range(4)]
    scales = torch.tensor([1 / 32, 1 / 64], device="cuda")
    got_qkv, want_qkv = qkv.clone(), qkv.clone()
    be.rope_store(got_qkv, cos, sin, KVLayer(caches[0], caches[1], scales), slots)
    ref.rope_store(want_qkv, cos, sin, KVLayer(caches[2], caches[3], scales), slots)
    assert rel_err(got_qkv, want_qkv) < 1e-2
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        a, b = a.float(), b.float()
        assert not a.isnan().any() and a.abs().max() <= FP8_MAX
        assert ((a - b).abs() <= b.abs() / 8 + 2 ** -9).all()
        assert (a == b).float().mean() > 0.98
    assert caches[1].float().abs().max() == FP8_MAX


@pytest.mark.parametrize("rows", [1, 77, 8192])
def test_fused_silu_mul_equals_the_torch_ops(rows, nan_empty):
    """aiter_triton's one-kernel MLP activation against torch's silu(gate) * up (bf16: computed in fp32 and
    rounded once, so within one rounding of the two-op result)."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    be, ref = make("aiter_triton"), make("torch")
    x = torch.randn(rows, 2 * 14336, generator=gen, device="cuda", dtype=torch.bfloat16) * 3
    got, want = be.silu_mul(x), ref.silu_mul(x)
    assert got.shape == want.shape and got.dtype == torch.bfloat16 and not got.isnan().any()
    assert rel_err(got, want) < 1e-2
    assert torch.equal(be.silu_mul(x[:1]), got[:1])


# ---------------------------------------------------------------- issue 34: the MoE/MLA decode fusions, bf16
def test_qwen3_norm_rope_store_matches_the_torch_ops_in_bf16():
    """Qwen3's q/k norm + RoPE + KV store (one kernel) against the base backend's torch ops, qwen3-30b-a3b's
    heads (32 q, 4 kv, head_dim 128)."""
    from autoprofile.engine.attention.torch_sdpa import TorchBackend

    torch.manual_seed(0)
    hq, hkv, d, t, page = 32, 4, 128, 3, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16) * 3
    q_w, k_w = (torch.rand(d, device="cuda") + 0.5).bfloat16(), (torch.rand(d, device="cuda") + 0.5).bfloat16()
    cos, sin = torch.randn(t, 1, d // 2, device="cuda"), torch.randn(t, 1, d // 2, device="cuda")
    slots = torch.tensor([17, 40, 95], device="cuda")
    caches = [torch.zeros(8, hkv, page, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    ref = TorchBackend(hq, hkv, d, page, torch.bfloat16, torch.device("cuda"))
    want = ref.norm_rope_store(qkv.clone(), q_w, k_w, 1e-6, cos, sin, KVLayer(caches[0], caches[1]), slots)
    got = make("aiter_triton", hq, hkv).norm_rope_store(qkv.clone(), q_w, k_w, 1e-6, cos, sin,
                                                        KVLayer(caches[2], caches[3]), slots)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=3e-2)
    torch.testing.assert_close(caches[2].float(), caches[0].float(), rtol=2e-2, atol=3e-2)
    assert torch.equal(caches[3], caches[1])


@pytest.mark.parametrize("fp8", [False, True])
def test_qwen3_5_gated_norm_rope_store_matches_the_torch_ops_in_bf16(fp8):
    """Qwen3.5's gated attention: q beside its gate, q/k norm, RoPE on the first 64 of 256 channels and the KV
    store (one kernel) against the base backend's torch ops (the model's path before the fusion),
    qwen3.5-27b's heads (24 q, 4 kv, head_dim 256), into bf16 or FP8 pages."""
    from autoprofile.engine.attention.torch_sdpa import TorchBackend

    if not aiter_installed():
        pytest.skip("amd-aiter not installed")
    torch.manual_seed(0)
    hq, hkv, d, rotary, t, page = 24, 4, 256, 64, 3, 16
    qkv = torch.randn(t, (2 * hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16) * 3
    q_w, k_w = [(torch.rand(d, device="cuda") + 0.5).bfloat16() for _ in range(2)]
    cos, sin = torch.randn(t, 1, rotary // 2, device="cuda"), torch.randn(t, 1, rotary // 2, device="cuda")
    slots = torch.tensor([17, 40, 95], device="cuda")
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    caches = [torch.zeros(8, hkv, page, d, device="cuda", dtype=cache_dtype) for _ in range(4)]
    scales = torch.tensor([0.02, 0.01], device="cuda") if fp8 else None
    ref = TorchBackend(hq, hkv, d, page, torch.bfloat16, torch.device("cuda"))
    want = ref.gated_norm_rope_store(qkv.clone(), q_w, k_w, 1e-6, cos, sin,
                                     KVLayer(caches[0], caches[1], scales), slots, rotary)
    be = AiterTritonBackend(hq, hkv, d, page, torch.bfloat16, torch.device("cuda"))
    got_qkv = qkv.clone()
    got = be.gated_norm_rope_store(got_qkv, q_w, k_w, 1e-6, cos, sin, KVLayer(caches[2], caches[3], scales),
                                   slots, rotary)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=3e-2)
    assert got[0].is_contiguous() and torch.equal(got_qkv[:, :2 * hq * d], qkv[:, :2 * hq * d])  # gates kept
    if fp8:  # within an FP8 step of the torch ops' pages
        for a, b in ((caches[2], caches[0]), (caches[3], caches[1])):
            torch.testing.assert_close(a.float(), b.float(), rtol=0.13, atol=2 ** -6)
    else:
        torch.testing.assert_close(caches[2].float(), caches[0].float(), rtol=2e-2, atol=3e-2)
        assert torch.equal(caches[3], caches[1])


def test_mla_rope_store_matches_the_torch_ops_in_bf16():
    """MLA's rope + latent norm + latent store (one kernel) at deepseek-v2-lite's widths (16 heads, nope 128,
    rope 64, rank 512)."""
    from autoprofile.engine.attention.torch_sdpa import TorchBackend

    if not aiter_installed():
        pytest.skip("amd-aiter not installed")
    torch.manual_seed(0)
    heads, nope, rope, rank, t, page = 16, 128, 64, 512, 2, 16
    q = torch.randn(t, heads, nope + rope, device="cuda", dtype=torch.bfloat16) * 2
    kv_a = torch.randn(t, rank + rope, device="cuda", dtype=torch.bfloat16) * 2
    w = (torch.rand(rank, device="cuda") + 0.5).bfloat16()
    cos, sin = torch.randn(t, 1, rope // 2, device="cuda"), torch.randn(t, 1, rope // 2, device="cuda")
    slots = torch.tensor([5, 33], device="cuda")
    caches = [torch.zeros(4, 1, page, rank + rope, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    ref = TorchBackend(heads, heads, nope + rope, page, torch.bfloat16, torch.device("cuda"))
    want = ref.mla_rope_store(q.clone(), kv_a.clone(), w, 1e-6, cos, sin, KVLayer(caches[0], caches[0]), slots,
                              nope)
    be = AiterTritonBackend(heads, heads, nope + rope, 16, torch.bfloat16, torch.device("cuda"))
    got = be.mla_rope_store(q.clone(), kv_a.clone(), w, 1e-6, cos, sin, KVLayer(caches[1], caches[1]), slots,
                            nope)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=3e-2)
    torch.testing.assert_close(caches[1].float(), caches[0].float(), rtol=2e-2, atol=3e-2)


def test_moe_sum_adds_the_top_k_the_shared_experts_and_the_residual_in_bf16():
    from autoprofile.kernels import triton_moe

    torch.manual_seed(0)
    down = torch.randn(3, 8, 2048, device="cuda", dtype=torch.bfloat16)
    shared, residual = (torch.randn(3, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = triton_moe.moe_sum(down, torch.empty_like(shared), (shared, residual))
    want = down.float().sum(1) + shared.float() + residual.float()
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=2e-2)


def test_the_router_gemv_reads_a_bf16_row_and_writes_fp32_logits():
    """DeepSeek's fp32 router at a batch-1 decode: one kernel reading x in bf16 (no fp32 copy), fp32 logits as
    F.linear over x in fp32 gives them; under --deterministic the backend gives none (its own GEMM serves)."""
    from autoprofile.kernels import triton_gemv
    torch.manual_seed(0)
    w = torch.randn(64, 2048, device="cuda") * 2048 ** -0.5
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    got = triton_gemv.router_linear(x, w)
    want = torch.nn.functional.linear(x.float(), w)
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    backend = AiterTritonBackend(16, 16, 128, 16, torch.bfloat16, torch.device("cuda"), deterministic=True)
    assert backend.router_gemm is None


def test_mla_absorption_kernels_equal_the_einsums_at_deepseek_widths():
    """DeepSeek-V2's widths (16 heads, nope 128, rope 64, rank 512, v 128) in bf16, every row count the
    kernels take: the backend's absorb and unabsorb against the einsums (and the cat) they replace; past
    MAX_ROWS the backend gives the einsums' values."""
    from autoprofile.kernels import triton_mla_absorb
    torch.manual_seed(0)
    be = AiterTritonBackend(16, 16, 192, 16, torch.bfloat16, torch.device("cuda"))
    w_uk, w_uv = (torch.randn(16, 256, 512, device="cuda", dtype=torch.bfloat16) * 0.05).split([128, 128], 1)
    for t in range(1, triton_mla_absorb.MAX_ROWS + 2):
        q = torch.randn(t, 16, 192, device="cuda", dtype=torch.bfloat16)
        got = be.mla_absorb(q[..., :128], q[..., 128:], w_uk)
        want = torch.cat([torch.einsum("thn,hnr->thr", q[..., :128].float(), w_uk.float()),
                          q[..., 128:].float()], dim=-1)
        assert rel_err(got.float(), want) < 1e-2
        o_lat = torch.randn(t, 16, 512, device="cuda", dtype=torch.bfloat16)
        got = be.mla_unabsorb(o_lat, w_uv)
        want = torch.einsum("thr,hvr->thv", o_lat.float(), w_uv.float()).reshape(t, -1)
        assert got.shape == (t, 16 * 128) and rel_err(got.float(), want) < 1e-2
