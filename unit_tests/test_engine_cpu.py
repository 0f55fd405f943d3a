"""The engine on CPU with the torch backend: KV pool, allocator, request table, the decoder's
cached decode against a from-scratch forward, checkpoint loading and TP sharding, build/teardown, stresses."""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import traceback
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from autoprofile import budget
from autoprofile.config import ServerConfig, validate
from autoprofile.layers.attention import AttentionMetadata
from autoprofile.engine.attention.torch_sdpa import TorchBackend
from autoprofile.engine.cuda_graph import batch_ladder
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.kv_cache import PAD_PAGE, KVCache, KVCacheFull, PageAllocator, ReqTable
from autoprofile.layers.parallel import TP
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.step_inputs import Staging
from autoprofile.engine.sampling import GREEDY
from autoprofile.engine.scheduler import StepRow
from autoprofile.engine.weights import init_random, load_checkpoint
from autoprofile.model_config import load_model_config
from models.llama import LlamaForCausalLM, rope_inv_freq

CPU = torch.device("cpu")
SMALL = dict(model="tiny", dtype="float32", attention_backend="torch", max_req_total_len=256,
             batch_max_tokens=256, graph_max_batch_size=4, running_max_req_size=16, report_dir=None)


def small_cfg(**kw) -> ServerConfig:
    return validate(ServerConfig(**{**SMALL, **kw}))


@pytest.fixture(scope="module")
def runner():
    r = ModelRunner(small_cfg())
    init_random(r.model, seed=1, std=0.08)  # larger than the default 0.02: less degenerate greedy text
    r.build(1024)
    return r


# ---------------------------------------------------------------- pages, slots, the one KV tensor
def test_page_allocator_hands_out_every_page_but_the_pad_page_then_fails_clearly():
    a = PageAllocator(9)
    assert a.capacity == a.num_free == 8
    got = a.alloc(3) + a.alloc(5)
    assert sorted(got) == list(range(1, 9)) and PAD_PAGE not in got
    with pytest.raises(KVCacheFull, match="1 pages requested, 0 of 8 free"):
        a.alloc(1)
    a.free(got[:2])
    assert a.num_free == 2 and sorted(a.alloc(2)) == sorted(got[:2])
    with pytest.raises(ValueError, match="double free"):
        a.free([got[2], got[2]])
    with pytest.raises(ValueError, match="not allocated"):
        a.free([PAD_PAGE])


@pytest.mark.parametrize("reqs,ctx,page", [(16, 256, 16), (2048, 131072, 16), (7, 1000, 64), (3, 17, 1)])
def test_req_table_bytes_equal_the_budget_formula(reqs, ctx, page):
    t = ReqTable(reqs, ctx, page, torch.device("cpu"))
    assert t.pages_per_req == math.ceil(ctx / page)
    assert t.nbytes == budget.req_table_bytes(reqs, ctx, page)


def test_req_table_mirrors_page_writes_and_refuses_out_of_range():
    t = ReqTable(2, 64, 16, torch.device("cpu"))
    t.write([(1, 0, [5, 6]), (0, 2, [9]), (1, 2, [7])])
    assert t.page_table.tolist() == [[0, 0, 9, 0], [5, 6, 7, 0]]
    with pytest.raises(ValueError, match="outside the 2 x 4 page table"):
        t.write([(0, 3, [1, 2])])
    with pytest.raises(ValueError, match="slot 2"):
        t.write([(2, 0, [1])])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_req_table_write_equals_the_writes_spelled_out(data):
    """The flat index_copy_ puts every page where a 2-D assignment would, and nothing else (last_tokens, the
    buffer's tail, untouched). A step writes a cell at most once (a slot's new pages)."""
    reqs, cols = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 9))
    t = ReqTable(reqs, cols * 16, 16, torch.device("cpu"))
    t.last_tokens.fill_(-7)
    want = torch.zeros(reqs, cols, dtype=torch.int32)
    writes = []
    for _ in range(data.draw(st.integers(1, 5))):
        slot, first = data.draw(st.integers(0, reqs - 1)), data.draw(st.integers(0, cols - 1))
        ids = data.draw(st.lists(st.integers(1, 10_000), min_size=1, max_size=cols - first))
        if (want[slot, first:first + len(ids)] != 0).any():
            continue  # a cell written twice in one step: not a step the scheduler makes
        writes.append((slot, first, ids))
        want[slot, first:first + len(ids)] = torch.tensor(ids, dtype=torch.int32)
    if writes:
        t.write(writes)
    assert torch.equal(t.page_table, want)
    assert (t.last_tokens == -7).all()


