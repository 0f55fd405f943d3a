"""Sampling: greedy, temperature, top-k, top-p, per request, batched, without sorting the vocabulary.

CUDA (float logits, triton importable): every batch with a sampled row is ONE Triton kernel, greedy rows
included (autoprofile.kernels.triton_sample: rejection sampling with inverse-CDF draws, a search over the
logits' bit patterns for top-k and its exact fallback, no sort, no host sync), and rows with a small top-k
(<= triton_sample.K_MAX) its split path (several programs a row in one launch: their candidates merged, the
draw over the top-k alone; a second launch where the batch also has other rows, `_split_mode`); an
all-greedy batch is `greedy`: the split-row argmax (autoprofile.kernels.triton_argmax, several programs a
row: the copy rate at 256 rows, where one program a row is not).
Elsewhere (CPU, no triton) the path is chosen on the host from the batch's parameters (no device read):
- every row greedy: argmax.
- top-k <= PREFILTER on every sampled row: torch.topk of the largest k, the nucleus searched inside them.
- top-p without a top-k: the same prefilter of PREFILTER tokens, exact when its mass reaches top_p; the rows
  whose nucleus is wider are sorted (the path's one host read: see `_pieces`).
- temperature only (no top-k, top_p 1): a race over the whole vocabulary, no sort.
- top_k > PREFILTER, or a batch built without its host parameters: the full sort (the old sampler).
Semantics (all paths, and `top_k_top_p_probs`, the full-sort reference): logits / temperature, top-k, then the
smallest prefix by descending probability whose mass reaches top_p (a token is kept when the mass before it is
<= top_p, so the first token always is; top_p = 1 keeps the whole top-k), renormalised. Ties: which of several
tokens with equal logits is kept at a top-k/top-p boundary is unspecified (as with torch.sort); how many are
kept and their probabilities are exact. Draws (torch paths, the kernel's fallback): exponential race, argmax
over kept tokens of logit/T - log(E), E ~ Exp(1) (= argmax p/E); the kernel: inverse-CDF draws, rejected
until kept. Greedy rows (temperature 0) are argmax of the raw logits whatever the path.
Memory: the torch paths sample CHUNK_ROWS rows at a time and sort SORT_ROWS at a time, so their transient
bytes
are bounded whatever the rows (`sampler_workspace_bytes`, the worst path's bound; the fused kernel's split
path needs `fused_bytes_per_row`, allocated for a batch with a small top-k row); the profiler's stress samples
with STRESS_PARAMS, the torch paths' worst cases (STRESS has a larger top-k: the stress allocates the split
path's workspace and launches its kernel for it, `_split_mode`'s "reserve").
Seeds: a seeded request draws from its own SeedStream, a host PRNG (random.Random of its seed) that gives one
Philox seed a sampled token: the fused kernel takes one seed per row (the unseeded rows' drawn on the device
from the engine's generator, the seeded rows' written over them in one upload from the runner's pinned
Staging: no kernel per seeded row; at 256 seeded rows the two kernels a row that a device generator per
request took cost an H200 host 7.2 ms a decode step; a stress corner uploads every row's seed, `_seeded`); the
torch paths sample such a row alone (~15 small kernels per seeded row) from a generator
seeded with its draw. Either way its tokens depend only on its logits, its parameters, its seed and how many
tokens it has drawn, never on the rest of the batch.
"""
from __future__ import annotations

import functools
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from autoprofile.engine.sampling_params import (  # noqa: F401 - re-exported
    GREEDY, MAX_LOGPROBS, PREFILTER, PROCESSORS, STRESS, STRESS_PARAMS, STRESS_WIDE, SamplingParams)
from autoprofile.engine.step_inputs import Staging, upload_array

