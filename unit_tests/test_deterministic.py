"""--deterministic on the CPU: the flag's wiring, the ordered all-reduce, and a seeded request that gets the
same tokens alone and inside a crowd of 300 (tests/test_deterministic_gpu.py runs the same check on the GPU's
batch-invariant kernels, whose Triton sources are checked here through the interpreter). Its refusals are in
test_config's table."""
from __future__ import annotations

import importlib.util
import multiprocessing as mp

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.attention.torch_sdpa import TorchBackend, tiled_linear
from autoprofile.engine.multimodal import ImageInput, MultiModalInput
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.sampling import GREEDY, SamplingParams
from autoprofile.engine.weights import init_random
from autoprofile.layers.attention import AttentionMetadata, KVLayer
from autoprofile.layers.moe import moe_reference
from autoprofile.layers.parallel import TP, ordered_sum
from unit_tests.crowd import alone_and_in_a_crowd, crowd_on_tp_ranks
from unit_tests.interpreter import run_script

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
needs_aiter = pytest.mark.skipif(importlib.util.find_spec("aiter") is None, reason="amd-aiter not installed")

CROWD = 60  # the MoE, MLA and VL crowds (their torch paths are slower on the CPU than the dense model's)
CROWD_CFG = dict(model="tiny", dtype="bfloat16", attention_backend="torch", max_req_total_len=512,
                 batch_max_tokens=64, graph_max_batch_size=4, running_max_req_size=64, report_dir=None)


@pytest.mark.slow  # a crowd of 300 requests, three times
@pytest.mark.parametrize("params, dtype, overlap", [
    (SamplingParams(temperature=0.9, top_p=0.9, seed=1234), "bfloat16", False),
    (SamplingParams(temperature=0.9, top_p=0.9, seed=99), "float32", True),
    (GREEDY, "bfloat16", True)],
                         ids=["seeded-top-p-bf16", "seeded-top-p-fp32-overlap", "greedy-bf16-overlap"])
def test_a_request_gets_the_same_tokens_alone_and_inside_a_crowd_of_300(params, dtype, overlap):
    r = ModelRunner(validate(ServerConfig(**{**CROWD_CFG, "dtype": dtype}, deterministic=True)))
    init_random(r.model, seed=1, std=0.08)
    r.build(8192)
    prompt = [(37 * i) % 4000 + 3 for i in range(150)]
    got = alone_and_in_a_crowd(r, prompt, params, max_tokens=24, crowd=300, overlap=overlap)
    assert len(got.alone) == 24 and len(set(got.alone)) > 3  # real text, not one repeated token
    assert got.crowded == got.alone
    # the crowd changed what the request ran beside: other chunks, mixed steps, many rows
    assert got.chunks_alone == [64, 64, 22] and got.chunks_crowded != got.chunks_alone, got
    assert got.mixed_steps > 0 and got.most_rows >= 8, got


FAMILY_CFG = dict(dtype="float32", attention_backend="torch", max_req_total_len=256, batch_max_tokens=32,
                  graph_max_batch_size=4, running_max_req_size=32, report_dir=None)
SIDE = 28 * 28


def image_prompt(mc, seed: int, side: int) -> tuple[list[int], MultiModalInput]:
    """Text, one image of side x side patches (side^2 / 4 tokens), text: the ids and its MultiModalInput."""
    from models.qwen2_5_vl import mrope_positions
    grid = (1, side, side)
    head = [(29 * i + seed) % 400 + 3 for i in range(12)]
    ids = head + [mc.vision_start_token_id] + [mc.image_token_id] * (side * side // 4) + [
        mc.vision_end_token_id] + head[:6]
    positions, delta = mrope_positions(ids, [grid], mc)
    pixels = torch.randn(side * side, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(seed))
    return ids, MultiModalInput([ImageInput(pixels, grid, len(head) + 1, seed)], positions, delta)


