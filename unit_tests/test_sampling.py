"""The sampler on CPU: greedy, the top-k / top-p paths against the full-sort reference, the drawn
distribution, per-request seeds, and the declared transient memory (measured with torch.profiler's CPU
allocator events).

Tie rule under test: at a top-k/top-p boundary the sampler keeps some n tokens holding the n largest logits
(which of several equal logits is unspecified, as with torch.sort); n and the probabilities are the
reference's.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from autoprofile.engine.sampling import (
    CHUNK_ROWS, PREFILTER, SEED_HIGH, SORT_ROWS, STRESS, SamplingBatch, SamplingParams, kept_probs,
    reference_sample, request_generator, sample, sampler_bytes_per_row,
    sampler_workspace_bytes, top_k_top_p_probs)

CPU = torch.device("cpu")


def _batch(params) -> SamplingBatch:
    return SamplingBatch.from_params(list(params), CPU)


def _same(n: int, **kw) -> SamplingBatch:
    return _batch([SamplingParams(**kw)] * n)


def _logits(rows: int, vocab: int, scale: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# ---------------------------------------------------------------- greedy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_and_top_k_1_is_greedy(dtype):
    logits = _logits(64, 3000, 2.0, 0, dtype)
    gen = torch.Generator().manual_seed(1)
    argmax = logits.float().argmax(-1)
    assert _same(64).all_greedy
    assert torch.equal(sample(logits, _same(64), gen), argmax)
    assert torch.equal(reference_sample(logits, _same(64), gen), argmax)
    for batch in (_same(64, temperature=1.5, top_k=1), _same(64, temperature=1.0, top_p=1e-6)):
        out = sample(logits, batch, gen)
        top = logits.gather(1, out.unsqueeze(1)).squeeze(1)
        assert torch.equal(top, logits.max(-1).values)  # a top token
        if dtype == torch.float32:  # no ties among fp32 randn: the argmax itself
            assert torch.equal(out, argmax)


def test_greedy_rows_of_a_mixed_batch_are_exact_argmax():
    logits = _logits(6, 3000, 0.05, 2)  # flat: a sampled greedy row would differ from argmax
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(top_p=0.5),
              SamplingParams(temperature=1.0), SamplingParams(top_k=7),
              SamplingParams(temperature=0.9, top_k=2000)]
    for perm in ([0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]):
        out = sample(logits[perm], _batch(params[i] for i in perm), torch.Generator().manual_seed(3))
        for row, i in enumerate(perm):
            if params[i].temperature == 0:
                assert out[row] == logits[i].argmax()


def test_a_top_p_that_rounds_to_1_in_fp32_keeps_the_whole_vocabulary():
    """0.9999999999999999 is 1.0 in the fp32 batch: the host's plan and the device agree (whole top-k), which
    hypothesis once found them not to (the plan searched a 1024-token nucleus the device then skipped)."""
    logits = _logits(1, 3000, 0.05, 7)
    p = SamplingParams(temperature=0.5, top_p=0.9999999999999999)
    dense, kept = kept_probs(logits, _batch([p]))
    assert int(kept.sum()) == 3000


# ---------------------------------------------------------------- kept set and probabilities vs the reference
def _ideal(z: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, callable]:
    """Float64 sorted probabilities of one row's top-k (logits / T given as fp32 z) and n(p): how many the
    reference keeps at top_p."""
    vocab = z.numel()
    k = top_k if 0 < top_k < vocab else vocab
    q = z.double().sort(descending=True).values[:k].softmax(-1)
    before = q.cumsum(-1) - q

    def n(p: float) -> int:
        return k if p >= 1 else int((before <= p).sum())

    return q, n


def _check_row(dense: torch.Tensor, kept: torch.Tensor, logits: torch.Tensor, p: SamplingParams,
               eps: float = 1e-4) -> int:
    """dense, kept: a sampler's distribution and kept set for one row. Returns the kept count."""
    z = logits.float() / max(p.temperature, 1e-5)
    q, n = _ideal(z, p.top_k, p.top_p)
    count = int(kept.sum())
    # the count may differ from the reference only when top_p is within float rounding of a prefix mass
    assert n(p.top_p - eps) <= count <= n(p.top_p + eps), (count, n(p.top_p))
    # tie rule: the kept tokens hold the `count` largest logits
    boundary = z.sort(descending=True).values[count - 1]
    assert (z[kept] >= boundary).all() and (z[~kept] <= boundary).all()
    # probabilities: the top `count` of the top-k distribution, renormalised; nothing outside the kept set
    want = q[:count] / q[:count].sum()
    got = dense[kept].double().sort(descending=True).values
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()
    assert (dense[~kept] == 0).all()
    return count


TOP_KS = [0, 1, 5, 50, PREFILTER, PREFILTER + 1, 5000]


