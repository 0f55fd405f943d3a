"""The sampler on a GPU at Llama 3's vocabulary (the fused Triton kernel): declared workspace vs
torch.cuda.max_memory_allocated at 256 and 1024 rows, no host sync, kept sets and draws against the full-sort
reference, seeded rows batch-invariant; the split path (top_k <= K_MAX): kept sets against the reference in
each dtype, every call alike, inside a CUDA graph, over several launches."""
from __future__ import annotations

import math

import pytest
import torch

from autoprofile.engine.sampling import (
    STRESS, STRESS_WIDE, SamplingBatch, SamplingParams, kept_probs, reference_sample, request_generator,
    sample,
    sampler_workspace_bytes, top_k_top_p_probs)
from scripts.cuda_timing import capture
from tests.conftest import require_backend

pytestmark = pytest.mark.gpu
VOCAB = 128256
CASES = {  # name: (logits scale, params); scale 5 at temperature 0.8: every nucleus inside the prefilter
    "greedy": (5.0, SamplingParams()),
    "top_k": (5.0, SamplingParams(temperature=0.8, top_k=50)),
    "top_p": (5.0, SamplingParams(temperature=0.8, top_p=0.9)),
    "top_k_top_p": (5.0, SamplingParams(temperature=0.8, top_k=50, top_p=0.9)),
    "temperature": (5.0, SamplingParams(temperature=0.8)),
    "top_p_wide": (1.0, SamplingParams(temperature=0.8, top_p=0.9)),  # every row sorted (fallback, host sync)
    "stress": (1.0, STRESS),
    "stress_wide": (1.0, STRESS_WIDE),
}


@pytest.fixture(autouse=True)
def _cuda():
    require_backend("torch")


def _logits(rows: int, scale: float, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator("cuda").manual_seed(seed)
    return (torch.randn(rows, VOCAB, device="cuda", generator=gen) * scale).to(torch.bfloat16)


def _batch(params) -> SamplingBatch:
    return SamplingBatch.from_params(list(params), torch.device("cuda"))


def _peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - base


def _case_peak(rows: int, scale: float, params: SamplingParams, stress: bool = False) -> int:
    """A case's peak; stress: sampled as a stress corner's rows (the Sampler passes meta.stress)."""
    logits, batch = _logits(rows, scale), _batch([params] * rows)
    return _peak(lambda: sample(logits, batch, torch.Generator("cuda").manual_seed(0), stress=stress))


@pytest.mark.parametrize("rows", [256, 1024])
def test_declared_workspace_bounds_the_measured_peak_and_stress_is_the_worst(rows):
    declared = sampler_workspace_bytes(rows, VOCAB, 2)
    # NOTE: every path once first: the first sort-path call of a process leaves a small allocation behind
    # (H100: the first case through it, top_p_wide, peaked 303,616 bytes above the later stress_wide). The
    # profiler's stress runs first in its process, so it pays that itself; here each case is compared warm.
    for name, (scale, p) in CASES.items():
        _case_peak(rows, scale, p, name.startswith("stress"))
    peaks = {name: _case_peak(rows, scale, p, name.startswith("stress"))
             for name, (scale, p) in CASES.items()}
    mixed = [p for name, (_, p) in CASES.items() if not name.startswith("stress")]
    logits = _logits(rows, 1.0)
    peaks["mixed"] = _peak(lambda: sample(logits, _batch((mixed * rows)[:rows]), None))
    old = _peak(lambda: reference_sample(logits, _batch([STRESS] * rows), None))
    report = {k: round(v / rows / 2**20, 3) for k, v in peaks.items()}
    print(f"rows {rows}: MiB/row {report}; declared {declared / rows / 2**20:.3f}; "
          f"old {old / rows / 2**20:.3f}")
    for name, peak in peaks.items():
        assert peak <= declared, (name, peak, declared)
    # the profiler's stress samples with both STRESS_PARAMS: together they are the worst
    assert max(peaks["stress"], peaks["stress_wide"]) + 64 * rows >= max(peaks.values()), report
    assert old > declared


def test_no_host_sync_on_any_path():
    """CUDA: every batch with a sampled row is one Triton kernel (triton_sample), no host read."""
    rows = 256
    runs = {}
    for name, (scale, p) in CASES.items():
        runs[name] = (_logits(rows, scale, 1), _batch([p] * rows))
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i) if i % 3 == 0
              else SamplingParams(temperature=0.8) for i in range(rows)]
    gens = [request_generator(p) for p in seeded]
    seeded_batch = _batch(seeded)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for logits, batch in runs.values():
            sample(logits, batch, None)
        sample(runs["top_p"][0], seeded_batch, None, gens)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("rounds", [None, 0], ids=["rejection", "exact_path"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_p=0.9),
                                    SamplingParams(temperature=1.0, top_k=50, top_p=0.95),
                                    SamplingParams(temperature=0.8, top_k=50)])
