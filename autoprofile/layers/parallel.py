"""Tensor-parallel layers: column-parallel (QKV, gate/up) by output rows, row-parallel (O, down) by
input columns + all_reduce, vocab-parallel embedding and LM head. World size 1 = plain layers.

Every parameter carries a `weight_loader(param, source, part)` that copies this rank's shard of a full
HF tensor. `source` is a torch.Tensor or a safetensors slice (both index as `src[a:b]` / `src[:, a:b]`),
so a checkpoint is read shard by shard, never whole.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass
class TP:
    """This rank's place in the tensor-parallel group (group None = the default group).

    One TP object is shared by every layer of a model, so `autoprofile.tp` can replace `group` after it
    aborted a communicator, and set `wait`: a wait for a gloo collective that gives up when a peer failed
    (None: the collective blocks until it completes)."""

    rank: int = 0
    size: int = 1
    group: object = None
    wait: Callable[[dist.Work], None] | None = None
    # the GEMM every linear layer calls instead of F.linear (the backend's: under --deterministic a
    # batch-invariant one), and --deterministic's all-reduce summed in rank order (NCCL's ring or tree order
    # follows the message size); the runner sets both
    matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
    ordered_reduce: bool = False
    # a row-parallel layer's residual add in cuBLAS's GEMM epilogue (linear_add); the runner sets it (not
    # under --deterministic, whose GEMM is its own)
    add_in_gemm: bool = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias) if self.matmul is None else self.matmul(x, weight, bias)

    def linear_add(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + all_reduce(x W^T). On one rank with add_in_gemm and more than one row (one row takes the
        GEMV): cuBLAS adds residual in the GEMM's epilogue (beta = 1), in place, rounding once: no [T, out]
        temporary and one pass fewer over the residual stream (a prefill step of 8 x 1,024 tokens spent 4.0 of
        186 ms in residual adds on an H100)."""
        if self.size == 1 and self.add_in_gemm and x.shape[0] > 1:
            return residual.addmm_(x, weight.t())
        return residual + self.all_reduce(self.linear(x, weight))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.ordered_reduce:
            return x.copy_(ordered_sum(self._gather(x)))
        self._done(dist.all_reduce(x, group=self.group, async_op=self.wait is not None))
        return x

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._done(dist.all_gather(parts, x.contiguous(), group=self.group, async_op=self.wait is not None))
        return parts

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (rank order)."""
        if self.size == 1:
            return x
        return torch.cat(self._gather(x), dim=-1)

    def _done(self, work: dist.Work | None) -> None:
        if work is not None:
            self.wait(work)


def ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """((p0 + p1) + p2) + ...: the same bits whatever the tensor's size (the batch-invariant all-reduce)."""
    total = parts[0].clone()
    for p in parts[1:]:
        total.add_(p)
    return total


def source_shape(src) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def read_rows(src, start: int, length: int, dim: int) -> torch.Tensor:
    """Rows [start, start+length) of src along dim 0 or 1, read without materialising the rest."""
    return src[start:start + length] if dim == 0 else src[:, start:start + length]


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """copy_ without broadcasting: a checkpoint of another shape is an error, not a silent fill."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"checkpoint tensor (shard) of shape {tuple(src.shape)} "
                         f"does not fit {tuple(dst.shape)}")
    dst.copy_(src)


def load_replicated(param: nn.Parameter, src, part: int = 0) -> None:
    copy_checked(param.data, src if isinstance(src, torch.Tensor) else src[:])


def load_column(param: nn.Parameter, src, part: int, *, shard_sizes: list[int], rank: int) -> None:
    size, offset = shard_sizes[part], sum(shard_sizes[:part])
    copy_checked(param.data.narrow(0, offset, size), read_rows(src, rank * size, size, 0))


def load_row(param: nn.Parameter, src, part: int, *, shard: int, rank: int) -> None:
    copy_checked(param.data, read_rows(src, rank * shard, shard, 1))


def load_vocab(param: nn.Parameter, src, part: int, *, start: int, valid: int) -> None:
    param.data.zero_()
    copy_checked(param.data[:valid], read_rows(src, start, valid, 0))


def new_param(shape: tuple[int, ...], dtype: torch.dtype, loader=load_replicated,
              num_parts: int = 1) -> nn.Parameter:
    # NOTE: allocated on the ambient device (the runner builds the model under `with torch.device(...)`).
    # Loaders are plain functions (no module reference): no param <-> module cycle delays freeing.
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader, p.num_parts = loader, num_parts
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split over ranks; no communication.

    `out_sizes` are the packed parts (q, k, v) or (gate, up): each part is split separately, so a rank
    holds [q_r; k_r; v_r] and whole heads stay together (head_dim rows per head)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TP, dtype: torch.dtype):
        super().__init__()
        if any(s % tp.size for s in out_sizes):
            raise ValueError(f"output sizes {out_sizes} are not divisible by {tp.size} TP ranks")
        shard_sizes = [s // tp.size for s in out_sizes]
        self.tp = tp
        loader = partial(load_column, shard_sizes=shard_sizes, rank=tp.rank)
        self.weight = new_param((sum(shard_sizes), in_features), dtype, loader, len(out_sizes))
        self.bias = new_param((sum(shard_sizes),), dtype, loader, len(out_sizes)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b with W's input columns split over ranks (x arrives split)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TP, dtype: torch.dtype):
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"input size {in_features} is not divisible by {tp.size} TP ranks")
        self.tp = tp
        shard = in_features // tp.size
        self.weight = new_param((out_features, shard), dtype, partial(load_row, shard=shard, rank=tp.rank))
        self.bias = new_param((out_features,), dtype) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """y, or residual + y (TP.linear_add: in place in residual where the GEMM adds it)."""
        if residual is not None and self.bias is None:
            return self.tp.linear_add(x, self.weight, residual)
        y = self.tp.all_reduce(self.tp.linear(x, self.weight))
        y = y + self.bias if self.bias is not None else y
        return y if residual is None else residual + y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds ceil(vocab/tp) rows; ids outside the shard look up zeros; all_reduce sums."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TP, dtype: torch.dtype,
                 weight: nn.Parameter | None = None):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.rows = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows
        self.valid = max(min(self.rows, vocab_size - self.start), 0)  # the last shard may be short
        loader = partial(load_vocab, start=self.start, valid=self.valid)
        self.weight = weight if weight is not None else new_param((self.rows, hidden_size), dtype, loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.valid)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T over this rank's vocab rows, gathered over ranks and cut to vocab_size.

    Tied embeddings: pass the embedding's Parameter as `weight` (same shard layout, one tensor)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(self.tp.linear(hidden, self.weight))
        return logits[..., : self.vocab_size] if logits.shape[-1] != self.vocab_size else logits
