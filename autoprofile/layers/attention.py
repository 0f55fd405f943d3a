"""The attention-backend seam: one interface, each backend declares its persistent workspace; its kernel
ops for the other layers are layers.ops.KernelOps."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from autoprofile.layers import gdn
from autoprofile.layers.ops import KernelOps
from autoprofile.layers.quant import FP8_MAX


class KVLayer(NamedTuple):
    """One layer's paged cache, in the backend's layout [num_pages, num_kv_heads, page_size, head_dim].

    scales: an FP8 cache's per-tensor dequantisation scales, a [2] fp32 device tensor (k_scale, v_scale):
    the cache holds fp8(x / scale) and a read is fp8 * scale. A device tensor, not a float, so captured
    graphs read the values of the moment (the first real batch may set them after capture). None when
    the cache has the model's dtype."""

    k: torch.Tensor
    v: torch.Tensor
    scales: torch.Tensor | None = None


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in `dtype` (saturated to the finite FP8 range: a value past it must not become NaN)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale in `dtype`, with no temporary wider than the result (the product is computed in fp32:
    the same values as (x.float() * scale).to(dtype))."""
    return x.to(dtype).mul_(scale)


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once per forward by the runner (one small object).

    Prefill (varlen; each request's new tokens attend causally to its own tokens):
        cu_seqlens [B+1] int32, max_seqlen (python int).
      Chunks over a cached prefix add what the attention reads from the cache (prefix + new tokens,
      aligned bottom-right): kv_slots [sum kv_len] int64 cache slots, cu_seqlens_k [B+1] int32,
      max_seqlen_k (python int). None when no row has a prefix (new tokens attend to themselves).
    Decode (one new token per request, reading the paged cache):
        block_tables [B, pages_per_req] int32 page ids, seq_lens [B] int32 (incl. the new token),
        max_seq_len (python int, static: --max_req_total_len so graphs and the probe see the worst case).
      captured: the decode runs inside a CUDA graph. Every such shape is captured, and so measured, at
        build: a kernel may pick its launch shape per batch (aiter_triton's v2 partitions). Eager decode
        keeps scratch that grows with the rows, so the stress's corner at the most rows holds the most.
    Both: slot_mapping [num_tokens] int64, slot = page * page_size + offset, where new K/V are written.
    Mixed (a prefill step with decode rows): `decode` is the decode rows' metadata; their tokens follow the
      prefill tokens (slot_mapping covers both), the model sends them through decode() and the rest through
      prefill(), each writing its rows of one output.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    max_seq_len: int = 0
    kv_slots: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_k: int = 0
    captured: bool = False
    decode: AttentionMetadata | None = None
    # decode rows as one-token varlen queries, [0, 1, ..., B] int32 (vLLM's name): a captured graph's metadata
    # carries its static buffer (cuda_graph.DecodeGraphs); None: query_starts() derives it
    query_start_loc: torch.Tensor | None = None
    # piecewise CUDA graphs (engine.piecewise.PiecewiseGraphs) while they are captured or warmed up: each
    # attention layer hands its q, k, v to pieces.split() instead of attending
    pieces: object | None = None
    # a hybrid model's rows' state slots [rows] int64 (engine.state_cache; a mixed step's decode rows: in
    # `decode`'s); a padded graph row's is the pad slot
    state_slots: torch.Tensor | None = None
    # a hybrid's prefill: fla's chunk indices [chunks, 2] int64 (layers.gdn.chunk_indices), made on the host
    # and uploaded with the step's other inputs (the runner's one copy); None: fla derives them from
    # cu_seqlens in every linear layer, a host sync each
    gdn_chunk_indices: torch.Tensor | None = None
    # what a backend derives from this metadata once per forward for every layer (once()); cleared by the model
    # at each forward's start (new_forward), so a captured graph's forward derives it inside the capture
    _per_forward: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def new_forward(self) -> None:
        """A forward starts: forget what the last one derived (once()), here and in the decode rows' metadata."""
        self._per_forward.clear()
        if self.decode is not None:
            self.decode.new_forward()

    def once(self, key, make):
        """make()'s value, computed by the first layer of a forward that asks for `key`, shared by the rest."""
        if key not in self._per_forward:
            self._per_forward[key] = make()
        return self._per_forward[key]

    def query_starts(self) -> torch.Tensor:
        """query_start_loc, made once per eager forward (the first layer that asks) when not given."""
        if self.query_start_loc is None:
            rows = self.seq_lens.shape[0]
            self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=self.seq_lens.device)
        return self.query_start_loc

    def token_rows(self) -> AttentionMetadata:
        """A paged prefill (block_tables and seq_lens per request) as decode metadata with one row per new
        token: its request's pages, and its own length (causal). Made once per forward (once())."""
        def make() -> AttentionMetadata:
            q_lens = self.cu_seqlens.diff().long()
            before = (self.seq_lens.long() - q_lens).repeat_interleave(q_lens)  # tokens before each chunk
            start = self.cu_seqlens[:-1].long().repeat_interleave(q_lens)
            pos = torch.arange(int(self.cu_seqlens[-1]), device=self.seq_lens.device) - start + before
            return AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping,
                                     block_tables=self.block_tables.repeat_interleave(q_lens, dim=0),
                                     seq_lens=(pos + 1).to(torch.int32), max_seq_len=int(self.seq_lens.max()))
        return self.once("token_rows", make)

    def keys(self) -> tuple[torch.Tensor, int]:
        """(cu_seqlens_k, max_seqlen_k) of what a prefill attends to: the gathered prefix + new tokens,
        or the new tokens alone."""
        if self.cu_seqlens_k is None:
            return self.cu_seqlens, self.max_seqlen
        return self.cu_seqlens_k, self.max_seqlen_k