CHUNK_ROWS = 128  # rows sampled at a time
SORT_ROWS = 64  # rows sorted at a time: chosen so that the sort path is the memory worst case
PROCESS_ROWS = 64  # rows the logits processors take at a time (logits_process): bounded transients
FUSED_ROWS = 1024  # rows the fused sampler's split path takes at a time (triton_sample.SPLIT_ROWS)
_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # logits the one-kernel sampler takes
SEED_HIGH = 2**63 - 1  # Philox seeds are drawn in [0, SEED_HIGH)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row parameters as device tensors (temperatures [B] fp32, top_ps [B] fp32, top_ks [B] int64) and on
    the host (`params`, which picks the sampler's path; None = unknown: the full sort)."""

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    params: tuple[SamplingParams, ...] | None = None

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device) -> SamplingBatch:
        """One non-blocking copy from pinned memory (three pageable copies each waited for the stream: on
        the decode hot path, for the step's forward). fp64 holds each float and top_k exactly."""
        host = torch.tensor([[p.temperature for p in params], [p.top_p for p in params],
                             [p.top_k for p in params]], dtype=torch.float64,
                            pin_memory=device.type == "cuda")
        dev = host.to(device, non_blocking=True)
        return cls(dev[0].float(), dev[1].float(), dev[2].long(), tuple(params))

    def __len__(self) -> int:
        return self.temperatures.numel()

    @property
    def all_greedy(self) -> bool:
        return self.params is not None and all(p.temperature == 0 for p in self.params)

    def rows(self, start: int, end: int) -> SamplingBatch:
        return SamplingBatch(self.temperatures[start:end], self.top_ps[start:end], self.top_ks[start:end],
                             None if self.params is None else self.params[start:end])

    def take(self, index: torch.Tensor) -> SamplingBatch:
        """Rows picked by a device index (host parameters dropped)."""
        return SamplingBatch(self.temperatures[index], self.top_ps[index], self.top_ks[index])


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed % 2**64)


