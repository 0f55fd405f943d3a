"""FP8 (e4m3) weights: the representation, and the torch reference that every backend's kernels match.

A quantized linear layer holds `weight` float8_e4m3fn [N, K], `weight_scale` fp32 ("channel": [N]; "block":
[ceil(N/bn), ceil(K/bk)]), and `input_scale` fp32 [1] for static activations. Scales MULTIPLY:
W = weight.float() * scale (HF's `weight_scale_inv` and compressed-tensors' `weight_scale` both are this
factor). Activations are quantized per token ("token"), per (token, bk-group) ("group", with "block"), or by
the checkpoint's one scale ("static"). The scheme itself (Fp8Scheme) lives in autoprofile.model_config,
torch-free, because the config and the planner read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from autoprofile.model_config import Fp8Scheme

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12  # a zero row's scale: its values quantize to zeros, not NaN

__all__ = ["FP8", "FP8_MAX", "Fp8Rows", "Fp8Scheme", "MoeQuant", "dequantize_weight", "expand_block_scale",
           "fp8_capability_problem", "fp8_linear_reference", "fused_input_quant", "moe_reference_fp8",
           "quantize_per_group", "quantize_per_token", "quantize_weight", "quantized_rows",
           "weight_scale_shape"]


FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores (cuBLASLt's e4m3 GEMMs)


def fp8_capability_problem(capability: tuple[int, int], source: str) -> str | None:
    """Why FP8 weights cannot be served on a GPU of this compute capability, or None; `source` is where the
    FP8 came from (the flag or the checkpoint)."""
    if tuple(capability) >= FP8_MIN_CAPABILITY:
        return None
    have = ".".join(map(str, capability))
    return (f"FP8 weights ({source}) need a GPU of compute capability >= 8.9 (Ada, Hopper); this one is "
            f"{have}: serve a bf16 checkpoint without --quantization")


@dataclass(frozen=True)
class MoeQuant:
    """The FP8 experts' scales (w13/w2 are float8 [E, 2I, H] / [E, H, I]): "channel" w13_scale [E, 2I],
    w2_scale [E, H]; "block" [E, ceil(2I/bn), ceil(H/bk)], [E, ceil(H/bn), ceil(I/bk)]."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    scheme: Fp8Scheme


@dataclass(frozen=True)
class Fp8Rows:
    """Activations [M, K] quantized by the kernel that made them (an RMSNorm's or SiLU-mul's output, for the
    one FP8 linear layer that reads them): q fp8 [M, K] and scale fp32 as quantize_input gives them for the
    layer's scheme; dtype: the model's, the layer's output dtype."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def linear_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; with out, of x [rows, K] written into out [rows, N] (cuBLAS's GEMM takes the output's
    address: nothing allocated, no copy)."""
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def rows_linear(x: torch.Tensor | Fp8Rows, n: int, residual: torch.Tensor | None, product) -> torch.Tensor:
    """A few-row FP8 kernel's linear: x [..., K] in the model's dtype (W8A16, not quantized) or Fp8Rows ->
    [..., N] in the model's dtype, where product(rows [M, K] unit stride, x_scale or None, dtype, into) gives
    [M, N], adding into the contiguous [M, N] residual in its epilogue when `into` is given (then it returns
    it); a residual that is not contiguous (or of another dtype) is added to after."""
    if isinstance(x, Fp8Rows):
        rows, x_scale, dtype, lead = x.q, x.scale, x.dtype, x.q.shape[:-1]
    else:
        rows, x_scale, dtype, lead = x.reshape(-1, x.shape[-1]), None, x.dtype, x.shape[:-1]
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    fused = residual is not None and residual.is_contiguous() and residual.dtype == dtype
    y = product(rows, x_scale, dtype, residual.view(-1, n) if fused else None)
    if fused:
        return residual
    y = y.view(*lead, n)
    return y if residual is None else residual.add_(y)