@pytest.mark.slow  # minutes on 2 cores (the interpreter or a crowd); the slow run has it
@pytest.mark.parametrize("model", ["tiny-moe", "tiny-mla", "tiny-vl"])
@pytest.mark.parametrize("params, overlap", [(SamplingParams(temperature=0.9, top_p=0.9, seed=1234), True),
                                             (GREEDY, False)], ids=["seeded-top-p-overlap", "greedy"])
def test_moe_mla_and_vl_give_a_request_the_same_tokens_alone_and_in_a_crowd(model, params, overlap):
    """MoE: the router and each expert's GEMMs batch-invariant. MLA: every token absorbed over the latent
    cache (prefill tokens as decode rows), its per-head projections batch-invariant. Qwen2.5-VL: the tower
    runs one image at a time (a third of the crowd carries images too), the decoder as the dense path."""
    vl = model == "tiny-vl"
    extra = dict(visual_batch_size=4, max_images_per_request=1, min_image_pixels=4 * SIDE,
                 max_image_pixels=36 * SIDE) if vl else {}
    r = ModelRunner(validate(ServerConfig(model=model, **FAMILY_CFG, **extra, deterministic=True)))
    init_random(r.model, seed=1, std=0.08)
    r.build(4096)
    mc = r.model_config
    if vl:
        prompt, _ = image_prompt(mc, 7, 12)  # 36 image tokens inside a 55-token prompt
        got = alone_and_in_a_crowd(r, prompt, params, max_tokens=12, crowd=CROWD, overlap=overlap,
                                   mm=lambda: image_prompt(mc, 7, 12)[1],
                                   image_request=lambda i: image_prompt(mc, 100 + i, 4 + 4 * (i % 2)))
    else:
        prompt = [(37 * i) % 4000 + 3 for i in range(70)]
        got = alone_and_in_a_crowd(r, prompt, params, max_tokens=12, crowd=CROWD, overlap=overlap)
    assert len(got.alone) == 12 and len(set(got.alone)) > 3, got  # real text, not one repeated token
    assert got.crowded == got.alone, got
    assert got.chunks_crowded != got.chunks_alone and got.mixed_steps > 0 and got.most_rows >= 4, got


def test_the_experts_give_a_token_the_same_bits_alone_and_among_others():
    """The torch backend's experts under --deterministic: each expert's GEMMs at a fixed row count (an
    expert's rows follow the step's tokens)."""
    torch.manual_seed(0)
    e, k, h, i, t = 8, 2, 256, 96, 40
    be = TorchBackend(4, 4, 32, 16, torch.float32, torch.device("cpu"), deterministic=True)
    x, w13, w2 = torch.randn(t, h), torch.randn(e, 2 * i, h) * h ** -0.5, torch.randn(e, h, i) * i ** -0.5
    weights, ids = torch.rand(t, k), torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
    full = be.fused_moe(x, w13, w2, weights, ids)
    assert all(torch.equal(be.fused_moe(x[a:b], w13, w2, weights[a:b], ids[a:b]), full[a:b])
               for a, b in ((0, 1), (5, 6), (0, 3), (7, 40)))
    torch.testing.assert_close(full, moe_reference(x, w13, w2, weights, ids))


@needs_triton
def test_summed_in_order_adds_each_rows_slots_in_slot_order_in_fp32():
    from autoprofile.kernels.triton_moe import summed_in_order
    down = torch.tensor([[[1.0], [2.0 ** -8], [2.0 ** -8]]], dtype=torch.bfloat16)
    out = torch.empty(1, 1, dtype=torch.bfloat16)
    # fp32 sums, one rounding: 1 + 2^-7 (bf16's spacing at 1; each add rounded to bf16 would drop both halves)
    assert summed_in_order(down, out).item() == 1 + 2 ** -7 and out.item() == 1 + 2 ** -7
    rows = torch.randn(50, 6, 64, dtype=torch.bfloat16)
    whole = summed_in_order(rows, torch.empty(50, 64, dtype=torch.bfloat16))
    assert torch.equal(summed_in_order(rows[3:4], torch.empty(1, 64, dtype=torch.bfloat16)), whole[3:4])
    torch.testing.assert_close(whole.float(), rows.float().sum(1), rtol=1e-2, atol=1e-2)


