"""The MoE router's greedy top-k and the stress's forced routing (layers.moe.route, then Routing.apply) in one
Triton launch: the torch version's dozen small kernels per MoE layer are launch-bound in decode.

Per token row: softmax in fp32 over the experts, the top_k (descending; among equal probabilities the lower
expert first), renormalised to sum 1 when asked, times `scale` (DeepSeek's routed_scaling_factor), cast to
the logits' dtype. Then the routing of the moment, read on the device from Routing.mode: the ids become
0..k-1 (worst) or (t * k + j) % E (balanced); the weights stay the router's. The token count is a runtime
argument (one compile serves every step) and nothing syncs with the host, so decode graphs capture it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 1024  # elements of a program's [rows, experts] tile
NUM_WARPS = 4


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

    mode = tl.load(mode_ptr)
    balanced = (rows[:, None] * K + slots) % E
    ids = tl.where(mode == 1, slots, tl.where(mode == 2, balanced, ids))
    out = rows[:, None] * K + slots
    keep = live[:, None] & (slots < K)
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + out, ids, mask=keep)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool, scale: float,
               mode: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (bf16/fp16/fp32), mode: Routing.mode ([1] int32 on the logits' device) -> (weights
    [T, k] in the logits' dtype, expert ids [T, k] int32), as layers.moe.route then Routing.apply."""
    tokens, experts = logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k {top_k} must be in [1, {experts}] (the experts)")
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens == 0:
        return weights, ids
    e_pow2 = triton.next_power_of_2(experts)
    rows = max(1, TILE // e_pow2)
    _route_kernel[(triton.cdiv(tokens, rows),)](
        logits.contiguous(), weights, ids, mode, tokens, float(scale), E=experts, E_POW2=e_pow2, K=top_k,
        K_POW2=triton.next_power_of_2(top_k), ROWS=rows, RENORMALIZE=bool(renormalize), num_warps=NUM_WARPS)
    return weights, ids
