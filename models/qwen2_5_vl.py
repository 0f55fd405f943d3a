"""Qwen2.5-VL: a ViT vision tower (`visual.*`) feeding the Qwen2 decoder (models.llama) with multimodal RoPE.

Vision tower: 14-px patches of 2 frames embedded by one matmul (HF's Conv3d with stride = kernel), blocks of
RMSNorm + 2-D rotary attention + SwiGLU, window attention (window_size px) except in fullatt_block_indexes,
and a 2x2 PatchMerger into the decoder's hidden size. Tokens run in window order (each window contiguous, as
HF orders them); window layers attend all windows at once, each padded to the window's patch count under a
key mask (no loop over windows); full-attention layers attend per frame of each image. Every index comes
from grid_thw on the host (`vision_layout`): a forward makes no host sync of its own.

TP: the decoder shards as Llama does; the vision tower is replicated on every rank (its linears are built
with a TP of size 1), so each rank encodes the same images and holds the same embeddings.

M-RoPE: rope positions [3, T] (temporal, height, width) pick their cos/sin per frequency section
(`mrope_section`); a [T] position (text, decode) is the same in all three sections, i.e. plain RoPE, which is
what runs inside the decode graphs. `mrope_positions` gives a prompt's [3, L] positions and the delta that
later tokens add to their sequence position.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autoprofile.layers.attention import AttentionBackend, AttentionMetadata
from autoprofile.layers.parallel import TP, ColumnParallelLinear, ParallelLMHead, RowParallelLinear, new_param
from autoprofile.model_config import ModelConfig, VisionConfig
from models.llama import KVLayer, LlamaForCausalLM, LlamaModel, RMSNorm, RotaryEmbedding, apply_rope

Grid = tuple[int, int, int]
VISION_NORM_EPS = 1e-6  # HF hard-codes it for the tower's norms


def as_grids(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[Grid]:
    """grid_thw [n, 3] as host ints (a CPU tensor or a list: a CUDA tensor would cost a sync)."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


# ---------------------------------------------------------------- vision layout (host side)
@dataclass(frozen=True)
class VisionLayout:
    """Where each patch goes, from grid_thw alone (CPU tensors; `to` moves them).

    Tokens are in window order: patch_order [S] is the processor's index of each, rot_pos [S, 2] its (h, w),
    window_dst [S] its slot in the padded [num_windows * window_len] layout; window_mask [num_windows,
    window_len] is True on real patches; frame_bounds (host ints) bound each frame (full attention);
    unmerge [S / m^2] puts the merged tokens back in image order."""

    patch_order: torch.Tensor
    rot_pos: torch.Tensor
    window_dst: torch.Tensor
    window_mask: torch.Tensor
    unmerge: torch.Tensor
    frame_bounds: tuple[int, ...]

    @property
    def num_windows(self) -> int:
        return self.window_mask.shape[0]

    @property
    def padded_tokens(self) -> int:
        """Patch slots the window layers attend over (real + padding)."""
        return self.window_mask.numel()

    def to(self, device: torch.device) -> VisionLayout:
        pin = device.type == "cuda"
        move = (lambda t: t.pin_memory().to(device, non_blocking=True)) if pin else (lambda t: t.to(device))
        return VisionLayout(move(self.patch_order), move(self.rot_pos), move(self.window_dst),
                            move(self.window_mask), move(self.unmerge), self.frame_bounds)


