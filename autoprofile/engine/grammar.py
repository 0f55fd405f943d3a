"""Structured output in the engine: a request's grammar matcher (xgrammar.GrammarMatcher, made by the serving
layer: autoprofile.serving.structured) masks the logits of its sampled rows, and advances by the tokens read
back.

    mask = TokenBitmask(rows=env.sampled_rows, vocab_size, device)   # one owner: the Sampler (engine.sampler)
    mask.apply(logits, [(row, matcher), ...])   # before sampling: disallowed tokens' logits = -inf, in place
    advance(matcher, token)                     # Scheduler.resolve, once per token read back: True = ended

The bitmask is [sampled_rows, ceil(vocab / 32)] int32: filled on the host (pinned on CUDA), one copy up,
an in-place kernel over the rows that have a grammar (over all the sampled rows when at least half have
one, the others' rows allowing every token: no index list to copy up; else the rows' indices, from a pinned
buffer; vLLM's order: first, before the logits processors and the sampler, so min_p measures the grammar's
distribution; not inside the sampler kernel). The kernel is ours (kernels.triton_bitmask, xgrammar's
semantics): the stress, and so every boot, masks without `import xgrammar` (it imports transformers).
Several rows are filled in one call on xgrammar's C++ threads (BatchGrammarMatcher, as vLLM and SGLang fill
them; fill_threads: the cores this process may use, at most 8); one row by its matcher's own call. The sampler
masks after the runner has launched the forward: on CUDA the host fills while the GPU computes (the
overlapped engine: after the step before is read back, ModelRunner.launch and LLMEngine.step).
The stress (SamplingMetadata.stress) applies a full-size mask to every sampled row of every corner.

vLLM's allowed_token_ids is a mask row too: AllowedTokens stands where a request's matcher stands (made by the
serving layer; wrapping the request's matcher when it has a grammar too), its row is the ids' bits (ANDed
with the grammar's), so such a row stays inside the envelope the stress covers and is sampled after the step
before is read back, like a grammar's.

A matcher is fed each output token exactly once, where the scheduler writes it into output_ids (a
recomputed, preempted request is not fed again: its matcher already holds its tokens). The host fills the
next mask from the matcher, so the overlapped engine launches a grammar step's forward, reads the step before
back (its tokens advance the matchers), then fills and samples (StepTokens.sample); a row whose request ended
there is not filled (a terminated matcher has no next mask).
"""
from __future__ import annotations

import functools
import logging
import math
import os

import numpy as np
import torch

log = logging.getLogger(__name__)


MAX_FILL_THREADS = 8


