"""AITER's native ROCm ops: paged_attention_ragged decode with a preallocated workspace,
flash_attn_varlen_func prefill, rmsnorm2d_fwd.

UNTESTED ON HARDWARE: this project has no ROCm GPU. The call contract (argument order, shapes, dtypes,
workspace size) is unit-tested against a mocked `aiter` (unit_tests/test_aiter_native_contract.py),
following amd-aiter 0.1.7's aiter/ops/attention.py and SGLang's aiter_backend.py.
"""
from __future__ import annotations

import importlib

import torch

from autoprofile import budget
from autoprofile.kernels import launch_rules
from autoprofile.layers.attention import (AttentionBackend, AttentionMetadata, KVLayer, output_rows,
                                          write_into)

PARTITION = launch_rules.AITER_PARTITION  # tokens per partition of the ragged decode (256)
KV_LAYOUT = "HND"  # [num_pages, num_kv_heads, page_size, head_dim]: our layout


class AiterNativeBackend(AttentionBackend):
    name = "aiter"

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, deterministic: bool = False):
        super().__init__(num_q_heads, num_kv_heads, head_dim, page_size, dtype, device, deterministic)
        try:
            self.aiter = importlib.import_module("aiter")
        except (ImportError, RuntimeError) as e:
            raise RuntimeError(f"--attention_backend aiter needs amd-aiter on ROCm ({e}); "
                               "try --attention_backend aiter_triton or torch") from e
        # Scales live outside build(): build allocates exactly workspace_bytes.
        self.k_scale = torch.ones(1, dtype=torch.float32, device=device)
        self.v_scale = torch.ones(1, dtype=torch.float32, device=device)
        self.workspace: torch.Tensor | None = None
        self.max_decode_rows = 0
        self.num_partitions = 0

    @classmethod
    def workspace_bytes(cls, max_decode_rows: int, max_context_len: int, num_q_heads: int,
                        head_dim: int) -> int:
        """fp32 partial outputs plus exp-sums and max-logits for every request, head and 256-token
        partition of the longest sequence (callers pass min(context_len, T): seed 001)."""
        partitions = launch_rules.aiter_num_partitions(max_context_len, partition=PARTITION)
        return budget.aiter_workspace_bytes(max_decode_rows, num_q_heads, head_dim, partitions)

    def build(self, max_decode_rows: int, max_context_len: int, graph_rows: int = 0) -> None:
        self.teardown()
        nbytes = self.workspace_bytes(max_decode_rows, max_context_len, self.num_q_heads, self.head_dim)
        self.workspace = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.max_decode_rows = max_decode_rows
        self.num_partitions = launch_rules.aiter_num_partitions(max_context_len, partition=PARTITION)

    def teardown(self) -> None:
        self.workspace = None
        self.max_decode_rows = self.num_partitions = 0

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv: KVLayer | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        cu_k, max_k = meta.keys()  # causal is aligned bottom-right (flash-attention >= 2.1 semantics)
        return write_into(out, self.aiter.flash_attn_varlen_func(
            q, k, v, meta.cu_seqlens, cu_k, meta.max_seqlen, max_k, softmax_scale=self.scale, causal=True))

    def decode(self, q: torch.Tensor, kv: KVLayer, meta: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Requires seq_lens >= 1. The partition count is the built one (static: graph-safe). The cache has
        the model's dtype (config refuses an FP8 cache here)."""
        k_cache, v_cache = kv.k, kv.v
        if self.workspace is None:
            raise RuntimeError("AiterNativeBackend.decode before build()")
        if q.shape[0] > self.max_decode_rows:
            raise ValueError(f"decode batch {q.shape[0]} exceeds the {self.max_decode_rows} decode rows the "
                             "workspace was built for")
        if launch_rules.aiter_num_partitions(meta.max_seq_len, partition=PARTITION) > self.num_partitions:
            raise ValueError(f"max_seq_len {meta.max_seq_len} is longer than the workspace was built for")
        indptr, indices, last_page_lens = ragged_pages(meta.block_tables, meta.seq_lens, self.page_size)
        out = output_rows(out, q)
        self.aiter.paged_attention_ragged(
            out, self.workspace, q.contiguous(), k_cache, v_cache, self.scale,
            indptr, indices, last_page_lens, self.page_size, self.num_partitions,
            None, "auto", KV_LAYOUT, 0.0, self.k_scale, self.v_scale, None, PARTITION)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.aiter.rmsnorm2d_fwd(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)


def ragged_pages(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, P] page table + lengths -> the ragged form (kv_indptr [B+1], kv_page_indices [B*P+1],
    kv_last_page_lens [B]), all int32, with static shapes (graph-safe): the used pages of request b
    sit at kv_page_indices[kv_indptr[b]:kv_indptr[b+1]]; unused columns land in the last slot."""
    b, p = block_tables.shape
    lens = seq_lens.to(torch.int32)
    num_pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(b + 1, dtype=torch.int32, device=block_tables.device)
    indptr[1:] = torch.cumsum(num_pages, 0)
    cols = torch.arange(p, dtype=torch.int32, device=block_tables.device)
    dest = torch.where(cols[None, :] < num_pages[:, None], indptr[:-1, None] + cols[None, :], b * p)
    indices = torch.zeros(b * p + 1, dtype=torch.int32, device=block_tables.device)
    indices.scatter_(0, dest.reshape(-1).long(), block_tables.reshape(-1).to(torch.int32))
    return indptr, indices, lens - (num_pages - 1) * page_size
