"""GPU: the split-row argmax (kernels.triton_argmax) against torch.argmax at Llama 3's vocabulary, 1 and 256
rows of bf16 (and fp16, fp32), with ties across the programs' chunks and rows of -inf; the split counts the
GPU picks and forced ones; repeated calls (a row's last program must see every program's key); inside a
captured CUDA graph, replayed over fresh logits (the scratch's fill is in the graph); and the all-greedy
path of sample() through it."""
from __future__ import annotations

import pytest
import torch

from autoprofile.engine.sampling import GREEDY, SamplingBatch, sample
from autoprofile.kernels import triton_argmax as ta
from scripts.cuda_timing import capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 128256


def logits(rows: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """randn * 5 with planted rows: ties at the max across chunks (the first must win), -inf, the max at 0
    and at vocab - 1, NaN."""
    gen = torch.Generator("cuda").manual_seed(seed)
    x = (torch.randn(rows, VOCAB, device="cuda", generator=gen) * 5).to(dtype)
    top = 100.0
    planted = {0: [7, 7 + ta.BLOCK, 40000, 90000, VOCAB - 1], 1: [VOCAB - 1, 65536, 30001], 2: [0],
               3: [VOCAB - 1]}
    for row, ids in planted.items():
        if row < rows:
            x[row, ids] = top
    if rows > 4:
        x[4] = float("-inf")
        x[rows // 2, [rows, 50000, 120000]] = top + 1
        x[rows - 1, [99999, 100000]] = float("nan")
    return x


@pytest.mark.parametrize("rows", [1, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_argmax_equals_torch(rows, dtype):
    x = logits(rows, dtype)
    want = x.argmax(dim=-1)
    for splits in (None, 1, 2, 7, 63):
        assert torch.equal(ta.argmax(x, splits), want), (rows, dtype, splits)
    assert int(ta.argmax(x)[0]) == 7
    wide = torch.zeros(rows, VOCAB + 8, device="cuda", dtype=dtype)
    wide[:, 8:] = x  # a row stride wider than the row
    assert torch.equal(ta.argmax(wide[:, 8:]), want)


def test_every_call_agrees():
    """A row's last program unpacks the max of every program's key: 200 calls at 256 rows, 64 at 1."""
    for rows, calls in ((256, 200), (1, 64)):
        x = logits(rows, seed=rows)
        want = x.argmax(dim=-1)
        outs = torch.stack([ta.argmax(x) for _ in range(calls)])
        assert torch.equal(outs, want.expand(calls, -1)), rows


@pytest.mark.parametrize("rows", [1, 256])
def test_argmax_in_a_cuda_graph(rows):
    x = logits(rows)
    graph, out = capture(lambda: ta.argmax(x))
    for seed in range(1, 6):
        x.copy_(logits(rows, seed=seed))
        graph.replay()
        assert torch.equal(out, x.argmax(dim=-1)), seed


def test_all_greedy_sample_is_the_kernels_argmax():
    x = logits(256)
    batch = SamplingBatch.from_params([GREEDY] * 256, torch.device("cuda"))
    assert torch.equal(sample(x, batch), x.argmax(dim=-1))
    assert sample(x[:0], SamplingBatch.from_params([], torch.device("cuda"))).shape == (0,)
