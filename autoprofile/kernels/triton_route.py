"""The MoE router's greedy top-k and the stress's forced routing (layers.moe.route, then Routing.apply) in one
Triton launch: the torch version's dozen small kernels per MoE layer are launch-bound in decode.

Per token row: softmax in fp32 over the experts, the top_k (descending; among equal probabilities the lower
expert first), renormalised to sum 1 when asked, times `scale` (DeepSeek's routed_scaling_factor), cast to
the logits' dtype. Then the routing of the moment, read on the device from Routing.mode: the ids become
0..k-1 (worst) or (t * k + j) % E (balanced); the weights stay the router's. The token count is a runtime
argument (one compile serves every step) and nothing syncs with the host, so decode graphs capture it.

DeepSeek-V3's noaux_tc router (layers.moe.biased_grouped_topk) is one launch too, `biased_grouped_topk`: a
program's tile is [rows, groups, experts of a group], padded to powers of two. Sigmoid scores in fp32 (as
torch's: 1 / (1 + exp(-x)) with an accurate exp and a rounded division; the interpreter's exp is numpy's);
the choice reads them plus the correction bias: groups ranked by the sum of their two best, the topk_group
best kept, their top_k experts. Ties go as the torch reference's stable sorts break them: among equal group
sums the lower group, among equal biased scores the lower expert. The weights are the unbiased scores, then
renormalised (plus HF's 1e-20), times `scale`; the forced routing as above.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from autoprofile.kernels.pdl import interpreted

TILE = 1024  # elements of a program's [rows, experts] tile
NUM_WARPS = 4


@triton.jit
def _store_routed(weights_ptr, ids_ptr, mode_ptr, weights, ids, rows, slots, live, K: tl.constexpr,
                  E: tl.constexpr):
    """Both routers' epilogue: the routing of the moment from Routing.mode (1 worst: ids 0..k-1; 2 balanced:
    (t * k + j) % E; else the router's ids), the weights the router's, stored for the live rows."""
    mode = tl.load(mode_ptr)
    balanced = (rows[:, None] * K + slots) % E
    ids = tl.where(mode == 1, slots, tl.where(mode == 2, balanced, ids))
    out = rows[:, None] * K + slots
    keep = live[:, None] & (slots < K)
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + out, ids, mask=keep)


@triton.jit(do_not_specialize=["tokens"])
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, mode_ptr, tokens, scale, E: tl.constexpr,
                  E_POW2: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr, ROWS: tl.constexpr,
                  RENORMALIZE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < tokens
    cols = tl.arange(0, E_POW2)
    expert = cols[None, :] < E
    # NOTE: dead rows load 0, not -inf: an all -inf row would make NaNs (never stored)
    x = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=live[:, None] & expert, other=0.0)
    x = tl.where(expert, x.to(tl.float32), float("-inf"))
    p = tl.exp(x - tl.max(x, 1)[:, None])  # the probabilities times their sum: the same order
    total = tl.sum(p, 1)
    p = tl.where(expert, p, -1.0)

    slots = tl.arange(0, K_POW2)[None, :]
    weights = tl.zeros([ROWS, K_POW2], dtype=tl.float32)
    ids = tl.zeros([ROWS, K_POW2], dtype=tl.int32)
    for j in tl.static_range(K):
        top = tl.max(p, 1)
        # the lowest index among equals; a NaN row matches nothing: clamped, so no id past the experts
        at = tl.minimum(tl.min(tl.where(p == top[:, None], cols[None, :], E_POW2), 1), E - 1)
        weights = tl.where(slots == j, top[:, None], weights)
        ids = tl.where(slots == j, at[:, None], ids)
        p = tl.where(cols[None, :] == at[:, None], -1.0, p)
    # NOTE: div_rn: Triton's fp32 `/` is approximate on NVIDIA (2 ulp), the torch path's is rounded
    weights = tl.math.div_rn(weights, total[:, None])  # the probabilities, as the torch path divides
    if RENORMALIZE:
        weights = tl.math.div_rn(weights, tl.sum(weights, 1)[:, None])
    weights = weights * scale

    _store_routed(weights_ptr, ids_ptr, mode_ptr, weights, ids, rows, slots, live, K, E)


def _outputs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both routers' outputs for logits [T, E]: weights [T, k] in the logits' dtype, ids [T, k] int32."""
    tokens, experts = logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k {top_k} must be in [1, {experts}] (the experts)")
    return (torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device),
            torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device))


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool, scale: float,
               mode: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (bf16/fp16/fp32), mode: Routing.mode ([1] int32 on the logits' device) -> (weights
    [T, k] in the logits' dtype, expert ids [T, k] int32), as layers.moe.route then Routing.apply."""
    tokens, experts = logits.shape
    weights, ids = _outputs(logits, top_k)
    if tokens == 0:
        return weights, ids
    e_pow2 = triton.next_power_of_2(experts)
    rows = max(1, TILE // e_pow2)
    _route_kernel[(triton.cdiv(tokens, rows),)](
        logits.contiguous(), weights, ids, mode, tokens, float(scale), E=experts, E_POW2=e_pow2, K=top_k,
        K_POW2=triton.next_power_of_2(top_k), ROWS=rows, RENORMALIZE=bool(renormalize), num_warps=NUM_WARPS)
    return weights, ids


@triton.jit
def _first_max(x, avail, index, NONE: tl.constexpr):
    """Per row of x [R, N] (as its index [R, N]): the largest available value and the lowest index holding it
    (NONE where none matches: a NaN row)."""
    top = tl.max(tl.where(avail, x, float("-inf")), 1)
    return top, tl.min(tl.where(avail & (x == top[:, None]), index, NONE), 1)


@triton.jit(do_not_specialize=["tokens"])
def _grouped_route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, mode_ptr, tokens, scale,
                          E: tl.constexpr, G: tl.constexpr, G_POW2: tl.constexpr, S: tl.constexpr,
                          S_POW2: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
                          K_POW2: tl.constexpr, ROWS: tl.constexpr, RENORMALIZE: tl.constexpr,
                          ACCURATE_EXP: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < tokens
    group = tl.arange(0, G_POW2)[None, :, None]
    within = tl.arange(0, S_POW2)[None, None, :]
    expert = group * S + within  # [1, G_POW2, S_POW2]
    valid = (group < G) & (within < S)
    x = tl.load(logits_ptr + rows[:, None, None] * E + expert, mask=live[:, None, None] & valid, other=0.0)
    x = x.to(tl.float32)
    if ACCURATE_EXP:
        scores = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-x))
    else:
        scores = tl.math.div_rn(1.0, 1.0 + tl.exp(-x))
    choice = tl.where(valid, scores + tl.load(bias_ptr + expert, mask=valid, other=0.0), float("-inf"))

    # each group's score: the sum of its two best (its one best when a group holds one expert)
    best = tl.max(choice, 2)
    if S >= 2:
        first = tl.min(tl.where(choice == best[:, :, None], within, S_POW2), 2)
        best = best + tl.max(tl.where(within == first[:, :, None], float("-inf"), choice), 2)
    groups = tl.arange(0, G_POW2)[None, :]
    free = groups < G
    keep = groups < 0
    for _ in tl.static_range(TOPK_GROUP):
        _, at = _first_max(best, free, groups, G_POW2)
        keep = keep | (groups == at[:, None])
        free = free & (groups != at[:, None])

    # the kept groups' top_k experts (as the reference: the others at -inf, so they come last, lowest first)
    choice = tl.reshape(tl.where(keep[:, :, None], choice, float("-inf")), (ROWS, G_POW2 * S_POW2))
    scores = tl.reshape(tl.broadcast_to(scores, (ROWS, G_POW2, S_POW2)), (ROWS, G_POW2 * S_POW2))
    # padding -1: a padded slot's g * S + s may name an expert of the next group
    flat = tl.reshape(tl.broadcast_to(tl.where(valid, expert, -1), (ROWS, G_POW2, S_POW2)),
                      (ROWS, G_POW2 * S_POW2))
    free = tl.reshape(tl.broadcast_to(valid, (ROWS, G_POW2, S_POW2)), (ROWS, G_POW2 * S_POW2))
    slots = tl.arange(0, K_POW2)[None, :]
    weights = tl.zeros([ROWS, K_POW2], dtype=tl.float32)
    ids = tl.zeros([ROWS, K_POW2], dtype=tl.int32)
    for j in tl.static_range(K):
        _, at = _first_max(choice, free, flat, E)
        at = tl.minimum(at, E - 1)  # a NaN row: no id past the experts
        w = tl.sum(tl.where(flat == at[:, None], scores, 0.0), 1)
        weights = tl.where(slots == j, w[:, None], weights)
        ids = tl.where(slots == j, at[:, None], ids)
        free = free & (flat != at[:, None])
    if RENORMALIZE:
        weights = tl.math.div_rn(weights, tl.sum(weights, 1)[:, None] + 1e-20)
    weights = weights * scale

    _store_routed(weights_ptr, ids_ptr, mode_ptr, weights, ids, rows, slots, live, K, E)


