"""Gated DeltaNet's operations (Qwen3.5's linear-attention layers) over a per-request state read and written
in place by request slot: the causal depthwise conv1d with its window of the last kernel - 1 inputs, and the
gated delta rule with its [v_heads, k_dim, v_dim] matrix.

Rows come as a step lays them out: prefill rows (chunks of any length, split by cu_seqlens; a chunk continues
from its slot's state, which the runner zeroes before a request's first chunk) and one-token decode rows. The
torch code here is the reference (CPU, and a GPU without flash-linear-attention); on CUDA the delta rule runs
fla-core's Triton kernel `chunk_gated_delta_rule` over the rows' states gathered by slot, written back after;
decode rows run the torch ops on every device. No host sync: the decode path is CUDA-graph capturable.

The recurrence, per value head (q, k l2-normalised, q scaled by k_dim^-1/2; g <= 0 the log decay, beta in (0,
1)):  S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t."""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

CHUNK = 64  # tokens of the reference's chunked form (fla's chunk size too)


class StateLayer(NamedTuple):
    """One linear layer's state cache: conv [slots, conv_dim, kernel - 1] (the model dtype) and ssm
    [slots, v_heads, k_dim, v_dim] (the checkpoint's mamba_ssm_dtype), indexed by request slot."""

    conv: torch.Tensor
    ssm: torch.Tensor


@functools.cache
def fla_ops():
    """fla-core's chunked delta rule: a GPU's prefill rows (the torch reference below serves the CPU). Not
    importable: RuntimeError naming the install. `serve` refuses a hybrid on a GPU without fla before its
    boot (config.fla_problem); this is where an install that is there but does not import shows, instead of
    a prefill tens of times slower."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        from autoprofile.config import FLA_REQUIREMENT
        raise RuntimeError(f"fla-core's delta-rule kernels did not import ({e}); a hybrid model's prefill on "
                           f"a GPU runs them: pip install {FLA_REQUIREMENT}") from e
    return chunk_gated_delta_rule


# ---------------------------------------------------------------- conv1d
def conv_prefill(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
                 cu_seqlens: torch.Tensor) -> torch.Tensor:
    """SiLU(causal depthwise conv1d) of prefill rows x [T, C] (rows split by cu_seqlens [N+1]), each row's
    window continuing from conv[slots[i]] [C, K-1]; the windows' last K-1 inputs written back. weight [C,
    K]."""
    t, k = x.shape[0], weight.shape[1]
    cu = cu_seqlens.long()
    tokens = torch.arange(t, device=x.device)
    seq = torch.searchsorted(cu[1:], tokens, right=True)  # each token's row
    pos = tokens - cu[seq]  # its position in the row's chunk
    row_slots = slots[seq]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(k):  # window element j of token t: input at pos - (K-1) + j, from the chunk or the state
        back = pos - (k - 1) + j
        inside = x[(tokens - (k - 1) + j).clamp(min=0)]
        before = conv[row_slots, :, (back + k - 1).clamp(0, k - 2)]
        out += torch.where((back >= 0).unsqueeze(1), inside, before).float() * weight[:, j].float()
    lens = cu[1:] - cu[:-1]
    last = torch.stack([_window_input(x, conv, slots, cu, lens, k, j) for j in range(k - 1)], dim=-1)
    conv.index_copy_(0, slots, last.to(conv.dtype))
    return F.silu(out).to(x.dtype)


def _window_input(x: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor, cu: torch.Tensor,
                  lens: torch.Tensor, k: int, j: int) -> torch.Tensor:
    """Input j of each row's window after its chunk (the state a later chunk or decode row continues from):
    [N, C]."""
    back = lens - (k - 1) + j
    inside = x[(cu[:-1] + back).clamp(0, max(x.shape[0] - 1, 0))]
    before = conv[slots, :, (back + k - 1).clamp(0, k - 2)]
    return torch.where((back >= 0).unsqueeze(1), inside, before)


def conv_decode(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
    """One token a row: x [B, C] after each row's window conv[slots] [B, C, K-1]; the window moves on."""
    window = torch.cat([conv[slots], x.unsqueeze(-1).to(conv.dtype)], dim=-1)  # [B, C, K]
    out = (window.float() * weight.float()).sum(-1)
    conv.index_copy_(0, slots, window[..., 1:])
    return F.silu(out).to(x.dtype)


