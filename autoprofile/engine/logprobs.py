"""Logprobs of the RAW model logits (vLLM's default `raw_logprobs`): log_softmax of the logits before any
logits processor, penalty, grammar mask or temperature; computed on the device and carried back with the
step's tokens (sampler.StepTokens: one non-blocking copy, so the overlapped engine never waits for them).
The sampler (autoprofile.engine.sampler) calls these functions; it alone reads a row's `logprobs`.

- Sampled rows (`SamplingParams.logprobs`): the log-softmax [rows, vocab] fp32 of the step's sampled rows,
  the top-k [rows, k] (k <= MAX_LOGPROBS) and the sampled token's logprob after sampling: per-row buffers of
  the envelope's sampled_rows, which every stress row asks for at MAX_LOGPROBS (sampling.STRESS_PARAMS).
- Prompt tokens (`SamplingParams.prompt_logprobs`, completions' `echo`): the logits of every prompt
  position of a prefill row, PROMPT_CHUNK rows at a time (so the [chunk, vocab] logits and their fp32
  log-softmax are bounded whatever the chunk); position p scores prompt token p + 1. Every stress prefill
  corner asks for them on every token. A request with prompt logprobs takes nothing from the prefix cache
  (Scheduler._page_keys): a cached position has no logits.

Host form of one scored token: (token id, logprob, [(id, logprob), ...] its top-k by descending logprob);
a prompt token's carries its rank last (PromptTokenLogprob: vLLM's, 1 = the most likely).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from autoprofile.engine.sampling_params import MAX_LOGPROBS

PROMPT_CHUNK = 256  # prompt positions whose logits exist at once (the [chunk, vocab] buffers' rows)
TokenLogprob = tuple[int, float, list[tuple[int, float]]]
PromptTokenLogprob = tuple[int, float, list[tuple[int, float]], int]


def top_k_of(ks: Sequence[int | None]) -> int | None:
    """The top-k a batch computes: the most any row asks for (None: no row asks)."""
    asked = [k for k in ks if k is not None]
    return max(asked) if asked else None


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax [rows, vocab] fp32 of raw logits (call before anything edits them in place)."""
    return torch.log_softmax(logits.float(), dim=-1)


def scored(lp: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, 1 + 2k] fp32: each row's target logprob, its top-k logprobs (descending) and their ids (fp32
    holds ids below 2**24 exactly)."""
    assert k <= MAX_LOGPROBS and lp.shape[-1] < 1 << 24
    vals, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return torch.cat([lp.gather(1, targets.view(-1, 1)), vals, ids.float()], dim=1)


def ranked(lp: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, 2 + 2k]: scored() and last each target's rank, vLLM's: how many logprobs of its row are >= its
    own (1 = the most likely). The [rows, vocab] bool lives after raw_logprobs' fp32 copy is freed."""
    out = scored(lp, targets, k)
    rank = (lp >= out[:, :1]).sum(dim=1, keepdim=True)
    return torch.cat([out, rank.float()], dim=1)


def prompt_positions(rows, cu: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int, int]]]:
    """For the prefill rows with prompt logprobs: the hidden rows to score (every position of the row, indices
    into the step's tokens), the token each scores (position p scores prompt token p + 1; past the prompt's
    last token, and in a stress row without a request, the row's own ids shifted), and per row (index in
    rows, first prompt position scored, positions that score a prompt token, positions scored).
    NOTE: the positions scored depend on the step alone, never on the request: under --tp every rank runs
    the same LM-head gathers (a TP worker's rows carry no request)."""
    index, targets, spans = [], [], []
    for i, r in enumerate(rows):
        if r.params.prompt_logprobs is None:
            continue
        n = len(r.ids)
        tgt = list(r.ids[1:]) + list(r.ids[:1])
        valid = n
        if r.request is not None:
            prompt = r.request.prompt_ids
            valid = max(min(n, len(prompt) - 1 - r.start), 0)
            tgt[:valid] = prompt[r.start + 1:r.start + 1 + valid]
        index.append(np.arange(cu[i], cu[i] + n, dtype=np.int64))
        targets += tgt
        spans.append((i, r.start + 1, valid, n))
    flat = np.concatenate(index) if index else np.zeros(0, np.int64)
    return flat, np.asarray(targets, dtype=np.int64), spans


def prompt_scores(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                  index: torch.Tensor, targets: torch.Tensor, k: int, chunk: int = PROMPT_CHUNK,
                  log: list | None = None) -> torch.Tensor:
    """ranked() of every indexed hidden row, `chunk` rows of logits at a time. log: each chunk's rows."""
    out = []
    for lo in range(0, index.numel(), chunk):
        logits = compute_logits(hidden[index[lo:lo + chunk]])
        if log is not None:
            log.append(("prompt", logits.shape[0], k))
        out.append(ranked(raw_logprobs(logits), targets[lo:lo + chunk], k))
        del logits
    return torch.cat(out)


def entries(block: torch.Tensor, k: int, ks: Sequence[int | None]) -> list[TokenLogprob | None]:
    """Host rows of scored() [rows, >= 1 + 2k] (k: the batch's top-k) as entries, each cut to its own top-k
    (None: none). Columns to lists at once (the ids as ints): a stress corner's 8,192 prompt rows of 20."""
    first = block[:, 0].tolist()
    vals, ids = block[:, 1:1 + k].tolist(), block[:, 1 + k:1 + 2 * k].long().tolist()
    return [None if want is None else (-1, f, list(zip(i[:want], v[:want])))
            for f, v, i, want in zip(first, vals, ids, ks)]


@dataclass(frozen=True)
class SampledLogprobs:
    """The sampled rows' logprobs on the device until read back: `scores` [rows, 1 + 2k] (scored), k the
    batch's top-k, ks each row's (None: the row asked for none)."""

    scores: torch.Tensor
    k: int
    ks: tuple[int | None, ...]

    def host(self, block: torch.Tensor, tokens: list[int]) -> list[TokenLogprob | None]:
        """Per sampled row, its token's entry (None: the row asked for none), from the scores' host copy."""
        got = entries(block, self.k, self.ks)
        return [None if e is None else (t, *e[1:]) for e, t in zip(got, tokens)]


@dataclass(frozen=True)
class PromptLogprobs:
    """The prefill rows' prompt logprobs on the device until read back: `scores` [prompt positions, 2 + 2k]
    (ranked) with `spans` (prompt_positions), ks each span's top-k, ids the scored prompt tokens in order."""

    scores: torch.Tensor
    k: int
    spans: tuple[tuple[int, int, int, int], ...]
    ks: tuple[int, ...]
    ids: tuple[int, ...]

    def host(self, block: torch.Tensor) -> dict[int, tuple[int, list[PromptTokenLogprob]]]:
        """{index in step.rows: (first prompt position scored, entries)} from scores' host copy."""
        ranks, out, at = block[:, -1].long().tolist(), {}, 0
        for (i, first, valid, n), want in zip(self.spans, self.ks):
            if valid:
                got = entries(block[at:at + valid], self.k, [want] * valid)
                ids = self.ids[at:at + valid]
                out[i] = (first, [(t, *e[1:], r) for e, t, r in zip(got, ids, ranks[at:at + valid])])
            at += n
        return out
