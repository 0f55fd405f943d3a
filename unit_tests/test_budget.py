"""The budget arithmetic against the public cases (seeds 000 and 001) and the solver's defining inequality."""
from __future__ import annotations

import random

import pytest

from autoprofile import budget
from autoprofile.budget import GiB, Sizing
from autoprofile.kernels import launch_rules
from autoprofile.model_config import load_model_config

LLAMA_Q_HEADS, HEAD_DIM = 32, 128


def aiter_ws(q_heads: int = LLAMA_Q_HEADS, head_dim: int = HEAD_DIM):
    """The native AITER workspace as a Sizing callback (decode rows, longest sequence) -> bytes."""
    return lambda reqs, longest: budget.aiter_workspace_bytes(
        reqs, q_heads, head_dim, launch_rules.aiter_num_partitions(longest))


# ---------------------------------------------------------------- AITER workspace: the public numbers
def test_llama_aiter_workspace_full_context_is_16_25_gib():
    parts = launch_rules.aiter_num_partitions(131072)
    assert parts == 512
    ws = budget.aiter_workspace_bytes(2048, LLAMA_Q_HEADS, HEAD_DIM, parts)
    assert ws == 2048 * 32 * 512 * (4 * 128 + 8)
    assert ws / GiB == 16.25


def test_llama_aiter_workspace_capped_by_cache_is_3_17_gib():
    parts = launch_rules.aiter_num_partitions(131072, tokens=25432)
    assert parts == 100
    ws = budget.aiter_workspace_bytes(2048, LLAMA_Q_HEADS, HEAD_DIM, parts)
    assert ws / GiB == pytest.approx(3.17, abs=0.005)
    # The same cap applies through Sizing: no sequence outgrows a 25,432-token cache.
    s = Sizing(cell_bytes=131072, context_len=131072, page_size=16, running_reqs=2048, decode_rows=2048,
               workspace=aiter_ws())
    table = budget.req_table_bytes(2048, 131072, 16)
    assert s.overhead(25432) == budget.reserved_bytes(ws) + budget.reserved_bytes(table)


def test_workspace_follows_decode_rows_and_table_follows_running_requests():
    """The envelope's rows size the declared buffers: 256 decode rows of a 4096-slot table."""
    s = Sizing(cell_bytes=131072, context_len=131072, page_size=16, running_reqs=4096, decode_rows=256,
               workspace=aiter_ws())
    parts = launch_rules.aiter_num_partitions(131072)
    assert s.workspace_reserved(10**6) == budget.reserved_bytes(budget.aiter_workspace_bytes(256, 32, 128,
                                                                                             parts))
    assert s.table_reserved(10**6) == budget.reserved_bytes(4096 * (8192 + 1) * 4)  # pages + last token


def test_qwen3_30b_a3b_aiter_workspace_is_65_gib():
    m = load_model_config("qwen3-30b-a3b")
    assert (m.num_heads, m.head_dim, m.max_position_embeddings) == (32, 128, 262144)
    partitions = launch_rules.aiter_num_partitions(262144)
    ws = budget.aiter_workspace_bytes(4096, m.num_heads, m.head_dim, partitions)
    assert ws / GiB == 65.0


def test_partitions_round_up_and_cap():
    assert launch_rules.aiter_num_partitions(257) == 2
    # cache larger than the context: no cap
    assert launch_rules.aiter_num_partitions(131072, tokens=10**9) == 512
    assert launch_rules.aiter_num_partitions(131072, tokens=0) == 0


# ---------------------------------------------------------------- KV per token
def test_cell_bytes_llama_bf16():
    m = load_model_config("llama-3.1-8b")
    assert budget.cell_bytes_for(m, 2) == 131072 == 2 * 8 * 128 * 32 * 2


def test_cell_bytes_split_per_tp_rank():
    m = load_model_config("llama-3.1-8b")
    assert budget.cell_bytes_for(m, 2, tp=2) == 131072 // 2
    assert budget.cell_bytes_for(m, 2, tp=8) == 131072 // 8
    # 16 ranks, 8 KV heads: each rank keeps one (replicated) head, not half a head.
    assert budget.cell_bytes_for(m, 2, tp=16) == 131072 // 8


def test_cell_bytes_fp32_doubles():
    assert budget.kv_cell_bytes(32, 8, 128, 4) == 2 * budget.kv_cell_bytes(32, 8, 128, 2)


