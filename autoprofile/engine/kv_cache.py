"""The paged KV pool (one tensor) and the request table (slots -> pages); the page allocator and the prefix
cache are engine.prefix_cache's (no torch)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from autoprofile.engine.prefix_cache import PAD_PAGE, KVCacheFull, PageAllocator  # noqa: F401 - re-exported
from autoprofile.layers.attention import KVLayer

FP8_DTYPES = (torch.float8_e4m3fn,)
KV_SCALE_TEXT = {"checkpoint": "the checkpoint's k_scale/v_scale",
                 "first_batch": "set by the first real batch, amax x 2 / 448 per layer", "unit": "1.0"}


def kv_scale_source(kv_cache_dtype: str, flag: str, checkpoint_has_scales: bool) -> str | None:
    """Where an FP8 cache's per-layer K/V scales come from (--kv_scales): 'checkpoint', 'first_batch' or
    'unit' (1.0); None for a cache in the model's dtype."""
    if kv_cache_dtype != "fp8_e4m3":
        return None
    if flag == "auto":
        return "checkpoint" if checkpoint_has_scales else "first_batch"
    return flag


class KVCache:
    """ONE contiguous tensor [2, num_layers, num_pages, kv_heads, page_size, head_dim]; `layers[i]` is
    layer i's KVLayer: the k and v views in the backend's layout [num_pages, kv_heads, page_size, head_dim],
    and for an FP8 cache a view of `scales` [num_layers, 2] (fp32 k_scale, v_scale per layer, 1.0 until
    set_scales or a calibrating step sets them).

    NOTE: captured decode graphs hold raw pointers into `buffer` and `scales`: drop the graphs first."""

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, latent: bool = False):
        # zeros, not empty: masked-out cache entries must not be NaN bit patterns (0 * NaN = NaN)
        # NOTE: an MLA cache (latent) holds one tensor per layer, [pages, 1, page, latent]: k and v are it
        parts = 1 if latent else 2
        shape = (parts, num_layers, num_pages, num_kv_heads, page_size, head_dim)
        self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.scales = torch.ones(num_layers, 2, dtype=torch.float32,
                                 device=device) if dtype in FP8_DTYPES else None
        self.layers = [KVLayer(self.buffer[0, i], self.buffer[-1, i],
                               None if self.scales is None else self.scales[i])
                       for i in range(num_layers)]
        self.num_pages, self.page_size = num_pages, page_size

    @property
    def nbytes(self) -> int:
        """The KV buffer (an FP8 cache's scales, a few bytes of the small-block pool, are non-KV memory)."""
        return self.buffer.nbytes

    def set_scales(self, scales: torch.Tensor | None) -> None:
        """[num_layers, 2] (k, v) per layer, or None for 1.0; in place (graphs read these addresses)."""
        if self.scales is not None:
            self.scales.copy_(scales if scales is not None else torch.ones_like(self.scales))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the stream (the request table's page writes, a VL step's
    M-RoPE positions, pixels and image mask; a step's indices go up through step_inputs.Staging's own pinned
    buffers): pinned, then a non-blocking copy. A copy from pageable memory waits for the stream,
    so the overlapped engine's launch would wait for the step in flight. The pinned block is reused only
    after the copy is done (torch's host allocator). A tensor already on a device (the stress's random
    pixels) is returned as it is."""
    if device.type == "cpu" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class ReqTable:
    """The GPU page table of the request slots: page_table [max_reqs, ceil(context_len/page_size)] int32
    page ids (the block tables the decode kernels read). The scheduler owns which slot holds which
    request; the runner mirrors each step's new pages here. Beside it, last_tokens [max_reqs] int32: the token
    each slot's request sampled last, written on the device by the step that sampled it (record), so the next
    step can feed it before the host has read it back (feed; the overlapped engine). One buffer: bytes =
    budget.req_table_bytes(...)."""

    def __init__(self, max_reqs: int, context_len: int, page_size: int, device: torch.device):
        self.max_reqs, self.page_size = max_reqs, page_size
        self.pages_per_req = math.ceil(context_len / page_size)
        cells = max_reqs * self.pages_per_req
        self.buffer = torch.zeros(cells + max_reqs, dtype=torch.int32, device=device)
        self.page_table = self.buffer[:cells].view(max_reqs, self.pages_per_req)
        self.last_tokens = self.buffer[cells:]

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """The tokens a step sampled, by request slot (on the device, no host read; one a slot a step)."""
        self.last_tokens.index_copy_(0, slots.long(), tokens.to(torch.int32))

    def feed(self, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Token ids [b] int64 of rows of request slots `slots`: a PENDING id (< 0) becomes the token its slot
        sampled last (CUDA-graph capturable)."""
        return torch.where(ids < 0, self.last_tokens[slots].long(), ids)

    def decode_metadata(self, pos: torch.Tensor, slots: torch.Tensor, cols: int,
                        real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block_tables [b, cols] int32, slot_mapping [b] int64, seq_lens [b] int32) of decode rows at
        positions `pos` of request slots `slots`, on the device, no host read (CUDA-graph capturable). `real`
        [b] bool: rows where it is False are padding, they write to PAD_PAGE and read one token of it."""
        ps = self.page_size
        tables = self.page_table[slots, :cols]
        if real is not None:
            tables = torch.where(real.unsqueeze(1), tables, PAD_PAGE)
        page = tables.gather(1, (pos // ps).clamp_(max=cols - 1).unsqueeze(1)).squeeze(1)
        slot_mapping = page * ps + pos % ps
        seq_lens = pos + 1 if real is None else torch.where(real, pos + 1, 1)
        return tables, slot_mapping, seq_lens.to(torch.int32)

    def write(self, writes: list[tuple[int, int, list[int]]]) -> None:
        """(slot, first column, page ids) triples, in one copy and one index_copy_ into the flat buffer. The
        2-D indexed assignment it replaces took 1.2 ms more host time a call in a microbenchmark (H100 host);
        served with overlap off (c256, one run), a prefill step's inputs did not move (5.46 -> 5.75 ms)."""
        if not writes:
            return
        for slot, first, ids in writes:
            if not 0 <= slot < self.max_reqs or first + len(ids) > self.pages_per_req:
                raise ValueError(f"pages {first}..{first + len(ids) - 1} of slot {slot} are outside the "
                                 f"{self.max_reqs} x {self.pages_per_req} page table")
        cells = to_device(page_write_arrays(writes, self.pages_per_req), self.buffer.device)
        n = cells.shape[0] // 2
        self.buffer.index_copy_(0, cells[:n], cells[n:].to(torch.int32))


def page_write_arrays(writes: list[tuple[int, int, list[int]]], pages_per_req: int) -> torch.Tensor:
    """ReqTable.write's host array: the flat cells (slot * pages_per_req + column) of every page, then the
    page ids, int64 [2 * pages]."""
    counts = np.fromiter((len(ids) for _, _, ids in writes), dtype=np.int64, count=len(writes))
    total = int(counts.sum())
    starts = np.fromiter((slot * pages_per_req + first for slot, first, _ in writes), dtype=np.int64,
                         count=len(writes))
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.empty(2 * total, dtype=np.int64)
    out[:total] = np.repeat(starts, counts) + within
    out[total:] = np.fromiter(itertools.chain.from_iterable(ids for _, _, ids in writes), dtype=np.int64,
                              count=total)
    return torch.from_numpy(out)
