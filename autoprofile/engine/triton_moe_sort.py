"""The expert sort of the fused MoE path (layers.moe.sort_by_expert, vLLM's moe_align_block_size) in one Triton
launch of one program, for decode: the torch version's dozen small kernels are launch-bound there.

The program walks the (token, slot) pairs twice in chunks: counting each expert's pairs, then placing each
pair after its expert's earlier ones (a running count per expert and an in-chunk prefix: stable, as the
torch version's argsort). The pad slots, each expert's and those past the padded length, are written
apart from the pairs' slots (no write ordering needed), then the expert of every block and the padded
length. Outputs, dtypes and every slot equal the torch version's; their sizes follow the tokens alone and
the token count is a runtime argument (one compile serves every step), so decode graphs capture it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from autoprofile import budget

TILE = 16384  # elements of a [pairs, experts] chunk tile: the chunk is TILE // experts pairs
NUM_WARPS = 8


@triton.jit(do_not_specialize=["tokens"])
def _sort_by_expert_kernel(ids_ptr, sorted_ptr, block_experts_ptr, padded_ptr, tokens, E: tl.constexpr,
                           E_POW2: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    pairs = tokens * K
    slots = tl.minimum(pairs + E * (BLOCK_M - 1), pairs * BLOCK_M)
    experts = tl.arange(0, E_POW2)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for first in range(0, pairs, CHUNK):
        e = tl.load(ids_ptr + first + lanes, mask=first + lanes < pairs, other=-1)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)

    running = starts  # each expert's next free slot
    for first in range(0, pairs, CHUNK):
        pair = first + lanes
        e = tl.load(ids_ptr + pair, mask=pair < pairs, other=-1)
        hit = (e[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(hit, 0) - hit  # earlier pairs of the chunk with the same expert
        slot = tl.sum(hit * (running[None, :] + before), 1)
        tl.store(sorted_ptr + slot, pair, mask=pair < pairs)
        running += tl.sum(hit, 0)

    fill = counts[:, None] + tl.arange(0, BLOCK_M)[None, :]  # each expert's pad slots
    tl.store(sorted_ptr + starts[:, None] + fill, fill * 0 + pairs, mask=fill < padded[:, None])
    for first in range(total, slots, CHUNK):  # past the padded length
        tl.store(sorted_ptr + first + lanes, lanes * 0 + pairs, mask=first + lanes < slots)

    blocks = tl.cdiv(slots, BLOCK_M)
    for first in range(0, blocks, CHUNK):
        block = first + lanes
        done = (ends[None, :] <= block[:, None] * BLOCK_M) & (experts[None, :] < E)
        expert = tl.minimum(tl.sum(done.to(tl.int32), 1), E - 1)
        tl.store(block_experts_ptr + block, expert, mask=block < blocks)
    tl.store(padded_ptr, total)


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """As layers.moe.sort_by_expert, bit for bit: (sorted ids [budget.sorted_slots], the expert of each
    block, the padded length [1]), int32. block_m: a power of two."""
    tokens, top_k = ids.shape
    slots = budget.sorted_slots(tokens, top_k, num_experts, block_m)
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(triton.cdiv(slots, block_m), dtype=torch.int32, device=ids.device)
    padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    experts = triton.next_power_of_2(num_experts)
    _sort_by_expert_kernel[(1,)](ids.contiguous(), sorted_ids, block_experts, padded, tokens, E=num_experts,
                                 E_POW2=experts, K=top_k, BLOCK_M=block_m, CHUNK=max(16, TILE // experts),
                                 num_warps=NUM_WARPS)
    return sorted_ids, block_experts, padded