@st.composite
def cases(draw):
    vocab = draw(st.sampled_from([7, 64, PREFILTER + 200, 3000]))
    rows = draw(st.integers(1, 5))
    params = [SamplingParams(temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 1.7])),
                             top_p=draw(st.one_of(st.sampled_from([1.0, 0.9, 0.5]),
                                                  st.floats(0.01, 1.0, allow_subnormal=False))),
                             top_k=draw(st.sampled_from(TOP_KS + [vocab, vocab - 1])))
              for _ in range(rows)]
    scale = draw(st.sampled_from([0.05, 1.0, 3.0, 8.0]))  # flat (the nucleus passes the prefilter) .. peaked
    grid = draw(st.sampled_from([0.0, 0.5]))  # > 0: logits rounded to a grid, many ties
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    logits = _logits(rows, vocab, scale, draw(st.integers(0, 2**31 - 1)))
    if grid:
        logits = (logits / grid).round() * grid
    return logits.to(dtype), params


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_kept_set_and_probabilities_match_the_reference(case):
    logits, params = case
    batch = _batch(params)
    dense, kept = kept_probs(logits, batch)
    probs, ids = top_k_top_p_probs(logits, batch)
    ref = torch.zeros_like(dense).scatter_(1, ids, probs)
    ref /= ref.sum(-1, keepdim=True)
    drawn = sample(logits, batch, torch.Generator().manual_seed(0))
    for i, p in enumerate(params):
        if p.temperature == 0:
            assert drawn[i] == logits[i].argmax()
            continue
        count = _check_row(dense[i], kept[i], logits[i], p)
        _, n = _ideal(logits[i].float() / max(p.temperature, 1e-5), p.top_k, p.top_p)
        if n(p.top_p - 1e-4) == n(p.top_p + 1e-4):  # not at a rounding boundary: the reference agrees
            assert count == n(p.top_p)
            assert torch.allclose(dense[i].sort().values, ref[i].sort().values, atol=1e-5)
        assert kept[i, drawn[i]]


def test_paths_are_exercised():
    """The hypothesis cases reach each path: prefilter exact, prefilter too narrow (sort fallback), whole
    vocab, full sort; checked here on fixed inputs so that a refactor cannot silently drop one."""
    import autoprofile.engine.sampling as s

    vocab = 3000
    assert s._plan(_same(2, temperature=1.0, top_k=50).params, vocab) == s._Plan(prefilter=50)
    assert s._plan(_same(2, temperature=1.0, top_p=0.9).params, vocab) == \
        s._Plan(prefilter=PREFILTER, nucleus=True)
    assert s._plan(_same(2, temperature=1.0).params, vocab) == s._Plan(whole_vocab=True)
    assert s._plan(_same(2, temperature=1.0, top_k=PREFILTER + 1).params, vocab) == s._Plan(sort=True)
    assert s._plan(_same(2, temperature=1.0, top_k=vocab).params, vocab) == s._Plan(whole_vocab=True)
    assert s._plan(None, vocab) == s._Plan(sort=True)
    flat, peaked = _logits(3, vocab, 0.05, 5), _logits(3, vocab, 8.0, 5)
    b = _same(3, temperature=1.0, top_p=0.9)
    assert s._prefilter(flat, b, PREFILTER, True)[2].all()
    assert not s._prefilter(peaked, b, PREFILTER, True)[2].any()


# ---------------------------------------------------------------- the drawn distribution
def _chi2_critical(df: int, z: float = 5.0) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at the normal z (5.0: p ~ 3e-7)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(tokens: torch.Tensor, expected: torch.Tensor, bins: int = 24) -> tuple[float, float]:
    """(statistic, critical) of the draws against `expected` [V] (sums to 1), cells grouped by descending
    expected probability into `bins` groups of similar mass; a draw where expected is 0 fails outright."""
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    if counts[expected == 0].sum() > 0:
        return math.inf, 0.0
    order = expected.sort(descending=True).indices
    order = order[expected[order] > 0]
    cell = (expected[order].cumsum(0) * bins).ceil().clamp(1, bins).long() - 1  # cell per token by mass
    exp = torch.zeros(bins, dtype=torch.float64).index_add_(0, cell, expected[order].double())
    exp *= tokens.numel()
    obs = torch.zeros(bins, dtype=torch.float64).index_add_(0, cell, counts[order])
    used = exp > 0
    stat = float(((obs - exp)[used] ** 2 / exp[used]).sum())
    return stat, _chi2_critical(int(used.sum()) - 1)