def test_mla_cell_bytes_formula_and_dispatch():
    # DeepSeek-V3-like: 61 layers, kv_lora_rank 512, rope dim 64.
    assert budget.mla_cell_bytes(61, 512, 64, 2) == (512 + 64) * 61 * 2 == 70272
    m = load_model_config("llama-3.1-8b")
    import dataclasses
    mla = dataclasses.replace(m, kv_lora_rank=512, qk_rope_head_dim=64, num_layers=61)
    assert mla.is_mla
    assert budget.cell_bytes_for(mla, 2, tp=8) == 70272  # latent replicated on every rank


# ---------------------------------------------------------------- the solver
def fits(tokens: int, available: int, s: Sizing, mem_fraction: float) -> bool:
    """The solver's defining inequality, written out independently of solve_target_tokens."""
    return tokens * s.cell_bytes <= (available - s.overhead(tokens)) * mem_fraction


def check_solution(available: int, s: Sizing, mem_fraction: float) -> int:
    t = budget.solve_target_tokens(available, s, mem_fraction)
    assert t % s.page_size == 0 and t >= 0
    if t > 0:
        assert fits(t, available, s, mem_fraction)
    assert not fits(t + s.page_size, available, s, mem_fraction)
    return t


@pytest.mark.parametrize("available_gib, below_context", [(3, True), (6, True), (100, False)])
def test_solver_charges_the_workspace_below_and_above_the_context_cap(available_gib, below_context):
    context = 131072  # a cache below the context caps the partitions at T
    s = Sizing(cell_bytes=131072, context_len=context, page_size=16, running_reqs=256, decode_rows=256,
               workspace=aiter_ws())
    t = check_solution(available_gib * GiB, s, 1.0)
    assert (t < context) == below_context
    # The workspace really is charged: the same budget without it fits strictly more tokens.
    bare = Sizing(131072, context, 16, running_reqs=256, decode_rows=256)
    assert budget.solve_target_tokens(available_gib * GiB, bare, 1.0) > t


def test_solver_random_inputs():
    rng = random.Random(1234)
    for _ in range(400):
        page = rng.choice([16, 32, 64, 128, 256])
        context = rng.choice([512, 2048, 4096, 32768, 131072, 262144])
        s = Sizing(
            cell_bytes=rng.choice([4096, 49152, 65536, 98304, 131072, 70272]),
            context_len=context, page_size=page,
            running_reqs=rng.choice([1, 64, 256, 5000]), decode_rows=rng.choice([1, 64, 256]),
            workspace=rng.choice([None, aiter_ws(rng.choice([4, 16, 32, 64]), rng.choice([64, 128]))]),
        )
        available = rng.randint(-GiB, 300 * GiB)
        check_solution(available, s, rng.choice([1.0, 0.95, 0.5, 0.1]))


def test_solver_nothing_available_gives_zero():
    s = Sizing(cell_bytes=131072, context_len=8192, page_size=16, running_reqs=256, decode_rows=256,
               workspace=aiter_ws())
    assert budget.solve_target_tokens(-5 * GiB, s, 1.0) == 0
    assert budget.solve_target_tokens(0, s, 1.0) == 0


