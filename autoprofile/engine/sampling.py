"""Sampling over the full vocabulary: greedy, temperature, top-k, top-p, per request, batched.

One sort/softmax path for every row (the stress runs it at its worst: full vocab, every row), outside
any CUDA graph. Draws come from a seeded torch.Generator (exponential race: argmax p/E, E ~ Exp(1)).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 = whole vocabulary

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")


GREEDY = SamplingParams()
STRESS = SamplingParams(temperature=0.8, top_p=0.9, top_k=50)  # every branch of the sampler


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row parameters as device tensors: temperatures [B] fp32, top_ps [B] fp32, top_ks [B] int64."""

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device) -> SamplingBatch:
        return cls(torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
                   torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
                   torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device))

    def __len__(self) -> int:
        return self.temperatures.numel()

    def rows(self, start: int, end: int) -> SamplingBatch:
        return SamplingBatch(self.temperatures[start:end], self.top_ps[start:end], self.top_ks[start:end])


def top_k_top_p_probs(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, ids), both [B, V] sorted by descending logit; probs zero outside each row's top-k and
    nucleus (the smallest prefix whose mass reaches top_p; the first token always stays); not renormalised."""
    temps = batch.temperatures.clamp_min(1e-5).unsqueeze(1)
    sorted_logits, ids = (logits.float() / temps).sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(batch.top_ks > 0, batch.top_ks, vocab).clamp(max=vocab).unsqueeze(1)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    probs = sorted_logits.masked_fill_(rank >= k, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    return probs.masked_fill_(mass_before > batch.top_ps.unsqueeze(1), 0.0), ids


def sample(logits: torch.Tensor, batch: SamplingBatch,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Token ids [B] (int64): argmax where temperature == 0, else a draw from the top-k/top-p distribution."""
    greedy = logits.argmax(dim=-1)
    probs, ids = top_k_top_p_probs(logits, batch)
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-20)  # 0/0 would be NaN
    drawn = ids.gather(1, (probs / race).argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(batch.temperatures > 0, drawn, greedy)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)