def patch_positions(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """(h, w) of each patch [t*h*w, 2], merge-block-major (the processor's patch order)."""
    hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    blocks = (h // merge, merge, w // merge, merge)
    hh, ww = (x.reshape(blocks).transpose(1, 2).flatten() for x in (hh, ww))
    return torch.stack([hh, ww], -1).repeat(t, 1)


def window_order(t: int, h: int, w: int, units_per_side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged units of one image in window order [t*h*w] and each window's unit count; h, w are
    the merged grid. Windows tile each frame row-major; edge windows are partial, none is empty."""
    nh, nw = -(-h // units_per_side), -(-w // units_per_side)
    index = torch.arange(t * h * w).reshape(t, h, w)
    padded = F.pad(index, (0, nw * units_per_side - w, 0, nh * units_per_side - h), value=-1)
    windows = padded.reshape(t, nh, units_per_side, nw, units_per_side).permute(0, 1, 3, 2, 4)
    windows = windows.reshape(t * nh * nw, units_per_side ** 2)
    return windows[windows >= 0], (windows >= 0).sum(-1)


def vision_layout(grids: Sequence[Grid], v: VisionConfig) -> VisionLayout:
    m2, side = v.spatial_merge_size ** 2, v.window_size // v.spatial_merge_size // v.patch_size
    if side < 1:
        raise ValueError(f"vision window_size {v.window_size} is smaller than one merged patch "
                         f"({v.spatial_merge_size * v.patch_size} px)")
    units, counts, positions, bounds, offset = [], [], [], [0], 0
    for t, h, w in grids:
        if h % v.spatial_merge_size or w % v.spatial_merge_size or min(t, h, w) < 1:
            raise ValueError(f"image grid {(t, h, w)}: h and w must be positive multiples of "
                             f"spatial_merge_size {v.spatial_merge_size}")
        order, n = window_order(t, h // v.spatial_merge_size, w // v.spatial_merge_size, side)
        units.append(order + offset)
        counts.append(n)
        positions.append(patch_positions(t, h, w, v.spatial_merge_size))
        bounds += [bounds[-1] + h * w * (f + 1) for f in range(t)]
        offset += t * h * w // m2
    unit_order, window_units = torch.cat(units), torch.cat(counts)
    patch_order = (unit_order[:, None] * m2 + torch.arange(m2)).flatten()  # units move as whole m x m blocks
    lens = window_units * m2
    window_len = side * side * m2
    window_of = torch.repeat_interleave(torch.arange(len(lens)), lens)
    starts = torch.cumsum(lens, 0) - lens
    dst = window_of * window_len + torch.arange(int(lens.sum())) - starts[window_of]
    mask = torch.arange(window_len)[None, :] < lens[:, None]
    return VisionLayout(patch_order, torch.cat(positions)[patch_order], dst, mask, torch.argsort(unit_order),
                        tuple(bounds))


# ---------------------------------------------------------------- vision tower
class VisionRotary(nn.Module):
    """2-D rotary: the first half of each head's frequencies turn with h, the second with w."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.int64, device="cpu").float() / (head_dim // 2)
        inv_freq = (1.0 / theta ** quarter).to(torch.get_default_device())
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, rot_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = (rot_pos.float()[:, :, None] * self.inv_freq).flatten(1)  # [S, (h freqs, w freqs)]
        return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)  # [S, 1, head_dim/2]


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VisionLayout) -> torch.Tensor:
    """All windows in one SDPA call: [S, H, D] scattered to [windows, H, window_len, D] (zeros in the padding,
    masked out as keys), attended, gathered back to [S, H, D]."""
    s, heads, d = q.shape
    n, length = layout.window_mask.shape
    padded = q.new_zeros(3, n * length, heads, d)
    padded[:, layout.window_dst] = torch.stack([q, k, v])
    pq, pk, pv = padded.view(3, n, length, heads, d).transpose(2, 3).unbind(0)
    out = F.scaled_dot_product_attention(pq, pk, pv, attn_mask=layout.window_mask[:, None, None, :])
    return out.transpose(1, 2).reshape(n * length, heads, d)[layout.window_dst]


def frame_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """Full attention within each frame of each image (one SDPA per frame, no mask).
    NOTE: 4-D [1, H, n, D] inputs: torch's flash and memory-efficient kernels take only 4-D tensors; a 3-D
    call
    falls back to the math path, which holds [H, n, n] scores (the peak then grows with the square of the
    patches: 64.5 GiB for four 2044-px images measured on an H100 with 3-D calls)."""
    out = torch.empty_like(q)
    for a, b in zip(bounds[:-1], bounds[1:]):
        qh, kh, vh = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        out[a:b] = F.scaled_dot_product_attention(qh, kh, vh)[0].transpose(0, 1)
    return out


class VisionAttention(nn.Module):
    def __init__(self, v: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.head_dim = v.num_heads, v.head_dim
        self.qkv = ColumnParallelLinear(v.hidden_size, [3 * v.hidden_size], True, TP(), dtype)
        self.proj = RowParallelLinear(v.hidden_size, v.hidden_size, True, TP(), dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: VisionLayout,
                full: bool) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = frame_attention(q, k, v, layout.frame_bounds) if full else window_attention(q, k, v, layout)
        return self.proj(o.reshape(x.shape[0], -1))


class VisionMLP(nn.Module):
    """SwiGLU with biases (gate/up packed, as the decoder's)."""

    def __init__(self, v: VisionConfig, dtype: torch.dtype):
        super().__init__()
        i = v.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(v.hidden_size, [i, i], True, TP(), dtype)
        self.down_proj = RowParallelLinear(i, v.hidden_size, True, TP(), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, v: VisionConfig, backend: AttentionBackend, dtype: torch.dtype, full: bool):
        super().__init__()
        self.full = full
        self.norm1 = RMSNorm(v.hidden_size, VISION_NORM_EPS, backend, dtype)
        self.norm2 = RMSNorm(v.hidden_size, VISION_NORM_EPS, backend, dtype)
        self.attn = VisionAttention(v, dtype)
        self.mlp = VisionMLP(v, dtype)

    def forward(self, x: torch.Tensor, rope, layout: VisionLayout) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, layout, self.full)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """HF's Conv3d (kernel = stride = one patch of 2 frames, no bias) as one matmul over the flat patch."""

    def __init__(self, v: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = new_param((v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size,
                                      v.patch_size), dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixel_values.to(w.dtype), w.view(w.shape[0], -1))


class PatchMerger(nn.Module):
    """RMSNorm, then each 2x2 block of patches (m^2 consecutive tokens) -> Linear, GELU, Linear."""

    def __init__(self, v: VisionConfig, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.merged = v.hidden_size * v.spatial_merge_size ** 2
        self.ln_q = RMSNorm(v.hidden_size, VISION_NORM_EPS, backend, dtype)
        self.mlp = nn.Sequential(ColumnParallelLinear(self.merged, [self.merged], True, TP(), dtype),
                                 nn.GELU(),
                                 ColumnParallelLinear(self.merged, [v.out_hidden_size], True, TP(), dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class Qwen2_5_VisionTransformer(nn.Module):
    """pixel_values [sum patches, C*T*P*P] (HF's processor layout) + grid_thw [n_images, 3] (a CPU tensor or
    a list) -> merged embeddings [sum t*h*w / m^2, out_hidden] in image order. Replicated on every TP rank."""

    def __init__(self, v: VisionConfig, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.config = v
        self.patch_embed = PatchEmbed(v, dtype)
        self.rotary_pos_emb = VisionRotary(v.head_dim, v.rope_theta)
        full = set(v.fullatt_block_indexes)
        self.blocks = nn.ModuleList(VisionBlock(v, backend, dtype, i in full) for i in range(v.depth))
        self.merger = PatchMerger(v, backend, dtype)

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        grids = as_grids(grid_thw)
        if not grids:
            raise ValueError("grid_thw is empty: the vision tower needs at least one image")
        patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape != (patches, self.config.patch_dim):
            raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; grid_thw {grids} needs "
                             f"({patches}, {self.config.patch_dim})")
        layout = vision_layout(grids, self.config).to(pixel_values.device)
        x = self.patch_embed(pixel_values)[layout.patch_order]
        rope = self.rotary_pos_emb(layout.rot_pos)
        for block in self.blocks:
            x = block(x, rope, layout)
        return self.merger(x)[layout.unmerge]


# ---------------------------------------------------------------- decoder with M-RoPE
class MRotaryEmbedding(nn.Module):
    """Wraps the decoder's RotaryEmbedding (same cos/sin table): [T] positions are plain RoPE; [3, T] take
    the frequencies of section i (mrope_section) from positions[i]."""

    def __init__(self, rotary: RotaryEmbedding, mrope_section: Sequence[int]):
        super().__init__()
        self.rotary = rotary
        section = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        self.register_buffer("section_of", torch.cat([section, section]).to(rotary.cos_sin.device),
                             persistent=False)  # cos columns, then sin columns

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return self.rotary(positions)
        rows = self.rotary.cos_sin[positions]  # [3, T, D]
        picked = rows.gather(0, self.section_of.expand(1, rows.shape[1], -1))[0]
        cos, sin = picked.chunk(2, dim=-1)
        return cos.unsqueeze(1), sin.unsqueeze(1)


class Qwen2_5_VLTextModel(LlamaModel):
    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP, dtype: torch.dtype,
                 max_positions: int):
        super().__init__(mc, backend, tp, dtype, max_positions)
        self.rotary_emb = MRotaryEmbedding(self.rotary_emb, mc.mrope_section)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_layers: Sequence[KVLayer], mm_embeds: torch.Tensor | None = None,
                mm_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if mm_embeds is not None:
            x = merge_embeds(x, mm_embeds, mm_mask)
        return self.decode_layers(x, self.rotary_emb(positions), meta, kv_layers)


def merge_embeds(x: torch.Tensor, mm_embeds: torch.Tensor, mm_mask: torch.Tensor) -> torch.Tensor:
    """x [T, hidden] with its mm_mask rows replaced, in order, by mm_embeds [mask.sum(), hidden] (no host
    sync: the caller guarantees the count)."""
    row = (torch.cumsum(mm_mask, 0) - 1).clamp_(min=0)
    return torch.where(mm_mask[:, None], mm_embeds.to(x.dtype)[row], x)


class Qwen2_5_VLForConditionalGeneration(nn.Module):
    """HF parameter names: `model.*` (decoder), `visual.*`, `lm_head`. Checkpoints written as
    `model.language_model.*` / `model.visual.*` load through `checkpoint_renames`."""

    packed_modules = LlamaForCausalLM.packed_modules
    checkpoint_renames = (("model.language_model.", "model."), ("model.visual.", "visual."))

    def __init__(self, mc: ModelConfig, backend: AttentionBackend, tp: TP = TP(),
                 dtype: torch.dtype = torch.bfloat16, max_positions: int | None = None):
        super().__init__()
        if mc.vision is None or mc.mrope_section is None:
            raise ValueError(f"model '{mc.name}' has no vision_config/mrope_section: not a Qwen2.5-VL config")
        self.config = mc
        self.model = Qwen2_5_VLTextModel(mc, backend, tp, dtype, max_positions or mc.max_position_embeddings)
        self.visual = Qwen2_5_VisionTransformer(mc.vision, backend, dtype)
        tied = self.model.embed_tokens.weight if mc.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(mc.vocab_size, mc.hidden_size, tp, dtype, weight=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_layers: Sequence[KVLayer], mm_embeds: torch.Tensor | None = None,
                mm_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden [T, hidden]; positions [T] or [3, T] (M-RoPE); mm_embeds replace the
        embeddings of the mm_mask tokens."""
        return self.model(input_ids, positions, meta, kv_layers, mm_embeds, mm_mask)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden, out)


# ---------------------------------------------------------------- prompt positions
def mrope_positions(input_ids: Sequence[int], image_grid_thw: Sequence[Grid], cfg: ModelConfig
                    ) -> tuple[torch.Tensor, int]:
    """A prompt's rope positions [3, L] (int64, CPU) and its delta: text runs on from the last position in
    all three sections; image k's t*h*w/m^2 tokens (the k-th run of image_token_id tokens in order) take
    (start + frame, start + row, start + column) and the text after it starts at start + max(h, w) / m
    (HF's get_rope_index for images, t = 1). A token at sequence position p >= L has rope position
    p + delta."""
    merge = cfg.vision.spatial_merge_size
    ids = torch.as_tensor(list(input_ids), dtype=torch.int64)
    image_at = torch.nonzero(ids == cfg.image_token_id).flatten().tolist()
    sizes = [t * h * w // merge ** 2 for t, h, w in image_grid_thw]
    if len(image_at) != sum(sizes):
        raise ValueError(f"the prompt has {len(image_at)} image tokens; image_grid_thw "
                         f"{list(image_grid_thw)} needs {sum(sizes)}")
    parts, pos, prev, first = [], 0, 0, 0
    for (t, h, w), n in zip(image_grid_thw, sizes):
        start = image_at[first]
        if image_at[first + n - 1] != start + n - 1:
            raise ValueError(f"image tokens of image {len(parts) // 2} are not contiguous at {start}")
        parts.append(torch.arange(pos, pos + start - prev).expand(3, -1))
        pos += start - prev
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h // merge), torch.arange(w // merge),
                                    indexing="ij")
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(h, w) // merge
        prev, first = start + n, first + n
    parts.append(torch.arange(pos, pos + len(ids) - prev).expand(3, -1))
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - len(ids) if len(ids) else 0
