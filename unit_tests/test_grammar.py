"""Structured output in the engine (autoprofile.engine.grammar) on the tiny model, CPU, torch backend:
every sampled answer follows its grammar, on both engines, through preemption; the stress masks every
sampled row."""
from __future__ import annotations

import json
import os
import random
import re

import numpy as np
import pytest
import torch

from autoprofile.engine import grammar as grammar_module
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.grammar import AllowedTokens, TokenBitmask, bitmask_width, fill_threads
from autoprofile.engine.sampling import SamplingParams
from autoprofile.serving.structured import Grammars, Spec
from autoprofile.serving.tokenizer import ByteTokenizer
from unit_tests.test_scheduler import run_all, tiny_runner

pytest.importorskip("xgrammar")

TOK = ByteTokenizer(4096, eos_token_ids=[2], specials=[1])
WORD = r"[a-e]{12,20}"  # long enough that a tight cache preempts its requests mid-answer


@pytest.fixture(scope="module")
def grammars():
    return Grammars(TOK, 4096)


@pytest.fixture(scope="module")
def roomy():
    return tiny_runner(2048)


def _answers(engine: LLMEngine, grammars: Grammars, spec: Spec, prompts: list[list[int]], seeds: list[int],
             max_tokens: int = 40) -> list[tuple[str, str]]:
    ids = [engine.add_request(p, SamplingParams(temperature=1.0, seed=s), max_tokens, stop_token_ids={2},
                              grammar=grammars.new_matcher(spec)) for p, s in zip(prompts, seeds)]
    out = run_all(engine)
    return [(TOK.decode(out[i][0]), out[i][1]) for i in ids]


PROMPTS = [[(7 * i + j) % 4000 + 3 for j in range(10 + 5 * i)] for i in range(4)]


@pytest.mark.parametrize("overlap", [False, True])
def test_every_sampled_answer_follows_its_regex_on_both_engines(roomy, grammars, overlap):
    spec = Spec("regex", WORD, "regex")
    engine = LLMEngine(roomy, overlap=overlap)
    free = LLMEngine(roomy, overlap=overlap).generate(PROMPTS, SamplingParams(temperature=1.0, seed=1), 20)
    assert not any(re.fullmatch(WORD, TOK.decode(o)) for o in free)  # unconstrained, the model writes noise
    answers = _answers(engine, grammars, spec, PROMPTS, [1, 2, 3, 4])
    for text, reason in answers:
        assert re.fullmatch(WORD, text) and reason == "stop", (text, reason)
    assert len({t for t, _ in answers}) > 1  # sampled, not one forced string
    assert engine.stats.pages_used == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_json_schema_and_choice_answers_validate(roomy, grammars, overlap):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "required": ["ok", "n", "tag"],
              "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                             "tag": {"enum": ["x", "y", "zz"]}}}
    engine = LLMEngine(roomy, overlap=overlap)
    answers = _answers(engine, grammars, Spec("json", json.dumps(schema), "s"), PROMPTS, [5, 6, 7, 8], 60)
    for text, reason in answers:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    choices = ["red", "green", "blue"]
    picked = _answers(engine, grammars, Spec("choice", json.dumps(choices), "c"), PROMPTS * 2, list(range(8)))
    assert all(t in choices and r == "stop" for t, r in picked), picked


@pytest.mark.parametrize("overlap", [False, True])
def test_the_grammar_s_end_wins_over_min_tokens(roomy, grammars, overlap):
    """min_tokens past the grammar's end: the request ends at the grammar's end ("stop"), with no token the
    grammar forbids (docs/server.md: the grammar wins)."""
    engine = LLMEngine(roomy, overlap=overlap)
    spec = Spec("regex", "ab|cd", "regex")
    ids = [engine.add_request(p, SamplingParams(temperature=1.0, seed=s, min_tokens=12), 30,
                              stop_token_ids={2}, grammar=grammars.new_matcher(spec))
           for s, p in enumerate(PROMPTS)]
    out = run_all(engine)
    for i in ids:
        tokens, reason = out[i]
        assert TOK.decode(tokens) in ("ab", "cd") and tokens[-1] == 2 and len(tokens) == 3, tokens
        assert reason == "stop"
    assert engine.stats.pages_used == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_grammar_survives_preemption_and_the_answer_is_the_unpreempted_one(roomy, grammars, overlap):
    """A preempted request is recomputed from its prompt and tokens: its matcher must hold each token once
    (fed again, the grammar would be past its end or refuse the next token)."""
    spec = Spec("regex", r"[a-e]{30,50}", "regex")
    prompts = [[(3 * i + j) % 4000 + 3 for j in range(40)] for i in range(3)]
    seeds = [11, 12, 13]
    want = _answers(LLMEngine(roomy, overlap=overlap), grammars, spec, prompts, seeds, 60)
    tight = LLMEngine(tiny_runner(160), overlap=overlap)  # 9 pages: three requests of up to 7 pages each
    got = _answers(tight, grammars, spec, prompts, seeds, 60)
    assert tight.stats.preemptions > 0
    assert got == want
    for text, reason in got:
        assert re.fullmatch(r"[a-e]{30,50}", text) and reason == "stop", (text, reason)
    assert tight.stats.pages_used == 0