def fill_threads() -> int:
    """xgrammar's threads for a batched fill: the cores this process may run on, at most MAX_FILL_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_FILL_THREADS))


def bitmask_width(vocab_size: int) -> int:
    return math.ceil(vocab_size / 32)


def bitmask_bytes(rows: int, vocab_size: int) -> int:
    """Device bytes of the mask (the host copy is pinned host memory)."""
    return rows * bitmask_width(vocab_size) * 4


class TokenBitmask:
    """The per-row token bitmask of the envelope's sampled rows (host + device)."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device):
        self.rows, self.vocab_size, self.device = rows, vocab_size, device
        shape = (rows, bitmask_width(vocab_size))
        self.host = torch.full(shape, -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.dev = self.host if device.type != "cuda" else torch.full(shape, -1, dtype=torch.int32,
                                                                      device=device)
        # the masked rows' indices when few rows have a mask (the host side written again, like the mask's
        # rows, only once the step that read it is read back)
        self.index_host = torch.zeros(rows, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.index_dev = self.index_host if device.type != "cuda" else torch.zeros(rows, dtype=torch.int32,
                                                                                   device=device)
        # NOTE: the host rows are written through numpy views: a torch write of a few rows (index_put_, fill_)
        # enters the intra-op OpenMP pool, whose threads then spin beside the engine loop (on a 16-core H200
        # host, 15 threads at 1.6 s of CPU each in a 6 s JSON-schema run)
        self.host_np, self.index_np = self.host.numpy(), self.index_host.numpy()
        self._batch = None  # xgrammar.BatchGrammarMatcher, made at the first fill of several rows

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, object]]) -> None:
        """Mask logits [sampled rows, vocab] in place at `rows` [(row index, matcher)]; nothing if empty."""
        if not rows:
            return
        self.fill(rows)
        self._apply(logits, [i for i, _ in rows])

    def fill(self, rows: list[tuple[int, object]]) -> None:
        """Write each row's next-token mask into its host row: a matcher's (AllowedTokens: its matcher's, if
        any, then its ids')."""
        index, matchers, allowed = split_rows(rows)
        self._fill_matchers(index, matchers)
        for i, m in allowed:
            m.restrict(self.host[i])

    def _fill_matchers(self, index: list[int], matchers: list) -> None:
        """One row by its matcher's own call, several in one batched call on xgrammar's threads (the same
        bits)."""
        if not matchers:
            return
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(self.host, index[0])
            return
        if self._batch is None:
            import xgrammar
            self._batch = xgrammar.BatchGrammarMatcher(fill_threads())
        self._batch.batch_fill_next_token_bitmask(matchers, self.host, index)

    def apply_stress(self, logits: torch.Tensor) -> None:
        """The stress: a mask on every sampled row (each allows every token but id 0: a real mask's work and
        bytes, the corner's tokens still sampled from the rest of the vocabulary)."""
        n = logits.shape[0]
        self.host_np[:n] = -1
        self.host_np[:n, 0] = -2
        self._apply(logits, list(range(n)))

    def _apply(self, logits: torch.Tensor, index: list[int]) -> None:
        if len(index) > self.rows:
            raise RuntimeError(f"{len(index)} masked rows, the bitmask holds {self.rows}")
        rest = unmasked(index, logits.shape[0])
        if rest is not None:  # most rows masked: the others allow every token, and no index list goes up
            if rest:
                self.host_np[rest] = -1
            index = None
        n = logits.shape[0] if index is None else max(index) + 1
        rows = None
        if index is not None:
            self.index_np[:len(index)] = index
            rows = self.index_dev[:len(index)]
        if self.dev is not self.host:
            # NOTE: the host rows are written again only once this step is read back (LLMEngine.step)
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
            if rows is not None:
                rows.copy_(self.index_host[:len(index)], non_blocking=True)
        mask_logits_(logits, self.dev[:n], self.vocab_size, rows)


def check_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """The shapes xgrammar's apply_token_bitmask_inplace accepts: 2-D logits, int32 words enough for
    vocab_size, vocab_size at most the logits' width."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"logits [rows, V] and an int32 bitmask [rows, words]; got {tuple(logits.shape)}, "
                         f"{tuple(bitmask.shape)} {bitmask.dtype}")
    fits = min(logits.shape[1], bitmask.shape[1] * 32)
    if not 0 < vocab_size <= fits:
        raise ValueError(f"vocab_size {vocab_size} must be in (0, {fits}]: the logits' and the mask's width")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool, True where the token is allowed (bit j % 32 of word
    j // 32)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] != 0


def mask_logits_(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int,
                 index: torch.Tensor | None = None) -> torch.Tensor:
    """logits[i, j] = -inf where bit j of bitmask row i is 0, for the rows `index` names (int32, on the
    logits' device; else every row) and j < vocab_size, in place (xgrammar.apply_token_bitmask_inplace's
    semantics). On CUDA our kernel (kernels.triton_bitmask, imported there: it imports triton); elsewhere
    these torch ops, the kernel's reference."""
    check_bitmask(logits, bitmask, vocab_size)
    if logits.is_cuda:
        return _bitmask_kernel().apply_bitmask_(logits, bitmask, vocab_size, index)
    if index is None:
        logits[:, :vocab_size].masked_fill_(~unpack_bitmask(bitmask[:logits.shape[0]], vocab_size),
                                            float("-inf"))
        return logits
    rows = index.long()
    allowed = unpack_bitmask(bitmask[rows], vocab_size)
    logits[rows, :vocab_size] = logits[rows, :vocab_size].masked_fill(~allowed, float("-inf"))
    return logits


