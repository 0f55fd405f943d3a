"""Gated DeltaNet's one-token decode in Triton, over the state cache in place by request slot; and the prefill
rows' conv (`conv_prefill`: the outputs as fla's chunked rule takes them, then the windows moved on).

`_gdn_decode_kernel`: one program per (row, HEADS value heads, VBLOCKS blocks of BV value channels). For each
of its heads and blocks it takes the row's q and k of the head's key head (l2-normalised in fp32, q scaled by
k_dim^-1/2), its [k_dim, BV] tile of the row's state, and writes the advanced tile back where it was read and
the output's BV channels. So the state is read once and written once (the bytes floor of a decode step's
linear layers), with no gather into a temporary and no scatter back; a padded graph row reads and writes the
pad slot. Same math as the torch reference (layers.gdn.delta_rule_decode). Options (constexpr):
- GATE: g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) from the in_proj_ba rows, in the kernel;
- CONV: the causal conv1d + SiLU step too, from the row's window conv[slot] (moved on in place) and the
  in_proj_qkv row; one program then owns a key head (its q/k channels and its value heads' channels, every
  block), so no program reads a window another writes;
- NORM (a block holds the whole head): the gated RMSNorm of the output, with in_proj_z's gate.
`decode_layer` runs a layer's decode rows from its projections to out_proj's input in 1 to 3 launches
(launch_rules.gdn_decode_launch picks the variant); `decode` is the rule alone (g and beta given).
Imported when the aiter_triton backend is built.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from autoprofile.kernels import launch_rules, pdl
from autoprofile.kernels.launch_rules import GdnLaunch

CONV_BLOCK = 256  # channels a program of the separate conv step
CONV_PREFILL_TOKENS = 16  # tokens a program of the prefill conv
NORM_ROWS = 16  # rows a program of the separate gated norm (a prefill's thousands of rows)


@triton.jit
def _l2normed(x):
    """x (fp32, 0 past its channels) l2-normalised (eps 1e-6, as fla)."""
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _loaded(ptr, stride, kd, BK: tl.constexpr):
    cols = tl.arange(0, BK)
    return tl.load(ptr + cols * stride, mask=cols < kd, other=0.0).to(tl.float32)


@triton.jit
def _conv_silu(row_ptr, win_ptr, w_ptr, ch, cmask, KW: tl.constexpr, KP: tl.constexpr):
    """SiLU(causal depthwise conv1d) of one row at channels ch: the window win_ptr [C, KW-1] (the last KW-1
    inputs), then the row's input; fp32, rounded to the input's dtype as the reference does. The window moves
    on in place, after a barrier (every thread of the program has read it)."""
    t = tl.arange(0, KP)
    x = tl.load(row_ptr + ch, mask=cmask, other=0.0)
    win = tl.load(win_ptr + ch[:, None] * (KW - 1) + t[None, :], mask=cmask[:, None] & (t[None, :] < KW - 1),
                  other=0.0)
    tile = tl.where(t[None, :] == KW - 1, x.to(win.dtype)[:, None], win)
    w = tl.load(w_ptr + ch[:, None] * KW + t[None, :], mask=cmask[:, None] & (t[None, :] < KW), other=0.0)
    out = tl.sum(tile.to(tl.float32) * w.to(tl.float32), axis=1)
    tl.debug_barrier()
    moved = cmask[:, None] & (t[None, :] >= 1) & (t[None, :] < KW)
    tl.store(win_ptr + ch[:, None] * (KW - 1) + t[None, :] - 1, tile, mask=moved)
    return (out * tl.sigmoid(out)).to(row_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _conv_decode_kernel(x_ptr, sx_b, conv_ptr, sc_slot, w_ptr, slots_ptr, out_ptr, so_b, channels,
                        KW: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr = False):
    """The conv step alone: one program per (row, BC channels)."""
    pdl.begin(PDL)
    b, j = tl.program_id(0).to(tl.int64), tl.program_id(1)
    ch = j * BC + tl.arange(0, BC)
    cmask = ch < channels
    slot = tl.load(slots_ptr + b)
    c = _conv_silu(x_ptr + b * sx_b, conv_ptr + slot * sc_slot, w_ptr, ch, cmask, KW, KP)
    tl.store(out_ptr + b * so_b + ch, c.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _gated_norm(o, z, w, vd, eps, dtype: tl.constexpr):
    """The output norm over the last axis of a tile of heads (fp32 o, z and w; 0 past vd): RMSNorm, times
    weight in the model's dtype, times SiLU(z) in fp32 (layers.gdn.gated_rms_norm)."""
    o = o.to(dtype).to(tl.float32)
    normed = (o * tl.rsqrt(tl.sum(o * o, axis=-1, keep_dims=True) / vd + eps)).to(dtype)
    return (w * normed.to(tl.float32)).to(dtype).to(tl.float32) * (z * tl.sigmoid(z))  # w * normed in dtype


