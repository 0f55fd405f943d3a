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
    """Request slots on the GPU: page_table [max_reqs, ceil(context_len/page_size)] int32 page ids,
    seq_lens [max_reqs] int32 (tokens in the cache) and last_tokens [max_reqs] int32 (the next decode
    input, so decode steps need no host round trip). Bytes = budget.req_table_bytes(...)."""

    def __init__(self, max_reqs: int, context_len: int, page_size: int, device: torch.device):
        self.max_reqs, self.page_size = max_reqs, page_size
        self.pages_per_req = math.ceil(context_len / page_size)
        self.page_table = torch.zeros((max_reqs, self.pages_per_req), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self.last_tokens = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self._free = list(range(max_reqs - 1, -1, -1))
        self._used = bytearray(max_reqs)

    @property
    def nbytes(self) -> int:
        return self.page_table.nbytes + self.seq_lens.nbytes + self.last_tokens.nbytes

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, pages: list[int]) -> int:
        """A free slot whose page row starts with `pages` (seq_len 0)."""
        if not self._free:
            raise KVCacheFull(f"request table full: all {self.max_reqs} slots in use")
        if len(pages) > self.pages_per_req:
            raise ValueError(f"{len(pages)} pages exceed the {self.pages_per_req} a request may hold")
        slot = self._free.pop()
        self._used[slot] = 1
        if pages:
            self.page_table[slot, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.seq_lens[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.max_reqs or not self._used[slot]:
            raise ValueError(f"request slot {slot} is not in use (double free?)")
        self._used[slot] = 0
        self._free.append(slot)
