"""The memory-budget arithmetic: pure functions, every input an argument, no torch.cuda.

Terms (bytes unless named tokens):
    cell            per-token KV over all layers, per TP rank
    sized(T)        everything built from the token count T: KV + declared workspace + request table
    non_kv_peak     peak_reserved - sized(probe_tokens)   (weights, activations, graph pools)
    peers           total - free - own_reserved - own_non_torch, floored at 0
    budget(T)       (total - own_non_torch - non_kv_peak - peers - canary - overhead(T)) * mem_fraction
    target          largest page-aligned T with T * cell <= budget(T)   (overhead(T) grows with T)

How a kernel is launched (partitions, splits, rows per block, captured batch sizes) and what one launch
allocates are autoprofile.kernels.launch_rules'; this module counts what those launches hold.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from autoprofile.kernels.launch_rules import (SPLIT_DECODE_PROGRAMS, TRITON_PARTITION, aiter_num_partitions,
                                              batch_ladder, coarse_ladder, moe_block_m, sorted_slots,
                                              split_decode_scratch_bytes, split_decode_splits,
                                              triton_decode_uses_v1)

GiB = 1 << 30
MiB = 1 << 20
# The driver cannot hand out the last MiBs of the card: on H100 a 2/20/256 MiB cudaMalloc failed with
# 2.19/20.19/256.19 MiB reported free. Never plan to the last byte.
DRIVER_RESERVE = 64 * MiB


def gib(n: float) -> float:
    return n / GiB


# ---------------------------------------------------------------- per-token KV
def running_reqs(running_max_req_size: int | None, graph_max_batch_size: int) -> int:
    """Request slots: --running_max_req_size, or --graph_max_batch_size (every decode step a graph)."""
    return running_max_req_size or graph_max_batch_size


def kv_cell_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1) -> int:
    """MHA/GQA: K and V, kv heads split over TP ranks (replicated when there are fewer heads than ranks)."""
    heads_per_rank = max(num_kv_heads // tp, 1)
    return 2 * heads_per_rank * head_dim * num_layers * dtype_bytes


def mla_cell_bytes(num_layers: int, kv_lora_rank: int, rope_dim: int, dtype_bytes: int) -> int:
    """MLA: one compressed latent plus the rope key per token, replicated on every rank."""
    return (kv_lora_rank + rope_dim) * num_layers * dtype_bytes


def cache_shape(model, tp: int = 1) -> tuple[int, int]:
    """(heads, width) of one layer's cache per token on one rank: the K (and V) heads of this rank, or MLA's
    one latent of kv_lora_rank + rope dim (replicated)."""
    if model.is_mla:
        return 1, model.kv_lora_rank + model.qk_rope_head_dim
    return max(model.num_kv_heads // tp, 1), model.head_dim


def cell_bytes_for(model, dtype_bytes: int, tp: int = 1) -> int:
    """A token's K/V over the layers that hold a KV cache (a hybrid model's attention layers only)."""
    if model.is_mla:
        return mla_cell_bytes(model.attention_layers, model.kv_lora_rank, model.qk_rope_head_dim, dtype_bytes)
    return kv_cell_bytes(model.attention_layers, model.num_kv_heads, model.head_dim, dtype_bytes, tp)


def state_cache_bytes(model, slots: int, dtype_bytes: int, tp: int = 1,
                      checkpoints: int = 0) -> tuple[int, int]:
    """A hybrid model's state cache (engine.state_cache): its (conv, ssm) tensors' bytes for `slots` request
    slots, the pad slot and `checkpoints` checkpoint rows; (0, 0) for a model without linear layers."""
    n = (slots + 1 + checkpoints) * model.linear_layers
    return n * model.conv_state_bytes(tp, dtype_bytes), n * model.ssm_state_bytes(tp)


# ---------------------------------------------------------------- sizes derived from T
INDEX_LIMIT = (1 << 31) - 1  # 32-bit offsets: AITER's paged kernels index one layer's K (or V) view with them


def wide_offsets(backend: str, deterministic: bool) -> bool:
    """Whether the kernels indexing a layer's cache on `backend`'s path offset it in 64 bits (a view past
    INDEX_LIMIT elements): torch's indexing; aiter_triton's own kernels (its AITER v1/v2 decode only within
    the limit: AiterTritonBackend.decode), not --deterministic's unified attention nor native AITER's."""
    return backend == "torch" or (backend == "aiter_triton" and not deterministic)


def max_indexable_tokens(kv_heads: int, head_dim: int, page_size: int, wide: bool = False) -> int:
    """The most KV tokens a layer's view [pages, kv_heads, page, head_dim] holds within what the kernels
    address: INDEX_LIMIT elements with 32-bit offsets, INDEX_LIMIT tokens (int32 slots) with 64-bit ones."""
    return round_down(INDEX_LIMIT // (1 if wide else kv_heads * head_dim), page_size)


def round_down(tokens: int, page_size: int) -> int:
    return max(tokens, 0) // page_size * page_size


def round_up(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size) * page_size


def aiter_workspace_bytes(max_reqs: int, q_heads: int, head_dim: int, num_partitions: int) -> int:
    """Native AITER paged decode: fp32 partial outputs (4*head_dim) + exp-sums and max-logits (8)."""
    return max_reqs * q_heads * num_partitions * (4 * head_dim + 8)


def triton_decode_workspace_bytes(num_seqs: int, q_heads: int, head_dim: int, max_seq_len: int,
                                  out_bytes: int, partition: int = 1024) -> int:
    """AITER Triton paged decode v2, allocated per call (inside a graph: in its pool, for good)."""
    return num_seqs * q_heads * math.ceil(max_seq_len / partition) * (head_dim * out_bytes + 8)


def triton_decode_scratch_bytes(num_seqs: int, q_heads: int, head_dim: int, max_seq_len: int, out_bytes: int,
                                partition: int = TRITON_PARTITION) -> int:
    """What one AITER Triton decode call allocates: v2 partials, nothing on the v1 path. Eager decode runs
    in AITER's partitions; a captured graph in triton_decode_partition's."""
    if triton_decode_uses_v1(num_seqs, q_heads, max_seq_len):
        return 0
    return triton_decode_workspace_bytes(num_seqs, q_heads, head_dim, max_seq_len, out_bytes, partition)


def split_decode_peak_scratch_bytes(max_seqs: int, q_heads: int, kv_heads: int, head_dim: int,
                                    max_seq_len: int) -> int:
    """The most any call of 1..max_seqs rows allocates: fewer rows take more splits, so the peak need not be
    at the most rows (splits > 1 only below SPLIT_DECODE_PROGRAMS rows)."""
    return max(split_decode_scratch_bytes(n, q_heads, head_dim, split_decode_splits(n, kv_heads, max_seq_len))
               for n in range(1, min(max_seqs, SPLIT_DECODE_PROGRAMS) + 1))


def persistent_workspace_bytes(backend: str, max_reqs: int, longest: int, q_heads: int, head_dim: int) -> int:
    """The persistent workspace each backend declares (its workspace_bytes; only native AITER has one)."""
    if backend != "aiter":
        return 0
    return aiter_workspace_bytes(max_reqs, q_heads, head_dim, aiter_num_partitions(longest))


# ---------------------------------------------------------------- MoE experts (per step, from T)
def moe_scratch_bytes(tokens: int, top_k: int, num_experts: int, inter: int, hidden: int,
                      elem_bytes: int) -> int:
    """What the fused MoE path holds at once for a step of `tokens` tokens (per call, freed after it): the
    expert sort's int64 temporaries (5 per pair, 4 per expert, 1 per block) and int32 outputs (sorted ids,
    block experts), the [T*k, I] and [T, k, H] intermediates and the [T, H] sum. A function of T alone:
    the routing decides which slots hold which pairs, never how many there are."""
    block_m = moe_block_m(tokens, top_k, num_experts)
    slots = sorted_slots(tokens, top_k, num_experts, block_m)
    pairs, blocks = tokens * top_k, -(-slots // block_m)
    sort = 8 * (5 * pairs + 4 * num_experts + blocks + 1) + 4 * (slots + blocks + 1)
    return sort + elem_bytes * (pairs * inter + pairs * hidden + tokens * hidden)


def moe_fp8_scratch_bytes(tokens: int, top_k: int, inter: int, hidden: int, group: int | None) -> int:
    """FP8 experts' extra per-call buffers (triton_moe), on top of moe_scratch_bytes: each GEMM's input
    in FP8 ([T, H] and [T*k, I], a byte each) and its fp32 scales, one per row (group None: per token) or per
    row and group of `group` columns."""
    pairs = tokens * top_k
    scales = tokens + pairs if group is None else tokens * -(-hidden // group) + pairs * -(-inter // group)
    return tokens * hidden + pairs * inter + 4 * scales


# --------------------------------------------------------------- MLA (kernels.triton_mla, models.deepseek_v2)
def mla_unmeasured_reserve_bytes(rows: int, max_seq_len: int) -> int:
    """What plan keeps beside MLA's decode scratch until deepseek-v2-lite's KV is profiled again with our MLA
    decode: the rows of docs/measured_kv_tokens.csv for deepseek-v2-lite (2026-11-25/26) were measured with
    AITER's, whose packed token slots (rows x max_seq_len int32 and the row offsets) sat in the graph pool.
    Without it plan predicts ~0.4% above those measurements (its rule: never above a measurement). Drop it
    with the re-measured rows."""
    return 4 * (rows * max_seq_len + rows + 1)


def mla_expanded_bytes(keys: int, heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int, v_dim: int,
                       elem_bytes: int) -> int:
    """MLA's expanded prefill over `keys` keys (a chunk over the longest cached prefix: keys = the context):
    the gathered latents, kv_b_proj's output (each head's k_nope and v), the keys [k_nope | k_pe] and a
    contiguous v, all live inside the attention call."""
    latent, kv_b_out = kv_lora_rank + rope_dim, heads * (nope_dim + v_dim)
    per_key = latent + kv_b_out + heads * (nope_dim + rope_dim) + heads * v_dim
    return keys * per_key * elem_bytes


# Decode graphs are captured per (batch size, max_seq_len bucket): AITER's Triton decode launches its
# partitions and sizes its reduction from max_seq_len, so a batch at ~1k tokens replayed at 131072
# costs 5x the same batch at 4096 (H100). The first bucket, then x DECODE_BUCKET_GROWTH up to the context.
DECODE_FIRST_BUCKET = 4096
DECODE_BUCKET_GROWTH = 4


def decode_buckets(context_len: int) -> list[int]:
    """max_seq_len values a decode step is launched with, ascending; the last is context_len (a bucket
    within 2x of it is dropped: context_len serves those rows at little extra cost)."""
    b, out = DECODE_FIRST_BUCKET, []
    while 2 * b <= context_len:
        out.append(b)
        b *= DECODE_BUCKET_GROWTH
    return out + [context_len]


def decode_bucket(buckets: list[int], longest: int) -> int:
    """The smallest bucket that holds the batch's longest seq_len (tokens incl. the one decoded)."""
    for b in buckets:
        if b >= longest:
            return b
    raise ValueError(f"a decode row of {longest} tokens is longer than the largest bucket {buckets[-1]}")


