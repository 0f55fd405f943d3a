"""The v2 paged decode's partition reduce, in place of AITER's `_paged_attn_decode_v2_w_dot_reduce_kernel`.

AITER's reduce loads every partition of a row at once: a [partitions_pow2, group_pow2 (16), head_dim] tile of
partial outputs, 256 x 16 x 128 fp32 values for 4 warps at 256 partitions. It spills: 18,696 B of stack per
thread on an H100, and the driver reserves stack x every resident thread for the life of the process
(2.5-4.5 GiB of KV lost). This one merges the partitions in blocks of BLOCK_P, so registers hold
[BLOCK_P, head_dim] whatever the partition count: a log-sum-exp merge of the partitions' max-logits,
exp-sums and (normalized) partial outputs, one program per (row, query head).

Scratch layout (what the partition kernels write, contiguous): exp_sums/max_logits [rows, kv_heads,
max_parts, group] fp32, partials [rows, kv_heads, max_parts, group, head_dim]; MHA (group 1) is the same.
No allocation, no host sync: CUDA-graph safe. max_parts and partition follow the step's shape and are
unspecialized, so one compile per model serves every batch, length and partition size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_P = 16  # partitions merged per iteration: [16, head_dim] fp32 = 16 values per thread at 128 x 4 warps
NUM_WARPS = 4


@triton.jit(do_not_specialize=["max_parts", "partition"])
def _reduce_partitions_kernel(out_ptr, exp_sums_ptr, max_logits_ptr, partials_ptr, seq_lens_ptr,
                              stride_out_row, max_parts, partition,
                              GROUP: tl.constexpr, HEAD: tl.constexpr, HEAD_POW2: tl.constexpr,
                              BLOCK_P: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    seq_len = tl.load(seq_lens_ptr + row)
    num_parts = tl.cdiv(seq_len, partition)
    # (row, kv head) of this query head, then partition p of query g sits at (base + p) * GROUP + g
    base = ((row * num_heads + head) // GROUP).to(tl.int64) * max_parts
    g = head % GROUP
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, HEAD_POW2)

    m = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for start in range(0, num_parts, BLOCK_P):
        p = start + offs_p
        ml = tl.load(max_logits_ptr + (base + p) * GROUP + g, mask=p < num_parts, other=float("-inf"))
        m = tl.maximum(m, ml)
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # no key at all: weights 0, output 0

    total = tl.zeros([BLOCK_P], tl.float32)
    acc = tl.zeros([HEAD_POW2], tl.float32)
    for start in range(0, num_parts, BLOCK_P):
        p = start + offs_p
        live = p < num_parts
        idx = (base + p) * GROUP + g
        ml = tl.load(max_logits_ptr + idx, mask=live, other=float("-inf"))
        es = tl.load(exp_sums_ptr + idx, mask=live, other=0.0)
        w = tl.where(live, es * tl.exp(ml - m_all), 0.0)
        part = tl.load(partials_ptr + idx[:, None] * HEAD + offs_d[None, :],
                       mask=live[:, None] & (offs_d[None, :] < HEAD), other=0.0)
        # NOTE: a partition without a live key wrote 0/0 = NaN partials: weight 0 must drop them, not multiply
        acc += tl.sum(tl.where(w[:, None] > 0.0, w[:, None] * part.to(tl.float32), 0.0), axis=0)
        total += w
    norm = tl.sum(total, axis=0)
    norm = tl.where(norm == 0.0, 1.0, norm)
    tl.store(out_ptr + row * stride_out_row + head * HEAD + offs_d, (acc / norm).to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD)


def reduce_partitions(out: torch.Tensor, exp_sums: torch.Tensor, max_logits: torch.Tensor,
                      partials: torch.Tensor, seq_lens: torch.Tensor, partition: int) -> None:
    """out[row, head] = the partitions' partial outputs weighted by exp_sum * exp(max_logit - max),
    normalized.

    out: [rows, q_heads, head_dim] (heads contiguous); exp_sums, max_logits: [rows, kv_heads, max_parts
    (, group)] fp32; partials: [rows, kv_heads, max_parts(, group), head_dim]; all contiguous. A row with
    seq_len 0 gets 0."""
    rows, q_heads, head_dim = out.shape
    max_parts = exp_sums.shape[2]
    group = q_heads // exp_sums.shape[1]
    if out.stride(2) != 1 or out.stride(1) != head_dim:
        raise ValueError(f"reduce_partitions writes heads contiguously, got out strides {out.stride()}")
    for name, t in (("exp_sums", exp_sums), ("max_logits", max_logits), ("partials", partials)):
        if not t.is_contiguous():
            raise ValueError(f"reduce_partitions reads a contiguous {name}")
    expected = ((rows, q_heads // group, max_parts, group, head_dim) if group > 1
                else (rows, q_heads, max_parts, head_dim))
    if tuple(partials.shape) != expected:
        raise ValueError(f"partials shape {tuple(partials.shape)} != {expected}")
    _reduce_partitions_kernel[(rows, q_heads)](
        out, exp_sums, max_logits, partials, seq_lens, out.stride(0), max_parts, partition,
        GROUP=group, HEAD=head_dim, HEAD_POW2=triton.next_power_of_2(head_dim), BLOCK_P=BLOCK_P,
        num_warps=NUM_WARPS)