class SeedStream:
    """A seeded request's draws: one Philox seed [0, SEED_HIGH) a sampled token, from its own host PRNG (the
    same seed, the same draws; it advances once per sampled token, preemptions included)."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed % 2**64)  # a negative seed is its own stream (random takes |seed|)

    def draw(self) -> int:
        return self._rng.randrange(SEED_HIGH)


def request_generator(params: SamplingParams) -> SeedStream | None:
    """The SeedStream a seeded request keeps across its steps (None: it draws from the engine's generator)."""
    return None if params.seed is None else SeedStream(params.seed)


# ---------------------------------------------------------------- declared memory
def sort_bytes_per_row(vocab_size: int, dtype_bytes: int) -> int:
    """Sort path, per row: the gathered row, the sorted copy and torch's sort scratch (keys: 2 * dtype,
    int64 ids: 3 * 8, the output included), then fp32 logits / T, softmax/cumsum, noise; + a margin.
    Measured on an H200 (bf16, vocab 128,256, 64 rows sorted at a time): 40.3 bytes per logit at the
    worst (prefilter + fallback sort); 38 were declared and fell short, so 46 (3 * 2 + 40)."""
    return vocab_size * (3 * dtype_bytes + 40)


def fast_bytes_per_row(vocab_size: int) -> int:
    """Prefilter and whole-vocabulary race, per row: fp32 logits/T + fp32 noise over the vocabulary, plus the
    prefilter's values, int64 ids, masks, cumsum and noise (48 bytes per prefiltered token)."""
    return 8 * vocab_size + 48 * PREFILTER


def process_bytes_per_row(vocab_size: int) -> int:
    """The logits processors (autoprofile.engine.logits_process), per row, PROCESS_ROWS at a time: the fp32
    row, the int32 counts, the repetition factor, where's two operands and its result, the frequency and
    presence terms (8 x 4 bytes a logit), and 4 bool masks, + a margin (measured:
    tests/test_sampling_gpu.py)."""
    return vocab_size * (9 * 4 + 4)


def fused_bytes_per_row(vocab_size: int) -> int:
    """The one-kernel sampler (CUDA), per row, FUSED_ROWS at a time: its split path's workspace
    (autoprofile.kernels.triton_sample.workspace_bytes: a slot of 256 int64 keys a program, a program per
    8,192 logits; unit_tests/test_triton_sample_topk.py holds it under this bound), a quarter byte a logit +
    2 KiB; the token, seed and bounds (and a seeded row's index and seed going up) are the 64 bytes a row of
    `sampler_workspace_bytes`."""
    return vocab_size // 4 + 2048


def sampler_workspace_bytes(rows: int, vocab_size: int, dtype_bytes: int = 4) -> int:
    """Worst-case transient bytes of one step's processors then sample() call over `rows` rows of
    `dtype_bytes` logits (the logits themselves excluded): bounded by CHUNK_ROWS / SORT_ROWS / PROCESS_ROWS /
    FUSED_ROWS rows whatever `rows` (the processors' transients are freed before the sampler runs), + 64
    bytes per row of outputs."""
    return (max(min(rows, SORT_ROWS) * sort_bytes_per_row(vocab_size, dtype_bytes),
                min(rows, CHUNK_ROWS) * fast_bytes_per_row(vocab_size),
                min(rows, PROCESS_ROWS) * process_bytes_per_row(vocab_size),
                min(rows, FUSED_ROWS) * fused_bytes_per_row(vocab_size)) + 64 * rows)


def sampler_bytes_per_row(vocab_size: int, dtype_bytes: int = 4) -> int:
    """Per sampled row, an upper bound at any number of rows: workspace(rows) <= rows * this."""
    return max(sort_bytes_per_row(vocab_size, dtype_bytes), fast_bytes_per_row(vocab_size),
               process_bytes_per_row(vocab_size), fused_bytes_per_row(vocab_size)) + 64


# ---------------------------------------------------------------- reference (the full sort)
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


def reference_sample(logits: torch.Tensor, batch: SamplingBatch,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """The previous sampler (full sort of every row): the baseline of tests and benchmarks."""
    greedy = logits.argmax(dim=-1)
    probs, ids = top_k_top_p_probs(logits, batch)
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-20)  # 0/0 would be NaN
    drawn = ids.gather(1, (probs / race).argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(batch.temperatures > 0, drawn, greedy)


# ---------------------------------------------------------------- the sampler
def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Token ids [B] int64 of an all-greedy batch (the sampler's and the engine's): torch.argmax(dim=-1), the
    first index of each row's max; on the kernels' logits (`_kernel_logits`) the split-row Triton argmax
    (autoprofile.kernels.triton_argmax: the same ids at the copy rate), else torch's."""
    argmax = _triton_argmax() if _kernel_logits(logits) else None
    return logits.argmax(dim=-1) if argmax is None else argmax.argmax(logits)


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None,
           row_generators: Sequence[SeedStream | None] | None = None,
           stress: bool = False, staging: Staging | None = None) -> torch.Tensor:
    """Token ids [B] (int64): argmax where temperature == 0, else a draw from the top-k/top-p distribution.
    Row i draws from row_generators[i] when given (its own seed stream: batch-invariant), else from
    `generator`.
    stress: a stress corner's rows (the fused sampler's split path reserved: `_split_mode`; every row's seed
    uploaded as a seeded row's: `_seeded`; the greedy argmax's kept scratch allocated: so that the probe's
    peak holds them). staging: the runner's pinned buffers, the seeded rows' seeds go up from them."""
    rows = logits.shape[0]
    argmax = _triton_argmax() if stress and _kernel_logits(logits) else None
    if argmax is not None:
        argmax.scratch(logits.device)
    if batch.all_greedy:
        return greedy(logits)
    if row_generators is not None and len(row_generators) != rows:
        raise ValueError(f"{len(row_generators)} row generators for {rows} rows")
    seeded = [i for i, g in enumerate(row_generators or ()) if g is not None]
    fused = _fused(logits)
    if fused is not None:
        seeds = _seeds(rows, logits.device, generator, _seeded(row_generators, rows, stress), staging)
        return fused.sample_batch(logits, batch.temperatures, batch.top_ps, batch.top_ks, seeds,
                                  split=_split_mode(batch.params, logits.shape[-1], fused.K_MAX, stress))
    if len(seeded) == rows:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    elif rows <= CHUNK_ROWS:
        out = _sample_chunk(logits, batch, generator)
    else:
        out = torch.cat([_sample_chunk(logits[lo:lo + CHUNK_ROWS], batch.rows(lo, lo + CHUNK_ROWS), generator)
                         for lo in range(0, rows, CHUNK_ROWS)])
    for i in seeded:
        own = make_generator(row_generators[i].draw(), logits.device)
        out[i] = _sample_chunk(logits[i:i + 1], batch.rows(i, i + 1), own)[0]
    return out


def compile_ahead(vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """The sampler's Triton launches for logits [rows, vocab] of `dtype`, for kernels.compile_ahead's `dry`
    (their outputs are never written, nothing here reads them): the fused sampler in each `_split_mode` a
    step takes (a stress corner's "reserve" and "none", a top-k batch's "all" and "some") and the greedy
    argmax. Specialized as the steps' launches are: unit-stride rows of `vocab` logits, fresh tensors."""
    logits = torch.zeros(2, vocab, dtype=dtype, device=device)
    generator = make_generator(0, device)
    top_k, top_p = SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=1.0, top_p=0.9)
    for params, stress in (((STRESS, STRESS), True), ((STRESS_WIDE, STRESS_WIDE), True),
                           ((top_k, top_k), False), ((top_k, top_p), False)):
        sample(logits, SamplingBatch.from_params(params, device), generator, stress=stress)
    greedy(logits)


def kept_probs(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [B, V] fp32, kept [B, V] bool): the distribution sample() draws each row from and its kept set,
    through the same path (greedy rows: unspecified, sample() gives their argmax). For tests: [B, V] dense."""
    fused = _fused(logits)
    if fused is not None:
        zeros = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        split = _split_mode(batch.params, logits.shape[-1], fused.K_MAX)
        _, bounds = fused.sample_batch(logits, batch.temperatures, batch.top_ps, batch.top_ks, zeros,
                                       bounds=True, split=split)
        x = logits.float()
        n, least = bounds[:, 0].long(), bounds[:, 1].unsqueeze(1)
        above, at = x > least, x == least
        kept = above | (at & (at.cumsum(dim=-1) <= (n - above.sum(dim=-1)).unsqueeze(1)))  # the first ties
        z = (x / batch.temperatures.clamp_min(1e-5).unsqueeze(1)).masked_fill_(~kept, float("-inf"))
        return z.softmax(dim=-1), kept
    assert logits.shape[0] <= CHUNK_ROWS
    dense = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    kept = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    for rows, z, ids in _pieces(logits, batch):
        part, mask = z.softmax(dim=-1), z > float("-inf")
        if ids is not None:
            part = torch.zeros_like(dense[: len(part)]).scatter_(1, ids, part)
            mask = torch.zeros_like(kept[: len(mask)]).scatter_(1, ids, mask)
        if isinstance(rows, torch.Tensor) and rows.dtype == torch.bool:
            dense = torch.where(rows.unsqueeze(1), part, dense)
            kept = torch.where(rows.unsqueeze(1), mask, kept)
        else:
            dense[rows], kept[rows] = part, mask
    return dense, kept


@dataclass(frozen=True)
class _Plan:
    sort: bool = False  # the full sort for every row
    prefilter: int = 0  # width of the torch.topk prefilter (0: none)
    whole_vocab: bool = False  # a sampled row has neither top-k nor top-p: a race over the whole vocabulary
    nucleus: bool = False  # a sampled row has top-p, no top-k: its nucleus may outgrow the prefilter


def _plan(params: tuple[SamplingParams, ...] | None, vocab: int) -> _Plan:
    if params is None:
        return _Plan(sort=True)
    sampled = [p for p in params if p.temperature > 0]
    ks = [p.top_k if p.top_k < vocab else 0 for p in sampled]  # top_k >= vocab: no top-k
    if vocab <= PREFILTER:
        return _Plan(prefilter=vocab)
    if any(k > PREFILTER for k in ks):
        return _Plan(sort=True)
    nucleus = any(k == 0 and _as_f32(p.top_p) < 1 for k, p in zip(ks, sampled))
    whole_vocab = any(k == 0 and _as_f32(p.top_p) >= 1 for k, p in zip(ks, sampled))
    return _Plan(prefilter=max([k for k in ks if k] + [PREFILTER] * nucleus, default=0),
                 whole_vocab=whole_vocab, nucleus=nucleus)


def _as_f32(x: float) -> float:
    """x as the device sees it (SamplingBatch holds fp32): a top_p of 0.9999999999999999 is 1.0 there, so the
    host's plan must read it as 1 too (else it planned a nucleus search the device skipped)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _sample_chunk(x: torch.Tensor, b: SamplingBatch, generator: torch.Generator | None) -> torch.Tensor:
    if b.all_greedy:
        return x.argmax(dim=-1)
    # every row sampled (known on the host): no argmax pass over the vocabulary; the pieces cover every row
    none_greedy = b.params is not None and all(p.temperature > 0 for p in b.params)
    greedy = None if none_greedy else x.argmax(dim=-1)
    tok = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device) if none_greedy else greedy.clone()
    for rows, z, ids in _pieces(x, b):
        col = _race(z, generator)
        drawn = col if ids is None else ids.gather(1, col.unsqueeze(1)).squeeze(1)
        del z, ids
        if isinstance(rows, slice):
            tok[rows] = drawn
        elif rows.dtype == torch.bool:
            tok = torch.where(rows, drawn, tok)
        else:
            tok.index_copy_(0, rows, drawn)
    return tok if greedy is None else torch.where(b.temperatures > 0, tok, greedy)


