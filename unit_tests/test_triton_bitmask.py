"""Structured output's mask against xgrammar's own `apply_token_bitmask_inplace` (its CPU kernel: the
reference users know): our torch path (engine.grammar.mask_logits_ off CUDA) in this process, the Triton
kernel (kernels.triton_bitmask) through Triton's interpreter in a subprocess. Rows by index and every row;
a vocabulary that is not a multiple of 32; logits wider than the vocabulary (the padding left alone);
random words (the sign bit among them). On the GPU: tests/test_grammar_gpu.py."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from autoprofile.engine.grammar import check_bitmask, mask_logits_, unpack_bitmask
from unit_tests.interpreter import run_script

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CASES = [(5, 4096, 4096, None), (7, 1000, 1024, [0, 3, 6]), (3, 100, 131, [2]), (12, 8200, 8200, [11, 4, 5]),
         (1, 33, 33, None)]


def _case(rows: int, vocab: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=g)
    words = (vocab + 31) // 32
    bits = torch.randint(-2**31, 2**31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    return logits, bits


@pytest.mark.parametrize("rows, vocab, width, index", CASES)
def test_the_torch_path_is_xgrammars_mask(rows, vocab, width, index):
    xgrammar = pytest.importorskip("xgrammar")
    logits, bits = _case(rows, vocab, width, rows + vocab)
    want = logits.clone()
    xgrammar.apply_token_bitmask_inplace(want, bits, vocab_size=vocab, indices=index)
    got = logits.clone()
    mask_logits_(got, bits, vocab, None if index is None else torch.tensor(index, dtype=torch.int32))
    assert torch.equal(got, want)
    masked = torch.isinf(got[:, :vocab])
    assert 0 < int(masked.sum()) < masked.numel()  # the case masks some tokens, not all
    assert torch.equal(got[:, vocab:], logits[:, vocab:])


def test_unpack_reads_bit_j_of_word_j_over_32():
    bits = torch.tensor([[0b101, -2**31]], dtype=torch.int32)
    allowed = unpack_bitmask(bits, 64)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 63]


@pytest.mark.parametrize("shape, words, vocab", [((4, 64), 2, 65), ((4, 64), 1, 64), ((4,), 2, 4)])
def test_a_mask_that_does_not_fit_is_refused(shape, words, vocab):
    with pytest.raises(ValueError):
        check_bitmask(torch.zeros(shape), torch.zeros(4, words, dtype=torch.int32), vocab)


INTERPRETED = r'''
import torch, xgrammar
from autoprofile.kernels import triton_bitmask as tb
from unit_tests.test_triton_bitmask import CASES, _case

for rows, vocab, width, index in CASES:
    for dtype in (torch.float32, torch.float16):
        logits, bits = _case(rows, vocab, width, rows * vocab)
        logits = logits.to(dtype)
        want = logits.clone()
        xgrammar.apply_token_bitmask_inplace(want, bits, vocab_size=vocab, indices=index)
        got = logits.clone()
        idx = None if index is None else torch.tensor(index, dtype=torch.int32)
        grid = (got.shape[0] if idx is None else idx.numel(), -(-vocab // tb.BLOCK))
        tb._apply_bitmask[grid](got, bits, idx if idx is not None else bits, vocab, got.stride(0),
                                bits.stride(0), HAS_INDEX=idx is not None, BLOCK=tb.BLOCK)
        assert torch.equal(got, want), (rows, vocab, width, index, dtype)
print("ok")
'''


@needs_triton
def test_the_triton_kernel_is_xgrammars_mask_in_the_interpreter():
    pytest.importorskip("xgrammar")
    run_script(INTERPRETED)