class QueuedCopy:
    """torch.cuda.Event as Staging reads it: query() is False until the copy it marks has run (`ran`)."""

    def __init__(self):
        self.ran = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.ran


def test_staging_never_rewrites_a_buffer_whose_copy_is_still_queued():
    """On the CPU the 'copy' is the staging buffer itself, so a buffer written again while its copy is queued
    shows in the tensor that copy returned (on a GPU: the device reads the new indices)."""
    events: list[QueuedCopy] = []
    stage = Staging(new_event=lambda: events.append(QueuedCopy()) or events[-1], pin_memory=False)
    first = stage.copy([np.arange(5), np.array([9])], 6, CPU)
    second = stage.copy([np.full(4, 7)], 4, CPU)
    assert first.tolist() == [0, 1, 2, 3, 4, 9] and second.tolist() == [7] * 4
    assert len(stage.buffers) == 2  # the first buffer's copy is queued: a second buffer
    events[0].ran = True
    third = stage.copy([np.full(3, 8)], 3, CPU)
    assert third.data_ptr() == first.data_ptr() and len(stage.buffers) == 2  # reused once its copy ran
    assert second.tolist() == [7] * 4


def test_decode_metadata_of_real_and_padding_rows():
    """Graphs and eager decode derive slot mapping, seq_lens and block tables with
    ReqTable.decode_metadata."""
    t = ReqTable(3, 64, 16, torch.device("cpu"))
    t.write([(1, 0, [5, 6, 7]), (2, 0, [9])])
    pos, slots = torch.tensor([33, 0, 20]), torch.tensor([1, 2, 2])
    tables, slot_mapping, seq_lens = t.decode_metadata(pos, slots, 3)
    assert tables.tolist() == [[5, 6, 7], [9, 0, 0], [9, 0, 0]]
    assert slot_mapping.tolist() == [7 * 16 + 1, 9 * 16, 0 * 16 + 4]  # position 20 of slot 2: its 2nd page
    assert seq_lens.tolist() == [34, 1, 21] and seq_lens.dtype == torch.int32
    real = torch.tensor([True, False, True])
    tables, slot_mapping, seq_lens = t.decode_metadata(pos, slots, 3, real)
    assert tables[1].tolist() == [PAD_PAGE] * 3 and slot_mapping[1] == PAD_PAGE * 16 and seq_lens[1] == 1
    assert slot_mapping[0] == 7 * 16 + 1 and seq_lens[0] == 34


def test_kv_cache_is_one_tensor_with_per_layer_views():
    kv = KVCache(3, 5, 2, 16, 8, torch.float32, torch.device("cpu"))
    assert kv.buffer.shape == (2, 3, 5, 2, 16, 8) and kv.buffer.is_contiguous()
    assert kv.nbytes == 2 * 3 * 5 * 2 * 16 * 8 * 4
    k1, v1, scales = kv.layers[1]
    assert scales is None and kv.scales is None
    assert k1.shape == (5, 2, 16, 8)
    k1[4, 1, 15, 7] = 3.0
    v1[0, 0, 0, 0] = 4.0
    assert kv.buffer[0, 1, 4, 1, 15, 7] == 3.0 and kv.buffer[1, 1, 0, 0, 0, 0] == 4.0
    assert k1.untyped_storage().data_ptr() == kv.buffer.untyped_storage().data_ptr()