def _pieces(x: torch.Tensor, b: SamplingBatch):
    """Yields (rows, z, ids) covering every row, later pieces overriding earlier ones. rows: a slice or an
    index (z holds those rows in that order) or a bool mask (z holds every row, only the masked ones take it).
    z [n, W]: fp32 logits / T, -inf outside the kept set; ids [n, W]: their token ids (None: the whole
    vocabulary in order). A generator, so that each piece's memory is freed before the next."""
    vocab = x.shape[-1]
    plan = _plan(b.params, vocab)
    if plan.sort:
        yield from _sort_rows(x, b, torch.arange(x.shape[0], device=x.device))
        return
    no_top_k = (b.top_ks <= 0) | (b.top_ks >= vocab)
    wider = None
    if plan.prefilter:
        z, ids, wider = _prefilter(x, b, plan.prefilter, plan.nucleus)
        yield slice(None), z, ids
        del z, ids
    if plan.whole_vocab:
        yield no_top_k & (b.top_ps >= 1), x / b.temperatures.clamp_min(1e-5).unsqueeze(1), None
    if plan.nucleus:
        # NOTE: the sampler's one host read (nonzero: a sync), only for batches with top-p rows without top-k.
        # Avoiding it means sorting every such row (the old cost) or a custom kernel (FlashInfer-style).
        yield from _sort_rows(x, b, wider.nonzero().squeeze(1))