def _expected(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    probs, ids = top_k_top_p_probs(logits.unsqueeze(0).double(), _batch([p]))
    out = torch.zeros(logits.numel(), dtype=torch.float64).scatter_(0, ids[0], probs[0].double())
    return out / out.sum()


DRAWS = 12000
VOCAB = 3000
STEEP = torch.cat([torch.tensor([4.0, 3.6, 3.1, 3.0, 2.2, 1.5, 1.0, 0.4]), torch.full((VOCAB - 8,), -4.0)])
SLOPE = torch.linspace(2.0, 0.0, VOCAB)  # flat: the nucleus at 0.5 holds ~1300 tokens, past the prefilter


@pytest.mark.parametrize("logits,params", [
    (STEEP, SamplingParams(temperature=0.8, top_p=0.9)),  # prefilter top-p
    (STEEP, SamplingParams(temperature=1.3, top_k=5, top_p=0.8)),  # top-k + top-p
    (STEEP, SamplingParams(temperature=1.0)),  # whole vocabulary race
    (SLOPE, SamplingParams(temperature=1.0, top_p=0.5)),  # nucleus wider than the prefilter: sort fallback
    (SLOPE, SamplingParams(temperature=0.7, top_k=PREFILTER + 500)),  # full sort
], ids=["top_p", "top_k_top_p", "temperature", "wide_nucleus", "sort"])
def test_draws_follow_the_reference_distribution_and_a_wrong_one_fails(logits, params):
    batch = _batch([params] * DRAWS)
    expected = _expected(logits, params)
    tokens = sample(logits.expand(DRAWS, -1), batch, torch.Generator().manual_seed(11))
    stat, critical = _chi2(tokens, expected)
    assert stat < critical, (stat, critical)
    # the same test rejects a distribution 25% off in temperature, and the old sampler with top_p on/off
    off = SamplingParams(temperature=params.temperature * 1.25, top_p=params.top_p, top_k=params.top_k)
    stat, critical = _chi2(tokens, _expected(logits, off))
    assert stat > critical, (stat, critical)
    wrong = SamplingParams(temperature=params.temperature, top_p=1.0 if params.top_p < 1 else 0.9,
                           top_k=params.top_k)
    drawn = reference_sample(logits.expand(DRAWS, -1), _batch([wrong] * DRAWS),
                             torch.Generator().manual_seed(12))
    stat, critical = _chi2(drawn, expected)
    assert stat > critical, (stat, critical)


# ---------------------------------------------------------------- per-request seeds
def test_seeded_rows_are_batch_invariant():
    vocab = 3000
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    row = _logits(1, vocab, 2.0, 21)

    def run(others: list[SamplingParams], at: int, steps: int = 4) -> list[int]:
        params = others[:at] + [target] + others[at:]
        logits = _logits(len(params), vocab, 0.5, 22)
        logits[at] = row[0]
        gens = [request_generator(p) for p in params]
        shared = torch.Generator().manual_seed(len(params))
        return [int(sample(logits, _batch(params), shared, gens)[at]) for _ in range(steps)]

    alone = run([], 0)
    assert len(set(alone)) > 1  # it really samples
    assert run([SamplingParams()] * 3, 2) == alone  # greedy neighbours (fast path off: one row samples)
    assert run([SamplingParams(temperature=1.0, top_k=PREFILTER + 7)] * 5, 1) == alone  # sort plan
    assert run([SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.3, seed=9)], 1) \
        == alone
    many = [SamplingParams(temperature=1.0, top_k=3)] * (CHUNK_ROWS + 3)
    assert run(many, CHUNK_ROWS + 1) == alone  # in the second chunk


def test_the_fused_samplers_seeds_are_each_seeded_rows_own_draws():
    """The fused sampler's Philox seed per row (CUDA; the same code on the CPU here): a seeded row's is its
    stream's next draw wherever it sits and whatever else the batch holds; every other row's comes from the
    shared generator, as it would without seeded rows."""
    from autoprofile.engine.sampling import SeedStream, _seeds

    def run(rows: int, at: int) -> tuple[list[int], torch.Tensor]:
        mine, other = SeedStream(42), SeedStream(7)
        shared = torch.Generator().manual_seed(rows)
        out = [_seeds(rows, CPU, shared, [(at, mine), ((at + 1) % rows, other)]) for _ in range(3)]
        plain = torch.randint(SEED_HIGH, (rows,), generator=torch.Generator().manual_seed(rows))
        return [int(o[at]) for o in out], out[0], plain

    want = [s.draw() for s in [SeedStream(42)] for _ in range(3)]
    for rows, at in ((2, 0), (9, 5), (300, 299)):
        mine, first, plain = run(rows, at)
        assert mine == want
        rest = [i for i in range(rows) if i not in (at, (at + 1) % rows)]
        assert torch.equal(first[rest], plain[rest])


