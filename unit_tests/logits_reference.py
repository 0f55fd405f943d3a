"""The logits processors' per-row reference in vLLM's order, in fp64 on the CPU (unit_tests/test_logits_process.py
and the GPU test tests/test_sampling_gpu.py, which must not need the HTTP clients those tests import)."""
from __future__ import annotations

import math
from collections import Counter

import torch

from autoprofile.engine.sampling import SamplingParams


def reference_process(x: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams,
                      stop: tuple[int, ...] = ()) -> torch.Tensor:
    """One row, token by token, in vLLM's order: bias, min_tokens, repetition (prompt and output), frequency
    and presence (output), min_p at the row's temperature."""
    x = x.double().clone()
    for tok, b in p.logit_bias:
        x[tok] += b
    if len(output) < p.min_tokens:
        for tok in stop:
            x[tok] = -math.inf
    for tok in set(prompt) | set(output):
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok, count in Counter(output).items():
        x[tok] -= p.frequency_penalty * count + p.presence_penalty
    if p.min_p > 0 and p.temperature > 0:
        probs = (x / p.temperature).softmax(-1)
        x[probs < p.min_p * probs.max()] = -math.inf
    return x.float()
