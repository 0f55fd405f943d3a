"""layers.quant, the FP8 reference every kernel is checked against: the weight and activation round trips,
a zero row, block tails, per-token against per-group scales, the W8A8 reference GEMM."""
from __future__ import annotations

import pytest
import torch

from autoprofile.layers.quant import (FP8, FP8_MAX, Fp8Scheme, MoeQuant, dequantize_weight,
                                      fp8_linear_reference, moe_reference_fp8, quantize_per_group,
                                      quantize_per_token, quantize_weight, weight_scale_shape)
from autoprofile.layers.moe import moe_reference

BLOCK = Fp8Scheme("block", (128, 128), "group")
CHANNEL = Fp8Scheme("channel", None, "token")
E4M3_REL = 2 ** -4  # e4m3 keeps 3 mantissa bits: a rounding error of at most half an ulp, 1/16 of the value


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("scheme,shape", [(CHANNEL, (96, 200)), (BLOCK, (256, 384)), (BLOCK, (300, 200)),
                                          (Fp8Scheme("block", (32, 16), "group"), (70, 45))])
def test_weight_round_trip_within_e4m3_rounding(scheme, shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-2, 1, shape[0])[:, None]  # rows of very different sizes
    q, s = quantize_weight(w, scheme)
    assert q.dtype == FP8 and q.shape == w.shape and s.dtype == torch.float32
    assert tuple(s.shape) == weight_scale_shape(*shape, scheme)
    back = dequantize_weight(q, s, scheme)
    assert ((back - w).abs() <= w.abs() * E4M3_REL + s.max() * 2 ** -9).all()  # subnormals near zero
    assert rel(back, w) < 0.03


def test_block_tails_get_their_own_scales():
    """N and K past a multiple of 128: the tail tiles' scales come from their own (few) elements."""
    w = torch.zeros(130, 260)
    w[128:, :] = 1.0  # the last block row: 2 rows
    w[:128, 256:] = 7.0  # the last block column: 4 columns
    q, s = quantize_weight(w, BLOCK)
    assert s.shape == (2, 3)
    assert s[1, 0].item() == pytest.approx(1.0 / FP8_MAX)
    assert s[0, 2].item() == pytest.approx(7.0 / FP8_MAX)
    assert s[0, 0].item() == pytest.approx(1e-12)  # an all-zero tile
    torch.testing.assert_close(dequantize_weight(q, s, BLOCK), w)


def test_a_zero_row_quantizes_to_zeros_not_nan():
    x = torch.randn(3, 256)
    x[1] = 0
    for q, s in (quantize_per_token(x), quantize_per_group(x, 128)):
        assert torch.isfinite(s).all() and (s > 0).all()
        assert (q[1].float() == 0).all()
    q, s = quantize_weight(torch.zeros(4, 8), CHANNEL)
    assert (q.float() == 0).all() and (dequantize_weight(q, s, CHANNEL) == 0).all()


def test_per_group_scales_follow_each_group_per_token_the_row():
    """A row with one large group: per-token quantization loses its small groups (rounded to zero), per-group
    keeps them."""
    x = torch.full((2, 256), 1e-4)
    x[:, :128] = 300.0
    qt, st = quantize_per_token(x)
    qg, sg = quantize_per_group(x, 128)
    assert st.shape == (2, 1) and sg.shape == (2, 2)
    assert sg[0, 1].item() == pytest.approx(1e-4 / FP8_MAX)
    back_t = qt.float() * st
    back_g = qg.float() * sg.repeat_interleave(128, dim=1)
    assert rel(back_g[:, 128:], x[:, 128:]) < 0.07
    assert (back_t[:, 128:] == 0).all()  # all below e4m3's smallest subnormal


def test_per_group_tail_group():
    x = torch.randn(4, 200)
    q, s = quantize_per_group(x, 128)
    assert s.shape == (4, 2)
    torch.testing.assert_close(s[:, 1], x[:, 128:].abs().amax(dim=1) / FP8_MAX)
    assert rel(q.float() * s.repeat_interleave(128, dim=1)[:, :200], x) < 0.04


def test_values_clamp_at_448():
    x = torch.tensor([[1.0, -2.0]])
    q = quantize_per_token(x)[0]
    assert q.float().abs().max().item() == FP8_MAX


@pytest.mark.parametrize("scheme", [CHANNEL, BLOCK, Fp8Scheme("channel", None, "static")])
def test_reference_linear_close_to_the_dequantized_bf16_product(scheme):
    torch.manual_seed(1)
    x, w, b = torch.randn(5, 300, dtype=torch.bfloat16), torch.randn(260, 300) * 0.05, torch.randn(260)
    q, s = quantize_weight(w, scheme)
    static = x.float().abs().amax().reshape(1) / FP8_MAX if scheme.activation == "static" else None
    y = fp8_linear_reference(x, q, s, scheme, static, b.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (5, 260)
    ref = x.float() @ dequantize_weight(q, s, scheme).t() + b.bfloat16().float()
    assert rel(y, ref) < 0.05


def test_static_activations_need_their_scale():
    q, s = quantize_weight(torch.randn(8, 16), CHANNEL)
    with pytest.raises(ValueError, match="input_scale"):
        fp8_linear_reference(torch.randn(2, 16), q, s, Fp8Scheme("channel", None, "static"))


@pytest.mark.parametrize("scheme", [CHANNEL, Fp8Scheme("block", (32, 32), "group")])
def test_fp8_experts_reference_close_to_the_bf16_experts(scheme):
    torch.manual_seed(2)
    e, i, h, t = 4, 64, 96, 10
    w13, w2 = torch.randn(e, 2 * i, h) * 0.1, torch.randn(e, h, i) * 0.1
    q13, s13 = zip(*(quantize_weight(w, scheme) for w in w13))
    q2, s2 = zip(*(quantize_weight(w, scheme) for w in w2))
    quant = MoeQuant(torch.stack(s13), torch.stack(s2), scheme)
    x = torch.randn(t, h)
    ids = torch.randint(0, e, (t, 2), dtype=torch.int32)
    weights = torch.rand(t, 2)
    got = moe_reference_fp8(x, torch.stack(q13), torch.stack(q2), weights, ids, quant)
    deq13 = dequantize_weight(torch.stack(q13), quant.w13_scale, scheme)
    deq2 = dequantize_weight(torch.stack(q2), quant.w2_scale, scheme)
    assert rel(got, moe_reference(x, deq13, deq2, weights, ids)) < 0.05
