"""Sampling controls (vLLM's semantics): presence/frequency/repetition penalties, logit_bias, min_p,
min_tokens, stop_token_ids. The processors against a per-row reference written here; generation through the
engine (plain and overlapped) and through HTTP with the `openai` client against a reference loop of full
forwards of the tiny model; bad values are 400s naming the field; the stress runs every processor on the
envelope's most sampled rows."""
from __future__ import annotations

import math

import numpy as np
import openai
import pytest
import torch

from autoprofile.engine import logits_process, stress
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.kv_cache import KVCache
from autoprofile.engine.request import PENDING, RequestError
from autoprofile.engine.sampling import (
    PROCESS_ROWS, STRESS_PARAMS, SamplingParams, process_bytes_per_row, sampler_workspace_bytes)
from autoprofile.layers.attention import AttentionMetadata
from autoprofile.serving.tokenizer import load_tokenizer
from unit_tests import test_server
from unit_tests.test_openai_api import client, refused
from unit_tests.test_server import CFG, post
from unit_tests.logits_reference import reference_process

booted, engine, run = test_server.booted, test_server.engine, test_server.run  # the server tests' fixtures
VOCAB = 4096  # the tiny model's
EOS = 2


# ---------------------------------------------------------------- the reference
def _row(params, prompt, output, stop=(), slot=0) -> logits_process.RowTokens:
    return logits_process.RowTokens(params, np.asarray(prompt, np.int64), np.asarray(output, np.int64),
                                    tuple(stop), slot)


CASES = {
    "repetition": SamplingParams(repetition_penalty=1.7),
    "repetition_below_1": SamplingParams(repetition_penalty=0.6),
    "frequency": SamplingParams(frequency_penalty=1.3),
    "presence": SamplingParams(presence_penalty=-0.8),
    "bias": SamplingParams(logit_bias=((3, 7.5), (11, -100.0))),
    "min_tokens": SamplingParams(min_tokens=5),
    "min_p": SamplingParams(temperature=0.7, min_p=0.2),
    "all": SamplingParams(temperature=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                          repetition_penalty=1.2, logit_bias=((5, 2.0),), min_p=0.05, min_tokens=9),
}


@pytest.mark.parametrize("name", CASES)
def test_each_processor_equals_the_reference(name):
    """Rows of several parameters in one batch (a plain row among them, untouched), prompt and output tokens
    repeated, a stop token masked until min_tokens; more rows than PROCESS_ROWS (chunks)."""
    gen = torch.Generator().manual_seed(0)
    rows = PROCESS_ROWS + 3
    logits = torch.randn(rows, 64, generator=gen) * 3
    params = [CASES[name] if i % 5 else SamplingParams() for i in range(rows)]
    hist = [(torch.randint(0, 64, (9,), generator=gen).tolist(), torch.randint(0, 64, (1 + i % 7,),
                                                                               generator=gen).tolist())
            for i in range(rows)]
    stop = (2, 9)
    want = torch.stack([reference_process(logits[i], *hist[i], params[i], stop) for i in range(rows)])
    before = logits.clone()
    picked = logits_process.processed_rows(params)
    assert picked == [i for i in range(rows) if i % 5]
    logits_process.apply(logits, picked, [_row(params[i], *hist[i], stop) for i in picked])
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    changed = [not torch.equal(logits[i], before[i]) for i in picked]
    assert sum(changed) > len(picked) // 2  # the test can fail


def test_min_tokens_leaves_the_stop_tokens_when_nothing_else_is_allowed():
    """A grammar at its end allows only EOS (every other logit -inf, as its mask leaves them): min_tokens
    must not mask that too (every logit -inf samples token 0, a token the grammar forbids). A row with
    another token left still has its stop tokens masked."""
    x = torch.full((2, 8), float("-inf"))
    x[0, EOS] = 1.5
    x[1, EOS], x[1, 5] = 1.5, 0.5
    params = SamplingParams(min_tokens=10)
    logits_process.apply(x, [0, 1], [_row(params, [1], [3], (EOS, 7)), _row(params, [1], [3], (EOS, 7))])
    assert x[0, EOS] == 1.5 and x[0].isinf().sum() == 7
    assert x[1, EOS] == float("-inf") and x[1, 5] == 0.5


