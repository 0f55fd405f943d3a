"""Batch-invariant attention for --deterministic: AITER's Triton `kernel_unified_attention_2d` (vLLM's unified
attention) at one fixed launch config, for prefill chunks and decode rows alike, every key read from the
paged cache.

AITER's wrapper (unified_attention) picks its tile sizes, warps and a split-KV "3d" variant from the batch
(how many sequences, the longest query, the SM count), so a row's attention depends on its neighbours. Called
here with CONFIG, each program takes BLOCK_Q query tokens of one sequence times the GQA group (BLOCK_M rows)
and walks that sequence's keys from position 0 in tiles of TILE_SIZE, never split: a query row's scores, its
online softmax and its sum over V see the same tiles in the same order whether the row is a decode row, the
last token of a 5-token chunk or token 4,000 of an 8,192-token prompt, alone or beside 300 others (tiles past
a row's own position are masked to exact zeros). Scratch: none (the output only).
"""
from __future__ import annotations

import torch
import triton

# One config for every step: of 9 on an H100 (scripts/bench_deterministic.py), the fastest prefill (T=8192
# causal: 0.50x torch SDPA) whose decode keeps pace with the default (256 rows x 1,024 tokens: 0.98x).
BLOCK_M = 64
TILE_SIZE = 32
CONFIG = {"num_warps": 4, "num_stages": 2}


def block_m(group: int) -> int:
    """Rows a program holds: BLOCK_M, or the GQA group when it is larger (a power of two)."""
    return max(BLOCK_M, triton.next_power_of_2(group))


def attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
              scales: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] (unit stride in D), the tokens of len(seq_lens) sequences split by cu_seqlens [B+1] int32;
    sequence b has seq_lens[b] tokens in the cache (its q tokens last: causal, aligned bottom-right) on pages
    block_tables[b]; caches [num_pages, Hkv, page_size, D] (FP8: `scales` [2] = k_scale, v_scale) -> out."""
    from autoprofile.kernels.aiter_loader import load_unified_attention

    tokens, q_heads, head_dim = q.shape
    kv_heads, page = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    rows = block_m(group)
    block_q = rows // group
    seqs = seq_lens.shape[0]
    if tokens == 0:
        return out
    k_scale = scales[0:1] if scales is not None else None
    v_scale = scales[1:2] if scales is not None else None
    load_unified_attention()[(kv_heads, tokens // block_q + seqs)](
        output_ptr=out, query_ptr=q, key_cache_ptr=k_cache, value_cache_ptr=v_cache, sink_ptr=None,
        block_tables_ptr=block_tables, seq_lens_ptr=seq_lens, alibi_slopes_ptr=None, qq_bias_ptr=None,
        scale=scale, k_scale=k_scale, v_scale=v_scale, out_scale=1.0, softcap=0.0,
        num_query_heads=q_heads, num_queries_per_kv=group, block_table_stride=block_tables.stride(0),
        query_stride_0=q.stride(0), query_stride_1=q.stride(1), output_stride_0=out.stride(0),
        output_stride_1=out.stride(1), qq_bias_stride_0=0, BLOCK_SIZE=page, TILE_SIZE=TILE_SIZE,
        HEAD_SIZE=head_dim, HEAD_SIZE_PADDED=triton.next_power_of_2(head_dim), USE_ALIBI_SLOPES=False,
        USE_QQ_BIAS=False, USE_SOFTCAP=False, USE_SINKS=False, SLIDING_WINDOW=0,
        # our cache is [page, head, offset, dim]; the kernel indexes (page, offset, head, dim) by strides
        stride_k_cache_0=k_cache.stride(0), stride_k_cache_1=k_cache.stride(2),
        stride_k_cache_2=k_cache.stride(1), stride_k_cache_3=k_cache.stride(3),
        stride_v_cache_0=v_cache.stride(0), stride_v_cache_1=v_cache.stride(2),
        stride_v_cache_2=v_cache.stride(1), stride_v_cache_3=v_cache.stride(3),
        query_start_len_ptr=cu_seqlens, BLOCK_Q=block_q, num_seqs=seqs, BLOCK_M=rows, USE_FP8=False,
        ALL_DECODE=False, **CONFIG)
    return out