def test_draws_follow_the_reference_distribution(params, rounds, monkeypatch):
    """100k draws from one bf16 row at Llama 3's vocabulary against the full-sort reference: the 20 likeliest
    tokens and the rest, each within 5 standard deviations; every draw inside the reference's kept set (or
    tied with its last token: which ties are kept is unspecified). The kernel's rejection sampling, and its
    exact path alone (ROUNDS 0: the fallback); top_k 50: the split path (ROUNDS does not reach it)."""
    from autoprofile.kernels import triton_sample
    if rounds is not None:
        monkeypatch.setattr(triton_sample, "ROUNDS", rounds)
    row = (torch.randn(VOCAB, device="cuda", generator=torch.Generator("cuda").manual_seed(9)) * 3)
    row = row.to(torch.bfloat16)
    rows, calls = 4096, 25
    logits, batch = row.expand(rows, -1).contiguous(), _batch([params] * rows)
    gen = torch.Generator("cuda").manual_seed(1)
    counts = sum(torch.bincount(sample(logits, batch, gen), minlength=VOCAB) for _ in range(calls)).double()
    probs, ids = top_k_top_p_probs(logits[:1], batch.rows(0, 1))
    want = torch.zeros(VOCAB, dtype=torch.float64, device="cuda").scatter_(0, ids[0], probs[0].double())
    want /= want.sum()
    least = row.float()[ids[0][(probs[0] > 0).sum() - 1]]
    assert ((want > 0) | (row.float() == least))[counts > 0].all()
    n = rows * calls
    top = want.topk(20).indices
    got_p = torch.cat([counts[top], (n - counts[top].sum()).reshape(1)]) / n
    want_p = torch.cat([want[top], (1 - want[top].sum()).reshape(1)])
    sd = (want_p * (1 - want_p) / n).sqrt()
    print(f"{params}: kept {(want > 0).sum().item()} tokens; max |got - want| / sd "
          f"{((got_p - want_p).abs() / sd).max():.2f}")
    assert ((got_p - want_p).abs() <= 5 * sd + 1e-9).all(), (got_p, want_p)


