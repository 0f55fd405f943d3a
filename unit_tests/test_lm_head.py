"""The lm_head writes the decode graphs' static logits buffer itself (issue 48, item 3): the GEMM takes the
buffer's view as its output, so a captured step holds no [rows, vocab] temporary and makes no copy."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoprofile.engine.attention.torch_sdpa import tiled_linear
from autoprofile.layers.parallel import TP, ParallelLMHead


def _head(matmul=None) -> tuple[ParallelLMHead, torch.Tensor]:
    torch.manual_seed(0)
    head = ParallelLMHead(50, 16, TP(matmul=matmul), torch.float32)
    head.weight.data.normal_()
    return head, torch.randn(3, 16)


def test_one_rank_writes_the_logits_into_the_given_rows_of_the_buffer():
    head, hidden = _head()
    buf = torch.full((5, 50), float("nan"))
    out = head(hidden, buf[:3])
    assert out.data_ptr() == buf.data_ptr() and out.shape == (3, 50)
    torch.testing.assert_close(buf[:3], F.linear(hidden, head.weight))
    assert buf[3:].isnan().all()  # the rows past the batch are not touched
    torch.testing.assert_close(head(hidden), buf[:3])  # without out: the same logits, a new tensor


def test_a_backend_gemm_writes_into_out_too():
    """--deterministic's CPU GEMM (tiled_linear) copies its tiles' result into out; the logits are the same
    as its own output's."""
    head, hidden = _head(matmul=tiled_linear)
    buf = torch.zeros(4, 50)
    out = head(hidden, buf[:3])
    assert out.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf[:3], tiled_linear(hidden, head.weight))