def test_a_stress_corner_uploads_a_seed_for_every_row():
    """The fused sampler's seeded rows (`_seeded`): those with their own stream; in a stress corner every row,
    so that the largest upload of seeds is in the probe's peak."""
    from autoprofile.engine.sampling import SeedStream, _seeded
    mine = SeedStream(3)
    assert _seeded([None, mine, None], 3, False) == [(1, mine)] and _seeded(None, 3, False) == []
    assert [i for i, _ in _seeded(None, 300, True)] == list(range(300))
    assert [i for i, _ in _seeded([None, mine], 2, True)] == [0, 1]


def test_same_seed_same_tokens_and_unseeded_rows_use_the_shared_generator():
    logits = _logits(4, 3000, 1.0, 31)
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=1.0, top_k=20)]
    gens = [request_generator(p) for p in params]
    out = sample(logits[[0, 0, 2, 3]], _batch(params), torch.Generator().manual_seed(1), gens)
    assert out[0] == out[1]
    plain = sample(logits[[0, 0, 2, 3]], _batch(params), torch.Generator().manual_seed(1))
    also = sample(logits[[0, 0, 2, 3]], _batch(params), torch.Generator().manual_seed(1), [None] * 4)
    assert torch.equal(plain, also)
    with pytest.raises(ValueError, match="row generators"):
        sample(logits, _batch(params), None, gens[:2])


def test_params_validation_and_generators():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=True)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=1.5)
    assert request_generator(SamplingParams()) is None

    def draws(seed: int) -> list[int]:
        stream = request_generator(SamplingParams(seed=seed))
        return [stream.draw() for _ in range(4)]
    assert draws(-3) == draws(-3) and len(set(draws(-3))) == 4  # a stream: the same seed, the same draws
    assert draws(-3) != draws(3) and draws(3) != draws(4)
    assert all(0 <= d < SEED_HIGH for d in draws(2**70))


# ---------------------------------------------------------------- declared transient memory
def _peak_bytes(fn, tmp_path) -> int:
    """Peak bytes the CPU allocator held during fn() above what it held before (profiler memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [e["args"] for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    assert events, "no allocator events recorded"
    base = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - base


MEM_VOCAB = 8192
MEM_CASES = {
    "greedy": (8.0, SamplingParams()),
    "top_k": (8.0, SamplingParams(temperature=1.0, top_k=50)),
    "top_p": (8.0, SamplingParams(temperature=1.0, top_p=0.9)),
    "top_p_wide": (0.05, SamplingParams(temperature=1.0, top_p=0.9)),  # every row sorted (fallback)
    "temperature": (1.0, SamplingParams(temperature=1.0)),
    "stress": (1.0, STRESS),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_declared_workspace_bounds_what_the_sampler_allocates(tmp_path, dtype):
    torch.set_num_threads(1)  # the allocator events of one thread: no per-thread scratch to wonder about
    rows = CHUNK_ROWS + 44
    declared = sampler_workspace_bytes(rows, MEM_VOCAB, dtype.itemsize)
    peaks = {}
    for name, (scale, p) in MEM_CASES.items():
        logits = _logits(rows, MEM_VOCAB, scale, 41, dtype)
        batch = _batch([p] * rows)
        peaks[name] = _peak_bytes(lambda: sample(logits, batch, torch.Generator().manual_seed(0)), tmp_path)
    mixed = [p for name, (_, p) in MEM_CASES.items() if name != "stress"] * rows
    logits = _logits(rows, MEM_VOCAB, 0.05, 42, dtype)
    peaks["mixed"] = _peak_bytes(lambda: sample(logits, _batch(mixed[:rows]), None), tmp_path)
    for name, peak in peaks.items():
        assert peak <= declared, (name, peak, declared)
    # STRESS is the worst case the profiler measures (up to a few [rows] vectors, inside the 64 bytes per row)
    assert peaks["stress"] + 64 * rows >= max(peaks.values()), peaks
    assert peaks["stress"] >= 0.5 * declared  # and the declaration is not wildly loose
    # the old sampler grows with the rows; the bound does not
    old = _peak_bytes(lambda: reference_sample(logits, _batch(mixed[:rows]), None), tmp_path)
    assert old > declared


def test_workspace_formula():
    vocab = 128256
    assert sampler_workspace_bytes(1, vocab, 2) <= sampler_bytes_per_row(vocab, 2)
    for rows in (1, 7, SORT_ROWS, CHUNK_ROWS, 1024, 4096):
        assert sampler_workspace_bytes(rows, vocab, 2) <= rows * sampler_bytes_per_row(vocab, 2)
    # bounded: past CHUNK_ROWS only the outputs grow
    assert sampler_workspace_bytes(4096, vocab, 2) - sampler_workspace_bytes(CHUNK_ROWS, vocab, 2) == \
        64 * (4096 - CHUNK_ROWS)
    assert sampler_workspace_bytes(256, vocab, 2) < 0.5 * 256 * 4.4 * 2**20  # vs ~4.4 MiB/row before