@pytest.mark.parametrize("scale", [1.0, 5.0])
def test_kept_distribution_matches_the_reference(scale):
    params = [SamplingParams(temperature=t, top_p=p, top_k=k)
              for t in (0.6, 1.0) for p in (1.0, 0.9, 0.5) for k in (0, 40, 2000)]
    logits, batch = _logits(len(params), scale, 2), _batch(params)
    dense, kept = kept_probs(logits, batch)
    probs, ids = top_k_top_p_probs(logits, batch)
    ref = torch.zeros_like(dense).scatter_(1, ids, probs)
    ref /= ref.sum(-1, keepdim=True)
    ref_kept = torch.zeros_like(kept).scatter_(1, ids, probs > 0)
    counts, ref_counts = kept.sum(-1), ref_kept.sum(-1)
    # equal counts up to underflow in the reference (its zeros hide kept tokens of probability < 1e-38)
    assert ((counts - ref_counts).abs() <= torch.maximum(counts // 1000, torch.ones_like(counts))).all()
    assert torch.allclose(dense.sort(-1).values, ref.sort(-1).values, atol=1e-6)
    drawn = sample(logits, batch, torch.Generator("cuda").manual_seed(3))
    assert kept.gather(1, drawn.unsqueeze(1)).all()


@pytest.mark.parametrize("scale", [1.0, 5.0])
def test_rejection_takes_few_rounds(scale):
    """The kernel's rejection rounds a row (its `bounds` third column) at 256 rows: about 1 + ln(1 / top_p)
    (each rejection's token is a uniform mass quantile of its proposal), none reaching the fallback."""
    from autoprofile.kernels import triton_sample
    params = [SamplingParams(temperature=0.8, top_p=p, top_k=k) for p, k in ((0.9, 0), (0.9, 50), (0.5, 0))]
    for p in params:
        logits, batch = _logits(256, scale, 5), _batch([p] * 256)
        seeds = torch.arange(256, device="cuda")
        _, bounds = triton_sample.sample_batch(logits, batch.temperatures, batch.top_ps, batch.top_ks, seeds,
                                               bounds=True)
        rounds = bounds[:, 2]
        print(f"scale {scale} {p.top_p} {p.top_k}: mean rounds {rounds.mean():.3f}, max {rounds.max():.0f}")
        assert rounds.mean() <= 1.25 + math.log(1 / p.top_p) and rounds.max() <= triton_sample.ROUNDS


# ---------------------------------------------------------------- the split path (0 < top_k <= K_MAX)
def _split_case(dtype: torch.dtype, seed: int = 6):
    """(x, params): rows with top_k 1..K_MAX (with and without top-p, two temperatures) and others (K_MAX + 1,
    greedy, top-p alone), rows of a wider buffer at scale 3: a tie group just under each even row's max
    (b_k of most k), the top quarter of the vocabulary masked in every third row."""
    from autoprofile.kernels import triton_sample as ts
    params = [SamplingParams(temperature=t, top_p=p, top_k=k) for t in (0.6, 1.0) for p in (1.0, 0.9, 0.5)
              for k in (1, 20, 50, ts.K_MAX)]
    params += [SamplingParams(temperature=1.0, top_k=ts.K_MAX + 1), SamplingParams(),
               SamplingParams(temperature=0.8, top_p=0.9)]
    gen = torch.Generator("cuda").manual_seed(seed)
    wide = (torch.randn(len(params), VOCAB + 64, device="cuda", generator=gen) * 3).to(dtype)
    x = wide[:, 5:VOCAB + 5]
    x[::2, 60000:60100] = x[::2].max(dim=1, keepdim=True).values - 0.25
    x[::3, 3 * VOCAB // 4:] = float("-inf")
    return x, params


def _reference_bounds(x: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept count, smallest kept logit) per row by the full-sort reference."""
    probs, ids = top_k_top_p_probs(x, batch)
    n = (probs > 0).sum(-1)
    return n, x.float().gather(1, ids.gather(1, (n - 1).unsqueeze(1))).squeeze(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_split_path_keeps_the_reference_set(dtype):
    """Each split row's kept count and boundary logit (bounds) equal the full sort's (a count off by one at
    a top-p boundary in fp32 rounding allowed once), its draw a kept token; the same bounds through the
    one-program kernel (split "none"); the other rows as that kernel gives them."""
    from autoprofile.kernels import triton_sample as ts
    x, params = _split_case(dtype)
    batch = _batch(params)
    seeds = torch.arange(len(params), device="cuda") * 7919
    args = (x, batch.temperatures, batch.top_ps, batch.top_ks, seeds)
    tok, got = ts.sample_batch(*args, bounds=True, split="some")
    n, least = _reference_bounds(x, batch)
    split = torch.tensor([p.temperature > 0 and 0 < p.top_k <= ts.K_MAX for p in params], device="cuda")
    off = split & ((got[:, 0].long() != n) | (got[:, 1] != least))
    assert int(off.sum()) <= 1 and ((got[:, 0].long() - n).abs()[split] <= 1).all(), (got[off], n[off])
    assert (got[split, 2] == 1).all()
    assert (x.float().gather(1, tok.unsqueeze(1)).squeeze(1) >= got[:, 1])[split].all()
    tok_one, got_one = ts.sample_batch(*args, bounds=True, split="none")
    assert int((got_one[split, 0] != got[split, 0]).sum()) <= 1
    assert torch.equal(tok_one[~split], tok[~split]) and torch.equal(got_one[~split], got[~split])


def test_split_path_every_call_alike_in_a_graph_and_over_launches(monkeypatch):
    """256 rows of top-k 50 + top-p 0.9: 100 eager calls give the same tokens (a row's last program sees every
    program's candidates); a captured graph replays them, and again over fresh logits as eager calls give
    them; SPLIT_ROWS 100: three launches sharing the call's counts (each reset by its row), the same
    tokens."""
    from autoprofile.kernels import triton_sample as ts
    rows = 256
    x, batch = _logits(rows, 5.0, 7), _batch([SamplingParams(temperature=0.8, top_k=50, top_p=0.9)] * rows)
    seeds = torch.randint(2**62, (rows,), device="cuda", generator=torch.Generator("cuda").manual_seed(2))

    def call():
        return ts.sample_batch(x, batch.temperatures, batch.top_ps, batch.top_ks, seeds, split="all")

    want = call()
    assert all(torch.equal(call(), want) for _ in range(100))
    graph, out = capture(call)
    for seed in range(8, 12):
        x.copy_(_logits(rows, 5.0, seed))
        graph.replay()
        assert torch.equal(out, call()), seed
    monkeypatch.setattr(ts, "SPLIT_ROWS", 100)
    assert torch.equal(call(), out)


def test_greedy_is_argmax_and_seeded_rows_are_batch_invariant():
    logits = _logits(300, 3.0, 4)
    assert torch.equal(sample(logits, _batch([SamplingParams()] * 300)), logits.argmax(-1))
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=77)

    def run(others, at):
        params = others[:at] + [target] + others[at:]
        x = _logits(len(params), 1.0, len(params))
        x[at] = logits[0]
        gens = [request_generator(p) for p in params]
        return [int(sample(x, _batch(params), None, gens)[at]) for _ in range(3)]

    alone = run([], 0)
    assert run([SamplingParams(temperature=1.0, top_k=5)] * 200, 150) == alone
    assert run([STRESS] * 9, 3) == alone


# ---------------------------------------------------------------- the logits processors (logits_process)
def _processed_case(rows: int, history: int, seed: int = 0):
    """bf16 logits at Llama 3's vocabulary, rows of mixed controls (a plain one every 7th row), random prompt
    and output ids (`history` of each, repeats included), EOS 2 a stop token."""
    from autoprofile.engine.logits_process import RowTokens
    import numpy as np
    gen = torch.Generator().manual_seed(seed)
    kinds = [SamplingParams(temperature=0.9, presence_penalty=0.7, frequency_penalty=0.4,
                            repetition_penalty=1.3, logit_bias=((5, 30.0), (128000, -100.0)), min_p=0.05,
                            min_tokens=history + 1),
             SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5),
             SamplingParams(temperature=0.6, min_p=0.2), SamplingParams()]
    params = [kinds[i % 3] if i % 7 else kinds[3] for i in range(rows)]
    ids = lambda: torch.randint(0, 2000, (history,), generator=gen).numpy().astype(np.int64)  # noqa: E731
    hist = [(ids(), ids()) for _ in range(rows)]
    tokens = [RowTokens(p, pr, out, (2,), i) for i, (p, (pr, out)) in enumerate(zip(params, hist))]
    return _logits(rows, 3.0, seed), params, tokens


def test_processors_on_cuda_equal_the_reference():
    """logits_process.apply on CUDA (bf16 logits, chunks of PROCESS_ROWS) against the per-row reference of
    unit_tests/logits_reference.py, computed in fp64 on the CPU from the same logits."""
    from autoprofile.engine import logits_process
    from unit_tests.logits_reference import reference_process
    rows = logits_process.PROCESS_ROWS + 9
    logits, params, tokens = _processed_case(rows, 300)
    want = torch.stack([reference_process(logits[i].float().cpu(), t.prompt.tolist(), t.output.tolist(),
                                          t.params, t.stop) for i, t in enumerate(tokens)])
    picked = logits_process.processed_rows(params)
    logits_process.apply(logits, picked, [tokens[i] for i in picked])
    got = logits.float().cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want.to(torch.bfloat16).float(), rtol=1.6e-2, atol=2e-2)
    # the fused sampler takes the processed rows: no draw lands on a masked token (min_p, min_tokens, bias)
    for seed in range(20):
        tok = sample(logits, _batch(params), torch.Generator("cuda").manual_seed(seed))
        assert torch.isfinite(logits.gather(1, tok.unsqueeze(1))).all()


def test_processors_stay_inside_the_declared_workspace_and_never_sync():
    """256 rows, every row with every control and 4096-token histories: the peak of processors + sampler
    (STRESS, as the profiler's stress runs them) within sampler_workspace_bytes + the ids uploaded; no host
    sync in the processors."""
    from autoprofile.engine import logits_process
    from autoprofile.engine.sampling import process_bytes_per_row
    rows, history = 256, 4096
    logits, _, tokens = _processed_case(rows, history, 1)
    tokens = [logits_process.RowTokens(STRESS, t.prompt, t.output, t.stop, t.slot) for t in tokens]
    batch = _batch([STRESS] * rows)

    def step():
        logits_process.apply(logits, list(range(rows)), tokens)
        return sample(logits, batch, torch.Generator("cuda").manual_seed(0))

    step()  # warm
    uploaded = logits_process.PROCESS_ROWS * 2 * history * 8 * 2  # int64 ids and their rows, pinned copies
    peak = _peak(step)
    declared = sampler_workspace_bytes(rows, VOCAB, 2)
    print(f"processors + sampler at {rows} rows: peak {peak / 2**20:.1f} MiB, declared "
          f"{declared / 2**20:.1f} MiB (+ {uploaded / 2**20:.1f} MiB of ids)")
    assert peak <= declared + uploaded
    processors = _peak(lambda: logits_process.apply(logits, list(range(rows)), tokens))
    bound = logits_process.PROCESS_ROWS * process_bytes_per_row(VOCAB)
    print(f"processors alone: {processors / 2**20:.1f} MiB, declared {bound / 2**20:.1f} MiB")
    assert processors <= bound + uploaded
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits_process.apply(logits, list(range(rows)), tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
