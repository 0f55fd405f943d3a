"""The torch reference backend: plain SDPA prefill and a paged decode in torch ops. Runs on CPU and CUDA.

It is the numerical reference of every kernel test and the backend CI runs. Its decode is
CUDA-graph-capturable: no host syncs, every shape comes from q and block_tables, never from seq_lens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoprofile.layers.attention import AttentionBackend, AttentionMetadata, KVLayer, write_into

DECODE_CHUNK_BYTES = 256 << 20  # fp32 K gathered per decode step of the loop over pages
# --deterministic: the keys a step of the paged loop reads, whatever the rows (the loop's chunks are where its
# online softmax rescales, so they must not follow the batch), and the rows of every GEMM call
INVARIANT_CHUNK_TOKENS = 64
INVARIANT_GEMM_ROWS = 32


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear called on tiles of INVARIANT_GEMM_ROWS rows (the last one zero-padded): every call has one
    shape, so the CPU's GEMM takes one kernel and blocking whatever the step's row count, and a row's result
    does not depend on the rows beside it (a [M, K] call picks its kernel by M)."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    pad = -m % INVARIANT_GEMM_ROWS
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    result = torch.cat([F.linear(t, weight, bias) for t in rows.split(INVARIANT_GEMM_ROWS)]) if m else \
        x.new_empty(0, weight.shape[0])
    return write_into(out, result[:m].view(*x.shape[:-1], weight.shape[0]))


class TorchBackend(AttentionBackend):
    """Decode walks the page table in chunks with an online softmax (fp32), so its working set is
    bounded by `decode_chunk_bytes` whatever max_seq_len is; it reads all block_tables columns (the
    static worst case), so it is slow for long max_seq_len: a reference, not a fast path."""

    name = "torch"

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, deterministic: bool = False,
                 decode_chunk_bytes: int = DECODE_CHUNK_BYTES):
        super().__init__(num_q_heads, num_kv_heads, head_dim, page_size, dtype, device, deterministic)
        self.group = num_q_heads // num_kv_heads
        self.decode_chunk_bytes = decode_chunk_bytes

    @property
    def paged_prefill(self) -> bool:
        return self.deterministic

    @property
    def gemm(self):
        return tiled_linear if self.deterministic else None

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv: KVLayer | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """--deterministic: each new token is a row of the paged loop over the cache (its own length: causal),
        so a token's attention is a decode row's, whatever the chunk it came in."""
        if self.deterministic:
            return self.decode(q, kv, meta.token_rows(), out)
        return write_into(out, self._varlen(q, k, v, meta, self.group, self.scale))

    def mla_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
        return self._varlen(q, k, v, meta, 1, scale)

    def _varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, group: int,
                scale: float) -> torch.Tensor:
        bounds = meta.cu_seqlens.tolist()
        kv_bounds = meta.cu_seqlens_k.tolist() if meta.cu_seqlens_k is not None else bounds
        if bounds[-1] != q.shape[0] or kv_bounds[-1] != k.shape[0]:
            raise ValueError(f"cu_seqlens cover {bounds[-1]} query and {kv_bounds[-1]} key tokens, "
                             f"q has {q.shape[0]} and k {k.shape[0]}")
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        for start, end, kv_start, kv_end in zip(bounds[:-1], bounds[1:], kv_bounds[:-1], kv_bounds[1:]):
            if end > start:
                out[start:end] = _causal(q[start:end], k[kv_start:kv_end], v[kv_start:kv_end], group, scale)
        return out

    def decode_chunk_pages(self, num_seqs: int, pages_per_req: int, width: int | None = None) -> int:
        """Pages per step of the decode loop: fp32 K of one chunk (`width` channels a token, all kv heads)
        fits decode_chunk_bytes."""
        per_token = num_seqs * (width or self.num_kv_heads * self.head_dim) * 4
        return max(min(self.decode_chunk_bytes // (per_token * self.page_size), pages_per_req), 1)

    def decode(self, q: torch.Tensor, kv: KVLayer, meta: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Requires seq_lens >= 1 (padded graph slots included: point them at a scratch page). An FP8
        cache is dequantised as it is gathered (fp32, by its scales)."""
        return write_into(out, self._paged(q, kv, meta, self.num_kv_heads, self.scale))

    def mla_decode(self, q: torch.Tensor, kv: KVLayer, meta: AttentionMetadata, scale: float,
                   v_dim: int) -> torch.Tensor:
        """The latent cache read as one shared head (its values the latents themselves, of which the first
        v_dim channels are kept: the rest, the rope key, only scores)."""
        return self._paged(q, kv, meta, 1, scale)[..., :v_dim]

    def _paged(self, q: torch.Tensor, kv: KVLayer, meta: AttentionMetadata, hkv: int,
               scale: float) -> torch.Tensor:
        k_cache, v_cache = kv.k, kv.v
        k_scale, v_scale = (None, None) if kv.scales is None else kv.scales.unbind()
        tables, seq_lens = meta.block_tables, meta.seq_lens
        b, pages_per_req = tables.shape
        d, group = q.shape[-1], q.shape[1] // hkv
        # NOTE: columns past seq_len may hold anything (the AITER kernels never read them): clamp to gather
        tables = tables.clamp(0, k_cache.shape[0] - 1)
        qg = q.reshape(b, hkv, group, d).float() * scale
        m = torch.full((b, hkv, group, 1), float("-inf"), device=q.device)
        denom = torch.zeros((b, hkv, group, 1), device=q.device)
        acc = torch.zeros((b, hkv, group, d), device=q.device)
        step = (max(INVARIANT_CHUNK_TOKENS // self.page_size, 1) if self.deterministic
                else self.decode_chunk_pages(b, pages_per_req, hkv * d))
        offsets = torch.arange(step * self.page_size, device=q.device)
        for first in range(0, pages_per_req, step):
            pages = tables[:, first:first + step]
            n = pages.shape[1] * self.page_size
            keys, values = self._gather(k_cache, pages, k_scale), self._gather(v_cache, pages, v_scale)
            scores = qg @ keys.transpose(-1, -2)  # [b, hkv, group, n]
            valid = (first * self.page_size + offsets[:n]) < seq_lens[:, None].to(offsets.dtype)
            scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
            # NOTE: and their values zeroed: an uninitialized cache cell may hold NaN or inf, and its zero
            # weight would carry it into p @ values (0 * NaN is NaN)
            values = values.masked_fill_(~valid[:, None, :, None], 0.0)
            m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
            # NOTE: a chunk wholly past seq_len leaves m_new = -inf, and exp(-inf - -inf) is nan
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = torch.exp(scores - m_safe)
            alpha = torch.exp(m - m_safe)
            denom = denom * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + p @ values
            m = m_new
        return (acc / denom).to(q.dtype).view(b, hkv * group, d)

    def _gather(self, cache: torch.Tensor, pages: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """[num_pages, Hkv, page, D] at pages [B, c] -> fp32 [B, Hkv, c*page, D] (times scale, if any)."""
        g = cache[pages].permute(0, 2, 1, 3, 4)
        b, h, c, p, d = g.shape
        out = torch.empty(g.shape, dtype=torch.float32, device=g.device).copy_(g)
        if scale is not None:
            out.mul_(scale)
        return out.view(b, h, c * p, d)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, scale: float) -> torch.Tensor:
    """One request: q [Lq, Hq, D], k [Lk, Hkv, D], v [Lk, Hkv, Dv] with Lk >= Lq (the last Lq keys are q's
    own tokens: causal aligned bottom-right), Hq = group * Hkv -> [Lq, Hq, Dv]."""
    qh = q.transpose(0, 1)[None]
    kh = k.transpose(0, 1).repeat_interleave(group, 0)[None].to(q.dtype)
    vh = v.transpose(0, 1).repeat_interleave(group, 0)[None].to(q.dtype)
    if k.shape[0] == q.shape[0]:
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)[0].transpose(0, 1)
    # NOTE: imported here: torch.nn.attention.bias imports torch._dynamo (sympy, fx), 1-5 s of every boot,
    # where a GPU server never takes this path (scripts/boot_profile.py)
    from torch.nn.attention.bias import causal_lower_right
    mask = causal_lower_right(q.shape[0], k.shape[0])
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)[0].transpose(0, 1)