def test_batch_ladder():
    assert batch_ladder(1) == [1]
    assert batch_ladder(8) == [1, 2, 4, 8]
    assert batch_ladder(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert batch_ladder(30) == [1, 2, 4, 8, 16, 24, 30]
    assert batch_ladder(256)[-2:] == [248, 256] and len(batch_ladder(256)) == 35


def test_decode_buckets_grow_by_four_up_to_the_context():
    assert budget.decode_buckets(131072) == [4096, 16384, 65536, 131072]
    assert budget.decode_buckets(32768) == [4096, 16384, 32768]
    assert budget.decode_buckets(20000) == [4096, 20000]  # 16384 is within 2x of the context: dropped
    assert budget.decode_buckets(4096) == [4096] and budget.decode_buckets(256) == [256]


def test_decode_bucket_is_the_smallest_that_holds_the_longest_row():
    buckets = [4096, 16384, 65536, 131072]
    assert [budget.decode_bucket(buckets, n) for n in (1, 4096, 4097, 16384, 70000, 131072)] == [
        4096, 4096, 16384, 16384, 131072, 131072]
    with pytest.raises(ValueError, match="longer than the largest bucket"):
        budget.decode_bucket(buckets, 131073)


def test_decode_graph_keys_capture_the_largest_scratch_first():
    keys = budget.decode_graph_keys(256, 131072)
    assert keys[0] == (256, 131072) and keys[-1] == (1, 4096)
    assert len(keys) == len(set(keys)) == 35 + 3 * 9  # full ladder at 4096, powers of two (+256) above
    scratch = [budget.triton_decode_workspace_bytes(bs, 32, 128, bucket, 2) for bs, bucket in keys]
    assert scratch[0] == max(scratch)
    buckets = [bucket for _, bucket in keys]
    assert buckets == sorted(buckets, reverse=True)  # bucket-major, each bucket's batches descending
    assert budget.decode_graph_keys(4, 256) == [(4, 256), (2, 256), (1, 256)]
    assert budget.coarse_ladder(24) == [1, 2, 4, 8, 16, 24] and budget.coarse_ladder(1) == [1]


def test_the_pieces_warm_up_every_bucket_once_a_process_and_the_largest_in_every_build():
    """The piecewise graphs warm every bucket in a first build, the largest alone (cuBLAS's workspace on the
    capture stream) once a build of the process warmed them, and a bucket no build warmed as in a first
    build. (The decode graphs warm their first graph alone: test_failures counts their calls.)"""
    from autoprofile.engine.piecewise import warm_ups_due
    buckets = [512, 256, 128, 64]
    assert warm_ups_due(buckets, set()) == set(buckets)
    assert warm_ups_due(buckets, set(buckets)) == {512}
    assert warm_ups_due(buckets, {512, 256}) == {512, 128, 64}


def test_decode_graphs_pick_the_smallest_graph_that_holds_the_batch():
    from autoprofile.engine.cuda_graph import DecodeGraphs

    g = DecodeGraphs(256, ReqTable(4, 131072, 16, CPU), 131072)
    assert g.sizes == batch_ladder(256) and set(g.buckets) == {4096, 16384, 65536, 131072}
    assert g.pick(1, 1) == (1, 4096)
    assert g.pick(200, 1025) == (200, 4096)
    assert g.pick(17, 4097) == (32, 16384)  # the coarse ladder above the first bucket
    assert g.pick(129, 131072) == (256, 131072)
    assert g.columns(4096) == 256 and g.columns(131072) == 8192
    meta = g.meta(32, 16384)
    assert meta.max_seq_len == 16384 and meta.block_tables.shape == (32, 1024)
    assert meta.block_tables.stride(0) == 8192  # a view of the static table: graphs read it in place


# ---------------------------------------------------------------- the decoder
def test_llama3_rope_scaling_keeps_high_and_slows_low_frequencies():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024}
    base, scaled = rope_inv_freq(64, 10000.0, None), rope_inv_freq(64, 10000.0, scaling)
    wavelen = 2 * math.pi / base
    high, low = wavelen < 1024 / 4, wavelen > 1024
    assert torch.equal(scaled[high], base[high]) and torch.allclose(scaled[low], base[low] / 8)
    mid = ~high & ~low
    assert mid.any() and ((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8)).all()
    with pytest.raises(NotImplementedError, match="longrope"):
        rope_inv_freq(64, 10000.0, {"rope_type": "longrope", "factor": 4.0})


