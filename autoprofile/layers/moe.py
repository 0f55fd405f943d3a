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
from typing import NamedTuple

import torch
from torch import nn

from autoprofile.kernels.launch_rules import sorted_slots
from autoprofile.layers.parallel import (TP, check_block_shards, copy_checked, new_param, quantize_rows,
                                         read_rows, scalar_or_rows, source_shape)
from autoprofile.layers.quant import FP8, Fp8Scheme, MoeQuant

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


class GroupedTopk(NamedTuple):
    """noaux_tc's grouping for one layer: its correction bias [E] (fp32) and groups kept of all."""

    e_score_correction_bias: torch.Tensor
    num_expert_group: int
    topk_group: int


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


def biased_grouped_topk(logits: torch.Tensor, e_score_correction_bias: torch.Tensor, top_k: int,
                        num_expert_group: int, topk_group: int, renormalize: bool,
                        scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's noaux_tc router (HF's DeepseekV3TopkRouter, SGLang's biased_grouped_topk): sigmoid scores
    in fp32; the choice reads them plus the correction bias: each of num_expert_group groups ranks by the sum
    of its two best, the topk_group best groups stay, then their top_k experts. The weights are the chosen
    experts' scores without the bias, renormalised to sum 1 when asked, times scale. Among equals the lower
    group or expert first (stable sorts). Returns (weights [T, k] in the logits' dtype, expert ids [T, k]
    int32); static shapes, no host sync."""
    scores = logits.float().sigmoid()
    choice = scores + e_score_correction_bias.float()
    t, experts = choice.shape
    size = experts // num_expert_group
    best = choice.view(t, num_expert_group, size).topk(min(2, size), dim=-1).values.sum(dim=-1)
    groups = best.sort(dim=-1, descending=True, stable=True).indices[:, :topk_group]
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~keep.repeat_interleave(size, dim=1), float("-inf"))
    ids = choice.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # HF's guard
    return (weights * scale).to(logits.dtype), ids.to(torch.int32)


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, linear=torch.nn.functional.linear) -> torch.Tensor:
    """The torch reference (HF's loop): per expert hit, in expert order, its tokens gathered, SiLU-gated,
    projected down, weighted and added. Its temporaries grow with the tokens one expert holds (the
    routing): [n_e, 2I] + [n_e, I] + [n_e, H]. Host syncs (the experts hit): not capturable. linear: the
    GEMM (--deterministic: a batch-invariant one; an expert's row count follows the step's tokens)."""
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    hits = torch.bincount(ids.flatten().long(), minlength=num_experts).tolist()
    for e, n in enumerate(hits):
        if not n:
            continue
        token, slot = torch.where(ids == e)
        gate, up = linear(x[token], w13[e]).chunk(2, dim=-1)
        h = linear(torch.nn.functional.silu(gate) * up, w2[e])
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
def load_expert_gate_up(param: nn.Parameter, src, part: int, *, shard: int, rank: int,
                        scale: nn.Parameter | None = None, scheme: Fp8Scheme | None = None) -> None:
    """Part 2e (gate) or 2e + 1 (up) of expert e: this rank's rows of its [I, H] tensor (FP8 experts: a bf16
    checkpoint's rows quantized into the weight and `scale`)."""
    expert, half = divmod(part, 2)
    rows = read_rows(src, rank * shard, shard, 0)
    if param.dtype == FP8 and rows.dtype != FP8:
        quantize_rows(_expert(param, expert), rows, half * shard, _expert(scale, expert), scheme)
        return
    copy_checked(param.data[expert].narrow(0, half * shard, shard), rows)


def load_expert_down(param: nn.Parameter, src, part: int, *, shard: int, rank: int,
                     scale: nn.Parameter | None = None, scheme: Fp8Scheme | None = None) -> None:
    """Part e: this rank's columns of expert e's down projection [H, I]."""
    cols = read_rows(src, rank * shard, shard, 1)
    if param.dtype == FP8 and cols.dtype != FP8:
        quantize_rows(_expert(param, part), cols, 0, _expert(scale, part), scheme)
        return
    copy_checked(param.data[part], cols)


def _expert(param: nn.Parameter, e: int) -> nn.Parameter:
    """Expert e's slice of a packed parameter, as a parameter the linear layers' loaders write into."""
    return nn.Parameter(param.data[e], requires_grad=False)


def load_expert_gate_up_scale(param: nn.Parameter, src, part: int, *, shard: int, rank: int, ranks: int,
                              scheme: Fp8Scheme) -> None:
    """Expert e's gate (part 2e) or up (2e + 1) scales: per channel [I] (or one per-tensor value), or blocks
    [ceil(I / bn), ceil(H / bk)]; this rank's rows."""
    expert, half = divmod(part, 2)
    dst = param.data[expert]
    if scheme.weight == "channel":
        rows = scalar_or_rows(src, shard * ranks, "expert weight")[rank * shard:(rank + 1) * shard]
        copy_checked(dst.narrow(0, half * shard, shard), rows)
        return
    rows, cols = shard // scheme.block[0], dst.shape[1]
    shape = source_shape(src)
    if len(shape) != 2 or shape != (rows * ranks, cols):
        raise ValueError(f"expert block scale of shape {shape} does not fit [{rows * ranks}, {cols}] "
                         "(weight rows / block_n, weight columns / block_k)")
    copy_checked(dst.narrow(0, half * rows, rows), read_rows(src, rank * rows, rows, 0))


def load_expert_down_scale(param: nn.Parameter, src, part: int, *, rank: int, ranks: int,
                           scheme: Fp8Scheme) -> None:
    """Expert e's down scales: per channel [H], or blocks [ceil(H / bn), ceil(I / bk)] (this rank's
    columns)."""
    dst = param.data[part]
    if scheme.weight == "channel":
        copy_checked(dst, scalar_or_rows(src, dst.shape[0], "expert weight"))
        return
    rows, cols = dst.shape
    shape = source_shape(src)
    if len(shape) != 2 or shape[0] != rows or shape[1] != cols * ranks:
        raise ValueError(f"expert block scale of shape {shape} does not fit [{rows}, {cols * ranks}] "
                         "(weight rows / block_n, weight columns / block_k)")
    copy_checked(dst, read_rows(src, rank * cols, cols, 1))


EXPERT_SUFFIXES = {"weight": "", "weight_scale": "_scale", "weight_scale_inv": "_scale"}


def expert_part(name: str) -> tuple[str, int] | None:
    """A checkpoint's per-expert tensor `...experts.<e>.(gate|up|down)_proj.weight` -> (our packed parameter
    name, part); its FP8 scale (`.weight_scale_inv`, `.weight_scale`) -> the packed `..._proj_scale`; None for
    any other name."""
    head, sep, tail = name.rpartition(".experts.")
    if not sep:
        return None
    index, _, proj = tail.partition(".")
    proj, _, suffix = proj.partition(".")
    if (not index.isdigit() or proj not in ("gate_proj", "up_proj", "down_proj")
            or suffix not in EXPERT_SUFFIXES):
        return None
    e, ours = int(index), EXPERT_SUFFIXES[suffix]
    if proj == "down_proj":
        return f"{head}.experts.down_proj{ours}", e
    return f"{head}.experts.gate_up_proj{ours}", 2 * e + (proj == "up_proj")


class FusedMoE(nn.Module):
    """The experts of one layer: x [T, H] and the routing's choice (weights, expert ids [T, k]) -> [T, H],
    all-reduced over TP. The ids reach forward with the current routing already forced: from select (the
    greedy router, through the kernel ops: layers.ops.KernelOps) or from force (a router of the model's own:
    DeepSeek's group-limited one). `ops`: the KernelOps its router and experts run on."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, inter: int, tp: TP, dtype: torch.dtype,
                 ops, routing: Routing, quant: Fp8Scheme | None = None):
        super().__init__()
        if inter % tp.size:
            raise ValueError(f"moe_intermediate_size {inter} is not divisible by {tp.size} TP ranks")
        shard = inter // tp.size
        self.num_experts, self.top_k = num_experts, top_k
        self.tp, self.ops, self.routing, self.quant = tp, ops, routing, quant
        e = num_experts
        self.gate_up_proj_scale = self.down_proj_scale = None
        gate_up = partial(load_expert_gate_up, shard=shard, rank=tp.rank)
        down = partial(load_expert_down, shard=shard, rank=tp.rank)
        if quant is not None:
            check_block_shards(quant, [shard, shard], tp.size, "output")
            check_block_shards(quant, [shard], tp.size, "input")
            s13, s2 = expert_scale_shapes(quant, e, shard, hidden)
            self.gate_up_proj_scale = new_param(s13, torch.float32, partial(
                load_expert_gate_up_scale, shard=shard, rank=tp.rank, ranks=tp.size, scheme=quant), 2 * e)
            self.down_proj_scale = new_param(s2, torch.float32, partial(
                load_expert_down_scale, rank=tp.rank, ranks=tp.size, scheme=quant), e)
            gate_up = partial(gate_up, scale=self.gate_up_proj_scale, scheme=quant)
            down = partial(down, scale=self.down_proj_scale, scheme=quant)
            dtype = FP8
        self.gate_up_proj = new_param((e, 2 * shard, hidden), dtype, gate_up, 2 * e)
        self.down_proj = new_param((e, hidden, shard), dtype, down, e)

    def select(self, logits: torch.Tensor, renormalize: bool, scale: float = 1.0,
               grouped: GroupedTopk | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The router over logits [T, E] with the current routing forced, the kernel ops': the greedy one
        (route), or noaux_tc's (biased_grouped_topk) when grouped."""
        return self.ops.route_experts(logits, self.top_k, renormalize, scale, self.routing, grouped)

    def force(self, ids: torch.Tensor) -> torch.Tensor:
        """A model's own router's ids [T, k] as the current routing has them."""
        return self.routing.apply(ids, self.num_experts)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                add: tuple[torch.Tensor | None, ...] = ()) -> torch.Tensor:
        """The experts' output plus each tensor of `add` [T, H] in order (None: skipped); on one rank the
        backend sums them with the top-k rows (one kernel on aiter_triton), over TP after the all-reduce."""
        add = tuple(a for a in add if a is not None)
        quant = None if self.quant is None else MoeQuant(self.gate_up_proj_scale, self.down_proj_scale,
                                                         self.quant)
        if self.tp.size == 1:
            return self.ops.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, quant=quant, add=add)
        out = self.tp.all_reduce(self.ops.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids,
                                                        quant=quant))
        for a in add:
            out = out + a
        return out


def expert_scale_shapes(scheme: Fp8Scheme, experts: int, shard: int,
                        hidden: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(gate_up_proj_scale, down_proj_scale) shapes for one rank's FP8 experts (layers.quant.MoeQuant)."""
    if scheme.weight == "channel":
        return (experts, 2 * shard), (experts, hidden)
    bn, bk = scheme.block
    return (experts, -(-2 * shard // bn), -(-hidden // bk)), (experts, -(-hidden // bn), -(-shard // bk))