def fused_input_quant(scheme: Fp8Scheme | None) -> Fp8Scheme | None:
    """The scheme a producer (norm, SiLU-mul) quantizes its rows with for an FP8 layer that reads them alone;
    None where the layer quantizes nothing (bf16) or takes the checkpoint's static scale."""
    return scheme if scheme is not None and scheme.dynamic else None


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x times the scale's reciprocal (one division a scale, as vLLM's and our kernels do), saturated."""
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q fp8 [M, K], scale fp32 [M, 1]): each row's amax maps to 448."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=MIN_SCALE)
    return _to_fp8(x, scale), scale


def quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q fp8 [M, K], scale fp32 [M, ceil(K/group)]): one scale per row and group of `group`
    columns (the last group may be short)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = (padded.abs().amax(dim=-1) / FP8_MAX).clamp_(min=MIN_SCALE)
    return _to_fp8(x, scale.repeat_interleave(group, dim=1)[:, :k]), scale


def weight_scale_shape(n: int, k: int, scheme: Fp8Scheme) -> tuple[int, ...]:
    """weight_scale's shape for a weight [n, k]."""
    if scheme.weight == "channel":
        return (n,)
    bn, bk = scheme.block
    return (-(-n // bn), -(-k // bk))


def expand_block_scale(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """[ceil(n/bn), ceil(k/bk)] -> [n, k]: each tile's scale on each of its elements (tails cut)."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


def quantize_weight(w: torch.Tensor, scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16/fp32 W [N, K] -> (weight fp8 [N, K], weight_scale fp32): each output row's ("channel") or each
    [bn, bk] tile's ("block") amax maps to 448."""
    n, k = w.shape
    if scheme.weight == "channel":
        scale = (w.float().abs().amax(dim=-1) / FP8_MAX).clamp_(min=MIN_SCALE)
        return _to_fp8(w, scale[:, None]), scale
    bn, bk = scheme.block
    rows, cols = weight_scale_shape(n, k, scheme)
    tiles = F.pad(w.float().abs(), (0, cols * bk - k, 0, rows * bn - n)).view(rows, bn, cols, bk)
    scale = (tiles.amax(dim=(1, 3)) / FP8_MAX).clamp_(min=MIN_SCALE)
    return _to_fp8(w, expand_block_scale(scale, n, k, scheme.block)), scale


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor, scheme: Fp8Scheme,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight fp8 [N, K] (or [E, N, K] with per-expert scales) -> W [.., N, K] in dtype."""
    n, k = weight.shape[-2:]
    if scheme.weight == "channel":
        scale = weight_scale.float().unsqueeze(-1)
    else:
        scale = expand_block_scale(weight_scale.float(), n, k, scheme.block)
    return (weight.float() * scale).to(dtype)


def quantize_input(x: torch.Tensor, scheme: Fp8Scheme,
                   input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] as the scheme says -> (x_q fp8, scale): "token" [M, 1], "group" [M, K/bk],
    "static" the checkpoint's [1]."""
    if scheme.activation == "static":
        if input_scale is None:
            raise ValueError("static FP8 activations need the layer's input_scale")
        return _to_fp8(x, input_scale.float()), input_scale.float()
    if scheme.activation == "group":
        return quantize_per_group(x, scheme.block[1])
    return quantize_per_token(x)


def quantized_rows(out: torch.Tensor, scheme: Fp8Scheme) -> Fp8Rows:
    """A producer's output [..., K] quantized as the scheme's activations (the torch path of the fused
    producers: AttentionBackend.rms_norm_quant, silu_mul_quant)."""
    return Fp8Rows(*quantize_input(out.reshape(-1, out.shape[-1]), scheme), out.dtype)


def dequantize_input(x_q: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme) -> torch.Tensor:
    if scheme.activation == "group":
        k = x_q.shape[-1]
        return x_q.float() * scale.repeat_interleave(scheme.block[1], dim=-1)[..., :k]
    return x_q.float() * scale


def fp8_linear_reference(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
                         scheme: Fp8Scheme, input_scale: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None,
                         residual: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: x [..., K] quantized as the scheme says (or Fp8Rows, quantized already), both sides dequantized
    to fp32, matmul in fp32, + bias; in x's dtype. residual: the result is added to it, in place, and it is
    returned."""
    if isinstance(x, Fp8Rows):
        x_q, x_scale, dtype, lead = x.q, x.scale, x.dtype, x.q.shape[:-1]
    else:
        x_q, x_scale = quantize_input(x.reshape(-1, x.shape[-1]), scheme, input_scale)
        dtype, lead = x.dtype, x.shape[:-1]
    y = dequantize_input(x_q, x_scale, scheme) @ dequantize_weight(weight, weight_scale, scheme).t()
    if bias is not None:
        y = y + bias.float()
    y = y.to(dtype).reshape(*lead, weight.shape[0])
    return y if residual is None else residual.add_(y)


def moe_reference_fp8(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, quant: MoeQuant) -> torch.Tensor:
    """layers.moe.moe_reference over FP8 experts: per expert hit, its tokens' activations quantized (per
    token or group) before each of its two GEMMs against the dequantized expert weights."""
    out = torch.zeros_like(x)
    scheme = quant.scheme
    hits = torch.bincount(ids.flatten().long(), minlength=w13.shape[0]).tolist()
    for e, n in enumerate(hits):
        if not n:
            continue
        token, slot = torch.where(ids == e)
        gate, up = fp8_linear_reference(x[token], w13[e], quant.w13_scale[e], scheme).chunk(2, dim=-1)
        h = fp8_linear_reference(F.silu(gate) * up, w2[e], quant.w2_scale[e], scheme)
        out.index_add_(0, token, (h * weights[token, slot, None]).to(out.dtype))
    return out