def _prefill_meta(lens: list[int], slots: torch.Tensor) -> AttentionMetadata:
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    return AttentionMetadata(is_prefill=True, slot_mapping=slots, cu_seqlens=cu, max_seqlen=max(lens))


def test_prefill_then_decode_equals_a_from_scratch_forward():
    """Cached, paged decode (pages deliberately out of order) against a full-sequence forward."""
    mc = load_model_config("tiny")
    page, ctx = 4, 64
    backend = TorchBackend(mc.num_heads, mc.num_kv_heads, mc.head_dim, page, torch.float32, CPU)
    model = LlamaForCausalLM(mc, backend, TP(), torch.float32, max_positions=ctx)
    init_random(model, seed=4, std=0.08)
    kv = KVCache(mc.num_layers, 32, mc.num_kv_heads, page, mc.head_dim, torch.float32, torch.device("cpu"))
    seq = torch.randint(0, mc.vocab_size, (30,), generator=torch.Generator().manual_seed(5))
    prompt_len = 21
    pages = torch.tensor([17, 3, 25, 9, 30, 12, 1, 22])  # 32 slots for 30 tokens
    slot = lambda p: pages[p // page] * page + p % page  # noqa: E731
    with torch.no_grad():
        pos = torch.arange(prompt_len)
        hidden = model(seq[:prompt_len], pos, _prefill_meta([prompt_len], slot(pos)), kv.layers)
        cached = [model.compute_logits(hidden[-1:])]
        for p in range(prompt_len, 30):
            meta = AttentionMetadata(is_prefill=False, slot_mapping=slot(torch.tensor([p])),
                                     block_tables=pages[None].to(torch.int32),
                                     seq_lens=torch.tensor([p + 1], dtype=torch.int32), max_seq_len=ctx)
            cached.append(model.compute_logits(model(seq[p:p + 1], torch.tensor([p]), meta, kv.layers)))
        fresh_kv = KVCache(mc.num_layers, 32, mc.num_kv_heads, page, mc.head_dim, torch.float32, CPU)
        full = model.compute_logits(model(seq, torch.arange(30), _prefill_meta([30], torch.arange(30)),
                                          fresh_kv.layers))
    cached = torch.cat(cached)
    assert cached.shape == (10, mc.vocab_size)
    torch.testing.assert_close(cached, full[prompt_len - 1:], rtol=1e-4, atol=1e-4)
    assert cached.std() > 0.1  # not a degenerate all-equal output


def test_generate_matches_argmax_of_a_full_forward_and_is_batch_invariant(runner):
    prompts = [[7, 99, 1000, 3], [5] * 17, list(range(40, 80))]
    out = LLMEngine(runner).generate(prompts, max_tokens=6)
    assert [len(o) for o in out] == [6, 6, 6]
    assert out == [LLMEngine(runner).generate([p], max_tokens=6)[0] for p in prompts]
    seq = prompts[2] + out[2]
    kv = runner.kv.layers
    page_ids = list(range(1, 1 + math.ceil(len(seq) / 16)))  # the engine is idle: every page is free
    slots = torch.tensor(page_ids).repeat_interleave(16)[: len(seq)] * 16 + torch.arange(len(seq)) % 16
    with torch.no_grad():
        meta = _prefill_meta([len(seq)], slots)
        hidden = runner.model(torch.tensor(seq), torch.arange(len(seq)), meta, kv)
        logits = runner.model.compute_logits(hidden)
    assert logits[len(prompts[2]) - 1:-1].argmax(-1).tolist() == out[2]


def test_mixed_steps_decode_beside_chunks_and_generate_what_each_request_generates_alone():
    """Requests arriving while others decode, with a small token budget: chunks and decode rows share steps
    (one forward: the paged decode for the decode rows, the varlen prefill for the chunks), and every request
    gets the tokens it gets alone."""
    r = ModelRunner(small_cfg(batch_max_tokens=24))
    init_random(r.model, seed=1, std=0.08)
    r.build(1024)
    prompts = [[7, 99, 1000, 3], list(range(40, 100)), [5] * 37, list(range(300, 331))]
    alone = [LLMEngine(r).generate([p], max_tokens=8)[0] for p in prompts]
    engine, r.step_log, out = LLMEngine(r), [], {}

    def step() -> None:
        for o in engine.step():
            out[o.request_id] = out.get(o.request_id, []) + o.new_token_ids

    ids = [engine.add_request(prompts[0], max_tokens=8)]
    step()
    step()
    ids += [engine.add_request(p, max_tokens=8) for p in prompts[1:]]
    while engine.has_unfinished():
        step()
    assert [out[i] for i in ids] == alone
    mixed = [s for s in r.step_log if s.decode_rows and s.prefill_rows]
    assert mixed and all(s.mixed_tokens <= 24 for s in mixed)
    assert any(s.decode_rows > 1 for s in mixed) and any(s.max_prefix_len > 0 for s in mixed)


def test_engine_refuses_what_can_never_fit_naming_the_field(runner):
    e = LLMEngine(runner)
    with pytest.raises(ValueError, match="max_tokens: .*--max_req_total_len.*try max_tokens <= 6"):
        e.add_request([1] * 250, max_tokens=10)
    with pytest.raises(ValueError, match="prompt: .*at most 255 tokens"):
        e.add_request([1] * 256, max_tokens=1)
    with pytest.raises(ValueError, match=r"prompt: token ids must be integers in \[0, 4096\)"):
        e.add_request([4096], max_tokens=1)
    with pytest.raises(ValueError, match="prompt: must hold at least one token"):
        e.add_request([], max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens: must be an integer >= 1"):
        e.add_request([1], max_tokens=0)
    e.add_request([1], request_id="a")
    with pytest.raises(ValueError, match="request_id: 'a' is already in use"):
        e.add_request([2], request_id="a")
    assert e.stats.waiting == 1


# ---------------------------------------------------------------- build / teardown / stresses
def test_build_teardown_drops_the_kv_and_rebuild_works(runner):
    runner.teardown()
    runner.build(1000)  # rounded down to whole pages
    assert runner.built_tokens == 992
    assert runner.kv_bytes == 992 * runner.sizing.cell_bytes  # exactly what the budget solved for
    assert runner.envelope.pages == 992 // 16 - 1  # the pad page
    assert runner.req_table.nbytes == budget.req_table_bytes(16, 256, 16)
    ref = weakref.ref(runner.kv_buffer)
    # structured output's mask: one row per sampled row of the envelope, dropped with the rest
    assert runner.sampler.bitmask.dev.shape[0] == runner.envelope.sampled_rows
    mask = weakref.ref(runner.sampler.bitmask.dev)
    with pytest.raises(RuntimeError, match="teardown"):
        runner.build(64)
    runner.teardown()
    runner.teardown()  # idempotent
    assert ref() is None and mask() is None and runner.sampler is None
    assert runner.kv is runner.req_table is runner.envelope is runner.graphs is runner.kv_buffer is None
    assert runner.built_tokens is None and runner.kv_bytes == 0
    runner.build(512)
    assert runner.built_tokens == 512 and len(LLMEngine(runner).generate([[1, 2]], max_tokens=2)[0]) == 2
    runner.teardown()
    runner.build(1024)


def test_a_failing_build_tears_down_what_it_built(runner, mocker):
    runner.teardown()
    kv_refs = []

    def boom(*a):
        kv_refs.append(weakref.ref(runner.kv_buffer))
        raise torch.OutOfMemoryError("injected")

    mocker.patch.object(runner.backend, "build", side_effect=boom)
    with pytest.raises(torch.OutOfMemoryError):
        runner.build(1024)
    assert kv_refs and kv_refs[0]() is None and runner.kv is None and runner.built_tokens is None
    mocker.stopall()
    points = []

    def refuse(point):
        points.append(point)
        raise ValueError(f"refused at {point}")

    with pytest.raises(ValueError, match="refused at kv_alloc"):
        runner.build(1024, refuse)
    assert points == ["kv_alloc"] and runner.kv is None
    runner.build(1024, points.append)
    assert points == ["kv_alloc", "kv_alloc"]  # no graph_capture checkpoint without graphs


def test_each_stress_is_a_timed_boot_step_taken_once(runner):
    """The profiler's phases name what they spent on the stresses (and graphs, on a GPU): the runner times
    each stress, and each of its corners named by its shape, and hands the steps over once."""
    from autoprofile.engine import stress
    runner.take_boot_steps()
    prefill = runner.stress_prefill()
    decode = runner.stress_decode()
    steps = runner.take_boot_steps()
    totals = [(name, s) for name, s in steps if not name.startswith(stress.CORNER)]
    assert [name for name, _ in totals] == ["stress prefill", "stress decode"]
    assert all(seconds > 0 for _, seconds in steps)
    corners = [name.removeprefix(stress.CORNER) for name, _ in steps if name.startswith(stress.CORNER)]
    assert corners == [stress.corner_label(shape, step.routing) for shape, step in
                       zip(prefill + decode, runner.corners(stress.prefill_steps)
                           + runner.corners(stress.decode_steps))]
    # each stress's corners took no longer than the stress
    cut = len(prefill) + 1
    assert sum(s for _, s in steps[1:cut]) <= steps[0][1]
    assert sum(s for _, s in steps[cut + 1:]) <= steps[cut][1]
    assert runner.take_boot_steps() == []


@pytest.mark.parametrize("tokens", [128, 1024])
def test_stresses_reach_every_limit_whatever_the_cache_size(runner, tokens):
    """The corners need no real cache (prefixes reuse pages cyclically): a 128-token cache runs the
    same chunk over a 254-token prefix as a big one, and the engine serves afterwards."""
    runner.teardown()
    runner.build(tokens)
    try:
        env = runner.envelope
        shapes = runner.stress_prefill() + runner.stress_decode()
        for name, limit in env.limits().items():
            assert max(getattr(s, name) for s in shapes) == limit, name
        assert len(LLMEngine(runner).generate([[3, 4]], max_tokens=3)[0]) == 3
    finally:
        runner.teardown()
        runner.build(1024)


def test_a_size_past_what_the_backends_kernels_address_is_refused_before_any_allocation(runner, monkeypatch):
    """The runner's own bound (budget.max_indexable_tokens for its backend): a backend whose kernels offset a
    layer's cache in 32 bits (ROCm's native one under auto, which config's pin check reads as aiter_triton)
    refuses a size past it, naming the flag and the bound, before anything is allocated."""
    from autoprofile.config import ConfigError
    runner.teardown()
    monkeypatch.setattr(budget, "wide_offsets", lambda backend, deterministic: False)
    bound = runner.max_cache_tokens
    assert bound == budget.max_indexable_tokens(runner.cache_heads, runner.cache_width, 16)
    with pytest.raises(ConfigError, match=f"try --max_total_token_num {bound}$") as e:
        runner.build(bound + 16)
    assert e.value.flag == "max_total_token_num" and runner.kv is None and runner.built_tokens is None
    monkeypatch.undo()
    assert runner.max_cache_tokens == budget.INDEX_LIMIT // 16 * 16  # torch's indexing: 64-bit offsets
    runner.build(1024)


def test_sizing_matches_what_build_allocates(runner):
    s = runner.sizing
    mc = runner.model_config
    assert s.cell_bytes == 2 * mc.num_kv_heads * mc.head_dim * mc.num_layers * 4
    assert (s.context_len, s.page_size, s.running_reqs, s.decode_rows) == (256, 16, 16, 16)
    assert s.overhead(1024) == budget.reserved_bytes(budget.req_table_bytes(16, 256, 16))  # no workspace


# ---------------------------------------------------------------- checkpoints and tensor parallelism
def hf_tensors(d: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights under HF names for an HF-style config dict."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = d["hidden_size"], d["intermediate_size"], d["vocab_size"]
    hd = d.get("head_dim") or h // d["num_attention_heads"]
    q, kv = d["num_attention_heads"] * hd, d["num_key_value_heads"] * hd
    rnd = lambda *s: torch.randn(*s, generator=g) * 0.08  # noqa: E731
    t = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": 1 + rnd(h)}
    if not d.get("tie_word_embeddings"):
        t["lm_head.weight"] = rnd(v, h)
    for n in range(d["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t |= {p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
              p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
              p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
              p + "mlp.down_proj.weight": rnd(h, i), p + "input_layernorm.weight": 1 + rnd(h),
              p + "post_attention_layernorm.weight": 1 + rnd(h)}
        if d.get("model_type") == "qwen2":
            t |= {p + "self_attn.q_proj.bias": rnd(q), p + "self_attn.k_proj.bias": rnd(kv),
                  p + "self_attn.v_proj.bias": rnd(kv)}
        if d.get("model_type") == "qwen3":
            t |= {p + "self_attn.q_norm.weight": 1 + rnd(hd), p + "self_attn.k_norm.weight": 1 + rnd(hd)}
    return t


QWEN_SMALL = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 1001, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False}


def write_checkpoint(folder: Path, d: dict, seed: int = 0, files: int = 2) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d))
    t = hf_tensors(d, seed)
    names = sorted(t)
    for f in range(files):  # split over several files like real checkpoints
        save_file({n: t[n].contiguous() for n in names[f::files]}, str(folder / f"model-{f:05d}.safetensors"))
    return t


def test_checkpoint_loads_with_hf_names_into_packed_layers(tmp_path):
    t = write_checkpoint(tmp_path / "qwen", QWEN_SMALL)
    mc = load_model_config(str(tmp_path / "qwen"))
    assert mc.attention_bias and len(mc.checkpoint_files) == 2
    model = LlamaForCausalLM(mc, TorchBackend(4, 2, 32, 16, torch.float32, CPU), TP(), torch.float32)
    load_checkpoint(model, mc.checkpoint_files, show_progress=False)
    attn = model.model.layers[1].self_attn
    p = "model.layers.1.self_attn."
    assert torch.equal(attn.qkv_proj.weight, torch.cat([t[p + "q_proj.weight"], t[p + "k_proj.weight"],
                                                        t[p + "v_proj.weight"]]))
    assert torch.equal(attn.qkv_proj.bias, torch.cat([t[p + "q_proj.bias"], t[p + "k_proj.bias"],
                                                      t[p + "v_proj.bias"]]))
    mlp = model.model.layers[1].mlp
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([t["model.layers.1.mlp.gate_proj.weight"],
                                                           t["model.layers.1.mlp.up_proj.weight"]]))
    assert torch.equal(model.lm_head.weight, t["lm_head.weight"])


