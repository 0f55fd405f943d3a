"""Tensor-parallel layers: column-parallel (QKV, gate/up) by output rows, row-parallel (O, down) by
input columns + all_reduce, vocab-parallel embedding and LM head. World size 1 = plain layers.

Every parameter carries a `weight_loader(param, source, part)` that copies this rank's shard of a full
HF tensor. `source` is a torch.Tensor or a safetensors slice (both index as `src[a:b]` / `src[:, a:b]`),
so a checkpoint is read shard by shard, never whole.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autoprofile.layers.quant import (FP8, Fp8Rows, Fp8Scheme, fp8_linear_reference, linear_out,
                                      quantize_weight)


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
    # a row-parallel layer's residual add in the GEMM's epilogue, in place (linear_add); the runner sets it
    # (not under --deterministic, whose GEMM is its own)
    add_in_gemm: bool = False
    # residual += x W^T in place (the backend's gemm_add: one row through our GEMV's epilogue); None:
    # cuBLAS's addmm_
    matmul_add: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # FP8 weights' GEMM (x, weight, weight_scale, scheme, input_scale, bias) -> y, the backend's fp8_gemm;
    # None: layers.quant.fp8_linear_reference
    fp8_matmul: Callable | None = None
    # an fp32 router's logits (x, weight) -> fp32 (the backend's router_gemm); None: x.float() through
    # linear
    router_matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def linear_fp8(self, x: torch.Tensor | Fp8Rows, layer: nn.Module, bias: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias) through a quantized layer's weight, weight_scale, quant and input_scale; x may come
        quantized (Fp8Rows); with residual: added to it in place, and it is returned (one rank only)."""
        fn = fp8_linear_reference if self.fp8_matmul is None else self.fp8_matmul
        return fn(x, layer.weight, layer.weight_scale, layer.quant, layer.input_scale, bias, residual)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Every GEMM of the model's layers, sharded or replicated (routers, MLA's kv_a_proj): the backend's
        (aiter_triton: one row through our GEMV, where cuBLAS took 3.3-5.0 us for a router or kv_a_proj at a
        batch-1 decode; --deterministic: batch-invariant), else F.linear. out ([rows, N], unit stride in N):
        the GEMM writes its result there and returns it (no temporary, no copy)."""
        return (self.matmul or linear_out)(x, weight, bias, out=out)

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """fp32 logits of an fp32 router weight (replicated: no all-reduce)."""
        if self.router_matmul is not None:
            return self.router_matmul(x, weight)
        return self.linear(x.float(), weight)

    def linear_add(self, x: torch.Tensor | Fp8Rows, layer: nn.Module, residual: torch.Tensor) -> torch.Tensor:
        """residual + all_reduce(x W^T) through a row-parallel layer without bias (its weight, or its FP8
        weight and scales). On one rank with add_in_gemm, in place, rounding once: no [T, out] temporary and
        one pass fewer over the residual stream (a prefill step of 8 x 1,024 tokens spent 4.0 of 186 ms in
        residual adds on an H100). bf16: the backend's matmul_add (aiter_triton: one row in our GEMV's
        epilogue, where a GEMV and an add kernel ran), else cuBLAS's epilogue (beta = 1) past one row; FP8:
        the FP8 GEMM's (one row: the GEMV's epilogue, more: in place after it)."""
        in_place = self.size == 1 and self.add_in_gemm
        if layer.quant is not None:
            if in_place:
                return self.linear_fp8(x, layer, residual=residual)
            return residual + self.all_reduce(self.linear_fp8(x, layer))
        if in_place:
            if self.matmul_add is not None:
                return self.matmul_add(x, layer.weight, residual)
            if x.shape[0] > 1:
                return residual.addmm_(x, layer.weight.t())
        return residual + self.all_reduce(self.linear(x, layer.weight))

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


QUANT_CHUNK_ROWS = 2048  # rows quantized at once at load (at least): bounds the fp32 temporaries
QUANT_CHUNK_ELEMENTS = 1 << 24  # ... or more rows, up to this many elements (64 MiB of fp32 a temporary)


def quant_chunk_rows(k: int, bn: int) -> int:
    """Rows of K quantized at once: QUANT_CHUNK_ROWS, or more while QUANT_CHUNK_ELEMENTS allows; whole blocks
    of bn rows."""
    rows = max(QUANT_CHUNK_ROWS, QUANT_CHUNK_ELEMENTS // max(k, 1))
    return max(bn, rows // bn * bn)


def quantize_rows(param: nn.Parameter, rows: torch.Tensor, offset: int, scale: nn.Parameter,
                  scheme: Fp8Scheme) -> None:
    """A bf16 shard of W (rows [offset, offset + n) of an FP8 weight) quantized into the weight and its scale
    (--quantization fp8 and random weights); a block scheme's offset is whole blocks. A chunk of rows at a
    time, so the load's temporaries stay small beside the weights."""
    bn = 1 if scheme.weight == "channel" else scheme.block[0]
    step = quant_chunk_rows(rows.shape[1], bn)
    for start in range(0, rows.shape[0], step):
        q, s = quantize_weight(rows[start:start + step].to(param.device), scheme)
        copy_checked(param.data.narrow(0, offset + start, q.shape[0]), q)
        copy_checked(scale.data.narrow(0, (offset + start) // bn, s.shape[0]), s)


def load_column_fp8(param: nn.Parameter, src, part: int, *, shard_sizes: list[int], rank: int,
                    scale: nn.Parameter, scheme: Fp8Scheme) -> None:
    """An FP8 column-parallel weight: an FP8 checkpoint's rows copied, a bf16 one's quantized (its scale
    rows written here: load_checkpoint counts them)."""
    size, offset = shard_sizes[part], sum(shard_sizes[:part])
    rows = read_rows(src, rank * size, size, 0)
    if rows.dtype == FP8:
        copy_checked(param.data.narrow(0, offset, size), rows)
    else:
        quantize_rows(param, rows, offset, scale, scheme)


def load_row_fp8(param: nn.Parameter, src, part: int, *, shard: int, rank: int, scale: nn.Parameter,
                 scheme: Fp8Scheme) -> None:
    cols = read_rows(src, rank * shard, shard, 1)
    if cols.dtype == FP8:
        copy_checked(param.data, cols)
    else:
        quantize_rows(param, cols, 0, scale, scheme)


def scalar_or_rows(src, n: int, where: str) -> torch.Tensor:
    """A per-channel scale as [n] (a per-tensor one, [] or [1], repeated): compressed-tensors' 'tensor' and
    'channel' weight strategies, [n] or [n, 1]."""
    shape = source_shape(src)
    full = src if isinstance(src, torch.Tensor) else src[:]
    if math.prod(shape) == 1:
        return full.reshape(1).float().expand(n)
    if shape not in ((n,), (n, 1)):
        raise ValueError(f"per-channel {where} scale of shape {shape} does not fit {n} output rows "
                         f"(expected [{n}], [{n}, 1] or one per-tensor value)")
    return full.reshape(n).float()


def load_channel_scale_column(param: nn.Parameter, src, part: int, *, shard_sizes: list[int], rank: int,
                              ranks: int) -> None:
    size, offset = shard_sizes[part], sum(shard_sizes[:part])
    rows = scalar_or_rows(src, size * ranks, "weight")
    copy_checked(param.data.narrow(0, offset, size), rows[rank * size:(rank + 1) * size])


def load_block_scale_column(param: nn.Parameter, src, part: int, *, block_rows: list[int], rank: int,
                            ranks: int, cols: int) -> None:
    """Part `part`'s block scales [ceil(N_p / bn), ceil(K / bk)]: this rank's block rows, after the parts
    before it."""
    rows, offset = block_rows[part], sum(block_rows[:part])
    shape = source_shape(src)
    if shape != (rows * ranks, cols):
        raise ValueError(f"block scale of shape {shape} does not fit [{rows * ranks}, {cols}] "
                         "(weight rows / block_n, weight columns / block_k)")
    copy_checked(param.data.narrow(0, offset, rows), read_rows(src, rank * rows, rows, 0))


def load_channel_scale_row(param: nn.Parameter, src, part: int = 0) -> None:
    copy_checked(param.data, scalar_or_rows(src, param.shape[0], "weight"))


def load_block_scale_row(param: nn.Parameter, src, part: int, *, cols: int, rank: int, ranks: int) -> None:
    """A row-parallel layer's block scales: all block rows, this rank's block columns."""
    shape = source_shape(src)
    if shape != (param.shape[0], cols * ranks):
        raise ValueError(f"block scale of shape {shape} does not fit [{param.shape[0]}, {cols * ranks}] "
                         "(weight rows / block_n, weight columns / block_k)")
    copy_checked(param.data, read_rows(src, rank * cols, cols, 1))


def load_input_scale(param: nn.Parameter, src, part: int = 0) -> None:
    """A static activation scale [1]: packed parts (q/k/v, gate/up) share the largest (vLLM's choice)."""
    value = (src if isinstance(src, torch.Tensor) else src[:]).float().reshape(-1)
    if value.numel() != 1 or not value.item() > 0:
        raise ValueError(f"input_scale must be one value > 0, got shape {tuple(value.shape)}")
    param.data.copy_(torch.maximum(param.data, value.to(param.device)))


def check_block_shards(scheme: Fp8Scheme | None, sizes: list[int], tp: int, what: str) -> None:
    """FP8 block scales split whole blocks: each packed part's rows per rank (or a row-parallel layer's input
    columns per rank) a multiple of the block, except one unsplit tail."""
    if scheme is None or scheme.weight != "block":
        return
    block = scheme.block[0 if what == "output" else 1]
    if (len(sizes) > 1 or tp > 1) and any(s % block for s in sizes):
        raise ValueError(f"FP8 block {scheme.block[0]}x{scheme.block[1]}: {what} sizes per TP rank {sizes} "
                         f"are not multiples of {block}, so a block scale would straddle a shard or a packed "
                         "part")


def quant_params(module: nn.Module, scheme: Fp8Scheme | None, scale: nn.Parameter | None,
                 num_parts: int) -> None:
    """An FP8 layer's weight_scale and, for static activations, input_scale [1] (0 until loaded)."""
    module.quant = scheme
    module.weight_scale = scale
    module.input_scale = None
    if scheme is not None and scheme.activation == "static":
        module.input_scale = new_param((1,), torch.float32, load_input_scale, num_parts)
        module.input_scale.data.zero_()


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

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TP, dtype: torch.dtype,
                 quant: Fp8Scheme | None = None):
        super().__init__()
        if any(s % tp.size for s in out_sizes):
            raise ValueError(f"output sizes {out_sizes} are not divisible by {tp.size} TP ranks")
        shard_sizes = [s // tp.size for s in out_sizes]
        self.tp = tp
        loader = partial(load_column, shard_sizes=shard_sizes, rank=tp.rank)
        rows, parts = sum(shard_sizes), len(out_sizes)
        quant_params(self, quant, column_scale(quant, shard_sizes, in_features, tp), parts)
        if quant is not None:
            loader = partial(load_column_fp8, shard_sizes=shard_sizes, rank=tp.rank, scale=self.weight_scale,
                             scheme=quant)
        self.weight = new_param((rows, in_features), dtype if quant is None else FP8, loader, parts)
        loader = partial(load_column, shard_sizes=shard_sizes, rank=tp.rank)
        self.bias = new_param((rows,), dtype, loader, parts) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.tp.linear_fp8(x, self, self.bias)
        return self.tp.linear(x, self.weight, self.bias)


def column_scale(scheme: Fp8Scheme | None, shard_sizes: list[int], in_features: int,
                 tp: TP) -> nn.Parameter | None:
    """A column-parallel FP8 layer's weight_scale: [rows] per channel, or each part's block rows stacked."""
    if scheme is None:
        return None
    check_block_shards(scheme, shard_sizes, tp.size, "output")
    parts, rank = len(shard_sizes), tp.rank
    if scheme.weight == "channel":
        loader = partial(load_channel_scale_column, shard_sizes=shard_sizes, rank=rank, ranks=tp.size)
        return new_param((sum(shard_sizes),), torch.float32, loader, parts)
    bn, bk = scheme.block
    block_rows = [-(-s // bn) for s in shard_sizes]
    cols = -(-in_features // bk)
    loader = partial(load_block_scale_column, block_rows=block_rows, rank=rank, ranks=tp.size, cols=cols)
    return new_param((sum(block_rows), cols), torch.float32, loader, parts)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b with W's input columns split over ranks (x arrives split)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TP, dtype: torch.dtype,
                 quant: Fp8Scheme | None = None):
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"input size {in_features} is not divisible by {tp.size} TP ranks")
        self.tp = tp
        shard = in_features // tp.size
        check_block_shards(quant, [shard], tp.size, "input")
        quant_params(self, quant, row_scale(quant, out_features, shard, tp), 1)
        loader = partial(load_row, shard=shard, rank=tp.rank)
        if quant is not None:
            loader = partial(load_row_fp8, shard=shard, rank=tp.rank, scale=self.weight_scale, scheme=quant)
        self.weight = new_param((out_features, shard), dtype if quant is None else FP8, loader)
        self.bias = new_param((out_features,), dtype) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """y, or residual + y (TP.linear_add: in place in residual where the GEMM adds it)."""
        if residual is not None and self.bias is None:
            return self.tp.linear_add(x, self, residual)
        y = self.tp.all_reduce(self.tp.linear_fp8(x, self) if self.quant is not None else
                               self.tp.linear(x, self.weight))
        y = y + self.bias if self.bias is not None else y
        return y if residual is None else residual + y


def row_scale(scheme: Fp8Scheme | None, out_features: int, shard: int, tp: TP) -> nn.Parameter | None:
    """A row-parallel FP8 layer's weight_scale: [out] per channel (every rank all of it), or [ceil(out / bn),
    shard / bk] blocks."""
    if scheme is None:
        return None
    if scheme.weight == "channel":
        return new_param((out_features,), torch.float32, load_channel_scale_row)
    bn, bk = scheme.block
    cols = -(-shard // bk)
    return new_param((-(-out_features // bn), cols), torch.float32,
                     partial(load_block_scale_row, cols=cols, rank=tp.rank, ranks=tp.size))


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

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, vocab_size]; out (a [N, vocab_size] view of the decode graphs' static logits buffer):
        written there and returned. One rank (its shard is the whole vocabulary): the GEMM writes it (at 256
        rows of llama-3.1-8b a 66 MB temporary and its copy fewer a decode step); else the gathered logits
        are copied in."""
        if out is not None and self.tp.size == 1:
            return self.tp.linear(hidden, self.weight, out=out)
        logits = self.tp.all_gather_last(self.tp.linear(hidden, self.weight))
        logits = logits[..., : self.vocab_size] if logits.shape[-1] != self.vocab_size else logits
        return logits if out is None else out.copy_(logits)
