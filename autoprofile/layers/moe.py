"""Mixture-of-experts: the router's top-k, the routing the stress forces, the experts' packed weights.

The experts of one layer are two packed parameters, as transformers 5.x holds them: gate_up_proj
[E, 2 * I, H] (gate rows, then up rows) and down_proj [E, H, I]. A checkpoint's per-expert tensors
(`experts.<e>.gate_proj.weight`, ...) are packed into them at load. Tensor parallelism splits every
expert's intermediate dimension I (a rank holds I / tp columns of each expert, and the down projection's
partial sums are all-reduced), as vLLM's and SGLang's TP MoE do.

The routing is data: which experts a step's tokens reach depends on the tokens, so the memory a step
needs may too (the torch reference gathers each expert's tokens; a kernel pads each expert's rows to its
block). The stress therefore forces the routings at both ends (`Routing`): every token to the same
top_k experts (worst: one expert holds every token) and tokens spread evenly (balanced: the most experts
each padded to a block). A [1] device tensor selects the routing, so captured decode graphs obey it too.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from autoprofile.budget import sorted_slots
from autoprofile.layers.parallel import TP, copy_checked, new_param, read_rows

# Routing.mode values, by index: the router's own choice, every token to experts 0..top_k-1, round robin
ROUTINGS = ("model", "worst", "balanced")


class Routing:
    """The routing every MoE layer of one model uses for the current step (owned by the model; the runner
    sets it per step, the stress to each forced routing)."""

    def __init__(self, device: torch.device | None = None):
        self.mode = torch.zeros(1, dtype=torch.int32, device=device)
        self.current = "model"

    def set(self, name: str) -> None:
        if name not in ROUTINGS:
            raise ValueError(f"unknown routing {name!r}; one of {', '.join(ROUTINGS)}")
        if name != self.current:
            self.mode.fill_(ROUTINGS.index(name))
            self.current = name

    def apply(self, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
        """ids [T, k] as the current routing has them; no host sync (a graph replays this)."""
        t, k = ids.shape
        slots = torch.arange(k, device=ids.device, dtype=ids.dtype)
        worst = slots.expand(t, k)
        rows = torch.arange(t, device=ids.device, dtype=ids.dtype).unsqueeze(1)
        balanced = (rows * k + slots) % num_experts
        return torch.where(self.mode == 1, worst, torch.where(self.mode == 2, balanced, ids))


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy router (HF Qwen3-MoE's; DeepSeek-V2's greedy one with its routed_scaling_factor as `scale`):
    softmax in fp32 over the experts, the top_k, renormalised to sum 1 when asked, times scale.
    Returns (weights [T, k] in the logits' dtype, expert ids [T, k] int32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        weights = weights * scale
    return weights.to(logits.dtype), ids.to(torch.int32)


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """The torch reference (HF's loop): per expert hit, in expert order, its tokens gathered, SiLU-gated,
    projected down, weighted and added. Its temporaries grow with the tokens one expert holds (the
    routing): [n_e, 2I] + [n_e, I] + [n_e, H]. Host syncs (the experts hit): not capturable."""
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    hits = torch.bincount(ids.flatten().long(), minlength=num_experts).tolist()
    for e, n in enumerate(hits):
        if not n:
            continue
        token, slot = torch.where(ids == e)
        gate, up = torch.nn.functional.linear(x[token], w13[e]).chunk(2, dim=-1)
        h = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e])
        out.index_add_(0, token, (h * weights[token, slot, None]).to(out.dtype))
    return out


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """The block layout a fused MoE kernel reads (vLLM's moe_align_block_size): the (token, slot) pairs
    (flat index t * k + j) grouped by expert, in pair order, each expert's group padded with the pad id
    T * k to a multiple of block_m. Returns (sorted ids [sorted_slots] int32, the expert of each block
    [ceil(budget.sorted_slots / block_m)] int32, the padded length [1] int32; blocks past it are never read).

    Torch ops of static shapes, no host sync (a decode graph captures it): its sizes follow T alone."""
    flat = ids.flatten().long()
    pairs = flat.numel()
    slots = sorted_slots(ids.shape[0], ids.shape[1], num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # each expert's padded group ends here
    order = torch.argsort(flat, stable=True)  # pair indexes grouped by expert
    expert = flat[order]
    rank = torch.arange(pairs, device=ids.device) - (counts.cumsum(0) - counts)[expert]  # within its group
    sorted_ids = torch.full((slots,), pairs, dtype=torch.int32, device=ids.device)
    sorted_ids.scatter_(0, (ends - padded)[expert] + rank, order.to(torch.int32))
    blocks = torch.arange(0, slots, block_m, device=ids.device)
    block_experts = torch.searchsorted(ends, blocks, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_experts, ends[-1:].to(torch.int32)


# ---------------------------------------------------------------- loading
def load_expert_gate_up(param: nn.Parameter, src, part: int, *, shard: int, rank: int) -> None:
    """Part 2e (gate) or 2e + 1 (up) of expert e: this rank's rows of its [I, H] tensor."""
    expert, half = divmod(part, 2)
    copy_checked(param.data[expert].narrow(0, half * shard, shard), read_rows(src, rank * shard, shard, 0))


def load_expert_down(param: nn.Parameter, src, part: int, *, shard: int, rank: int) -> None:
    """Part e: this rank's columns of expert e's down projection [H, I]."""
    copy_checked(param.data[part], read_rows(src, rank * shard, shard, 1))


def expert_part(name: str) -> tuple[str, int] | None:
    """A checkpoint's per-expert tensor `...experts.<e>.(gate|up|down)_proj.weight` -> (our packed parameter
    name, part); None for any other name."""
    head, sep, tail = name.rpartition(".experts.")
    if not sep:
        return None
    index, _, proj = tail.partition(".")
    if not index.isdigit() or proj not in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        return None
    e = int(index)
    if proj == "down_proj.weight":
        return f"{head}.experts.down_proj", e
    return f"{head}.experts.gate_up_proj", 2 * e + (proj == "up_proj.weight")


class FusedMoE(nn.Module):
    """The experts of one layer: x [T, H] and the routing's choice (weights, expert ids [T, k]) -> [T, H],
    all-reduced over TP. The ids reach forward with the current routing already forced: from select (the
    greedy router, through the backend) or from force (a router of the model's own: DeepSeek's group-limited
    one)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, inter: int, tp: TP, dtype: torch.dtype,
                 backend, routing: Routing):
        super().__init__()
        if inter % tp.size:
            raise ValueError(f"moe_intermediate_size {inter} is not divisible by {tp.size} TP ranks")
        shard = inter // tp.size
        self.num_experts, self.top_k = num_experts, top_k
        self.tp, self.backend, self.routing = tp, backend, routing
        gate_up = partial(load_expert_gate_up, shard=shard, rank=tp.rank)
        self.gate_up_proj = new_param((num_experts, 2 * shard, hidden), dtype, gate_up, 2 * num_experts)
        self.down_proj = new_param((num_experts, hidden, shard), dtype,
                                   partial(load_expert_down, shard=shard, rank=tp.rank), num_experts)

    def select(self, logits: torch.Tensor, renormalize: bool,
               scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy router over logits [T, E] (route) with the current routing forced: the backend's."""
        return self.backend.route_experts(logits, self.top_k, renormalize, scale, self.routing)

    def force(self, ids: torch.Tensor) -> torch.Tensor:
        """A model's own router's ids [T, k] as the current routing has them."""
        return self.routing.apply(ids, self.num_experts)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.backend.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids))