def _crowd_tp(guard, params: SamplingParams, crowd: int):
    """Every rank builds the tiny model at --tp 2 with the same seeded shards (unit_tests.crowd runs the rest;
    one token alone: GEMMs of one row, another kernel, and twenty)."""
    r = ModelRunner(validate(ServerConfig(**CROWD_CFG, tp=2, deterministic=True)), rank=guard.rank,
                    world_size=2, group=guard.data)
    init_random(r.model, seed=1, std=0.08)
    guarded = guard.bind(r)
    guarded.build(8192)
    prompt = [(37 * i) % 4000 + 3 for i in range(150)]
    return crowd_on_tp_ranks(guarded, prompt, (1, 20), prompt[20:50], prompt[50:57], params, 24, crowd)


@pytest.mark.slow
def test_tp2_a_seeded_request_gets_the_same_tokens_alone_and_inside_a_crowd():
    """The same on two gloo ranks: each linear layer's GEMM on its shard, the row-parallel all-reduce summed
    in rank order, the vocab-parallel LM head gathered, rank 0's sampler (tests/test_tp_gpu.py: 2 GPUs).
    With two ranks a sum's order cannot change its bits (a + b == b + a); three ranks: the gloo test below."""
    from autoprofile import launch
    out = launch.launch(_crowd_tp, 2, (SamplingParams(temperature=0.9, top_p=0.9, seed=1234), 60),
                        device="cpu", timeout_s=600)
    assert all(o.ok for o in out), out
    (alone1, beside1, alone, beside), got = out[0].value
    # a prompt's last logits, exact floats: alone and between prompts of 30 and 7
    assert alone1 == beside1 and alone == beside
    assert len(got.alone) == 24 and len(set(got.alone)) > 3
    assert got.crowded == got.alone
    assert got.chunks_alone == [64, 64, 22] and got.chunks_crowded != got.chunks_alone, got
    assert got.mixed_steps > 0 and got.most_rows >= 8, got
    assert out[1].value > 50  # the worker ran the crowd's steps


def test_the_flag_sets_the_invariant_gemm_the_paged_prefill_and_the_ordered_all_reduce():
    cfg = dict(model="tiny", dtype="float32", attention_backend="torch", max_req_total_len=256,
               batch_max_tokens=256, graph_max_batch_size=4, report_dir=None)
    on, off = (ModelRunner(validate(ServerConfig(**cfg, deterministic=d))) for d in (True, False))
    assert on.tp.ordered_reduce and on.backend.paged_prefill and on.tp.matmul is tiled_linear
    assert not off.tp.ordered_reduce and not off.backend.paged_prefill and off.tp.matmul is None
    x, w, b = torch.randn(70, 48), torch.randn(40, 48), torch.randn(40)
    torch.testing.assert_close(tiled_linear(x, w, b), torch.nn.functional.linear(x, w, b))
    assert tiled_linear(x[:0], w).shape == (0, 40)


def test_a_rows_gemm_and_paged_attention_do_not_depend_on_the_rows_beside_it():
    """The torch ops the flag replaces do (on the CPU an fp32 GEMM of 1 to 5 rows takes another kernel, and
    the paged loop's chunks follow the batch): row 0 alone, and among 40."""
    torch.manual_seed(0)
    x, w = torch.randn(40, 256), torch.randn(704, 256)
    full = tiled_linear(x, w)
    assert all(torch.equal(tiled_linear(x[:m], w), full[:m]) for m in (1, 2, 5, 33))
    hq, hkv, d, page, pages = 8, 2, 32, 16, 16
    be = TorchBackend(hq, hkv, d, page, torch.float32, torch.device("cpu"), deterministic=True,
                      decode_chunk_bytes=8192)
    kv = KVLayer(torch.randn(40 * pages + 1, hkv, page, d), torch.randn(40 * pages + 1, hkv, page, d))
    tables = torch.arange(40 * pages, dtype=torch.int32).view(40, pages)
    lens = torch.randint(1, pages * page, (40,), dtype=torch.int32)
    q = torch.randn(40, hq, d)

    def decode(rows: int) -> torch.Tensor:
        return be.decode(q[:rows], kv, AttentionMetadata(False, torch.zeros(rows, dtype=torch.int64),
                                                         block_tables=tables[:rows], seq_lens=lens[:rows],
                                                         max_seq_len=pages * page))

    assert torch.equal(decode(1), decode(40)[:1])