# ---------------------------------------------------------------- the gated delta rule
def _expand(q: torch.Tensor, k: torch.Tensor, v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, D] -> [T, Hv, D]: each key head serves Hv / Hk consecutive value heads."""
    rep = v_heads // q.shape[1]
    return (q, k) if rep == 1 else (q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1))


def _normed(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q, k l2-normalised over their channels (eps 1e-6, as fla), q scaled by D^-1/2."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * q.shape[-1] ** -0.5, k


def delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       ssm: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                       chunks: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill rows: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv] (g fp32), rows split by cu_seqlens,
    each from its slot's state ssm[slots[i]]; the rows' final states written back. -> o [T, Hv, Dv] in v's
    dtype. fla's kernels take the key heads as they are (grouped value attention: value head h reads key head
    h // (Hv / Hk), as _expand lays them out). chunks: fla's chunk indices (chunk_indices, on the device);
    without them fla derives them from cu_seqlens on the GPU with a host sync (a repeat_interleave over
    device counts) in every layer whose cu_seqlens is a new tensor."""
    if q.is_cuda:  # NOTE: fla's kernels assume contiguous [1, T, H, D] inputs (a split's views are not)
        state = ssm[slots].float()
        q, k, v, g, beta = (t.contiguous().unsqueeze(0) for t in (q, k, v, g.float(), beta))
        o, final = fla_ops()(q, k, v, g, beta, initial_state=state, output_final_state=True,
                             cu_seqlens=cu_seqlens.long(), chunk_indices=chunks, use_qk_l2norm_in_kernel=True)
        ssm.index_copy_(0, slots, final.to(ssm.dtype))
        return o.squeeze(0).to(v.dtype)
    q, k = _expand(q, k, v.shape[1])
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    bounds = cu_seqlens.tolist()
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        slot = slots[i:i + 1]
        o, state = chunked_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], ssm[slot][0].float())
        out[a:b] = o.to(v.dtype)
        ssm.index_copy_(0, slot, state.unsqueeze(0).to(ssm.dtype))
    return out