def biased_grouped_topk(logits: torch.Tensor, e_score_correction_bias: torch.Tensor, top_k: int,
                        num_expert_group: int, topk_group: int, renormalize: bool, scale: float,
                        mode: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E], the correction bias [E], mode: Routing.mode -> (weights [T, k] in the logits' dtype,
    expert ids [T, k] int32), as layers.moe.biased_grouped_topk then Routing.apply; one launch."""
    tokens, experts = logits.shape
    if experts % num_expert_group:
        raise ValueError(f"n_group {num_expert_group} does not divide the {experts} experts")
    size = experts // num_expert_group
    if not 0 < topk_group <= num_expert_group:
        raise ValueError(f"topk_group {topk_group} must be in [1, {num_expert_group}] (n_group)")
    weights, ids = _outputs(logits, top_k)
    if tokens == 0:
        return weights, ids
    g_pow2, s_pow2 = triton.next_power_of_2(num_expert_group), triton.next_power_of_2(size)
    rows = max(1, TILE // (g_pow2 * s_pow2))
    _grouped_route_kernel[(triton.cdiv(tokens, rows),)](
        logits.contiguous(), e_score_correction_bias.float().contiguous(), weights, ids, mode, tokens,
        float(scale), E=experts, G=num_expert_group, G_POW2=g_pow2, S=size, S_POW2=s_pow2,
        TOPK_GROUP=topk_group, K=top_k, K_POW2=triton.next_power_of_2(top_k), ROWS=rows,
        RENORMALIZE=bool(renormalize), ACCURATE_EXP=not interpreted(), num_warps=NUM_WARPS)
    return weights, ids