def test_presence_and_frequency_count_output_tokens_only_and_repetition_both():
    """A token only in the prompt: repetition divides it, presence and frequency leave it (vLLM)."""
    x = torch.full((1, 8), 2.0)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    logits_process.apply(x, [0], [_row(params, prompt=[1], output=[3, 3, 4])])
    assert x[0].tolist() == [2.0, 1.0, 2.0, 1.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25, 2.0, 2.0, 2.0]


def test_repetition_penalizes_the_prompt_before_any_output_token():
    """The first token (a prefill row, no output yet): the prompt's tokens are penalized already."""
    x = torch.tensor([[4.0, -4.0, 4.0, 1.0]])
    logits_process.apply(x, [0], [_row(SamplingParams(repetition_penalty=4.0), prompt=[0, 1], output=[])])
    assert x[0].tolist() == [1.0, -16.0, 4.0, 1.0]


def test_a_pending_output_token_is_read_from_the_slots_last_token_on_the_device():
    """The overlapped engine: the last output token is PENDING on the host; its count comes from
    ReqTable.last_tokens[slot]."""
    last_tokens = torch.tensor([0, 0, 6, 0], dtype=torch.int32)
    x = torch.zeros(1, 8)
    params = SamplingParams(frequency_penalty=1.0)
    logits_process.apply(x, [0], [_row(params, [1], [5, PENDING], slot=2)], last_tokens)
    assert x[0].tolist() == [0, 0, 0, 0, 0, -1.0, -1.0, 0]


def test_a_batch_without_controls_processes_no_row():
    """The host check that keeps today's path: plain rows (greedy or sampled, top-k/top-p, seeded) need
    nothing; min_p on a greedy row changes nothing (vLLM applies it to sampled rows)."""
    plain = [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3),
             SamplingParams(min_p=0.5), SamplingParams(repetition_penalty=1.0, logit_bias=())]
    assert logits_process.processed_rows(plain) == []


@pytest.mark.parametrize("kw, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=-1), "min_tokens"), (dict(logit_bias=((1, 101.0),)), "logit_bias")])
def test_sampling_params_refuse_values_outside_vllms_ranges(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


# ---------------------------------------------------------------- memory and the stress
def test_the_declared_workspace_bounds_the_processors_whatever_the_rows():
    vocab = 128256
    assert sampler_workspace_bytes(10_000, vocab) - 64 * 10_000 >= PROCESS_ROWS * process_bytes_per_row(vocab)
    assert sampler_workspace_bytes(10_000, vocab) == sampler_workspace_bytes(20_000, vocab) - 64 * 10_000


def test_every_stress_row_runs_every_processor():
    """The stress samples with STRESS_PARAMS: each asks for every penalty, a bias, min_p and min_tokens, so
    the processors run on every sampled row of every corner (the counts' chunks at their largest)."""
    for p in STRESS_PARAMS:
        assert p.penalized and p.presence_penalty and p.frequency_penalty and p.repetition_penalty != 1
        assert p.logit_bias and p.min_p > 0 and p.temperature > 0 and p.min_tokens >= 1 << 20
        assert logits_process.processed_rows([p]) == [0]


def test_the_stress_processes_the_envelopes_most_sampled_rows_with_every_token_counted(booted, monkeypatch):
    """The runner's stress corners through the real processors: the most rows one step processes equals the
    envelope's sampled_rows, each decode row counting its whole context (the longest token lists)."""
    runner = booted[0]
    seen = []
    real = logits_process.apply

    def recording(logits, rows, tokens, last_tokens=None, staging=None):
        seen.append((len(rows), logits.shape[0], sum(len(t.output) for t in tokens),
                     {t.params for t in tokens}))
        return real(logits, rows, tokens, last_tokens, staging)

    monkeypatch.setattr(logits_process, "apply", recording)
    prefill, decode = runner.stress_prefill(), runner.stress_decode()
    env = runner.envelope
    assert max(n for n, *_ in seen) == env.sampled_rows
    assert all(n == rows for n, rows, *_ in seen)  # every sampled row of every corner
    assert {p for *_, ps in seen for p in ps} == set(STRESS_PARAMS)
    decode_steps = stress.decode_steps(env, runner.kv.num_pages - 1, VOCAB, runner.cfg.seed)
    tokens = [sum(r.start + 1 for r in s.rows) for s in decode_steps]
    assert [t for *_, t, _ in seen[-len(decode_steps):]] == tokens
    assert len(prefill) + len(decode) == len(seen)


# ---------------------------------------------------------------- generation against full forwards
def full_logits(model, seq: list[int]) -> torch.Tensor:
    """The last position's logits of a from-scratch forward of seq (a fresh cache of its own)."""
    mc, n, page = CFG.model_config, len(seq), 16
    kv = KVCache(mc.num_layers, math.ceil(n / page) + 1, mc.num_kv_heads, page, mc.head_dim, torch.float32,
                 torch.device("cpu"))
    cu = torch.tensor([0, n], dtype=torch.int32)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n), cu_seqlens=cu, max_seqlen=n)
    with torch.no_grad():
        hidden = model(torch.tensor(seq), torch.arange(n), meta, kv.layers)
        return model.compute_logits(hidden[-1:])[0]