def test_a_forwards_derived_row_metadata_is_made_once_and_shared_by_its_layers():
    """Each layer asks; the first makes it. A paged prefill of two chunks (3 new tokens over a 5-token prefix,
    2 fresh tokens) as token rows: each token its request's pages and its own length."""
    tables = torch.tensor([[7, 8], [9, 0]], dtype=torch.int32)
    meta = AttentionMetadata(True, torch.zeros(5, dtype=torch.int64), cu_seqlens=torch.tensor([0, 3, 5]),
                             block_tables=tables, seq_lens=torch.tensor([8, 2], dtype=torch.int32))
    rows = meta.token_rows()
    assert rows is meta.token_rows() and not rows.is_prefill
    assert rows.seq_lens.tolist() == [6, 7, 8, 1, 2] and rows.max_seq_len == 8
    assert rows.block_tables.tolist() == [[7, 8]] * 3 + [[9, 0]] * 2
    decode = AttentionMetadata(False, torch.zeros(3, dtype=torch.int64),
                               block_tables=tables[:1].expand(3, -1),
                               seq_lens=torch.tensor([4, 1, 9], dtype=torch.int32), max_seq_len=16)
    starts = decode.query_starts()
    assert starts is decode.query_starts() and starts.tolist() == [0, 1, 2, 3] and starts.dtype == torch.int32


def test_ordered_sum_adds_in_rank_order():
    parts = [torch.tensor([1e8]), torch.tensor([-1e8]), torch.tensor([1.0])]
    assert ordered_sum(parts).item() == 1.0  # (1e8 - 1e8) + 1; 1e8 + (-1e8 + 1) would be 0 in fp32
    assert parts[0].item() == 1e8  # the inputs are untouched


def _reduce_worker(rank: int, init: str, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3)
    try:
        x = torch.tensor([[1e8, 5.0], [-1e8, 6.0], [1.0, 7.0]][rank])
        TP(rank, 3, ordered_reduce=True).all_reduce(x)
        queue.put((rank, x.tolist()))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # three spawned ranks, each importing torch
def test_ordered_all_reduce_over_three_gloo_ranks_gives_every_rank_the_rank_order_sum(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_reduce_worker, args=(r, init, queue)) for r in range(3)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == {0: [1.0, 18.0], 1: [1.0, 18.0], 2: [1.0, 18.0]}


MATMUL = r'''
import torch
from autoprofile.kernels import triton_matmul

torch.manual_seed(0)
for m, n, k, bias, dtype in [(1, 96, 64, False, torch.float32), (300, 200, 96, True, torch.float32),
                             (5, 130, 130, True, torch.float16), (129, 256, 64, False, torch.float16)]:
    x = torch.randn(m, k, dtype=dtype)
    w = (torch.randn(n, k) * k ** -0.5).to(dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    got = triton_matmul.linear(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float() if bias else None)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    assert torch.allclose(got.float(), want, rtol=tol, atol=tol), (m, n, k, (got.float() - want).abs().max())
    for lo, hi in ((0, 1), (m // 2, m)):  # a row alone and among others
        assert torch.allclose(triton_matmul.linear(x[lo:hi], w, b), got[lo:hi], rtol=tol, atol=tol)
# the bits of a row alone and among others: on the GPU (tests/test_deterministic_gpu.py); numpy's dot under
# the interpreter rounds a row by its place in the tile on some CPUs (an AMD EPYC host, 2026-11-25: 1e-6 apart)
x = torch.randn(4, 3, 200)[:, :, :64]  # a strided view of leading dims
w = torch.randn(32, 64)
assert torch.allclose(triton_matmul.linear(x, w), x @ w.T, rtol=1e-4, atol=1e-4)
assert triton_matmul.linear(torch.empty(0, 64), w).shape == (0, 32)
print("ok")
'''