def test_checkpoint_with_a_missing_tensor_is_an_error_naming_it(tmp_path):
    write_checkpoint(tmp_path / "qwen", QWEN_SMALL, files=1)
    path = tmp_path / "qwen" / "model-00000.safetensors"
    from safetensors.torch import load_file
    t = load_file(str(path))
    del t["model.layers.0.self_attn.k_proj.weight"]
    save_file(t, str(path))
    mc = load_model_config(str(tmp_path / "qwen"))
    model = LlamaForCausalLM(mc, TorchBackend(4, 2, 32, 16, torch.float32, CPU), TP(), torch.float32)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight"):
        load_checkpoint(model, mc.checkpoint_files, show_progress=False)


def test_tp_rank_loads_its_shard(tmp_path):
    t = write_checkpoint(tmp_path / "qwen", QWEN_SMALL)
    mc = load_model_config(str(tmp_path / "qwen"))
    tp = TP(rank=1, size=2)
    model = LlamaForCausalLM(mc, TorchBackend(2, 1, 32, 16, torch.float32, CPU), tp, torch.float32)
    load_checkpoint(model, mc.checkpoint_files, show_progress=False)
    p = "model.layers.0."
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert torch.equal(attn.qkv_proj.weight, torch.cat([t[p + "self_attn.q_proj.weight"][64:],
                                                        t[p + "self_attn.k_proj.weight"][32:],
                                                        t[p + "self_attn.v_proj.weight"][32:]]))
    assert torch.equal(attn.o_proj.weight, t[p + "self_attn.o_proj.weight"][:, 64:])
    assert torch.equal(mlp.down_proj.weight, t[p + "mlp.down_proj.weight"][:, 128:])
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([t[p + "mlp.gate_proj.weight"][128:],
                                                           t[p + "mlp.up_proj.weight"][128:]]))
    emb = model.model.embed_tokens.weight  # 1001 rows over 2 ranks: 501 each, the last one padded
    assert emb.shape == (501, 128) and torch.equal(emb[:500], t["model.embed_tokens.weight"][501:])
    assert not emb[500:].any()