def test_mem_fraction_scales_the_budget_exactly():
    # With a fixed request count the overhead is a constant O: T = floor_page((A - O) * f / cell).
    s = Sizing(cell_bytes=131072, context_len=8192, page_size=16, running_reqs=512, decode_rows=512)
    a = 60 * GiB
    o = s.overhead(0)
    for f in (1.0, 0.9, 0.5, 0.25):
        expected = int((a - o) * f // 131072) // 16 * 16
        assert budget.solve_target_tokens(a, s, f) == expected
    assert budget.solve_target_tokens(a, s, 0.5) < budget.solve_target_tokens(a, s, 0.9)


# ---------------------------------------------------------------- retries
def test_shrink_schedule_four_sizes_for_three_retries():
    sizes = budget.shrink_schedule(500_000, 0.95, 3, 16)
    assert len(sizes) == 4 and sizes[0] == 500_000
    assert all(a > b for a, b in zip(sizes, sizes[1:]))
    assert all(s % 16 == 0 for s in sizes[1:])
    assert sizes[1] == 474_992 and sizes[3] == pytest.approx(500_000 * 0.95 ** 3, rel=1e-3)


def test_shrink_always_drops_at_least_a_page():
    # 5% of 64 tokens is less than a page: still strictly smaller and page aligned.
    sizes = budget.shrink_schedule(64, 0.95, 3, 16)
    assert sizes == [64, 48, 32, 16]
    assert budget.shrink(0, 0.95, 16) == 0


# ---------------------------------------------------------------- measurement terms
def test_peers_floored_at_zero():
    assert budget.peer_bytes(total=80, free=70, own_reserved=20, own_non_torch_bytes=5) == 0
    assert budget.peer_bytes(total=100, free=40, own_reserved=30, own_non_torch_bytes=10) == 20


def test_own_non_torch_with_and_without_nvml():
    assert budget.own_non_torch(process_used=12, own_reserved=10, total=100, free=50) == 2
    assert budget.own_non_torch(process_used=None, own_reserved=10, total=100, free=50) == 40  # pessimistic
    assert budget.own_non_torch(process_used=5, own_reserved=10, total=100, free=50) == 0


def test_non_kv_peak_and_available():
    assert budget.non_kv_peak(peak_reserved=30, probe_sized_bytes=10) == 20
    assert budget.non_kv_peak(peak_reserved=5, probe_sized_bytes=10) == 0
    assert budget.available_bytes(total=100, own_non_torch_bytes=1, non_kv=20, peers=4, canary=2,
                                  driver_reserve=3) == 70
    assert budget.DRIVER_RESERVE > 0


def test_probe_tokens_covers_both_stresses():
    assert budget.probe_tokens(8192, 256, 16) == 8192
    assert budget.probe_tokens(1000, 512, 16) == 512 * 2 * 16
    assert budget.probe_tokens(1001, 1, 16) == 1008


# ---------------------------------------------------------------- the give-up diagnostic
FLAGS = {"batch_max_tokens": 8192, "graph_max_batch_size": 256, "max_req_total_len": 131072,
         "running_max_req_size": None, "mem_fraction": 1.0, "canary_mb": 256, "shrink_ratio": 0.95,
         "max_retries": 3, "tp": 1, "page_size": 16}
KNOBS = ["--max_total_token_num", "--batch_max_tokens", "--graph_max_batch_size", "--max_req_total_len",
         "--running_max_req_size", "--mem_fraction", "--canary_mb", "--shrink_ratio", "--max_retries", "--tp",
         "--disable_cudagraph"]


@pytest.mark.parametrize("peers", [0, 3 * GiB])
def test_diagnostic_names_every_knob_and_figure(peers):
    g = budget.GiveUp(initial_tokens=400_000, last_tokens=342_000, attempts=4, cell_bytes=131072,
                      peak_reserved=70 * GiB, total=80 * GiB, canary=256 << 20, peers=peers,
                      last_error="OutOfMemoryError: CUDA out of memory", flags=FLAGS)
    text = budget.give_up_diagnostic(g)
    for knob in KNOBS:
        assert knob in text, knob
    for figure in ("400000 tokens", "342000 tokens", "4 attempt(s)", "70.00 GiB", "80.00 GiB", "0.25 GiB",
                   f"{peers / GiB:.2f} GiB", "OutOfMemoryError: CUDA out of memory", "(now 8192)",
                   "(now 256)"):
        assert figure in text, figure
    assert ("free the GPU" in text) == (peers > 0)
    hint = int(text.split("--max_total_token_num ")[1].split()[0])
    assert 0 < hint < 342_000 and hint % 16 == 0


def test_reserved_bytes_follows_the_caching_allocator_segments():
    MiB = 1 << 20
    assert budget.reserved_bytes(0) == 0
    assert budget.reserved_bytes(1) == budget.reserved_bytes(MiB) == 2 * MiB  # small pool
    assert budget.reserved_bytes(MiB + 1) == budget.reserved_bytes(10 * MiB - 1) == 20 * MiB
    assert budget.reserved_bytes(10 * MiB) == 10 * MiB
    assert budget.reserved_bytes(10 * MiB + 1) == 12 * MiB


def test_the_target_never_passes_the_kernels_32_bit_offsets():
    """A small model on a large card: the budget fits more tokens than one layer's K view can address with
    32-bit offsets (an H100 decoded out of bounds at 10.1M tokens of 8 x 128); the solver stops at the
    bound."""
    bound = budget.max_indexable_tokens(8, 128, 16)
    assert bound * 8 * 128 <= budget.INDEX_LIMIT < (bound + 16) * 8 * 128
    small = Sizing(cell_bytes=2 * 2 * 8 * 128 * 2, context_len=131072, page_size=16, running_reqs=16,
                   decode_rows=16,
                   max_tokens=bound)
    assert budget.solve_target_tokens(78 << 30, small) == bound
    assert budget.solve_target_tokens(1 << 30, small) < bound  # below the bound the memory decides


def test_only_the_backends_whose_kernels_offset_in_64_bits_pass_the_32_bit_bound():
    """aiter_triton's serving path (our decode, MLA decode, gather and RoPE stores; AITER's paged decode only
    within the bound) and torch's indexing offset a layer's cache in 64 bits; --deterministic's unified
    attention and native AITER in 32. Wide, the int32 slots bound the cache."""
    assert budget.wide_offsets("aiter_triton", False) and budget.wide_offsets("torch", False)
    assert budget.wide_offsets("torch", True)
    assert not budget.wide_offsets("aiter_triton", True) and not budget.wide_offsets("aiter", False)
    narrow, wide = (budget.max_indexable_tokens(2, 256, 16, w) for w in (False, True))
    assert narrow == 4194288 < wide == budget.INDEX_LIMIT // 16 * 16  # qwen3.5-35b-a3b's full layers: 2 x 256
    assert budget.max_indexable_tokens(1, 576, 64) == 3728256  # an MLA latent, pages of 64 (deepseek)


def test_mla_splits_fill_one_program_per_sm_and_the_peak_scratch_sits_below_it():
    splits = {rows: launch_rules.mla_kv_splits(rows) for rows in range(1, 1025)}
    assert splits[1] == 32 and splits[16] == 9 and splits[64] == 3 and splits[256] == 1  # the H100 tuning
    assert all(1 <= s <= launch_rules.MLA_MAX_SPLITS for s in splits.values())
    assert all(rows * s >= launch_rules.MLA_SPLIT_PROGRAMS or s == launch_rules.MLA_MAX_SPLITS
               for rows, s in splits.items())
    assert all(splits[r] >= splits[r + 1] for r in range(1, 1024))
    assert all(s == 1 for rows, s in splits.items() if rows >= launch_rules.MLA_SPLIT_PROGRAMS)
    # deepseek-v2-lite: 16 heads, latent 512; one split writes the output, more their fp32 partials
    partials = {n: launch_rules.mla_partials_bytes(n, 16, 512, splits[n]) for n in range(1, 257)}
    assert partials[256] == 0 and partials[64] == 4 * 64 * 16 * 3 * 513
    # a call's scratch: the most partials of 1..rows, so it grows with the rows (the stress's corner at the
    # most rows holds what any call of fewer rows holds), though fewer rows split more
    scratch = [launch_rules.mla_decode_scratch_bytes(n, 16, 512) for n in range(1, 257)]
    assert scratch == [max(partials[k] for k in range(1, n + 1)) for n in range(1, 257)]
    assert all(a <= b for a, b in zip(scratch, scratch[1:]))
    assert scratch[-1] == partials[131] > partials[132] == 0


def test_mla_expanded_prefix_arithmetic():
    # deepseek-v2-lite: 16 heads, latent 512 + rope 64, nope 128, v 128
    per_key = (512 + 64) + 16 * (128 + 128) + 16 * (128 + 64) + 16 * 128
    assert budget.mla_expanded_bytes(1000, 16, 512, 64, 128, 128, 2) == 1000 * per_key * 2


@pytest.mark.parametrize("tokens", [144, 1008, 1024, 1031, 4111, 4112, 10_000])
def test_context_that_fits_is_the_longest_whose_smallest_cache_fits(tokens):
    ctx = budget.context_that_fits(tokens, 4096, 16, 64, 8)
    longest = max(n for n in range(1, 4097) if budget.min_usable_tokens(n, 16, 64, 8) <= tokens)
    assert ctx == (4096 if tokens >= 4112 else longest // 16 * 16)  # whole pages
    assert budget.min_usable_tokens(ctx, 16, 64, 8) <= tokens


def test_no_context_fits_when_the_prefill_batch_or_the_rows_alone_do_not():
    assert budget.context_that_fits(144, 4096, 16, 64, 8) == 128
    assert budget.context_that_fits(143, 4096, 16, 64, 8) is None  # 8 rows + the pad page: 144
    assert budget.context_that_fits(272, 4096, 16, 256, 1) == 256
    assert budget.context_that_fits(271, 4096, 16, 256, 1) is None  # 16 prefill pages + the pad page
