"""The paged KV pool (one tensor), its page allocator, and the request table (slots -> pages)."""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from autoprofile.layers.attention import KVLayer

PAD_PAGE = 0  # never handed out: padded graph rows write their K/V here (and the prefill stress, scratch)


class KVCacheFull(RuntimeError):
    """No free page or request slot left."""


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


class PageAllocator:
    """Pages with reference counts (PAD_PAGE is never handed out). Host-side: never touches the GPU.

    Prefix caching: a full page of computed K/V is registered under the key (chain id of the page before it,
    its tokens). A page whose last holder frees it stays in the free list, least recently freed first, still
    registered: a request with the same prefix takes it back (`share`) until `alloc` hands it out again (and
    forgets its key). Chain ids are never reused, so a key can only match the exact same prefix."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(PAD_PAGE + 1, num_pages))
        self._ref = [0] * num_pages
        self._key: dict[int, tuple] = {}  # registered page -> (parent chain id, tokens)
        self._page: dict[tuple, int] = {}  # key -> registered page
        # registered page -> its chain id (the parent of the next page's key)
        self._chain: dict[int, int] = {}
        self._ids = itertools.count(1)  # 0: the empty prefix
        # a registered page that alloc hands out again: on_evict(page, key, chain id) first (the host tier
        # saves it), while the page still holds its K/V
        self.on_evict: Callable[[int, tuple, int], None] | None = None

    @property
    def capacity(self) -> int:
        """Pages that can be handed out."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages nobody holds (cached ones included: alloc may evict them)."""
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheFull(f"KV cache full: {n} pages requested, "
                              f"{len(self._free)} of {self.capacity} free")
        pages = [self._free.popitem(last=False)[0] for _ in range(n)]
        for p in pages:
            if self.on_evict is not None and p in self._key:
                self.on_evict(p, self._key[p], self._chain[p])
            self._forget(p)
            self._ref[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        """pages: in a request's order. The last goes back first, so alloc evicts a prefix's tail before its
        head (vLLM frees in reverse too): a head evicted first strands every cached page after it, and a
        working set a little over the cache (conversations returning in turn) would hit nothing."""
        for p in reversed(pages):
            if not PAD_PAGE < p < self.num_pages or not self._ref[p]:
                raise ValueError(f"page {p} is not allocated (double free?)")
            self._ref[p] -= 1
            if not self._ref[p]:
                self._free[p] = None

    # ------------------------------------------------------------ prefix caching
    def lookup(self, parent: int, tokens: tuple[int, ...]) -> tuple[int, int] | None:
        """(page, its chain id) holding `tokens` after the prefix `parent`, or None."""
        page = self._page.get((parent, tokens))
        return None if page is None else (page, self._chain[page])

    def is_free(self, page: int) -> bool:
        return not self._ref[page]

    def share(self, page: int) -> None:
        """One more holder of a registered page (taken back from the free list if nobody held it)."""
        if not self._ref[page]:
            del self._free[page]
        self._ref[page] += 1

    def register(self, page: int, parent: int, tokens: tuple[int, ...], chain: int | None = None) -> int:
        """Cache a held, full page; returns the chain id its successor's key uses. If the same prefix is
        cached in another page already, that one stays the cached copy and its chain id is returned.
        chain: the id the key had before (a page back from the host tier keeps it: its successors there
        still hang on it); None: a new one."""
        key = (parent, tokens)
        if key in self._page:
            return self._chain[self._page[key]]
        self._forget(page)
        self._key[page], self._page[key] = key, page
        self._chain[page] = next(self._ids) if chain is None else chain
        return self._chain[page]

    def registered(self) -> dict[tuple, int]:
        """Every cached key -> its page (the tests' view)."""
        return dict(self._page)

    def forget(self, page: int) -> None:
        """The page's K/V is not what its key says (a failed step's copy back): it leaves the cache."""
        self._forget(page)

    def _forget(self, page: int) -> None:
        key = self._key.pop(page, None)
        if key is not None:
            del self._page[key], self._chain[page]


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