def decode_graph_keys(max_bs: int, context_len: int) -> list[tuple[int, int]]:
    """(batch size, bucket) of every decode graph, in capture order: the largest scratch first (longest
    bucket, largest batch), so later captures reuse the shared pool's blocks. The first bucket takes the
    full batch ladder, the longer ones (rarer, and dominated by attention) the coarse one."""
    buckets = decode_buckets(context_len)
    return [(bs, bucket) for i, bucket in reversed(list(enumerate(buckets)))
            for bs in reversed(batch_ladder(max_bs) if i == 0 else coarse_ladder(max_bs))]


def req_table_bytes(max_reqs: int, context_len: int, page_size: int) -> int:
    """Request table: one int32 page id per page of the longest request, and the last sampled token, per
    request slot (kv_cache.ReqTable: one buffer)."""
    return max_reqs * (math.ceil(context_len / page_size) + 1) * 4


def reserved_bytes(n: int) -> int:
    """What PyTorch's caching allocator reserves for one n-byte buffer: small buffers share 2 MiB
    segments, 1-10 MiB buffers get a 20 MiB segment, larger ones are rounded up to 2 MiB."""
    if n <= 0:
        return 0
    if n <= MiB:
        return 2 * MiB
    if n < 10 * MiB:
        return 20 * MiB
    return -(-n // (2 * MiB)) * 2 * MiB


def min_usable_tokens(context_len: int, page_size: int, batch_max_tokens: int = 0,
                      decode_rows: int = 0) -> int:
    """The smallest cache that can serve, in tokens (a page multiple): one request of context_len
    tokens in whole pages, one prefill batch of batch_max_tokens tokens, and a page for each of
    decode_rows concurrent decodes, each PLUS the pad page (PageAllocator never hands out page 0).
    The one rule for config validation, the solver's floor, the shrink schedule, diagnostics and plan."""
    pages = max(math.ceil(context_len / page_size), math.ceil(batch_max_tokens / page_size), decode_rows) + 1
    return pages * page_size


def context_that_fits(tokens: int, context_len: int, page_size: int, batch_max_tokens: int = 0,
                      decode_rows: int = 0) -> int | None:
    """The longest request length, at most context_len, whose smallest usable cache (min_usable_tokens)
    fits a cache of `tokens`: context_len itself, else the whole pages left beside the pad page; None when
    the prefill batch or the decode rows alone do not fit (no shorter request helps then)."""
    if min_usable_tokens(context_len, page_size, batch_max_tokens, decode_rows) <= tokens:
        return context_len
    if min_usable_tokens(page_size, page_size, batch_max_tokens, decode_rows) > tokens:
        return None
    return (tokens // page_size - 1) * page_size


# ---------------------------------------------------------------- probe
def probe_tokens(batch_max_tokens: int, graph_max_batch_size: int, page_size: int,
                 decode_pages: int = 2) -> int:
    """Smallest cache that runs both stresses: one full prefill batch, or every graph request holding
    `decode_pages` pages. Activation and graph-pool memory do not depend on context length (decode
    metadata is sized at max_req_total_len regardless), so a longer probe measures nothing more."""
    return round_up(max(batch_max_tokens, graph_max_batch_size * decode_pages * page_size), page_size)


# ---------------------------------------------------------------- measurement terms
def non_kv_peak(peak_reserved: int, probe_sized_bytes: int) -> int:
    """What the stresses needed besides what the probe built from T. Floors at 0."""
    return max(peak_reserved - probe_sized_bytes, 0)


def own_non_torch(process_used: int | None, own_reserved: int, total: int, free: int) -> int:
    """This process outside the caching allocator (CUDA context, NCCL, cuBLAS workspaces).

    With NVML's per-process figure: process_used - reserved. Without it, assume every non-torch byte
    on the device is ours (pessimistic for us, safe for peers): total - free - reserved."""
    used = process_used if process_used is not None else total - free
    return max(used - own_reserved, 0)


def peer_bytes(total: int, free: int, own_reserved: int, own_non_torch_bytes: int) -> int:
    """Other processes on the same GPU."""
    return max(total - free - own_reserved - own_non_torch_bytes, 0)


def available_bytes(total: int, own_non_torch_bytes: int, non_kv: int, peers: int, canary: int,
                    driver_reserve: int = DRIVER_RESERVE) -> int:
    """What is left for everything sized from T, before mem_fraction."""
    return total - own_non_torch_bytes - non_kv - peers - canary - driver_reserve


CHECKPOINT_SHARE = 0.25  # a hybrid's state checkpoints (its prefix cache's resumable points) per request slot
MIN_CHECKPOINTS = 4
# at most this many by default: a quarter of 256 slots (64 rows, 9.2 GiB of qwen3.5-27b's KV) gave a multi-turn
# run no TTFT gain (docs/measurements.md, "Hybrid models"); a few shared system prompts need a few rows
MAX_DEFAULT_CHECKPOINTS = 8


def state_checkpoints(slots: int, prefix_caching: bool = True, requested: int | None = None) -> int:
    """A hybrid model's state checkpoint rows beside its `slots` request slots (engine.state_cache):
    --state_checkpoints when set, else a quarter of them, at least MIN_CHECKPOINTS and at most
    MAX_DEFAULT_CHECKPOINTS; none without prefix caching."""
    if not prefix_caching:
        return 0
    if requested is not None:
        return requested
    return max(MIN_CHECKPOINTS, min(MAX_DEFAULT_CHECKPOINTS, math.ceil(slots * CHECKPOINT_SHARE)))


STATE_SHARE = 0.5  # of the memory free after the weights, at most this share goes to a hybrid's state slots


def state_slots(default: int, free: int, slot_bytes: int, share: float = STATE_SHARE) -> int:
    """A hybrid model's request slots when --running_max_req_size is unset: the envelope's default (every
    decode row with its state), unless their state would take more than `share` of `free` (the memory left
    after the weights; the rest is for activations and KV): then the most slots that fit in it, at least 1."""
    return max(1, min(default, int(free * share) // max(slot_bytes, 1)))


@dataclass(frozen=True)
class Sizing:
    """How everything built from T is sized: the solver and the engine share it. The request table
    and the declared workspace are sized from the envelope's rows (running requests, decode rows per
    step), not from T; only the workspace's partition count follows T (min(context_len, T))."""

    cell_bytes: int
    context_len: int
    page_size: int
    running_reqs: int  # request slots (envelope.running_reqs)
    decode_rows: int  # rows of one decode step (envelope.decode_rows)
    workspace: Callable[[int, int], int] | None = None  # (decode_rows, longest_seq) -> declared bytes
    max_tokens: int | None = None  # what the kernels address (max_indexable_tokens)
    state: tuple[int, int] = (0, 0)  # a hybrid model's state cache: its two tensors (state_cache_bytes)

    def workspace_reserved(self, tokens: int) -> int:
        """The backend's declared persistent workspace at T, as the caching allocator reserves it."""
        ws = self.workspace(self.decode_rows, min(self.context_len, tokens)) if self.workspace else 0
        return reserved_bytes(ws)

    def table_reserved(self, tokens: int) -> int:
        return reserved_bytes(req_table_bytes(self.running_reqs, self.context_len, self.page_size))

    def overhead(self, tokens: int) -> int:
        """Declared bytes built beside the KV (workspace, request table, a hybrid model's state slots), as
        the caching allocator reserves them (a 1 MiB table and a 2 MiB one differ by a 20 MiB segment:
        counted here, not discovered as an OOM in validation)."""
        return (self.workspace_reserved(tokens) + self.table_reserved(tokens)
                + sum(map(reserved_bytes, self.state)))

    def sized_bytes(self, tokens: int) -> int:
        return tokens * self.cell_bytes + self.overhead(tokens)


def solve_target_tokens(available: int, sizing: Sizing, mem_fraction: float = 1.0) -> int:
    """Largest page-aligned T with T*cell <= (available - overhead(T)) * mem_fraction.

    overhead(T) is non-decreasing in T (partitions cap at min(context_len, T)), so the condition is
    monotone and a binary search over pages is exact."""

    def fits(pages: int) -> bool:
        t = pages * sizing.page_size
        return t * sizing.cell_bytes <= (available - sizing.overhead(t)) * mem_fraction

    lo, hi = 0, max(available, 0) // (sizing.cell_bytes * sizing.page_size) + 1
    while lo < hi:  # largest pages in [0, hi) that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return min(lo * sizing.page_size, sizing.max_tokens or lo * sizing.page_size)


# ---------------------------------------------------------------- retries and diagnostics
def shrink(tokens: int, ratio: float, page_size: int) -> int:
    """Next attempt's size: always strictly smaller (by at least a page) and page-aligned."""
    return max(min(round_down(int(tokens * ratio), page_size), tokens - page_size), 0)


def shrink_schedule(initial: int, ratio: float, max_retries: int, page_size: int,
                    floor: int = 0) -> list[int]:
    """Sizes tried: the initial target then up to max_retries shrinks (1 + max_retries attempts), never
    below `floor` (min_usable_tokens): a shrink that would cross it tries the floor itself, and the
    schedule stops there. An initial target below the floor is not tried at all (empty schedule)."""
    if initial < floor:
        return []
    sizes = [initial]
    for _ in range(max_retries):
        if sizes[-1] <= floor:
            break
        sizes.append(max(shrink(sizes[-1], ratio, page_size), floor))
    return sizes


@dataclass(frozen=True)
class GiveUp:
    """What the give-up diagnostic reports."""

    initial_tokens: int
    last_tokens: int
    attempts: int
    cell_bytes: int
    peak_reserved: int
    total: int
    canary: int
    peers: int
    last_error: str
    flags: dict  # current values of the knobs, by flag name
    min_tokens: int = 0  # min_usable_tokens: no suggestion goes below it
    stage: str = "validate"  # probe | measure | validate | teardown
    ranks: tuple = ()  # TP: every rank's (peak_reserved, total, peers), so every rank prints one text


def _headline(g: GiveUp) -> str:
    if g.stage == "probe":
        return (f"autoprofile: the worst-case stress failed even with the small probe cache of "
                f"{g.initial_tokens} "
                "tokens: the model, its activations or its graphs do not fit beside what is on the GPU.")
    if g.stage == "measure":
        return (f"autoprofile: the measured budget fits {g.last_tokens} KV tokens, fewer than the "
                f"{g.min_tokens} "
                "the smallest usable cache needs (one request of --max_req_total_len, one prefill batch and "
                "one page per decode row, plus the pad page); nothing was built at the target.")
    if g.stage == "teardown":
        return ("autoprofile: tearing the engine down failed; the GPU state is unknown, so nothing was "
                "retried.")
    if g.attempts == 0:
        return "autoprofile: no KV cache size was tried: the first target is below the smallest usable cache."
    return f"autoprofile: no KV cache size survived the worst-case stress after {g.attempts} attempt(s)."


def _knobs(g: GiveUp) -> list[str]:
    """Only knobs that can help at this stage, each with a value the CLI accepts."""
    f, ps = g.flags, g.flags.get("page_size", 16)
    fraction = f.get("mem_fraction", 1.0)
    out = []
    if g.stage == "validate" and g.last_tokens > g.min_tokens:
        hint = max(round_down(int(g.last_tokens * 0.8), ps), g.min_tokens)
        out.append(f"  --max_total_token_num {hint}   pin a smaller cache (still validated; "
                   f">= {g.min_tokens}, the smallest usable)")
    ctx = f.get("max_req_total_len")
    if g.stage == "measure" and _fitting_context(g) is not None:
        ctx = f"{_fitting_context(g)} (now {ctx})"
    else:
        ctx = f"(now {ctx})"
    out += [
        f"  --batch_max_tokens (now {f.get('batch_max_tokens')})   smaller prefill batches need fewer "
        f"activations",
        f"  --graph_max_batch_size (now {f.get('graph_max_batch_size')})   smaller decode graphs and pools",
        f"  --max_req_total_len {ctx}   shorter requests shrink the smallest usable cache, workspace and "
        f"tables",
        f"  --running_max_req_size (now {f.get('running_max_req_size')})   fewer request slots",
    ]
    if g.stage == "validate":
        lower = max(round(fraction * 0.9, 2), 0.01)
        out.append(f"  --mem_fraction {lower} (now {fraction})   leave more of the measured budget unused")
    elif g.stage == "measure" and fraction < 1:
        out.append(f"  --mem_fraction 1.0 (now {fraction})   it scales the measured budget down: raise it")
    out.append(f"  --canary_mb (now {f.get('canary_mb')})   headroom held through validation")
    if g.stage == "validate":
        out.append(f"  --shrink_ratio (now {f.get('shrink_ratio')}) / --max_retries (now "
                   f"{f.get('max_retries')})")
    out += [f"  --tp (now {f.get('tp')})   spread weights and KV over more GPUs",
            "  --disable_cudagraph   drop the decode graph pools"]
    if g.peers:
        out.append(f"  or free the GPU: other processes hold {gib(g.peers):.2f} GiB on it")
    return out


def _fitting_context(g: GiveUp) -> int | None:
    """The longest --max_req_total_len whose smallest usable cache fits the measured budget, if any."""
    f, ps = g.flags, g.flags.get("page_size", 16)
    ctx = (g.last_tokens // ps - 1) * ps
    bmt, rows = f.get("batch_max_tokens") or 0, f.get("graph_max_batch_size") or 0
    if ctx < 2 or min_usable_tokens(ctx, ps, bmt, rows) > g.last_tokens:
        return None
    return ctx


def _gpu_lines(g: GiveUp) -> list[str]:
    if len(g.ranks) < 2:
        return [f"  measured peak       : {gib(g.peak_reserved):.2f} GiB reserved by this process",
                f"  GPU total           : {gib(g.total):.2f} GiB",
                f"  canary              : {gib(g.canary):.2f} GiB",
                f"  peers on this GPU   : {gib(g.peers):.2f} GiB"]

    def per_rank(i: int) -> str:
        return ", ".join(f"rank {r} {gib(v[i]):.2f}" for r, v in enumerate(g.ranks)) + " GiB"
    return [f"  measured peak       : {per_rank(0)} reserved by each rank's process",
            f"  GPU total           : {per_rank(1)}",
            f"  canary              : {gib(g.canary):.2f} GiB per rank",
            f"  peers on the GPU    : {per_rank(2)}"]


def give_up_diagnostic(g: GiveUp) -> str:
    return "\n".join([
        _headline(g),
        f"  initial target      : {g.initial_tokens} tokens ({gib(g.initial_tokens * g.cell_bytes):.2f} GiB "
        f"KV)",
        f"  last attempt        : {g.last_tokens} tokens ({gib(g.last_tokens * g.cell_bytes):.2f} GiB KV)",
        f"  smallest usable     : {g.min_tokens} tokens ({gib(g.min_tokens * g.cell_bytes):.2f} GiB KV)",
        *_gpu_lines(g),
        f"  last error          : {g.last_error}",
        "Turn one of these knobs:",
    ] + _knobs(g))