def reference_generate(model, prompt: list[int], n: int, p: SamplingParams, stop: tuple[int, ...] = ()
                       ) -> list[int]:
    """Greedy tokens: argmax of the processed logits of a full forward each step; ends on a stop token."""
    out: list[int] = []
    while len(out) < n:
        tok = int(reference_process(full_logits(model, prompt + out), prompt, out, p, stop).argmax())
        out.append(tok)
        if tok in stop:
            break
    return out


PROMPTS = [[7, 99, 1000, 3, 7, 7], [5] * 11, list(range(40, 60))]
GREEDY_CASES = {
    "repetition": SamplingParams(repetition_penalty=1.6),
    "frequency": SamplingParams(frequency_penalty=1.5),
    "presence": SamplingParams(presence_penalty=1.9),
    "mixed": SamplingParams(presence_penalty=0.7, frequency_penalty=0.6, repetition_penalty=1.3,
                            logit_bias=((77, 3.0),)),
}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name", GREEDY_CASES)
def test_greedy_generation_with_penalties_equals_the_reference_loop(booted, name, overlap):
    """Each penalty changes the greedy tokens (the test could fail) and the engine's tokens, batched with a
    plain request, equal argmax of the reference's processed full-forward logits."""
    runner = booted[0]
    p = GREEDY_CASES[name]
    eng = LLMEngine(runner, overlap=overlap)
    ids = [eng.add_request(prompt, p, max_tokens=12) for prompt in PROMPTS]
    plain = eng.add_request(PROMPTS[0], SamplingParams(), max_tokens=12)
    got = _run(eng)
    for rid, prompt in zip(ids, PROMPTS):
        assert got[rid] == reference_generate(runner.model, prompt, 12, p), (name, prompt)
    assert got[plain] == reference_generate(runner.model, PROMPTS[0], 12, SamplingParams())
    assert any(got[rid] != reference_generate(runner.model, prompt, 12, SamplingParams())
               for rid, prompt in zip(ids, PROMPTS)), "the penalty changed nothing: the test cannot fail"
    assert eng.stats.pages_used == 0


