"""MLA's absorbed decode through AITER's Triton kernel (aiter.ops.triton.mla_decode_rope, SGLang's grouped
decode), the aiter_triton backend's mla_decode.

The kernel reads the cache token by token through kv_indptr / kv_indices (page size 1). Our pages become
token slots: `kv_slots` runs one program per row and block of tokens, each row's slots packed after the rows
before it. Each row's tokens are split in parts; a second kernel merges the splits. The latents are
the keys, and their first kv_lora_rank channels the values: the rope part only scores. Fewer rows get more
splits (budget.mla_kv_splits: rows x splits near 256 programs).

The launch takes the row count as a constexpr, so every distinct count is a compile. Rows are padded with
zero-length rows to `padded_rows`: the decode-graph ladder's sizes up to the captured ones, the envelope's
most decode rows above. The graphs' captures and the stress's corner at the most rows then compile every
size a step can take.

Scratch per call (in a graph, its pool; measured by the probe at the most rows and the largest bucket): the
packed slots, rows x max_seq_len int32 (not capped by the cache's slots: rows sharing a cached prefix read
the same slots, so the rows' tokens together can outnumber the cache), and the splits' partial outputs, rows
x heads x splits x (kv_lora_rank + 1) fp32: budget.mla_decode_scratch_bytes.
"""
from __future__ import annotations

import bisect
import functools
import importlib

import torch
import triton
import triton.language as tl

from autoprofile import budget
from autoprofile.kernels.aiter_loader import triton_ops_package

SLOT_BLOCK = 256
# --deterministic: every row's tokens in this many splits whatever the rows (budget.mla_kv_splits follows the
# row count, and a row's merged output follows its splits). 16: budget's choice at 16 rows
INVARIANT_SPLITS = 16
# No waves_per_eu, matrix_instr_nonkdim, kpack: AMD-only launch options (AITER's MI300 file has them).
# Tuned on an H100 (scripts/tune_mla_decode.py, ctx 4000): 1.5-2x faster than BLOCK_N 16 / 1 stage / 16 splits
CONFIG = {"fwd_grouped_kernel_stage1_rope": {"BLOCK_N": 32, "BLOCK_H": 16, "num_warps": 4, "num_stages": 2},
          "fwd_kernel_stage2": {"num_warps": 4, "num_stages": 1}}


@functools.cache
def _decode_fn():
    triton_ops_package()
    return importlib.import_module("aiter.ops.triton.mla_decode_rope").decode_attention_fwd_grouped_rope


@triton.jit(do_not_specialize=["stride_table"])
def _kv_slots_kernel(tables_ptr, seq_lens_ptr, indptr_ptr, out_ptr, stride_table, PAGE: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = t < tl.load(seq_lens_ptr + row)
    start = tl.load(indptr_ptr + row)
    page = tl.load(tables_ptr + row * stride_table + t // PAGE, mask=live, other=0)
    tl.store(out_ptr + start + t, page * PAGE + t % PAGE, mask=live)


def kv_slots(tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
             max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr [rows + 1], kv_indices) int32: row r's token slots at kv_indices[indptr[r]:indptr[r + 1]].
    seq_lens may have more rows than tables (zero-length padding rows past them)."""
    rows = seq_lens.shape[0]
    indptr = torch.zeros(rows + 1, dtype=torch.int32, device=seq_lens.device)
    indptr[1:] = seq_lens.cumsum(0)
    indices = torch.empty(rows * max_seq_len, dtype=torch.int32, device=seq_lens.device)
    grid = (tables.shape[0], triton.cdiv(max_seq_len, SLOT_BLOCK))
    _kv_slots_kernel[grid](tables, seq_lens, indptr, indices, tables.stride(0), PAGE=page_size,
                           BLOCK=SLOT_BLOCK)
    return indptr, indices


def padded_rows(rows: int, graph_rows: int, max_rows: int) -> int:
    """The compiled row count a decode of `rows` rows runs at: the graph ladder's next size while one holds
    it, else the envelope's most decode rows."""
    if rows <= graph_rows:
        ladder = budget.batch_ladder(graph_rows)
        return ladder[bisect.bisect_left(ladder, rows)]
    return max(rows, max_rows)


def launch_for(rows: int) -> tuple[int, dict]:
    """(splits of each row's tokens, the kernels' launch config) at a compiled row count."""
    return budget.mla_kv_splits(rows), CONFIG


def padded_slots(tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int, max_seq_len: int,
                 rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_slots of the rows padded to `rows` with zero-length rows: the same for every layer of a step."""
    if rows > seq_lens.shape[0]:
        seq_lens = torch.cat([seq_lens, seq_lens.new_zeros(rows - seq_lens.shape[0])])
    return kv_slots(tables, seq_lens, page_size, max_seq_len)


def mla_decode(q: torch.Tensor, latents: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
               max_seq_len: int, scale: float, v_dim: int, rows: int,
               launch: tuple[int, dict] | None = None,
               slots: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [B, H, L] against the latent cache [pages, 1, page, L] -> [B, H, v_dim], computed at `rows` rows
    (>= B; padding rows have no tokens). `launch` overrides launch_for(rows) (scripts/tune_mla_decode.py).
    slots: padded_slots(tables, seq_lens, page, max_seq_len, rows) made once for every layer of a step (None:
    made here)."""
    b, heads, width = q.shape
    page = latents.shape[2]
    if rows > b:  # zero-length rows: their outputs are dropped
        q = torch.cat([q, q.new_zeros(rows - b, heads, width)])
    buffer = latents.view(-1, 1, width)  # one head: (page, 1, offset) is slot page * page_size + offset
    indptr, indices = slots if slots is not None else padded_slots(tables, seq_lens, page, max_seq_len, rows)
    out = q.new_empty(rows, heads, v_dim)
    splits, config = launch or launch_for(rows)
    partial = torch.empty(rows, heads, splits, v_dim + 1, dtype=torch.float32, device=q.device)
    config = {k: dict(v) for k, v in config.items()}  # AITER writes its block sizes into it
    _decode_fn()(q, buffer, buffer[..., :v_dim], out, indptr, indices, None, v_dim, width - v_dim, None, None,
                 partial, splits, scale, 0.0, False, False, config)
    return out[:b]