def _tp_worker(rank: int, init: str, model_dir: str, queue) -> None:
    try:
        torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        r = ModelRunner(small_cfg(model=model_dir, tp=2), rank=rank, world_size=2,
                        group=torch.distributed.group.WORLD)
        r.build(512)
        queue.put((rank, LLMEngine(r).generate([[1, 2, 3, 4, 5], [9] * 12], max_tokens=8), _last_logits(r)))
        torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001 - report to the parent instead of hanging it
        queue.put((rank, "crash", traceback.format_exc()))


def _last_logits(r: ModelRunner) -> torch.Tensor:
    r.req_table.write([(0, 0, [1])])  # the engine is idle: slot 0 and page 1 are free
    with torch.no_grad():
        return r._prefill([StepRow(0, 0, [3, 1, 4, 1, 5, 9, 2, 6], True, GREEDY)])[0]


@pytest.mark.slow
def test_tensor_parallel_2_ranks_over_gloo_equals_one_rank(tmp_path):
    write_checkpoint(tmp_path / "qwen", QWEN_SMALL, seed=6)
    one = ModelRunner(small_cfg(model=str(tmp_path / "qwen")))
    one.build(512)
    want = LLMEngine(one).generate([[1, 2, 3, 4, 5], [9] * 12], max_tokens=8)
    want_logits = _last_logits(one)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_tp_worker, args=(r, init, str(tmp_path / "qwen"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((rank, rest) for rank, *rest in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    assert all(v[0] != "crash" for v in got.values()), got
    for rank in (0, 1):
        tokens, logits = got[rank]
        assert tokens == want
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_the_report_names_each_phases_slowest_stress_corners():
    """report.phase_steps_lines: a phase's totals on one line, its SLOWEST_CORNERS slowest corners (by their
    labels, slowest first) on the next; a phase without corners adds none."""
    from autoprofile.engine.envelope import StepShape
    from autoprofile.engine.stress import CORNER, corner_label
    from autoprofile.report import phase_steps_lines
    long = corner_label(StepShape(prefill_tokens=8192, prefill_rows=1, prefill_kv_tokens=131071))
    mixed = corner_label(StepShape(prefill_tokens=7937, prefill_rows=1, prefill_kv_tokens=131071,
                                   decode_rows=255), "worst")
    decode = corner_label(StepShape(decode_rows=256, max_req_total_len=131072))
    assert (long, mixed, decode) == ("8192 new in 1 row, kv 131071",
                                     "7937 new in 1 row, kv 131071 + 255 decode rows (worst)",
                                     "256 decode rows to 131072")
    many = corner_label(StepShape(prefill_tokens=8192, prefill_rows=256, prefill_kv_tokens=8192))
    steps = [("probe", "graphs", 5.5), ("probe", "stress prefill", 6.0), ("probe", CORNER + many, 0.5),
             ("probe", CORNER + long, 2.25), ("probe", CORNER + mixed, 1.5), ("probe", CORNER + decode, 0.75),
             ("rebuild+validate#1", "graphs", 1.9)]
    assert phase_steps_lines(steps) == [
        "    probe: graphs 5.50s, stress prefill 6.00s",
        "      slowest of 4 stress corners: 8192 new in 1 row, kv 131071 2.25s; "
        "7937 new in 1 row, kv 131071 + 255 decode rows (worst) 1.50s; 256 decode rows to 131072 0.75s",
        "    rebuild+validate#1: graphs 1.90s"]
