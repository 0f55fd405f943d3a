"""The kernel ops interface: the model's operations other than attention (GEMMs, the fused MoE and its
router, RMSNorm, the SiLU-and-mul activation, each with its FP8 input quantization), as torch references. A
GPU backend overrides them with its kernels; every attention backend is also a KernelOps
(layers.attention.AttentionBackend), and the model's norms, MLPs and experts take it as that.
"""
from __future__ import annotations

import torch

from autoprofile.layers.moe import GroupedTopk, Routing, biased_grouped_topk, moe_reference, route
from autoprofile.layers.quant import (Fp8Rows, Fp8Scheme, MoeQuant, fp8_linear_reference, moe_reference_fp8,
                                      quantized_rows)


class KernelOps:
    """The non-attention operations a model's layers call (RMSNorm, LlamaMLP, FusedMoE, TP's GEMMs)."""

    moe_capturable = False  # fused_moe launches no host sync: a decode graph may hold an MoE layer
    deterministic = False  # --deterministic: batch-invariant kernels (an attention backend sets it)

    @property
    def gemm(self):
        """The GEMM (x, weight, bias) -> y the model's linear layers call (TP.matmul): under --deterministic a
        batch-invariant one; None: F.linear."""
        return None

    @property
    def gemm_add(self):
        """(x, weight, residual) -> residual += x W^T in place (TP.matmul_add); None: cuBLAS's addmm_."""
        return None

    @property
    def router_gemm(self):
        """(x, fp32 weight) -> fp32 logits for an fp32 router (TP.router_matmul), reading x in its own dtype;
        None: x.float() through TP.linear."""
        return None

    @property
    def fp8_gemm(self):
        """The FP8 weights' GEMM (x, weight, weight_scale, scheme, input_scale, bias) -> y (TP.fp8_matmul):
        the torch reference here; a GPU backend's kernels."""
        return fp8_linear_reference

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP activation: x [..., 2 * I] = gate | up -> silu(gate) * up [..., I] (the model takes it from
        the backend, as its norms)."""
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def silu_mul_quant(self, x: torch.Tensor, scheme: Fp8Scheme) -> Fp8Rows:
        """silu_mul's rows quantized for the FP8 layer that reads them (layers.quant.fused_input_quant)."""
        return quantized_rows(self.silu_mul(x), scheme)

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, quant: MoeQuant | None = None,
                  add: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """The experts (layers.moe): x [T, H], w13 [E, 2I, H] (gate | up), w2 [E, H, I], the routing's
        weights [T, k] and expert ids [T, k] -> sum over k of weight * down(silu(gate) * up) [T, H], plus
        each tensor of `add` [T, H] in order (a layer's shared experts and residual: a backend may sum them
        with the top-k in one kernel). quant: FP8 experts' scales (w13/w2 float8_e4m3fn), activations
        quantized before each GEMM."""
        if quant is not None:
            out = moe_reference_fp8(x, w13, w2, weights, ids, quant)
        else:
            out = moe_reference(x, w13, w2, weights, ids, self.gemm or torch.nn.functional.linear)
        for a in add:
            out = out + a
        return out

    def route_experts(self, logits: torch.Tensor, top_k: int, renormalize: bool, scale: float,
                      routing: Routing,
                      grouped: GroupedTopk | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy router (layers.moe.route) over logits [T, E], or noaux_tc's (biased_grouped_topk) when
        grouped, then the routing's forced ids (Routing.apply) -> (weights [T, k] in the logits' dtype, expert
        ids [T, k] int32); no host sync."""
        if grouped is None:
            weights, ids = route(logits, top_k, renormalize, scale)
        else:
            weights, ids = biased_grouped_topk(logits, grouped.e_score_correction_bias, top_k,
                                               grouped.num_expert_group, grouped.topk_group, renormalize,
                                               scale)
        return weights, routing.apply(ids, logits.shape[-1])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim, computed in fp32 (the model takes its norm from the backend)."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)

    def rms_norm_quant(self, x: torch.Tensor, weight: torch.Tensor, eps: float, scheme: Fp8Scheme) -> Fp8Rows:
        """rms_norm's rows quantized for the FP8 layer that reads them (layers.quant.fused_input_quant)."""
        return quantized_rows(self.rms_norm(x, weight, eps), scheme)