def _sort_rows(x: torch.Tensor, b: SamplingBatch, index: torch.Tensor):
    """Pieces of the rows `index` through the full sort, SORT_ROWS at a time (gathered: one copy each)."""
    for lo in range(0, index.numel(), SORT_ROWS):
        rows = index[lo:lo + SORT_ROWS]
        yield rows, *_sorted(x[rows], b.take(rows))


def _prefilter(x: torch.Tensor, b: SamplingBatch, width: int, whole_mass: bool):
    """(z, ids, wider): the `width` largest logits of each row, z = logit / T with -inf outside the row's
    top-k and nucleus; wider [B] bool: the row's nucleus reaches past the prefilter (z is not its answer)."""
    vocab = x.shape[-1]
    temps = b.temperatures.clamp_min(1e-5).unsqueeze(1)
    vals, ids = x.topk(width, dim=-1)  # sorted: the order of logit / T too (T > 0)
    z = vals.float().div_(temps) if vals.dtype != torch.float32 else vals.div_(temps)
    del vals
    k = torch.where(b.top_ks > 0, b.top_ks, vocab).clamp(max=vocab)
    rank = torch.arange(width, device=x.device)
    z.masked_fill_(rank >= k.unsqueeze(1), float("-inf"))
    inside = k <= width
    lse = z.logsumexp(dim=-1)
    if whole_mass:  # rows without top-k: their probabilities are over the whole vocabulary
        lse = torch.where(inside, lse, _scaled_logsumexp(x, temps))
    top_p = torch.where(b.top_ps >= 1, float("inf"), b.top_ps).unsqueeze(1)  # 1: the whole top-k, no rounding
    mass = (z - lse.unsqueeze(1)).exp_().cumsum_(dim=-1)  # mass up to and including each rank
    n = 1 + (mass[:, :-1] <= top_p).sum(dim=-1)  # kept while the mass before the token is <= top_p
    wider = ~inside & (b.top_ps < 1) & (b.temperatures > 0) & (mass[:, -1:] <= top_p).squeeze(1)
    z.masked_fill_(rank >= n.unsqueeze(1), float("-inf"))
    return z, ids, wider


