"""The experts through AITER's Triton MoE kernels (aiter.ops.triton), the aiter_triton backend's fused_moe.

  sort_by_expert             the step's (token, slot) pairs sorted by expert, each expert's pairs padded to
                             a block of BLOCK_SIZE_M rows (the pad id T * k is masked by the kernels): our
                             one-launch kernel (triton_moe_sort) up to SORT_KERNEL_MAX_PAIRS pairs, else
                             layers.moe's torch ops (same outputs)
  fused_moe_silu             gate_up projection per block, silu(gate) * up fused: [T * k, I]
  fused_moe                  down projection per block, scaled by the routing weight: [T, k, H]
then a sum over k (moe_sum, with the addends a layer adds to the experts' output: the shared experts', the
residual). Every buffer's size follows the step's tokens T alone, whatever the routing: at most
T * k + E * (BLOCK_SIZE_M - 1) sorted slots (budget.moe_scratch_bytes), so the stress's corners at the most
tokens hold the most any routing can. No host sync: decode graphs capture it.

Not AITER's moe_align_block_size_triton: its token count is a constexpr (a compile per step size while
serving) and it leaves the padding unwritten. The GEMM kernels' token count (num_valid_tokens) follows the
step: unspecialized (aiter_loader), so the stress's compiles serve every step. Launch configs: CONFIGS below.

FP8 experts (quant: layers.quant.MoeQuant): each GEMM's input is quantized first (kernels.triton_fp8: per
(token, 128-group) for "block" weights, per token otherwise) and AITER's kernels run use_fp8_w8a8 on their
block-scaled path. Per-channel weight scales ride that path too, as blocks of [1, K]: one scale per output row
over the whole of K, with the token's one activation scale; AITER's own per-channel path would take one scale
per expert and quantize the activations per tensor. The extra buffers (the FP8 copies and their scales)
follow T alone: budget.moe_fp8_scratch_bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from autoprofile.kernels import launch_rules, triton_fp8, triton_moe_gemv, triton_moe_sort
from autoprofile.kernels.aiter_loader import load_aiter_moe
from autoprofile.layers import moe

# Per rows-per-block (launch_rules.moe_block_m). Small blocks (steps of few tokens): of 36 configs, the least
# geometric mean of times over deepseek-v2-lite's and qwen3-30b-a3b's experts at 1 and 8 tokens
# (scripts/tune_moe.py on an H100: 0.94 of vLLM's default's time; at 1 token 0.97 and 0.82); large blocks:
# vLLM's default launch config for unquantized experts
CONFIGS = {
    launch_rules.MOE_SMALL_BLOCK_M: {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 128,
                                     "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 3},
    launch_rules.MOE_LARGE_BLOCK_M: {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32,
                                     "GROUP_SIZE_M": 8},
}
# Pairs (T * k) up to which the sort is our one-program kernel; past them layers.moe's torch ops, faster on
# the GPU there (H100, in a graph: 8192 pairs 83-122 us against the torch ops' 130; 16384 pairs 123-232
# against 131-134). Up to 16384 (2,048 tokens at top-8) it stays ours: an eager prefill step that small is
# host-bound, and the torch ops are ~20 launches a layer against one. Measured (qwen3.5-35b-a3b-fp8, 1,384
# tokens + 32 decode rows, H100): the step's GPU time 45.2 ms with the torch sort, 45.6 ms with ours, its
# wall time unchanged (the host's other launches bound it; docs/measurements.md).
SORT_KERNEL_MAX_PAIRS = 16384
# FP8 experts: K tiles of 128 (the block scales' K block; FP8 dots take K tiles of 32 and more)
FP8_CONFIGS = {
    launch_rules.MOE_SMALL_BLOCK_M: {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128,
                                     "GROUP_SIZE_M": 1},
    launch_rules.MOE_LARGE_BLOCK_M: {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128,
                                     "GROUP_SIZE_M": 8},
}
COMPUTE_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def operands(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, quant) -> dict:
    """One GEMM's operands for AITER's kernels. FP8: a quantized, and the block-scaled path's arguments:
    the weight's scales as [E, ceil(N/bn), ceil(K/bk)] with block_shape [bn, bk]; "channel": [1, K]
    blocks."""
    if quant is None:
        return dict(A=a, B=w, A_scale=None, B_scale=None, block_shape=None)
    if quant.scheme.weight == "block":
        bn, bk = quant.scheme.block
        a_q, a_scale = triton_fp8.quantize_per_group(a, bk)
        return dict(A=a_q, B=w, A_scale=a_scale, B_scale=w_scale, block_shape=[bn, bk])
    a_q, a_scale = triton_fp8.quantize_per_token(a)
    return dict(A=a_q, B=w, A_scale=a_scale, B_scale=w_scale.unsqueeze(-1), block_shape=[1, a.shape[-1]])


SUM_BLOCK = 1024  # hidden channels a moe_sum program adds


@triton.jit
def _moe_sum_kernel(down_ptr, a_ptr, b_ptr, out_ptr, H, stride_a, stride_b, K: tl.constexpr,
                    ADDS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        acc += tl.load(down_ptr + (t * K + j) * H + cols, mask=live, other=0.0).to(tl.float32)
    if ADDS >= 1:
        acc += tl.load(a_ptr + t * stride_a + cols, mask=live, other=0.0).to(tl.float32)
    if ADDS >= 2:
        acc += tl.load(b_ptr + t * stride_b + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=live)


def moe_sum(down: torch.Tensor, out: torch.Tensor, add: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """out [T, H] = the top-k rows of down [T, k, H] (contiguous) plus each addend [T, H] (at most two: the
    shared experts' output, the residual), accumulated in fp32 and rounded once: one launch where torch took a
    reduction and an add per addend."""
    tokens, top_k, hidden = down.shape
    if len(add) > 2:
        raise ValueError(f"moe_sum adds at most 2 tensors to the experts' output, got {len(add)}")
    for a in add:
        if a.shape != out.shape or a.stride(-1) != 1:
            raise ValueError(f"an addend of shape {tuple(a.shape)} does not fit the experts' output "
                             f"{tuple(out.shape)} (or has no unit stride in its last dim)")
    a, b = (tuple(add) + (out, out))[:2]
    if tokens:
        _moe_sum_kernel[(tokens, triton.cdiv(hidden, SUM_BLOCK))](
            down, a, b, out, hidden, a.stride(0), b.stride(0), K=top_k, ADDS=len(add), BLOCK=SUM_BLOCK,
            num_warps=4)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, quant=None, deterministic: bool = False,
              add: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights/ids [T, k] -> [T, H] (as layers.moe.moe_reference),
    plus each tensor of `add` [T, H] (at most 2), summed with the top-k rows in one kernel (moe_sum). At a few
    (token, slot) pairs (launch_rules.moe_gemv) the experts run as GEMVs (triton_moe_gemv), else AITER's
    kernels.
    quant (layers.quant.MoeQuant): w13/w2 are float8_e4m3fn with its scales (as layers.quant's
    moe_reference_fp8). deterministic: batch-invariant (invariant_block_m, summed_in_order, then the addends
    in order)."""
    ops = load_aiter_moe()
    tokens, top_k = ids.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    if (not deterministic and launch_rules.moe_gemv(tokens * top_k)
            and triton_moe_gemv.serves(w13, quant)):  # a few pairs: GEMVs over the experts they reach
        return moe_sum(triton_moe_gemv.experts(x, w13, w2, weights, ids, quant), out, add)
    block_m = invariant_block_m() if deterministic else launch_rules.moe_block_m(tokens, top_k, num_experts)
    cfg = (CONFIGS if quant is None else FP8_CONFIGS)[block_m]
    sort = triton_moe_sort if tokens * top_k <= SORT_KERNEL_MAX_PAIRS else moe
    sorted_ids, block_experts, padded = sort.sort_by_expert(ids, num_experts, block_m)
    weights = weights.contiguous()
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    common = dict(B_zp=None, topk_weights=weights, topk_ids=ids, sorted_token_ids=sorted_ids,
                  expert_ids=block_experts, num_tokens_post_padded=padded,
                  compute_type=COMPUTE_TYPES[x.dtype], use_fp8_w8a8=quant is not None, use_int8_w8a16=False,
                  use_int4_w4a16=False)
    w13_scale, w2_scale = (None, None) if quant is None else (quant.w13_scale, quant.w2_scale)
    ops.silu(C=act, **operands(x, w13, w13_scale, quant), mul_routed_weight=False, top_k=top_k,
             config=dict(cfg), **common)
    down = torch.empty(tokens, top_k, x.shape[1], dtype=x.dtype, device=x.device)
    # NOTE: top_k=1: each sorted id is already the (token, slot) row of `act`
    ops.moe(C=down, **operands(act, w2, w2_scale, quant), mul_routed_weight=True, top_k=1,
            config=dict(cfg), **common)
    if deterministic:
        out = summed_in_order(down, out)
        for a in add:
            out = out + a
        return out
    return moe_sum(down, out, add)


def invariant_block_m() -> int:
    """--deterministic: one launch config for every step (the kernels never split K, so a row's products are
    one accumulator over K in BLOCK_SIZE_K steps: its bits follow the config, which moe_block_m picks by the
    step's tokens). The large blocks: the stress's corner at the most tokens runs them (moe_scratch_bytes)."""
    return launch_rules.MOE_LARGE_BLOCK_M


def summed_in_order(down: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = sum over k of down [T, k, H], each row's slots added in slot order in fp32, rounded once:
    torch.sum's reduction kernel picks how it splits the k values by the output count (the step's tokens)."""
    acc = down[:, 0].float()
    for j in range(1, down.shape[1]):
        acc += down[:, j]
    return out.copy_(acc)