class AttentionBackend(KernelOps, ABC):
    """The attention interface: the paged KV cache (layout per layer: k_cache, v_cache of shape [num_pages,
    num_kv_heads, page_size, head_dim]), its workspace, attention itself, MLA's latents and the hybrids'
    recurrent state. A backend is also the KernelOps the model's other layers run on (layers.ops): one
    object, two interfaces; a caller names the one it uses.
    """

    name: str = "base"
    # --deterministic on a GPU: this backend has batch-invariant kernels (its GEMM, prefill and decode give a
    # row the same bits whatever else the step holds). On the CPU the torch ops serve it.
    batch_invariant_on_gpu = False

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, deterministic: bool = False):
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.page_size, self.dtype, self.device = page_size, dtype, device
        self.scale = head_dim ** -0.5
        self.calibrating = False  # an FP8 cache's step that sets its scales from its own K/V (store_kv)
        self.deterministic = deterministic

    @property
    def paged_prefill(self) -> bool:
        """prefill() reads every key of its chunks (prefix and new) from the cache, through meta.block_tables
        and meta.seq_lens (the runner sets those instead of kv_slots, and passes the layer's cache)."""
        return False

    @classmethod
    def workspace_bytes(cls, max_decode_rows: int, max_context_len: int, num_q_heads: int,
                        head_dim: int) -> int:
        """Persistent bytes build() allocates for this backend: sized from the envelope's decode rows and
        from max_context_len = min(context, T), so the budget solver subtracts it. Per-call allocations
        are not declared: the stress measures them (inside graphs they live in the graph pool)."""
        return 0

    def build(self, max_decode_rows: int, max_context_len: int, graph_rows: int = 0) -> None:
        """Allocate persistent state (e.g. a workspace) for a cache of this size; graph_rows: the most rows a
        decode graph holds (0: no graphs)."""

    def seal(self) -> None:
        """The build is done: the kernels compiled so far are the ones steps may launch (a backend whose
        kernel would compile while serving takes another path instead). Teardown unseals."""

    def teardown(self) -> None:
        """Drop everything build() allocated."""

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv: KVLayer, slot_mapping: torch.Tensor) -> None:
        """Write new K/V [T, Hkv, D] into the paged cache at slot_mapping (an FP8 cache: quantised by its
        scales, which a calibrating step first sets from these K/V)."""
        pages, offs = slot_mapping // self.page_size, slot_mapping % self.page_size
        if kv.scales is not None:
            if self.calibrating:
                calibrate_(kv.scales, k, v)
            k, v = quantize(k, kv.scales[0], kv.k.dtype), quantize(v, kv.scales[1], kv.v.dtype)
        kv.k[pages, :, offs] = k.to(kv.k.dtype)
        kv.v[pages, :, offs] = v.to(kv.v.dtype)

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer,
                   slot_mapping: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The packed projection qkv [T, (Hq + 2*Hkv) * D]: RoPE (neox halves, fp32, cos/sin [T, 1, D/2])
        applied IN PLACE to its q and k heads, K/V written to the cache at slot_mapping. Returns q
        [T, Hq, D], k, v [T, Hkv, D]: views of qkv (no split copies)."""
        t, d, hq, hkv = qkv.shape[0], self.head_dim, self.num_q_heads, self.num_kv_heads
        rope_(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
        q = qkv[:, :hq * d].view(t, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        self.store_kv(k, v, kv, slot_mapping)
        return q, k, v

    def norm_rope_store(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
                        cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer,
                        slot_mapping: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """rope_store with Qwen3's per-head RMSNorm (weights q_norm, k_norm [D]) of q and k before RoPE:
        q, k [T, H, D] normed (rounded to the model dtype), then rotated (fp32), K/V to the cache."""
        t, d, hq, hkv = qkv.shape[0], self.head_dim, self.num_q_heads, self.num_kv_heads
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q = self.rms_norm(q.reshape(-1, d), q_norm, eps).view(t, hq, d)
        k = self.rms_norm(k.reshape(-1, d), k_norm, eps).view(t, hkv, d)
        rope_(q, cos, sin)
        rope_(k, cos, sin)
        v = v.reshape(t, hkv, d)
        self.store_kv(k, v, kv, slot_mapping)
        return q, k, v

    def gated_norm_rope_store(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
                              cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer, slot_mapping: torch.Tensor,
                              rotary_dim: int) -> tuple[torch.Tensor, ...]:
        """norm_rope_store for Qwen3.5's gated attention: qkv [T, (2*Hq + 2*Hkv) * D] with each q head beside
        its output gate ([q_h | gate_h]); RoPE on each head's first rotary_dim channels (cos, sin [T, 1,
        rotary_dim/2]), the rest normed only. Returns q [T, Hq, D] (a new tensor; the gates stay in qkv), k,
        v [T, Hkv, D]."""
        t, d, hq, hkv = qkv.shape[0], self.head_dim, self.num_q_heads, self.num_kv_heads
        qg, k, v = qkv.split([2 * hq * d, hkv * d, hkv * d], dim=-1)
        q = self.rms_norm(qg.view(t, hq, 2, d)[:, :, 0].reshape(-1, d), q_norm, eps).view(t, hq, d)
        k = self.rms_norm(k.reshape(-1, d), k_norm, eps).view(t, hkv, d)
        rope_(q[..., :rotary_dim], cos, sin)
        rope_(k[..., :rotary_dim], cos, sin)
        v = v.reshape(t, hkv, d)
        self.store_kv(k, v, kv, slot_mapping)
        return q, k, v

    def gather_kv(self, kv: KVLayer, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [N, Hkv, D] of the cache slots (a chunk's prefix + its new tokens) in the model's dtype
        (an FP8 cache dequantised): materialised per layer; the stress runs it at
        envelope.prefill_kv_tokens."""
        pages, offs = slots // self.page_size, slots % self.page_size
        return self.dequantize_kv(kv, kv.k[pages, :, offs], kv.v[pages, :, offs])

    def dequantize_kv(self, kv: KVLayer, k: torch.Tensor, v: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V read from an FP8 cache in the model's dtype (its scales); a bf16/fp16 cache's as they are."""
        if kv.scales is None:
            return k, v
        return dequantize(k, kv.scales[0], self.dtype), dequantize(v, kv.scales[1], self.dtype)

    def delta_rule_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Gated DeltaNet's one-token rows over the state cache in place by slot (layers.gdn: the torch
        reference); a GPU backend's kernel reads and writes each row's state once."""
        return gdn.delta_rule_decode(q, k, v, g, beta, ssm, slots)

    def gdn_decode(self, qkv: torch.Tensor, z: torch.Tensor, ba: torch.Tensor, conv_weight: torch.Tensor,
                   a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   conv: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """A Gated DeltaNet layer's decode rows from its projections to out_proj's input (into `out` where
        given), conv and state in place by slot (layers.gdn.decode_layer: the torch reference); a GPU
        backend's kernels fuse it."""
        o = gdn.decode_layer(qkv, z, ba, conv_weight, a_log, dt_bias, norm_weight, eps, conv, ssm, slots)
        return o if out is None else out.copy_(o)

    def gdn_prefill(self, qkv: torch.Tensor, z: torch.Tensor, ba: torch.Tensor, conv_weight: torch.Tensor,
                    a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    conv: torch.Tensor, ssm: torch.Tensor, meta: AttentionMetadata,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """A Gated DeltaNet layer's prefill rows (meta's cu_seqlens and state_slots) from its projections to
        out_proj's input (into `out` where given), conv window and state in place by slot
        (layers.gdn.prefill_layer: the torch reference, fla's rule on a GPU); a GPU backend's kernels take
        the conv and the norm."""
        o = gdn.prefill_layer(qkv, z, ba, conv_weight, a_log, dt_bias, norm_weight, eps, conv, ssm,
                              meta.state_slots, meta.cu_seqlens)
        return o if out is None else out.copy_(o)

    # ------------------------------------------------------------ MLA (DeepSeek-V2): a latent cache
    # The cache of an MLA model holds one latent per token and layer: KVLayer.k [num_pages, 1, page_size, L]
    # (L = kv_lora_rank + rope dim), and KVLayer.v is the same tensor.
    def store_latent(self, latent: torch.Tensor, kv: KVLayer, slot_mapping: torch.Tensor) -> None:
        """Write latents [T, L] into the cache at slot_mapping."""
        kv.k[slot_mapping // self.page_size, 0, slot_mapping % self.page_size] = latent.to(kv.k.dtype)

    def mla_rope_store(self, q: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer, slot_mapping: torch.Tensor,
                       nope: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA between its projections and attention: q [T, H, nope + rope]'s rope channels rotated
        (DeepSeek's pairs (2i, 2i + 1), fp32; cos, sin [T, 1, rope / 2]); the latent from kv_a [T, rank + rope]:
        RMSNorm(c) * norm_weight | the rotated k_pe, stored at slot_mapping. Returns (q_pe [T, H, rope], the
        latent [T, rank + rope]); a backend may return views of q and kv_a, rotated and normed in place."""
        rope = q.shape[-1] - nope
        c, k_pe = kv_a.split([kv_a.shape[-1] - rope, rope], dim=-1)
        q_pe = rope_interleaved(q[..., nope:], cos, sin)
        k_pe = rope_interleaved(k_pe.unsqueeze(1), cos, sin).squeeze(1)
        latent = torch.cat([self.rms_norm(c, norm_weight, eps), k_pe], dim=-1)
        self.store_latent(latent, kv, slot_mapping)
        return q_pe, latent

    def gather_latent(self, kv: KVLayer, slots: torch.Tensor) -> torch.Tensor:
        """Latents [N, L] of the cache slots (a chunk's prefix + its new tokens)."""
        return kv.k[slots // self.page_size, 0, slots % self.page_size]

    def mla_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
        """Expanded MLA prefill: q [T, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] (per-head keys and values
        decompressed from the latents) -> [T, H, Dv], causal as prefill()."""
        raise NotImplementedError(f"the {self.name} backend has no MLA path; use --attention_backend torch")

    def mla_absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """MLA's absorbed decode input: each head's q_nope [T, H, nope] into the latent space through its W_UK
        (w_uk [H, nope, rank]), q_pe [T, H, rope] beside it -> [T, H, rank + rope]."""
        return torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)

    def mla_unabsorb(self, o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """Its output [T, H, rank] out of the latent space through each head's W_UV (w_uv [H, v, rank]) ->
        [T, H * v]."""
        return torch.einsum("thr,hvr->thv", o_lat, w_uv).reshape(o_lat.shape[0], -1)

    def mla_decode(self, q: torch.Tensor, kv: KVLayer, meta: AttentionMetadata, scale: float,
                   v_dim: int) -> torch.Tensor:
        """Absorbed MLA decode: q [B, H, L] (each head's query in the latent space) attends to the cached
        latents as one shared head; values are the latents' first v_dim channels -> [B, H, v_dim]."""
        raise NotImplementedError(f"the {self.name} backend has no MLA path; use --attention_backend torch")

    @abstractmethod
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv: KVLayer | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D] -> [T, Hq, D]; causal within each request of cu_seqlens. k/v [T, Hkv, D], or with
        meta.kv_slots the gathered [sum kv_len, Hkv, D] split by cu_seqlens_k (causal bottom-right). A
        paged_prefill backend reads the keys from `kv` instead. out: where to write (a mixed step's rows of
        one output, see write_into), else a new tensor."""

    @abstractmethod
    def decode(self, q: torch.Tensor, kv: KVLayer, meta: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, D] attending to seq_lens[b] cached tokens of block_tables[b]; out as
        prefill's."""


def output_rows(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """Where a kernel that writes into a given output puts q's rows: `out` (a mixed step's rows of one
    output), else a new tensor like q."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out


def write_into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """A backend whose kernels allocate their own output: `result`, copied into `out` when one is given (a
    mixed step's prefill and decode rows share one output: the model concatenates nothing)."""
    return result if out is None else out.copy_(result)


# K/V calibrated from one batch are scaled so that its largest magnitude lands at half the FP8 range:
# later batches may reach twice it before saturating (vLLM leaves a similar margin).
CALIBRATION_HEADROOM = 2.0


def calibrate_(scales: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """scales [2] <- (amax|k|, amax|v|) * headroom / FP8_MAX, on the device (no host sync); an all-zero
    tensor keeps its scale. Reductions only: no temporary the size of k or v."""
    amax = torch.stack([_amax(k), _amax(v)])
    scales.copy_(torch.where(amax > 0, amax * (CALIBRATION_HEADROOM / FP8_MAX), scales))


def _amax(x: torch.Tensor) -> torch.Tensor:
    lo, hi = torch.aminmax(x)
    return torch.maximum(-lo, hi).float()


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Neox-style rotation of x [T, H, D] in place (halves, as HF's rotate_half), computed in fp32: the
    same operations as models.llama.apply_rope, so the result is bit for bit the same."""
    x1, x2 = x.float().chunk(2, dim=-1)
    # NOTE: both before either write (x may be fp32: no copy)
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    half = x.shape[-1] // 2
    x[..., :half].copy_(r1)
    x[..., half:].copy_(r2)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J-style rotation of x [T, H, D]: channel pairs (2i, 2i + 1) (DeepSeek's complex product), in fp32."""
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).to(x.dtype)