@functools.cache
def _bitmask_kernel():
    """kernels.triton_bitmask, imported at the first CUDA mask (it imports triton; a host without it never
    asks)."""
    from autoprofile.kernels import triton_bitmask
    return triton_bitmask


def compile_ahead(vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """The mask's launches on logits [rows, vocab_size] of `dtype`, for kernels.compile_ahead's `dry` (nothing
    here reads their output): over every row (the stress's, a step where most rows have a grammar) and over
    the rows an index names."""
    logits = torch.zeros(2, vocab_size, dtype=dtype, device=device)
    bits = torch.zeros(2, bitmask_width(vocab_size), dtype=torch.int32, device=device)
    mask_logits_(logits, bits, vocab_size)
    mask_logits_(logits, bits, vocab_size, torch.zeros(1, dtype=torch.int32, device=device))


def split_rows(rows: list[tuple[int, object]]) -> tuple[list[int], list, list[tuple[int, AllowedTokens]]]:
    """(row indices, matchers) that xgrammar fills, in one pass over the step's (row, matcher): an
    AllowedTokens row's own matcher if it has one; and the AllowedTokens rows, restricted after the fill."""
    index, matchers, allowed = [], [], []
    for i, m in rows:
        if isinstance(m, AllowedTokens):
            allowed.append((i, m))
            m = m.matcher
            if m is None:
                continue
        index.append(i)
        matchers.append(m)
    return index, matchers, allowed


def unmasked(index: list[int], n: int) -> list[int] | None:
    """The rows of logits [n, vocab] without a mask when masking every row is cheaper than naming the masked
    ones (at least half masked: one index list less to build and copy up each step; a request that ended
    since the launch leaves its row out), else None (xgrammar masks the named rows alone)."""
    if 2 * len(index) < n:
        return None
    named = set(index)
    return [i for i in range(n) if i not in named]


def allowed_bits(ids: list[int], vocab_size: int) -> torch.Tensor:
    """The bitmask row [ceil(vocab / 32)] int32 that allows exactly `ids` (bit t % 32 of word t // 32)."""
    bits = np.zeros(bitmask_width(vocab_size) * 32, dtype=bool)
    bits[np.asarray(ids, dtype=np.int64)] = True
    return torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4").astype(np.int32))


class AllowedTokens:
    """vLLM's allowed_token_ids in a matcher's place: the sampled token is one of `bits` (allowed_bits) and,
    with a grammar, one its matcher allows (each choice its own: the matcher is the choice's)."""

    def __init__(self, ids: frozenset[int], bits: torch.Tensor, matcher=None):
        self.ids, self.bits, self.matcher = ids, bits, matcher

    @classmethod
    def of(cls, ids: list[int], vocab_size: int, matcher=None) -> AllowedTokens:
        return cls(frozenset(ids), allowed_bits(ids, vocab_size), matcher)

    def restrict(self, row: torch.Tensor) -> None:
        """The host row, filled by the matcher (if any) already: only these ids left."""
        if self.matcher is None:
            row.copy_(self.bits)
        else:
            row.bitwise_and_(self.bits)

    def accept_token(self, token: int) -> bool:
        return token in self.ids and (self.matcher is None or self.matcher.accept_token(token))

    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()


def advance(matcher, token: int) -> bool:
    """Feed a sampled token to a request's matcher; True when its grammar is done (terminated, or the token
    was not one it allows: the request ends rather than go on outside its grammar)."""
    if not matcher.accept_token(token):
        log.warning("a grammar rejected sampled token %d: the request ends", token)
        return True
    return matcher.is_terminated()
