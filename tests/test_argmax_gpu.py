"""GPU: the split-row argmax (kernels.triton_argmax) against torch.argmax at Llama 3's vocabulary, 1 to 1,500
rows of bf16 (and fp16, fp32), with ties across the programs' parts and rows of -inf; each grid (flat, rows),
scan (the NaN-propagating max, the compares), a dependent launch and a filled scratch; the split counts the
GPU picks and forced ones; repeated calls (a row's last program must see every program's key, and leave the
kept scratch clean); inside a captured CUDA graph, replayed twice over each fresh logits (the kept scratch is
not in the graph: each replay must find it clean); the stress allocates the scratch; and the all-greedy path
of sample() through it."""
from __future__ import annotations

import pytest
import torch

from autoprofile.engine.sampling import GREEDY, STRESS, SamplingBatch, sample
from autoprofile.kernels import triton_argmax as ta
from scripts.cuda_timing import capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 128256
VARIANTS = {"flat": {}, "rows": {"GRID": "rows"}, "compares": {"FAST": False}, "pdl": {"PDL": True},
            "fill": {"SCRATCH": "fill"}}  # beside the shipped knobs


@pytest.fixture(params=list(VARIANTS))
def variant(request, monkeypatch):
    for name, value in VARIANTS[request.param].items():
        monkeypatch.setattr(ta, name, value)
    return request.param


def clean() -> bool:
    """Every kept key and count back at INT64_MIN."""
    return bool((ta.scratch(torch.device("cuda")) == ta.INT64_MIN).all())


def logits(rows: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """randn * 5 with planted rows: ties at the max across chunks (the first must win), -inf, the max at 0
    and at vocab - 1, -0.0 beside 0.0, NaN of either sign."""
    gen = torch.Generator("cuda").manual_seed(seed)
    x = (torch.randn(rows, VOCAB, device="cuda", generator=gen) * 5).to(dtype)
    top = 100.0
    planted = {0: [7, 7 + ta.BLOCK, 40000, 90000, VOCAB - 1], 1: [VOCAB - 1, 65536, 30001], 2: [0],
               3: [VOCAB - 1]}
    for row, ids in planted.items():
        if row < rows:
            x[row, ids] = top
    if rows > 6:
        x[4] = float("-inf")
        x[5] = -1.0  # -0.0 ties with 0.0: the first of either
        x[5, [20, 100000]] = -0.0
        x[5, [30, 90000]] = 0.0
        x[6, 77777] = -float("nan")  # NaN of either sign above all
        x[rows // 2, [rows, 50000, 120000]] = top + 1
        x[rows - 1, [99999, 100000]] = float("nan")
    return x


@pytest.mark.parametrize("rows", [1, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_argmax_equals_torch(rows, dtype, variant):
    x = logits(rows, dtype)
    want = x.argmax(dim=-1)
    for splits in (None, 1, 2, 7, 63):
        assert torch.equal(ta.argmax(x, splits), want), (rows, dtype, splits)
    assert int(ta.argmax(x)[0]) == 7
    wide = torch.zeros(rows, VOCAB + 8, device="cuda", dtype=dtype)
    wide[:, 8:] = x  # a row stride wider than the row
    assert torch.equal(ta.argmax(wide[:, 8:]), want)
    assert clean()


@pytest.mark.parametrize("rows", [1024, 1500])  # 1,500: a launch of SCRATCH_ROWS rows, then one of the rest
def test_many_rows(rows, variant):
    x = logits(rows)
    assert torch.equal(ta.argmax(x), x.argmax(dim=-1))
    assert clean()


def test_every_call_agrees(variant):
    """A row's last program unpacks the max of every program's key: 200 calls at 256 rows, 64 at 1, 20 at
    1,024 (programs ending one row and starting the next)."""
    for rows, calls in ((256, 200), (1, 64), (1024, 20)):
        x = logits(rows, seed=rows)
        want = x.argmax(dim=-1)
        outs = torch.stack([ta.argmax(x) for _ in range(calls)])
        assert torch.equal(outs, want.expand(calls, -1)), rows
    assert clean()


@pytest.mark.parametrize("rows", [1, 256, 1024, 1500])
def test_argmax_in_a_cuda_graph(rows, variant):
    """Each fresh logits replayed twice: the second replay finds the kept keys and counts as the first left
    them, and a row whose max fell since (seed to seed) must not keep the old key."""
    x = logits(rows)
    graph, out = capture(lambda: ta.argmax(x))
    for seed in range(1, 6):
        x.copy_(logits(rows, seed=seed))
        if seed % 2:
            x.sub_(100)  # every max below the last replay's
        want = x.argmax(dim=-1)
        for replay in range(2):
            out.fill_(-1)
            graph.replay()
            assert torch.equal(out, want), (seed, replay)
    assert clean()


def test_the_stress_allocates_the_kept_scratch(monkeypatch):
    """A stress corner's sample (its rows sampled, never greedy) allocates the argmax's scratch, so that the
    probe's measured peak holds it; a serving step's does not allocate."""
    monkeypatch.setattr(ta, "_scratch", {})
    x = logits(4)
    batch = SamplingBatch.from_params([STRESS] * 4, torch.device("cuda"))
    sample(x, batch)
    assert not ta._scratch
    sample(x, batch, stress=True)
    assert [b.numel() * 8 for b in ta._scratch.values()] == [ta.scratch_bytes()]
    assert clean()


def test_all_greedy_sample_is_the_kernels_argmax():
    x = logits(256)
    batch = SamplingBatch.from_params([GREEDY] * 256, torch.device("cuda"))
    assert torch.equal(sample(x, batch), x.argmax(dim=-1))
    assert sample(x[:0], SamplingBatch.from_params([], torch.device("cuda"))).shape == (0,)