def _run(eng: LLMEngine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


@pytest.mark.parametrize("overlap", [False, True])
def test_min_tokens_masks_stop_tokens_then_stop_token_ids_end_the_request(booted, overlap):
    """A bias that makes a stop token the argmax: without min_tokens the request stops at once; with it, the
    stop tokens are masked for min_tokens tokens and the first token after is the stop (finish "stop")."""
    runner = booted[0]
    eng = LLMEngine(runner, overlap=overlap)
    forced = SamplingParams(logit_bias=((EOS, 100.0),))
    early = eng.add_request(PROMPTS[1], forced, max_tokens=10, stop_token_ids=(EOS, 17))
    held = eng.add_request(PROMPTS[1], SamplingParams(logit_bias=((EOS, 100.0),), min_tokens=4),
                           max_tokens=10, stop_token_ids=(EOS, 17))
    other = eng.add_request(PROMPTS[2], SamplingParams(logit_bias=((17, 100.0),), min_tokens=3),
                            max_tokens=10, stop_token_ids=(EOS, 17))
    outs: dict = {}
    while eng.has_unfinished():
        for out in eng.step():
            outs.setdefault(out.request_id, []).append(out)
    tokens = {rid: [t for o in os for t in o.new_token_ids] for rid, os in outs.items()}
    assert tokens[early] == [EOS] and outs[early][-1].finish_reason == "stop"
    assert len(tokens[held]) == 5 and tokens[held][-1] == EOS and outs[held][-1].finish_reason == "stop"
    assert EOS not in tokens[held][:4] and 17 not in tokens[held][:4]
    assert tokens[held] == reference_generate(runner.model, PROMPTS[1], 10, SamplingParams(
        logit_bias=((EOS, 100.0),), min_tokens=4), (EOS, 17))
    assert len(tokens[other]) == 4 and tokens[other][-1] == 17


@pytest.mark.parametrize("overlap", [False, True])
def test_min_p_of_one_keeps_only_the_most_likely_token(booted, overlap):
    """Sampled at temperature 1.5 with min_p = 1, only tokens as likely as the best survive: the greedy
    tokens; without min_p the same seeds draw other tokens (the test can fail)."""
    runner = booted[0]
    eng = LLMEngine(runner, overlap=overlap)
    hot = dict(temperature=1.5, seed=11)
    rid = eng.add_request(PROMPTS[2], SamplingParams(min_p=1.0, **hot), max_tokens=12)
    free = eng.add_request(PROMPTS[2], SamplingParams(**hot), max_tokens=12)
    got = _run(eng)
    greedy = reference_generate(runner.model, PROMPTS[2], 12, SamplingParams())
    assert got[rid] == greedy
    assert got[free] != greedy


def test_engine_refuses_controls_it_can_never_serve_naming_the_field(booted):
    eng = LLMEngine(booted[0])
    for kw, params, field in [
            (dict(stop_token_ids=(VOCAB,)), SamplingParams(), "stop_token_ids"),
            ({}, SamplingParams(logit_bias=((VOCAB, 1.0),)), "logit_bias"),
            ({}, SamplingParams(min_tokens=9), "min_tokens")]:
        with pytest.raises(RequestError) as e:
            eng.add_request([5, 6], params, max_tokens=8, **kw)
        assert e.value.field == field
    assert not eng.has_unfinished()


# ---------------------------------------------------------------- through HTTP, the openai client
def test_the_openai_client_gets_penalized_greedy_text_equal_to_the_reference(run, booted):
    """completions and chat with every penalty and a bias (greedy); /generate with the same fields."""
    model = booted[0].model
    extra = dict(repetition_penalty=1.4)
    p = SamplingParams(presence_penalty=0.6, frequency_penalty=0.9, repetition_penalty=1.4,
                       logit_bias=((300, 4.0),))

    async def body(c, app):
        async with client(c) as oa:
            comp = await oa.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                               presence_penalty=0.6, frequency_penalty=0.9,
                                               logit_bias={"300": 4}, extra_body=dict(extra, ignore_eos=True))
        gen = await post(c, "/generate", {"input_ids": [PROMPTS[0]], "max_new_tokens": 10,
                                          "presence_penalty": 0.6, "frequency_penalty": 0.9,
                                          "repetition_penalty": 1.4, "logit_bias": {"300": 4}})
        return comp, gen
    comp, (status, gen) = run(body)
    want = reference_generate(model, PROMPTS[0], 10, p)
    assert status == 200 and gen["output_ids"] == [want]
    assert comp.usage.completion_tokens == 10
    assert comp.choices[0].text == load_tokenizer(CFG).decode(want)


def test_stop_token_ids_and_min_tokens_through_the_openai_client(run):
    """A bias forces token 'z' (id 3 + 122): stop_token_ids=[that id] ends the answer at once with
    finish_reason 'stop' and no text; with min_tokens 3 the three first tokens are other tokens (the bias's
    token is masked) and the stop comes fourth; chat too, streamed."""
    z = 3 + ord("z")

    async def body(c, app):
        async with client(c) as oa:
            at_once = await oa.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0,
                                                  logit_bias={str(z): 100},
                                                  extra_body={"stop_token_ids": [z]})
            later = await oa.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0,
                                                logit_bias={str(z): 100},
                                                extra_body={"stop_token_ids": [z], "min_tokens": 3})
            stream = await oa.chat.completions.create(model="tiny", messages=test_server.MSG, max_tokens=8,
                                                      temperature=0, logit_bias={str(z): 100}, stream=True,
                                                      extra_body={"stop_token_ids": [z], "min_tokens": 2})
            chunks = [ch async for ch in stream]
        return at_once, later, chunks
    at_once, later, chunks = run(body)
    assert at_once.choices[0].finish_reason == "stop" and at_once.choices[0].text == ""
    assert at_once.usage.completion_tokens == 1
    assert later.choices[0].finish_reason == "stop" and later.usage.completion_tokens == 4
    assert "z" not in later.choices[0].text and len(later.choices[0].text) > 0
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "z" not in "".join(ch.choices[0].delta.content or "" for ch in chunks)


