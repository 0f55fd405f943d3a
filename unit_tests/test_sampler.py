"""The Sampler (autoprofile.engine.sampler): logits to tokens in one place, raw logprobs, then the grammar
mask, the logits processors and the sample, in that order; its explicit result, read by the engine (the tiny
model and real xgrammar matchers on the CPU)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import autoprofile
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.grammar import TokenBitmask
from autoprofile.engine.sampler import Sampler, SampledTokens, SamplingMetadata, StepTokens
from autoprofile.engine.sampling import SamplingParams, SeedStream, make_generator
from autoprofile.engine.scheduler import StepRow
from autoprofile.serving.structured import Grammars, Spec
from unit_tests.test_grammar import TOK
from unit_tests.test_scheduler import run_all, tiny_runner

pytest.importorskip("xgrammar")

VOCAB = 4096
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def grammars():
    return Grammars(TOK, VOCAB)


@pytest.fixture(scope="module")
def roomy():
    return tiny_runner(2048)


def sampler(rows: int = 8, seed: int = 0) -> Sampler:
    return Sampler(TokenBitmask(rows, VOCAB, CPU), make_generator(seed, CPU), None)


def random_logits(rows: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def read_back(out) -> SampledTokens:
    return StepTokens(out).result()


def metadata(params: list[SamplingParams], grammars: tuple = (), generators: tuple | None = None
             ) -> SamplingMetadata:
    """What from_rows reads of rows without a request (a stress row's: the processors count its ids), with the
    grammars and the generators given."""
    meta = SamplingMetadata.from_rows([StepRow(i, 0, [5, 6], True, p) for i, p in enumerate(params)])
    return dataclasses.replace(meta, grammars=grammars, generators=generators)


def test_logprobs_are_the_raw_logits_and_the_tokens_follow_mask_and_processors(grammars):
    """Row 0: a grammar (b+), row 1: a logit bias that decides the token, row 2: no logprobs asked. The
    logprobs are the log-softmax of the logits before the mask and the processors (vLLM's raw_logprobs)."""
    logits = random_logits(3)
    raw = torch.log_softmax(logits, dim=-1)
    b_plus = grammars.new_matcher(Spec("regex", "b+", "regex"))
    meta = metadata([SamplingParams(logprobs=2), SamplingParams(logprobs=0, logit_bias=((7, 100.0),)),
                     SamplingParams()], grammars=((0, b_plus),))
    out = read_back(sampler()(logits.clone(), meta))
    assert isinstance(out, SampledTokens) and not isinstance(out, list)
    b, seven = out.tokens[:2]
    assert TOK.decode([b]) == "b" and seven == 7
    (t0, lp0, top0), (t1, lp1, top1), none = out.logprobs
    assert (t0, t1, none, out.prompt_logprobs) == (b, 7, None, {})
    assert lp0 == pytest.approx(raw[0, b].item(), abs=1e-5)
    assert lp1 == pytest.approx(raw[1, 7].item(), abs=1e-5)
    assert [i for i, _ in top0] == raw[0].topk(2).indices.tolist() and top1 == []


def test_the_grammar_masks_before_min_p_measures_the_distribution(grammars):
    """A disallowed token far above the allowed ones: min_p after the mask keeps the grammar's best tokens
    (the other order leaves the row no token: every allowed one under the disallowed token's threshold)."""
    logits = torch.zeros(1, VOCAB)
    logits[0, next(i for i in range(VOCAB) if TOK.decode([i]) == "a")] = 50.0
    for seed in range(8):
        b_plus = grammars.new_matcher(Spec("regex", "b+", "regex"))
        meta = metadata([SamplingParams(temperature=1.0, min_p=0.5)], grammars=((0, b_plus),))
        assert TOK.decode(read_back(sampler(seed=seed)(logits.clone(), meta)).tokens) == "b"


def test_a_seeded_row_draws_the_same_tokens_alone_and_in_a_crowd():
    """Its own seed stream only: the rest of the batch (other params, greedy rows, processors) changes
    nothing."""
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    crowd = [SamplingParams(), mine, SamplingParams(temperature=0.7, top_k=20),
             SamplingParams(temperature=1.3, presence_penalty=0.5)]
    g_alone, g_crowd = SeedStream(42), SeedStream(42)
    s_alone, s_crowd = sampler(seed=1), sampler(seed=2)
    for step in range(6):
        logits = random_logits(4, seed=step)
        alone = s_alone(logits[1:2].clone(), metadata([mine], generators=(g_alone,)))
        many = s_crowd(logits.clone(), metadata(crowd, generators=(None, g_crowd, None, None)))
        assert read_back(alone).tokens[0] == read_back(many).tokens[1]


def test_the_runner_returns_an_explicit_result_that_the_engine_keeps(roomy):
    """ModelRunner.execute returns SampledTokens (tokens, logprobs, prompt_logprobs), not a list carrying
    attributes; the engine's requests get exactly those entries."""
    results = []
    real = roomy.execute

    def execute(step):
        results.append(real(step))
        return results[-1]
    roomy.execute = execute
    try:
        engine = LLMEngine(roomy)
        prompt = [(7 * j) % 4000 + 3 for j in range(20)]
        rid = engine.add_request(prompt, SamplingParams(logprobs=3, prompt_logprobs=2), 5)
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.request_id == rid]
    finally:
        del roomy.execute
    assert results and all(type(r) is SampledTokens for r in results)
    tokens = [t for r in results for t in r.tokens]
    entries = [e for r in results for e in r.logprobs]
    assert [e[0] for e in entries] == tokens == [t for o in outs for t in o.new_token_ids]
    assert [e for o in outs for e in o.logprobs] == entries and all(len(e[2]) == 3 for e in entries)
    first, scored = results[0].prompt_logprobs[0]
    assert first == 1 and [e[0] for e in scored] == prompt[1:] and all(len(e[2]) == 2 for e in scored)
    assert outs[0].prompt_logprobs == [None, *scored]


def test_a_step_that_samples_nothing_still_carries_its_prompt_logprobs(roomy):
    """A prefill chunk before the prompt's last samples no row: its result has no token and the prompt
    logprobs of its positions."""
    results, real = [], roomy.execute

    def execute(step):
        results.append(real(step))
        return results[-1]
    roomy.execute = execute
    try:
        engine = LLMEngine(roomy)
        prompt = [(11 * j) % 4000 + 3 for j in range(roomy.envelope.prefill_tokens + 10)]
        engine.add_request(prompt, SamplingParams(prompt_logprobs=1), 1)
        run_all(engine)
    finally:
        del roomy.execute
    first, *_, last = results
    assert first.tokens == [] and first.logprobs is None and len(last.tokens) == 1
    scored = [e for r in results for _, entries in r.prompt_logprobs.values() for e in entries]
    assert [e[0] for e in scored] == prompt[1:]


def test_max_logprobs_is_written_once_and_one_module_is_named_logprobs():
    """One bound for the API and the engine (engine.sampling_params), one module named logprobs.py."""
    root = Path(autoprofile.__file__).parent
    files = sorted(root.rglob("*.py"))
    written = [p.relative_to(root).as_posix() for p in files
               if re.search(r"^MAX_LOGPROBS\s*[:=]", p.read_text(), re.MULTILINE)]
    assert written == ["engine/sampling_params.py"]
    named = [p.relative_to(root).as_posix() for p in files if p.name == "logprobs.py"]
    assert named == ["engine/logprobs.py"]