def _scaled_logsumexp(x: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """log sum exp(x / T) per row: the max of the raw logits, then one fp32 tensor x/T - max/T, exp'd in
    place."""
    inv = temps.reciprocal()
    shift = x.amax(dim=-1, keepdim=True).float() * inv
    return torch.addcmul(-shift, x, inv).exp_().sum(dim=-1).log_().add_(shift.squeeze(1))


def _kernel_logits(logits: torch.Tensor) -> bool:
    """Logits the Triton kernels take: CUDA, a float dtype, unit stride in the vocabulary."""
    return logits.is_cuda and logits.stride(-1) == 1 and logits.dtype in _FUSED_DTYPES


def _fused(logits: torch.Tensor):
    """The one-kernel sampler's module (autoprofile.kernels.triton_sample) where it applies: `_kernel_logits`,
    triton importable; else None (the torch paths)."""
    return _triton_sampler() if _kernel_logits(logits) else None


def _split_mode(params: tuple[SamplingParams, ...] | None, vocab: int, k_max: int,
                stress: bool = False) -> str:
    """The fused sampler's `split` for a batch, from its host parameters (None: unknown, "some"): "all" when
    every row is sampled with 0 < top_k <= k_max (and < vocab: a top-k), "some" when some are, else, in a
    stress corner whose sampled rows have a larger top-k (STRESS's), "reserve" (the split path's workspace
    measured, its kernel compiled and launched: what a batch with such a row could take), else "none"."""
    if params is None:
        return "some"
    ks = [p.top_k for p in params if p.temperature > 0 and 0 < p.top_k < vocab]
    small = sum(k <= k_max for k in ks)
    if small:
        return "all" if small == len(params) else "some"
    return "reserve" if ks and stress else "none"


@functools.cache
def _triton_argmax():
    try:
        from autoprofile.kernels import triton_argmax
    except ImportError:  # no triton: torch.argmax
        return None
    return triton_argmax


@functools.cache
def _triton_sampler():
    try:
        from autoprofile.kernels import triton_sample
    except ImportError:  # no triton: the torch paths
        return None
    return triton_sample


def _seeded(row_generators: Sequence[SeedStream | None] | None, rows: int,
            stress: bool) -> list[tuple[int, SeedStream]]:
    """The fused sampler's (row, seed stream) pairs: the rows with their own stream; in a stress corner every
    row, from one stream (the largest upload of seeds, in the probe's peak; its draws are any)."""
    if stress:
        stream = SeedStream(0)
        return [(i, stream) for i in range(rows)]
    return [(i, g) for i, g in enumerate(row_generators or ()) if g is not None]


def _seeds(rows: int, device: torch.device, generator: torch.Generator | None,
           seeded: Sequence[tuple[int, SeedStream]], staging: Staging | None = None) -> torch.Tensor:
    """One Philox seed per row: drawn on the device from `generator` (None: torch's default), and for a
    seeded row its stream's draw (its tokens never depend on the rest of the batch), the seeded rows' (index,
    seed) pairs in one upload (from `staging`'s pinned buffers) and one indexed write, whatever their
    number."""
    seeds = torch.randint(SEED_HIGH, (rows,), generator=generator, device=device)
    if seeded:
        pairs = np.array([[i for i, _ in seeded], [s.draw() for _, s in seeded]], dtype=np.int64)
        own = upload_array(pairs.reshape(-1), device, staging).view(2, -1)
        seeds[own[0]] = own[1]
    return seeds


def _sorted(x: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, ids) over the whole vocabulary by descending logit: the reference's semantics, in less memory."""
    vocab = x.shape[-1]
    vals, ids = x.sort(dim=-1, descending=True)
    temps = b.temperatures.clamp_min(1e-5).unsqueeze(1)
    z = vals.float().div_(temps) if vals.dtype != torch.float32 else vals.div_(temps)
    del vals
    k = torch.where(b.top_ks > 0, b.top_ks, vocab).clamp(max=vocab).unsqueeze(1)
    rank = torch.arange(vocab, device=x.device)
    z.masked_fill_(rank >= k, float("-inf"))
    top_p = torch.where(b.top_ps >= 1, float("inf"), b.top_ps).unsqueeze(1)
    mass = z.softmax(dim=-1).cumsum_(dim=-1)
    n = 1 + (mass[:, :-1] <= top_p).sum(dim=-1, keepdim=True)
    del mass
    return z.masked_fill_(rank >= n, float("-inf")), ids


def _race(z: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Column of the exponential race's winner per row (consumes z): argmax z - log E, E ~ Exp(1)."""
    noise = torch.empty_like(z).exponential_(generator=generator).clamp_min_(1e-20).log_()  # log 0: NaN below
    return z.sub_(noise).argmax(dim=-1)