def chunk_indices(cu_seqlens, chunk: int = CHUNK) -> np.ndarray:
    """fla's varlen chunk indices from the host's cu_seqlens [N+1]: one (row, chunk of the row) pair per
    `chunk` tokens of each row, rows in order -> [chunks, 2] int64 (fla.ops.utils.prepare_chunk_indices)."""
    counts = -(-np.diff(np.asarray(cu_seqlens, dtype=np.int64)) // chunk)
    rows = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)
    within = np.arange(rows.shape[0], dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([rows, within], 1)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of T tokens from state [H, Dk, Dv] (fp32), CHUNK tokens at a time: within a chunk the values
    the rule writes, u = beta (v - S^T k), solve one unit-lower-triangular system; -> (o [T, H, Dv] fp32, the
    final state)."""
    q, k = _normed(q, k)
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for a in range(0, q.shape[0], chunk):
        b = min(a + chunk, q.shape[0])
        qc, kc, vc = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, C, D]
        gc, bc = g[a:b].t().cumsum(-1), beta[a:b].t()  # [H, C]: cumulative log decay, beta
        n = b - a
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp((gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~causal, float("-inf")))  # i >= j
        # u_i + sum_{j<i} beta_i decay_ij (k_i . k_j) u_j = beta_i (v_i - exp(G_i) S^T k_i)
        a_mat = (bc.unsqueeze(-1) * decay * (kc @ kc.transpose(-1, -2))).tril(-1)
        rhs = bc.unsqueeze(-1) * (vc - torch.exp(gc).unsqueeze(-1) * (kc @ state))
        eye = torch.eye(n, device=q.device).expand_as(a_mat)
        u = torch.linalg.solve_triangular(eye + a_mat, rhs, upper=False, unitriangular=True)
        attn = decay * (qc @ kc.transpose(-1, -2))  # causal (decay is 0 above the diagonal)
        out[a:b] = (torch.exp(gc).unsqueeze(-1) * (qc @ state) + attn @ u).transpose(0, 1)
        last = gc[:, -1:]
        state = torch.exp(last).unsqueeze(-1) * state + (kc * torch.exp(last - gc).unsqueeze(-1)).transpose(
            -1, -2) @ u
    return out, state


def delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      ssm: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token a row: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv]; each row's state ssm[slots[b]] is
    advanced in place. -> o [B, Hv, Dv] in v's dtype."""
    # NOTE: torch ops (capturable), the reference of kernels.triton_gdn; fla-core 0.6.0's
    # fused_recurrent_gated_delta_rule gave NaN for one-token rows over states by slot on an H200
    q, k = _normed(*_expand(q, k, v.shape[1]))
    state = ssm[slots].float() * torch.exp(g.float())[..., None, None]  # [B, H, Dk, Dv]
    delta = beta.float().unsqueeze(-1) * (v.float() - torch.einsum("bhk,bhkv->bhv", k, state))
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    ssm.index_copy_(0, slots, state.to(ssm.dtype))
    return torch.einsum("bhk,bhkv->bhv", q, state).to(v.dtype)


def recurrent_reference(q, k, v, g, beta, state):
    """The rule one token at a time (the tests' reference for the chunked form): one row, [T, H, D]."""
    q, k = _normed(*_expand(q, k, v.shape[1]))
    out = []
    for t in range(q.shape[0]):
        state = state * torch.exp(g[t].float())[:, None, None]
        delta = beta[t].float().unsqueeze(-1) * (v[t].float() - torch.einsum("hk,hkv->hv", k[t], state))
        state = state + k[t].unsqueeze(-1) * delta.unsqueeze(-2)
        out.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(out), state


def gating(ba: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj_ba's rows [T, 2 Hv] (b | a) -> (g = -exp(A_log) softplus(a + dt_bias) fp32, beta = sigmoid(b)
    in ba's dtype)."""
    b, a = ba.float().chunk(2, dim=-1)
    return -a_log.float().exp() * F.softplus(a + dt_bias.float()), torch.sigmoid(b).to(ba.dtype)


def split_qkv(c: torch.Tensor, k_heads: int, k_dim: int, v_heads: int,
              v_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv's output [T, C] -> views q, k [T, Hk, Dk], v [T, Hv, Dv]."""
    q, k, v = c.split([k_heads * k_dim, k_heads * k_dim, v_heads * v_dim], dim=-1)
    return (q.unflatten(-1, (k_heads, k_dim)), k.unflatten(-1, (k_heads, k_dim)),
            v.unflatten(-1, (v_heads, v_dim)))


def decode_layer(qkv: torch.Tensor, z: torch.Tensor, ba: torch.Tensor, conv_weight: torch.Tensor,
                 a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 conv: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A layer's one-token rows from its projections to out_proj's input: qkv [B, 2 Hk Dk + Hv Dv], z [B, Hv
    Dv], ba [B, 2 Hv]; conv and ssm advanced in place at slots -> [B, Hv Dv] in qkv's dtype. The reference of
    kernels.triton_gdn.decode_layer."""
    b, hv, kd, vd = qkv.shape[0], ssm.shape[1], ssm.shape[2], ssm.shape[3]
    hk = (qkv.shape[1] - hv * vd) // (2 * kd)
    c = conv_decode(qkv, conv_weight.reshape(qkv.shape[1], -1), conv, slots)
    o = delta_rule_decode(*split_qkv(c, hk, kd, hv, vd), *gating(ba, a_log, dt_bias), ssm, slots)
    return gated_rms_norm(o, z.reshape(b, hv, vd), norm_weight, eps).reshape(b, hv * vd)


def prefill_layer(qkv: torch.Tensor, z: torch.Tensor, ba: torch.Tensor, conv_weight: torch.Tensor,
                  a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  conv: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor,
                  cu_seqlens: torch.Tensor) -> torch.Tensor:
    """A layer's prefill rows (split by cu_seqlens, each continuing from its slot's conv window and state)
    from its projections to out_proj's input: qkv [T, 2 Hk Dk + Hv Dv], z [T, Hv Dv], ba [T, 2 Hv] -> [T, Hv
    Dv] in qkv's dtype; windows and states moved on in place. The reference of a GPU backend's gdn_prefill."""
    t, hv, kd, vd = qkv.shape[0], ssm.shape[1], ssm.shape[2], ssm.shape[3]
    hk = (qkv.shape[1] - hv * vd) // (2 * kd)
    c = conv_prefill(qkv, conv_weight, conv, slots, cu_seqlens)
    o = delta_rule_prefill(*split_qkv(c, hk, kd, hv, vd), *gating(ba, a_log, dt_bias), ssm, slots, cu_seqlens)
    return gated_rms_norm(o, z.reshape(t, hv, vd), norm_weight, eps).reshape(t, hv * vd)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The output norm: RMSNorm(x) over each head's channels (fp32), times weight (in x's dtype first, as
    HF), times SiLU(gate) in fp32. x, gate [..., D]."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed).float() * F.silu(gate.float())).to(x.dtype)