def test_min_tokens_holds_back_stop_strings(run):
    """A bias forces 'x' every token: stop "x" ends the text at once, but with min_tokens 5 it is looked for
    only once more than 5 tokens came (vLLM's): five x's are text, the sixth is the stop string."""
    x = 3 + ord("x")

    async def body(c, app):
        async with client(c) as oa:
            kw = dict(model="tiny", prompt="Hello", max_tokens=12, temperature=0, logit_bias={str(x): 100},
                      stop=["x"])
            return [await oa.completions.create(**kw),
                    await oa.completions.create(**kw, extra_body={"min_tokens": 5}),
                    [ch async for ch in await oa.completions.create(**kw, stream=True,
                                                                     extra_body={"min_tokens": 5})]]
    at_once, held, chunks = run(body)
    assert at_once.choices[0].text == "" and at_once.choices[0].finish_reason == "stop"
    assert held.choices[0].text == "xxxxx" and held.choices[0].finish_reason == "stop"
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "xxxxx"


BAD = [
    ("completions", "presence_penalty", 2.5), ("chat", "frequency_penalty", -3),
    ("completions", "repetition_penalty", 0), ("chat", "min_p", 1.2), ("completions", "min_tokens", -1),
    ("chat", "logit_bias", {"abc": 1}), ("completions", "logit_bias", {str(VOCAB): 1}),
    ("chat", "logit_bias", {"5": 101}), ("completions", "stop_token_ids", [VOCAB]),
    ("chat", "stop_token_ids", "5"), ("completions", "min_tokens", 9),
]


@pytest.mark.parametrize("endpoint, field, value", BAD)
def test_bad_values_are_400s_naming_the_field(run, endpoint, field, value):
    async def body(c, app):
        async with client(c) as oa:
            kw = dict(model="tiny", max_tokens=8, extra_body={field: value})
            if endpoint == "chat":
                return await refused(oa.chat.completions.create(messages=test_server.MSG, **kw))
            return await refused(oa.completions.create(prompt="Hi", **kw))
    e = run(body)
    assert isinstance(e, openai.BadRequestError) and e.param == field, (e.param, e.message)
    assert field in e.message


def test_penalized_requests_preempted_mixed_and_overlapped_give_the_plain_engines_tokens():
    """A cache so small that requests are preempted and recomputed (their counts rebuilt from the tokens they
    kept), mixed steps, the overlapped engine: the same penalized greedy and seeded tokens as a roomy plain
    engine, and the penalties change them (the test can fail)."""
    from unit_tests.test_scheduler import tiny_runner
    prompts = [[(11 * i + j) % 4000 + 1 for j in range(15 + 9 * i)] for i in range(4)]
    params = [SamplingParams(presence_penalty=1.1, frequency_penalty=0.7, repetition_penalty=1.4),
              SamplingParams(temperature=1.0, top_p=0.9, seed=7, repetition_penalty=1.5, min_p=0.1,
                             min_tokens=30)] * 2
    roomy = tiny_runner(2048)
    want = LLMEngine(roomy).generate(prompts, params, max_tokens=40)
    plain = [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, seed=7)] * 2
    assert want != LLMEngine(roomy).generate(prompts, plain, max_tokens=40)
    tight = LLMEngine(tiny_runner(160), overlap=True)
    log = tight.runner.step_log = []
    assert tight.generate(prompts, params, max_tokens=40) == want
    assert tight.stats.preemptions > 0 and tight.stats.pages_used == 0
    assert any(s.prefill_tokens and s.decode_rows for s in log), "no mixed step ran"