@needs_triton
def test_the_batch_invariant_gemm_equals_torch_for_a_row_alone_and_among_others():
    run_script(MATMUL)


UNIFIED = r'''
import torch
from autoprofile.kernels import triton_unified
from autoprofile.layers.attention import FP8_MAX

torch.manual_seed(0)
hq, hkv, d, page, per_seq = 8, 2, 32, 16, 8

def reference(q, kc, vc, table, n, scales):
    """softmax(q k^T / sqrt(d)) v over the sequence's n cached tokens, q's tokens the last ones (causal)."""
    slots = torch.arange(n)
    k = kc[table[slots // page].long(), :, slots % page].float()
    v = vc[table[slots // page].long(), :, slots % page].float()
    if scales is not None:
        k, v = k * scales[0], v * scales[1]
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * d ** -0.5
    s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(n - len(q), n)[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

def run(q, kc, vc, tables, seq_lens, q_lens, scales=None):
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    out = torch.empty(q.shape, dtype=q.dtype)
    return triton_unified.attention(out, q, kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32), cu,
                                    d ** -0.5, scales)

for cache_dtype in (torch.float32, torch.float8_e4m3fn):
    q_lens, ctx = [1, 5, 1, 70, 3], [40, 3, 70, 0, 50]  # decode rows, chunks over a prefix, a fresh prompt
    seqs = len(q_lens)
    kc, vc = torch.randn(seqs * per_seq + 1, hkv, page, d), torch.randn(seqs * per_seq + 1, hkv, page, d)
    scales = None
    if cache_dtype != torch.float32:
        scales = torch.tensor([0.02, 0.03])
        kc = (kc / scales[0]).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)
        vc = (vc / scales[1]).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)
    tables = torch.randperm(seqs * per_seq).to(torch.int32).view(seqs, per_seq)  # scattered pages
    seq_lens = [a + b for a, b in zip(q_lens, ctx)]
    q = torch.randn(sum(q_lens), hq, d)
    out = run(q, kc, vc, tables, seq_lens, q_lens, scales)
    start = 0
    for b in range(seqs):
        want = reference(q[start:start + q_lens[b]], kc, vc, tables[b], seq_lens[b], scales)
        err = (out[start:start + q_lens[b]] - want).abs().max()
        assert err < 1e-4, (cache_dtype, b, err)
        start += q_lens[b]
    # one 70-token prompt computed whole, as two chunks, and its last token as a decode row: the same bits
    whole = out[7:77]  # sequence 3
    first = run(q[7:37], kc, vc, tables[3:4], [30], [30], scales)
    second = run(q[37:77], kc, vc, tables[3:4], [70], [40], scales)
    last = run(q[76:77], kc, vc, tables[3:4], [70], [1], scales)
    # the bits: on the GPU (tests/test_deterministic_gpu.py); here numpy's dot under the interpreter rounds a
    # query row by its place in the tile on some CPUs (an AMD EPYC host, 2026-11-25), so closeness
    assert torch.allclose(torch.cat([first, second]), whole, rtol=1e-5, atol=1e-5)
    assert torch.allclose(last, whole[-1:], rtol=1e-5, atol=1e-5)
print("ok")
'''


@needs_triton
@needs_aiter
def test_the_unified_attention_equals_the_reference_for_decode_rows_and_chunks_in_any_chunking():
    run_script(UNIFIED)