def test_the_stress_masks_every_sampled_row_of_every_corner(roomy):
    widths = []
    real = TokenBitmask._apply

    def spy(self, logits, index):
        widths.append((logits.shape[0], len(index)))
        return real(self, logits, index)
    TokenBitmask._apply = spy
    try:
        shapes = roomy.stress_prefill() + roomy.stress_decode()
    finally:
        TokenBitmask._apply = real
    env = roomy.envelope
    assert len(widths) == len(shapes) and all(rows == masked for rows, masked in widths)
    assert max(m for _, m in widths) == env.sampled_rows
    assert roomy.sampler.bitmask.host.shape == (env.sampled_rows, bitmask_width(4096))


def test_the_bitmask_masks_only_the_grammar_rows(grammars):
    mask = TokenBitmask(4, 4096, torch.device("cpu"))
    logits = torch.zeros(3, 4096)
    m = grammars.new_matcher(Spec("regex", "b+", "regex"))
    mask.apply(logits, [(1, m)])
    allowed = (logits[1] == 0).nonzero().flatten().tolist()
    assert allowed and {TOK.decode([i]) for i in allowed} == {"b"}
    assert torch.equal(logits[0], torch.zeros(4096)) and torch.equal(logits[2], torch.zeros(4096))


# ---------------------------------------------------------------- the batched fill (BatchGrammarMatcher)
SPECS = [Spec("regex", WORD, "regex"), Spec("regex", r"[a-e]{30,50}", "regex"), Spec("regex", "b+", "regex"),
         Spec("json", json.dumps({"type": "object", "required": ["ok", "n", "tag"], "properties": {
             "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
             "tag": {"enum": ["x", "y", "zz"]}}}), "s"),
         Spec("json", json.dumps({"type": "object", "required": ["name", "tags"], "properties": {
             "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}), "s"),
         Spec("choice", json.dumps(["red", "green", "blue"]), "c"), Spec("json_object", "", "j")]


def _allowed(row: torch.Tensor) -> list[int]:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:4096]
    return np.nonzero(bits)[0].tolist()


def _random_matchers(grammars, n: int, seed: int) -> list:
    """n matchers of random SPECS, each advanced by 0..25 random tokens its own mask allows (never EOS)."""
    rng = random.Random(seed)
    one = torch.empty(1, bitmask_width(4096), dtype=torch.int32)
    out = []
    for _ in range(n):
        m = grammars.new_matcher(rng.choice(SPECS))
        for _ in range(rng.randint(0, 25)):
            m.fill_next_token_bitmask(one, 0)
            allowed = [t for t in _allowed(one[0]) if t not in TOK.eos_token_ids]
            if not allowed:
                break
            assert m.accept_token(rng.choice(allowed))
        out.append(m)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_batched_fill_is_bit_identical_to_the_per_row_fill(grammars, seed):
    rng = random.Random(seed)
    ms = _random_matchers(grammars, 24, seed)
    index = sorted(rng.sample(range(32), len(ms)))  # scattered rows, as the grammar rows of a step are
    rows = list(zip(index, ms))
    want = torch.full((32, bitmask_width(4096)), 7, dtype=torch.int32)
    for i, m in rows:  # the reference: each matcher's own call
        m.fill_next_token_bitmask(want, i)
    mask = TokenBitmask(32, 4096, torch.device("cpu"))
    mask.host.fill_(7)
    mask.fill(rows)
    assert mask._batch is not None  # several rows went through the batched call
    assert torch.equal(mask.host, want)
    assert any(len(_allowed(want[i])) > 100 for i in index) and any(len(_allowed(want[i])) < 10 for i in index)
    one = TokenBitmask(32, 4096, torch.device("cpu"))
    one.fill(rows[:1])
    assert one._batch is None and torch.equal(one.host[index[0]], want[index[0]])


def test_several_rows_fill_in_one_batched_call_on_the_process_cores(grammars, monkeypatch):
    import xgrammar
    made, calls = [], []

    class Spy(xgrammar.BatchGrammarMatcher):
        def __init__(self, max_threads):
            made.append(max_threads)
            super().__init__(max_threads)

        def batch_fill_next_token_bitmask(self, matchers, bitmask, indices=None, debug_print=False):
            calls.append(list(indices))
            return super().batch_fill_next_token_bitmask(matchers, bitmask, indices, debug_print)
    monkeypatch.setattr(xgrammar, "BatchGrammarMatcher", Spy)
    mask = TokenBitmask(8, 4096, torch.device("cpu"))
    ms = _random_matchers(grammars, 3, 9)
    mask.apply(torch.zeros(8, 4096), [(1, ms[0]), (4, ms[1]), (6, ms[2])])
    mask.apply(torch.zeros(8, 4096), [(2, ms[0]), (3, ms[1])])
    mask.apply(torch.zeros(8, 4096), [(5, ms[2])])  # one row: the matcher's own call
    assert calls == [[1, 4, 6], [2, 3]]
    assert made == [min(len(os.sched_getaffinity(0)), 8)] == [fill_threads()]


def test_the_mask_is_filled_after_the_forward_and_before_the_processors_and_the_sampler(
        roomy, grammars, monkeypatch):
    """On CUDA the host fills the grammar rows' masks while the GPU runs the forward: the runner fills after
    it has launched the model, and the sampler masks before the logits processors and the sample (vLLM's
    order)."""
    import autoprofile.engine.sampler as sampler_module
    events = []

    def spy(name, fn):
        def wrapped(*a, **kw):
            events.append(name)
            return fn(*a, **kw)
        return wrapped
    monkeypatch.setattr(roomy.model, "forward", spy("forward", roomy.model.forward))
    monkeypatch.setattr(TokenBitmask, "fill", spy("fill", TokenBitmask.fill))
    process = sampler_module.logits_process
    monkeypatch.setattr(process, "apply", spy("process", process.apply))
    monkeypatch.setattr(sampler_module, "sample", spy("sample", sampler_module.sample))
    engine = LLMEngine(roomy)
    params = SamplingParams(temperature=1.0, seed=4, presence_penalty=0.5)
    for p in PROMPTS[:2]:
        engine.add_request(p, params, 8, grammar=grammars.new_matcher(SPECS[0]))
    run_all(engine)
    steps = "".join({"forward": "F", "fill": "M", "process": "P", "sample": "S"}[e] for e in events)
    assert steps.count("M") >= 8 and re.fullmatch(r"(FMPS)+", steps), steps


# ---------------------------------------------------------------- the mask over every row (no index list)
@pytest.mark.parametrize("masked", [1, 5, 8, 11, 12])
def test_the_mask_over_every_row_equals_the_mask_of_the_named_rows(grammars, masked, monkeypatch):
    """With at least half of the rows masked, every row is masked (the others allow every token) and no index
    list goes to the kernel; with fewer, the named rows alone. The logits are the per-row reference's, bit for
    bit, either way: a request that ended since the launch (its row left out) keeps its logits."""
    import xgrammar
    rng = random.Random(masked)
    index = sorted(rng.sample(range(12), masked))
    rows = list(zip(index, _random_matchers(grammars, masked, masked)))
    logits = torch.randn(12, 4096, generator=torch.Generator().manual_seed(masked))
    want = logits.clone()
    bits = torch.full((12, bitmask_width(4096)), -1, dtype=torch.int32)
    for i, m in rows:
        m.fill_next_token_bitmask(bits, i)
    xgrammar.apply_token_bitmask_inplace(want, bits, vocab_size=4096, indices=index)
    calls = []
    real = grammar_module.mask_logits_

    def spy(logits, bitmask, vocab_size, index):
        calls.append(None if index is None else index.tolist())
        return real(logits, bitmask, vocab_size, index)
    monkeypatch.setattr(grammar_module, "mask_logits_", spy)
    mask = TokenBitmask(16, 4096, torch.device("cpu"))
    mask.host.fill_(7)  # a step before's rows: never read as an unmasked row's
    mask.apply(logits, rows)
    assert torch.equal(logits, want)
    assert calls == [None if 2 * masked >= 12 else index]
    if calls == [None]:
        assert all(bool((mask.host[i] == -1).all()) for i in set(range(12)) - set(index))


@pytest.mark.parametrize("masked", [3, 9])
def test_the_host_mask_is_written_without_torch_ops(grammars, masked, monkeypatch):
    """The mask's host rows and index list are written through numpy views (and xgrammar's fill), never by a
    torch op: a torch write of a few rows enters the intra-op OpenMP pool, whose threads then spin beside the
    engine loop (15 of them on an H200 host in a JSON-schema run). Both of _apply's paths (the named rows;
    every row, the unmasked ones set to allow all) and the stress's."""
    from torch.profiler import ProfilerActivity, profile
    index = sorted(random.Random(masked).sample(range(12), masked))  # 3: the named rows; 9: every row
    rows = list(zip(index, _random_matchers(grammars, masked, masked)))
    monkeypatch.setattr(grammar_module, "mask_logits_", lambda logits, bitmask, vocab_size, index: logits)
    mask = TokenBitmask(16, 4096, torch.device("cpu"))
    logits = torch.zeros(12, 4096)
    mask.apply(logits, rows)  # xgrammar's batch matcher made outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        mask.apply(logits, rows)
        mask.apply_stress(logits)
    writes = {e.key for e in prof.key_averages()} & {"aten::index_put_", "aten::fill_", "aten::copy_",
                                                     "aten::_index_put_impl_"}
    assert not writes, writes
    assert bool((mask.host[:12, 0] == -2).all()) and bool((mask.host[:12, 1:] == -1).all())  # the stress's


def test_allowed_ids_rows_fill_with_and_without_their_grammar(grammars):
    """AllowedTokens: alone, its ids; with a matcher, the ids its grammar allows too (filled in the batched
    call with the plain grammar rows)."""
    m = grammars.new_matcher(Spec("regex", "b+", "regex"))
    ids = [TOK.encode("a")[0], TOK.encode("b")[0], 7]
    plain = grammars.new_matcher(Spec("regex", "c+", "regex"))
    rows = [(0, AllowedTokens.of(ids, 4096)), (2, AllowedTokens.of(ids, 4096, m)), (3, plain)]
    mask = TokenBitmask(4, 4096, torch.device("cpu"))
    mask.fill(rows)
    assert _allowed(mask.host[0]) == sorted(ids)
    assert _allowed(mask.host[2]) == [TOK.encode("b")[0]]
    assert {TOK.decode([i]) for i in _allowed(mask.host[3])} == {"c"}
    assert mask._batch is not None  # rows 2 and 3: one batched call


BOOT_WITHOUT_XGRAMMAR = r'''
import sys
from autoprofile.config import ServerConfig, validate
from autoprofile.engine import grammar
from unit_tests.cpu_server import boot_cpu
from unit_tests.test_server import FLAGS

masked, apply = [], grammar.mask_logits_
grammar.mask_logits_ = lambda logits, *a: masked.append(logits.shape[0]) or apply(logits, *a)
runner, result = boot_cpu(validate(ServerConfig(**FLAGS)))
runner.stress_prefill()  # the profiler's validation: every sampled row of a corner masked
runner.stress_decode()
assert masked and max(masked) > 1, masked
assert "xgrammar" not in sys.modules and "transformers" not in sys.modules
print("ok")
'''


def test_a_boot_masks_without_importing_xgrammar():
    """The stress applies structured output's mask with our kernel: a boot imports neither xgrammar nor the
    transformers it imports (5.7-7 s of a GPU host's boot); `serve` builds the grammars after it."""
    from unit_tests.interpreter import run_script
    run_script(BOOT_WITHOUT_XGRAMMAR, interpret=False)
