"""The fused MoE path's expert sort (layers.moe.sort_by_expert, vLLM's moe_align_block_size) in one Triton
launch of one program, for decode and small prefill steps: the torch version's dozen small kernels are
launch-bound there.

The program counts each expert's pairs (tl.histogram), then walks the (token, slot) pairs in steps, each
pair placed at its expert's next free slot (a running slot per expert, tl.gather) plus the earlier pairs
of its step with the same expert: stable, as the torch version's argsort. The pad slots, each expert's and
those past the padded length, are disjoint from the pairs' (no write ordering needed); then the expert of
every block and the padded length. Outputs equal the torch version's slot for slot; their sizes follow the
tokens alone and the token count is a runtime argument (one compile serves every step), so decode graphs
capture it. Needs Triton >= 3.2 (tl.gather).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from autoprofile.kernels import launch_rules

RANK_CHUNK = 32  # pairs placed per step: a [RANK_CHUNK, RANK_CHUNK] compare orders each step's own
COUNT_CHUNK = 1024  # pairs counted per step
FILL_CHUNK = 1024  # pad slots past the padded length written per step
BLOCK_TILE = 4096  # elements of a [blocks, experts] compare tile
NUM_WARPS = 4


@triton.jit(do_not_specialize=["tokens", "slots"])
def _sort_by_expert_kernel(ids_ptr, sorted_ptr, block_experts_ptr, padded_ptr, tokens, slots, E: tl.constexpr,
                           E_POW2: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                           RANK_CHUNK: tl.constexpr, COUNT_CHUNK: tl.constexpr, FILL_CHUNK: tl.constexpr,
                           BLOCK_CHUNK: tl.constexpr):
    pairs = tokens * K
    experts = tl.arange(0, E_POW2)
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    lanes = tl.arange(0, COUNT_CHUNK)
    for first in range(0, pairs, COUNT_CHUNK):
        live = first + lanes < pairs
        e = tl.load(ids_ptr + first + lanes, mask=live, other=0)
        # NOTE: the masked lanes are counted in bin 0 (histogram's own mask needs a newer Triton)
        counts += tl.histogram(e, E_POW2) - tl.where(experts == 0, tl.sum((~live).to(tl.int32), 0), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)

    running = starts  # each expert's next free slot
    lanes = tl.arange(0, RANK_CHUNK)
    for first in range(0, pairs, RANK_CHUNK):
        pair = first + lanes
        live = pair < pairs
        e = tl.load(ids_ptr + pair, mask=live, other=0)
        # earlier pairs of this step with the same expert: the order within an expert is the pairs' (stable)
        before = tl.sum(((e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None])).to(tl.int32), 1)
        tl.store(sorted_ptr + tl.gather(running, e, 0) + before, pair, mask=live)
        running += tl.histogram(e, E_POW2) - tl.where(experts == 0, tl.sum((~live).to(tl.int32), 0), 0)

    fill = counts[:, None] + tl.arange(0, BLOCK_M)[None, :]  # each expert's pad slots
    tl.store(sorted_ptr + starts[:, None] + fill, fill * 0 + pairs, mask=fill < padded[:, None])
    lanes = tl.arange(0, FILL_CHUNK)
    for first in range(total, slots, FILL_CHUNK):  # past the padded length
        tl.store(sorted_ptr + first + lanes, lanes * 0 + pairs, mask=first + lanes < slots)

    blocks = tl.cdiv(slots, BLOCK_M)
    lanes = tl.arange(0, BLOCK_CHUNK)
    for first in range(0, blocks, BLOCK_CHUNK):
        block = first + lanes
        done = (ends[None, :] <= block[:, None] * BLOCK_M) & (experts[None, :] < E)
        expert = tl.minimum(tl.sum(done.to(tl.int32), 1), E - 1)
        tl.store(block_experts_ptr + block, expert, mask=block < blocks)
    tl.store(padded_ptr, total)


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """As layers.moe.sort_by_expert, bit for bit: (sorted ids [launch_rules.sorted_slots], the expert of each
    block, the padded length [1]), int32. block_m: a power of two."""
    tokens, top_k = ids.shape
    slots = launch_rules.sorted_slots(tokens, top_k, num_experts, block_m)
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(triton.cdiv(slots, block_m), dtype=torch.int32, device=ids.device)
    padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    experts = triton.next_power_of_2(num_experts)
    _sort_by_expert_kernel[(1,)](ids.contiguous(), sorted_ids, block_experts, padded, tokens, slots,
                                 E=num_experts,
                                 E_POW2=experts, K=top_k, BLOCK_M=block_m, RANK_CHUNK=RANK_CHUNK,
                                 COUNT_CHUNK=COUNT_CHUNK, FILL_CHUNK=FILL_CHUNK,
                                 BLOCK_CHUNK=max(16, BLOCK_TILE // experts), num_warps=NUM_WARPS)
    return sorted_ids, block_experts, padded
