"""The paged KV pool (one tensor), its page allocator, and the request table (slots -> pages)."""
from __future__ import annotations

import math

import torch

PAD_PAGE = 0  # never handed out: padded graph rows write their K/V here (and the prefill stress, scratch)


class KVCacheFull(RuntimeError):
    """No free page or request slot left."""


class KVCache:
    """ONE contiguous tensor [2, num_layers, num_pages, kv_heads, page_size, head_dim]; `layers[i]` is the
    (k_cache, v_cache) view pair of layer i in the backend's layout
    [num_pages, kv_heads, page_size, head_dim].

    NOTE: captured decode graphs hold raw pointers into `buffer`: drop the graphs before the cache."""

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        # zeros, not empty: masked-out cache entries must not be NaN bit patterns (0 * NaN = NaN)
        self.buffer = torch.zeros((2, num_layers, num_pages, num_kv_heads, page_size, head_dim),
                                  dtype=dtype, device=device)
        self.layers = [(self.buffer[0, i], self.buffer[1, i]) for i in range(num_layers)]
        self.num_pages, self.page_size = num_pages, page_size

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes


class PageAllocator:
    """Free list of page ids (PAD_PAGE excluded). Host-side: allocation never touches the GPU."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, PAD_PAGE, -1))  # pop() hands out low ids first
        self._used = bytearray(num_pages)

    @property
    def capacity(self) -> int:
        """Pages that can be handed out."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheFull(f"KV cache full: {n} pages requested, "
                              f"{len(self._free)} of {self.capacity} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._used[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 < p < self.num_pages or not self._used[p]:
                raise ValueError(f"page {p} is not allocated (double free?)")
            self._used[p] = 0
            self._free.append(p)


class ReqTable:
    """The GPU page table of the request slots: page_table [max_reqs, ceil(context_len/page_size)] int32
    page ids (the block tables the decode kernels read). The scheduler owns which slot holds which
    request; the runner mirrors each step's new pages here. Bytes = budget.req_table_bytes(...)."""

    def __init__(self, max_reqs: int, context_len: int, page_size: int, device: torch.device):
        self.max_reqs, self.page_size = max_reqs, page_size
        self.pages_per_req = math.ceil(context_len / page_size)
        self.page_table = torch.zeros((max_reqs, self.pages_per_req), dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return self.page_table.nbytes

    def write(self, writes: list[tuple[int, int, list[int]]]) -> None:
        """(slot, first column, page ids) triples, in one indexed copy."""
        if not writes:
            return
        rows, cols, pages = [], [], []
        for slot, first, ids in writes:
            if not 0 <= slot < self.max_reqs or first + len(ids) > self.pages_per_req:
                raise ValueError(f"pages {first}..{first + len(ids) - 1} of slot {slot} are outside the "
                                 f"{self.max_reqs} x {self.pages_per_req} page table")
            rows += [slot] * len(ids)
            cols += range(first, first + len(ids))
            pages += ids
        dev = self.page_table.device
        self.page_table[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = torch.tensor(
            pages, dtype=torch.int32, device=dev)