@triton.jit
def _gates(a, b, a_log, dt_bias):
    """Gates from in_proj_ba's b and a (fp32): g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
    (layers.gdn.gating)."""
    a = a + dt_bias
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    return -tl.exp(a_log) * softplus, tl.sigmoid(b)


@triton.jit
def _gated_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, rows, sx_b, sx_h, sz_b, so_b, vd, eps, BD: tl.constexpr,
                       ROWS: tl.constexpr, PDL: tl.constexpr = False):
    """The gated RMSNorm alone: one program per (ROWS rows, head); _gated_norm's math on a [ROWS, BD] tile."""
    pdl.begin(PDL)
    b = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    vc = tl.arange(0, BD)
    mask = (b < rows)[:, None] & (vc < vd)[None, :]
    o = tl.load(x_ptr + b[:, None] * sx_b + h * sx_h + vc[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + vc, mask=vc < vd, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + b[:, None] * sz_b + h * vd + vc[None, :], mask=mask, other=0.0).to(tl.float32)
    y = _gated_norm(o, z, w[None, :], vd, eps, w_ptr.dtype.element_ty)
    tl.store(out_ptr + b[:, None] * so_b + h * vd + vc[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gdn_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, ssm_ptr, slots_ptr, out_ptr,
                       sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sb_b, so_b, so_h,
                       ss_slot, ss_h, ss_k, kd, vd, group, scale,
                       conv_ptr, sc_slot, cw_ptr, qk_width, a_log_ptr, dt_bias_ptr, z_ptr, sz_b, nw_ptr, eps,
                       BK: tl.constexpr, BV: tl.constexpr, HEADS: tl.constexpr, VBLOCKS: tl.constexpr,
                       GATE: tl.constexpr, CONV: tl.constexpr, NORM: tl.constexpr,
                       KW: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr = False):
    """Under CONV q_ptr is the in_proj_qkv rows (row stride sq_b; q | k | v channels, k from qk_width) and
    each program holds one key head (HEADS = group, VBLOCKS * BV >= vd); under GATE g_ptr / beta_ptr are the
    in_proj_ba rows' a and b parts."""
    pdl.begin(PDL)
    b, p, jp = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + b)
    kc = tl.arange(0, BK)
    kmask = kc < kd
    if CONV:
        row, win = q_ptr + b * sq_b, conv_ptr + slot * sc_slot
        q = _l2normed(_conv_silu(row, win, cw_ptr, p * kd + kc, kmask, KW, KP)) * scale
        k = _l2normed(_conv_silu(row, win, cw_ptr, qk_width + p * kd + kc, kmask, KW, KP))
    for i in range(HEADS * VBLOCKS):
        h = (p * HEADS + i // VBLOCKS).to(tl.int64)
        vc = (jp * VBLOCKS + i % VBLOCKS) * BV + tl.arange(0, BV)
        vmask = vc < vd
        if CONV:
            v = _conv_silu(row, win, cw_ptr, 2 * qk_width + h * vd + vc, vmask, KW, KP)
        else:
            kh = h // group
            q = _l2normed(_loaded(q_ptr + b * sq_b + kh * sq_h, 1, kd, BK)) * scale
            k = _l2normed(_loaded(k_ptr + b * sk_b + kh * sk_h, 1, kd, BK))
            v = tl.load(v_ptr + b * sv_b + h * sv_h + vc, mask=vmask, other=0.0).to(tl.float32)
        if GATE:
            g, beta = _gates(tl.load(g_ptr + b * sg_b + h).to(tl.float32),
                             tl.load(beta_ptr + b * sb_b + h).to(tl.float32),
                             tl.load(a_log_ptr + h).to(tl.float32), tl.load(dt_bias_ptr + h).to(tl.float32))
            beta = beta.to(beta_ptr.dtype.element_ty).to(tl.float32)  # the reference keeps beta in x's dtype
        else:
            g = tl.load(g_ptr + b * sg_b + h).to(tl.float32)
            beta = tl.load(beta_ptr + b * sb_b + h).to(tl.float32)
        tile = ssm_ptr + slot * ss_slot + h * ss_h + kc[:, None] * ss_k + vc[None, :]
        mask = kmask[:, None] & vmask[None, :]
        s = tl.load(tile, mask=mask, other=0.0).to(tl.float32) * tl.exp(g)
        delta = beta * (v - tl.sum(s * k[:, None], axis=0))
        s += k[:, None] * delta[None, :]
        tl.store(tile, s.to(ssm_ptr.dtype.element_ty), mask=mask)
        o = tl.sum(s * q[:, None], axis=0)
        if NORM:
            z = tl.load(z_ptr + b * sz_b + h * vd + vc, mask=vmask, other=0.0).to(tl.float32)
            w = tl.load(nw_ptr + vc, mask=vmask, other=0.0).to(tl.float32)
            o = _gated_norm(o, z, w, vd, eps, nw_ptr.dtype.element_ty)
        tl.store(out_ptr + b * so_b + h * so_h + vc, o.to(out_ptr.dtype.element_ty), mask=vmask)


@triton.jit
def _conv_prefill_kernel(x_ptr, sx_t, conv_ptr, sc_slot, w_ptr, slots_ptr, cu_ptr, seq_ptr, out_ptr, tokens,
                         channels, qk_width, v_width, KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """SiLU(causal depthwise conv1d) of prefill rows: one program per (BT tokens, BC channels). Token t of row
    r = seq[t] (starting at cu[r]) reads its window's inputs before the row's chunk from conv[slots[r]] (read
    only: _conv_window_kernel moves the windows on after). The output goes to q [T, qk_width], k [T, qk_width]
    and v [T, v_width] back to back in out_ptr, each contiguous (fla's kernels take them so)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    tmask, cmask = t < tokens, ch < channels
    mask = tmask[:, None] & cmask[None, :]
    row = tl.load(seq_ptr + t, mask=tmask, other=0)
    start = tl.load(cu_ptr + row, mask=tmask, other=0).to(tl.int64)
    win = conv_ptr + tl.load(slots_ptr + row, mask=tmask, other=0).to(tl.int64) * sc_slot
    t64 = t.to(tl.int64)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(KW):  # tap j of token t: the input at t - (KW - 1) + j, chunk or window
        back = t64 - (KW - 1) + j - start  # its position relative to the row's chunk
        inside = (back >= 0)[:, None]
        xv = tl.load(x_ptr + (t64 - (KW - 1) + j)[:, None] * sx_t + ch[None, :], mask=mask & inside,
                     other=0.0)
        wv = tl.load(win[:, None] + ch[None, :] * (KW - 1) + (back + KW - 1)[:, None], mask=mask & ~inside,
                     other=0.0)
        w = tl.load(w_ptr + ch * KW + j, mask=cmask, other=0.0).to(tl.float32)
        acc += tl.where(inside, xv.to(tl.float32), wv.to(tl.float32)) * w[None, :]
    y = acc * tl.sigmoid(acc)
    part = (ch >= qk_width).to(tl.int64) + (ch >= 2 * qk_width).to(tl.int64)  # 0 q, 1 k, 2 v
    width = tl.where(part == 2, v_width, qk_width).to(tl.int64)
    base = part * tokens * qk_width  # q, k and v back to back
    off = base[None, :] + t64[:, None] * width[None, :] + (ch - part * qk_width)[None, :]
    tl.store(out_ptr + off, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_window_kernel(x_ptr, sx_t, conv_ptr, sc_slot, slots_ptr, cu_ptr, channels, KW: tl.constexpr,
                        KP: tl.constexpr, BC: tl.constexpr):
    """Each prefill row's window moved on past its chunk: conv[slots[r]] [C, KW-1] <- the last KW-1 inputs
    (from the chunk, or the window itself where the chunk is shorter). One program per (row, BC channels);
    its loads precede its stores (a barrier), so a window read and written in place stays whole."""
    r = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = ch < channels
    start = tl.load(cu_ptr + r).to(tl.int64)
    n = tl.load(cu_ptr + r + 1).to(tl.int64) - start
    win = conv_ptr + tl.load(slots_ptr + r).to(tl.int64) * sc_slot + ch[:, None] * (KW - 1)
    j = tl.arange(0, KP)
    back = n - (KW - 1) + j  # window element j's input, relative to the chunk
    used = cmask[:, None] & (j < KW - 1)[None, :]
    inside = (back >= 0)[None, :]
    xv = tl.load(x_ptr + (start + back)[None, :] * sx_t + ch[:, None], mask=used & inside, other=0.0)
    old = tl.load(win + (back + KW - 1)[None, :], mask=used & ~inside, other=0.0)
    new = tl.where(inside, xv.to(old.dtype), old)
    tl.debug_barrier()
    tl.store(win + j[None, :], new, mask=used)


def _launch_options(launch: GdnLaunch) -> dict:
    return {"num_warps": launch.warps, "num_stages": launch.stages, **pdl.launch()}


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           ssm: torch.Tensor, slots: torch.Tensor, launch: GdnLaunch | None = None) -> torch.Tensor:
    """The rule alone: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv] (unit stride along their last dim),
    ssm [slots, Hv, Dk, Dv] (contiguous in its last three dims), slots [B] int64 -> o [B, Hv, Dv] in v's
    dtype; ssm[slots] advanced in place. launch: the rule's (its fuse_conv is not used here)."""
    b, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    launch = launch or launch_rules.gdn_decode_launch(b, hk, hv, vd)
    heads = launch.heads if hv % launch.heads == 0 else 1
    out = torch.empty(b, hv, vd, dtype=v.dtype, device=v.device)
    if b:
        grid = (b, hv // heads, triton.cdiv(vd, launch.block_v))
        _gdn_decode_kernel[grid](q, k, v, g, beta, ssm, slots, out,
                                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                 g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
                                 ssm.stride(0), ssm.stride(1), ssm.stride(2), kd, vd, hv // hk, kd ** -0.5,
                                 None, 0, None, 0, None, None, None, 0, None, 0.0,
                                 BK=triton.next_power_of_2(kd), BV=launch.block_v, HEADS=heads, VBLOCKS=1,
                                 GATE=False, CONV=False, NORM=False, KW=1, KP=1, **_launch_options(launch))
    return out


def conv_decode(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
    """The conv step alone, one launch (layers.gdn.conv_decode): x [B, C] (unit channel stride), weight [C, K]
    and conv [slots, C, K-1] contiguous -> SiLU(conv) [B, C] in x's dtype; the rows' windows moved on."""
    b, c = x.shape
    kw = weight.shape[1]
    out = torch.empty(b, c, dtype=x.dtype, device=x.device)
    if b:
        _conv_decode_kernel[(b, triton.cdiv(c, CONV_BLOCK))](
            x, x.stride(0), conv, conv.stride(0), weight, slots, out, out.stride(0), c,
            KW=kw, KP=triton.next_power_of_2(kw), BC=CONV_BLOCK, num_warps=4, **pdl.launch())
    return out


def token_rows(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each of the `tokens` prefill tokens' row [T] (rows split by cu_seqlens [N+1]; no host sync): what
    conv_prefill's programs look their row up in, the same for every linear layer of a forward
    (AttentionMetadata.once)."""
    t = torch.arange(tokens, device=cu_seqlens.device, dtype=torch.int32)
    return torch.searchsorted(cu_seqlens.to(torch.int32)[1:], t, right=True)


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
                 cu_seqlens: torch.Tensor, k_heads: int, k_dim: int, v_heads: int, v_dim: int,
                 rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill rows' conv in two launches (layers.gdn.conv_prefill, its reference): x [T, C] (unit channel
    stride; rows split by cu_seqlens [N+1]), weight [C, K] and conv [slots, C, K-1] contiguous -> contiguous
    q, k [T, Hk, Dk] and v [T, Hv, Dv] in x's dtype (one buffer); each row's window conv[slots[i]] moved on.
    rows: token_rows(cu_seqlens), when the caller has it already."""
    t, c = x.shape
    kw, qk = weight.shape[1], k_heads * k_dim
    out = torch.empty(t * c, dtype=x.dtype, device=x.device)
    q, k, v = (out[:t * qk].view(t, k_heads, k_dim), out[t * qk:2 * t * qk].view(t, k_heads, k_dim),
               out[2 * t * qk:].view(t, v_heads, v_dim))
    if not t:
        return q, k, v
    cu = cu_seqlens.to(torch.int32)
    seq = token_rows(cu, t) if rows is None else rows
    _conv_prefill_kernel[(triton.cdiv(t, CONV_PREFILL_TOKENS), triton.cdiv(c, CONV_BLOCK))](
        x, x.stride(0), conv, conv.stride(0), weight, slots, cu, seq, out, t, c, qk, v_heads * v_dim,
        KW=kw, BT=CONV_PREFILL_TOKENS, BC=CONV_BLOCK, num_warps=4)
    _conv_window_kernel[(slots.shape[0], triton.cdiv(c, CONV_BLOCK))](
        x, x.stride(0), conv, conv.stride(0), slots, cu, c, KW=kw, KP=triton.next_power_of_2(max(kw - 1, 1)),
        BC=CONV_BLOCK, num_warps=4)
    return q, k, v


@triton.jit
def _gates_kernel(ba_ptr, s_ba, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, tokens, HV: tl.constexpr,
                  BH: tl.constexpr, BT: tl.constexpr):
    """BT prefill tokens' gates from their in_proj_ba rows (b | a): g [T, HV] fp32, beta [T, HV] in ba's
    dtype, as layers.gdn.gating (and _gdn_decode_kernel's GATE) computes them."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.arange(0, BH)
    mask = (t[:, None] < tokens) & (h[None, :] < HV)
    row = ba_ptr + t[:, None].to(tl.int64) * s_ba + h[None, :]
    g, beta = _gates(tl.load(row + HV, mask=mask, other=0.0).to(tl.float32),
                     tl.load(row, mask=mask, other=0.0).to(tl.float32),
                     tl.load(a_log_ptr + h, mask=h < HV, other=0.0).to(tl.float32)[None, :],
                     tl.load(dt_bias_ptr + h, mask=h < HV, other=0.0).to(tl.float32)[None, :])
    out = t[:, None].to(tl.int64) * HV + h[None, :]
    tl.store(g_ptr + out, g, mask=mask)
    tl.store(beta_ptr + out, beta.to(beta_ptr.dtype.element_ty), mask=mask)


GATE_TOKENS = 32  # prefill tokens a program of the gates


def gates(ba: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill rows' gates in one launch (layers.gdn.gating, its reference: ~8 torch kernels): ba [T, 2 Hv]
    (b | a, unit stride last) -> (g [T, Hv] fp32, beta [T, Hv] in ba's dtype), both contiguous."""
    t, hv = ba.shape[0], ba.shape[1] // 2
    g = torch.empty(t, hv, dtype=torch.float32, device=ba.device)
    beta = torch.empty(t, hv, dtype=ba.dtype, device=ba.device)
    if t:
        _gates_kernel[(triton.cdiv(t, GATE_TOKENS),)](ba, ba.stride(0), a_log, dt_bias, g, beta, t, HV=hv,
                                                      BH=triton.next_power_of_2(hv), BT=GATE_TOKENS,
                                                      num_warps=4)
    return g, beta


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The gated RMSNorm alone, one launch: o [B, Hv, Dv] (unit stride last), z [B, Hv * Dv] (unit stride
    last) -> [B, Hv * Dv] in o's dtype (into `out`, unit stride last, where given)."""
    b, hv, vd = o.shape
    if out is None:
        out = torch.empty(b, hv * vd, dtype=o.dtype, device=o.device)
    if b:
        rows = NORM_ROWS if b >= NORM_ROWS else 1  # two compiles: decode rows, prefill rows
        _gated_norm_kernel[(triton.cdiv(b, rows), hv)](o, z, weight, out, b, o.stride(0), o.stride(1),
                                                       z.stride(0), out.stride(0), vd, eps,
                                                       BD=triton.next_power_of_2(vd), ROWS=rows, num_warps=4,
                                                       **pdl.launch())
    return out


def decode_layer(qkv: torch.Tensor, z: torch.Tensor, ba: torch.Tensor, conv_weight: torch.Tensor,
                 a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 conv: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor,
                 launch: GdnLaunch | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """A Gated DeltaNet layer's decode rows from its projections to out_proj's input (layers.gdn.decode_layer,
    its reference): qkv [B, 2 Hk Dk + Hv Dv], z [B, Hv Dv], ba [B, 2 Hv] (b | a), each of unit stride along
    its last dim; conv_weight [C, K]; a_log, dt_bias [Hv] fp32; conv [slots, C, K-1] and ssm [slots, Hv, Dk,
    Dv], advanced in place at slots [B] -> [B, Hv Dv] in qkv's dtype (into `out`, contiguous, where given).
    Launches: the conv step (or CONV), the rule with its gates (GATE), the norm (or NORM where a block holds a
    head)."""
    b, c = qkv.shape
    hv, kd, vd = ssm.shape[1], ssm.shape[2], ssm.shape[3]
    hk = (c - hv * vd) // (2 * kd)
    launch = launch or launch_rules.gdn_decode_launch(b, hk, hv, vd)
    conv_weight = conv_weight.reshape(c, -1)
    kw = conv_weight.shape[1]
    fuse_conv = launch.fuse_conv
    norm = launch.block_v >= vd
    vblocks = triton.cdiv(vd, launch.block_v)
    heads = hv // hk if fuse_conv else (launch.heads if hv % launch.heads == 0 else 1)
    # the rule's output: the caller's rows where the rule's kernel norms them too, else a temporary
    o = (out.view(b, hv, vd) if out is not None and norm
         else torch.empty(b, hv, vd, dtype=qkv.dtype, device=qkv.device))
    if not b:
        return o.reshape(b, hv * vd) if out is None else out
    if fuse_conv:
        x = q = k = v = qkv
        strides = (qkv.stride(0), kd, qkv.stride(0), kd, qkv.stride(0), vd)
    else:
        x = conv_decode(qkv, conv_weight, conv, slots)
        q, k, v = x.split([hk * kd, hk * kd, hv * vd], dim=-1)
        strides = (x.stride(0), kd, x.stride(0), kd, x.stride(0), vd)
    bpart, apart = ba.split([hv, hv], dim=-1)
    grid = (b, hv // heads, 1 if fuse_conv else vblocks)
    _gdn_decode_kernel[grid](q, k, v, apart, bpart, ssm, slots, o, *strides, ba.stride(0), ba.stride(0),
                             o.stride(0), o.stride(1), ssm.stride(0), ssm.stride(1), ssm.stride(2),
                             kd, vd, hv // hk, kd ** -0.5,
                             conv, conv.stride(0), conv_weight, hk * kd, a_log, dt_bias, z, z.stride(0),
                             norm_weight, eps, BK=triton.next_power_of_2(kd), BV=launch.block_v, HEADS=heads,
                             VBLOCKS=vblocks if fuse_conv else 1, GATE=True, CONV=fuse_conv, NORM=norm, KW=kw,
                             KP=triton.next_power_of_2(kw), **_launch_options(launch))
    return o.reshape(b, hv * vd) if norm else gated_rms_norm(o, z, norm_weight, eps, out)
