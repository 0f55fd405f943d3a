"""The memory-budget arithmetic: pure functions, every input an argument, no torch.cuda.

Terms (bytes unless named tokens):
    cell            per-token KV over all layers, per TP rank
    sized(T)        everything built from the token count T: KV + declared workspace + request table
    non_kv_peak     peak_reserved - sized(probe_tokens)   (weights, activations, graph pools)
    peers           total - free - own_reserved - own_non_torch, floored at 0
    budget(T)       (total - own_non_torch - non_kv_peak - peers - canary - overhead(T)) * mem_fraction
    target          largest page-aligned T with T * cell <= budget(T)   (overhead(T) grows with T)
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20
AITER_PARTITION = 256  # native AITER paged_attention_ragged partition size (tokens)
# The driver cannot hand out the last MiBs of the card: on H100 a 2/20/256 MiB cudaMalloc failed with
# 2.19/20.19/256.19 MiB reported free. Never plan to the last byte.
DRIVER_RESERVE = 64 * MiB


def gib(n: float) -> float:
    return n / GiB


# ---------------------------------------------------------------- per-token KV
def kv_cell_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1) -> int:
    """MHA/GQA: K and V, kv heads split over TP ranks (replicated when there are fewer heads than ranks)."""
    heads_per_rank = max(num_kv_heads // tp, 1)
    return 2 * heads_per_rank * head_dim * num_layers * dtype_bytes


def mla_cell_bytes(num_layers: int, kv_lora_rank: int, rope_dim: int, dtype_bytes: int) -> int:
    """MLA: one compressed latent plus the rope key per token, replicated on every rank."""
    return (kv_lora_rank + rope_dim) * num_layers * dtype_bytes


def cell_bytes_for(model, dtype_bytes: int, tp: int = 1) -> int:
    if model.is_mla:
        return mla_cell_bytes(model.num_layers, model.kv_lora_rank, model.qk_rope_head_dim, dtype_bytes)
    return kv_cell_bytes(model.num_layers, model.num_kv_heads, model.head_dim, dtype_bytes, tp)


# ---------------------------------------------------------------- sizes derived from T
def round_down(tokens: int, page_size: int) -> int:
    return max(tokens, 0) // page_size * page_size


def round_up(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size) * page_size


def aiter_num_partitions(context_len: int, tokens: int | None = None, partition: int = AITER_PARTITION) -> int:
    """Partitions per sequence; no sequence can outgrow the cache, so cap by min(context_len, T)."""
    longest = context_len if tokens is None else min(context_len, tokens)
    return math.ceil(longest / partition)


def aiter_workspace_bytes(max_reqs: int, q_heads: int, head_dim: int, num_partitions: int) -> int:
    """Native AITER paged decode: fp32 partial outputs (4*head_dim) + exp-sums and max-logits (8)."""
    return max_reqs * q_heads * num_partitions * (4 * head_dim + 8)


def triton_decode_workspace_bytes(num_seqs: int, q_heads: int, head_dim: int, max_seq_len: int,
                                  out_bytes: int, partition: int = 1024) -> int:
    """AITER Triton paged decode v2, allocated per call (inside a graph: in its pool, for good)."""
    return num_seqs * q_heads * math.ceil(max_seq_len / partition) * (head_dim * out_bytes + 8)


def req_table_bytes(max_reqs: int, context_len: int, page_size: int) -> int:
    """Request table: one int32 page id per page of the longest request, per request slot."""
    return max_reqs * math.ceil(context_len / page_size) * 4


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


# ---------------------------------------------------------------- probe
def probe_tokens(batch_max_tokens: int, graph_max_batch_size: int, page_size: int, decode_pages: int = 2) -> int:
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

    def workspace_reserved(self, tokens: int) -> int:
        """The backend's declared persistent workspace at T, as the caching allocator reserves it."""
        ws = self.workspace(self.decode_rows, min(self.context_len, tokens)) if self.workspace else 0
        return reserved_bytes(ws)

    def table_reserved(self, tokens: int) -> int:
        return reserved_bytes(req_table_bytes(self.running_reqs, self.context_len, self.page_size))

    def overhead(self, tokens: int) -> int:
        """Declared bytes built beside the KV (workspace, request table), as the caching allocator
        reserves them (a 1 MiB table and a 2 MiB one differ by a 20 MiB segment: counted here, not
        discovered as an OOM in validation)."""
        return self.workspace_reserved(tokens) + self.table_reserved(tokens)

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
    return lo * sizing.page_size


# ---------------------------------------------------------------- retries and diagnostics
def shrink(tokens: int, ratio: float, page_size: int) -> int:
    """Next attempt's size: always strictly smaller (by at least a page) and page-aligned."""
    return max(min(round_down(int(tokens * ratio), page_size), tokens - page_size), 0)


def shrink_schedule(initial: int, ratio: float, max_retries: int, page_size: int) -> list[int]:
    """Sizes tried: the initial target then max_retries shrinks (1 + max_retries attempts)."""
    sizes = [initial]
    for _ in range(max_retries):
        sizes.append(shrink(sizes[-1], ratio, page_size))
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


def give_up_diagnostic(g: GiveUp) -> str:
    f = g.flags
    fit_hint = max(shrink(g.last_tokens, 0.8, f.get("page_size", 16)), 0)
    return "\n".join([
        f"autoprofile: no KV cache size survived the worst-case stress after {g.attempts} attempt(s).",
        f"  initial target      : {g.initial_tokens} tokens ({gib(g.initial_tokens * g.cell_bytes):.2f} GiB KV)",
        f"  last attempt        : {g.last_tokens} tokens ({gib(g.last_tokens * g.cell_bytes):.2f} GiB KV)",
        f"  measured peak       : {gib(g.peak_reserved):.2f} GiB reserved by this process",
        f"  GPU total           : {gib(g.total):.2f} GiB",
        f"  canary              : {gib(g.canary):.2f} GiB",
        f"  peers on this GPU   : {gib(g.peers):.2f} GiB",
        f"  last error          : {g.last_error}",
        "Turn one of these knobs:",
        f"  --max_total_token_num {fit_hint}   pin a smaller cache (still validated)",
        f"  --batch_max_tokens (now {f.get('batch_max_tokens')})   smaller prefill batches need fewer activations",
        f"  --graph_max_batch_size (now {f.get('graph_max_batch_size')})   smaller decode graphs and pools",
        f"  --max_req_total_len (now {f.get('max_req_total_len')})   shorter requests shrink workspace and tables",
        f"  --running_max_req_size (now {f.get('running_max_req_size')})   fewer request slots",
        f"  --mem_fraction (now {f.get('mem_fraction')})   leave more of the measured budget unused",
        f"  --canary_mb (now {f.get('canary_mb')})   headroom held through validation",
        f"  --shrink_ratio (now {f.get('shrink_ratio')}) / --max_retries (now {f.get('max_retries')})",
        f"  --tp (now {f.get('tp')})   spread weights and KV over more GPUs",
        "  --disable_cudagraph   drop the decode graph pools",
    ] + ([f"  or free the GPU: other processes hold {gib(g.peers):.2f} GiB on it"] if g.peers else []))
