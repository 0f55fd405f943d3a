"""Logprobs, echo, n and best_of through HTTP with the real `openai` client against the real server (the tiny
model with random weights on the CPU, torch backend, 127.0.0.1), on the overlapped and the plain engine;
logprobs checked against the log-softmax of the model's own forward over the whole sequence."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.kv_cache import KVCache
from autoprofile.engine.logprobs import PROMPT_CHUNK
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.sampling import MAX_LOGPROBS, SamplingParams
from autoprofile.engine.weights import init_random
from autoprofile.layers.attention import AttentionMetadata
from autoprofile.serving import protocol
from autoprofile.serving.tokenizer import load_tokenizer
from unit_tests import test_server
from unit_tests.test_openai_api import client, refused
from unit_tests.test_server import CFG, MSG, serve

booted = test_server.booted
PROMPT = [(7 * i + 3) % 4000 + 60 for i in range(100)]  # 100 ids: two prefill chunks (--batch_max_tokens 64)
ATOL = 2e-4
TOKENIZER = load_tokenizer(CFG)
PARAMS = [SamplingParams(), SamplingParams(temperature=0.5, top_k=5, seed=11)]  # greedy, sampled


@pytest.fixture(params=[True, False], ids=["overlap", "plain"])
def engine(request, booted):
    eng = LLMEngine(booted[0], overlap=request.param)
    yield eng
    assert eng.stats.pages_used == 0 and not eng.has_unfinished()


@pytest.fixture
def run(engine, booted):
    return lambda body, **kw: serve(engine, booted[1], body, **kw)


def reference(runner, seq: list[int]) -> torch.Tensor:
    """log_softmax of the model's raw logits [len(seq), vocab] at every position of `seq`, by one forward over
    the whole sequence into a cache of its own (position p scores token p + 1)."""
    mc, ps, n = runner.model_config, CFG.page_size, len(seq)
    kv = KVCache(mc.num_layers, math.ceil(n / ps) + 1, mc.num_kv_heads, ps, mc.head_dim, torch.float32,
                 torch.device("cpu"))
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n) + ps,
                             cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n)
    with torch.no_grad():
        hidden = runner.model(torch.tensor(seq), torch.arange(n), meta, kv.layers)
        return torch.log_softmax(runner.model.compute_logits(hidden).float(), dim=-1)


def text_of(token_id: int) -> str:
    return TOKENIZER.decode([token_id])


def check_top(top: dict[str, float], k: int, token_id: int, ref_row: torch.Tensor) -> None:
    """A legacy top_logprobs dict: the reference's k best logprobs and the sampled token's (by descending
    logprob; ids that decode to the same text keep the best)."""
    vals, ids = ref_row.topk(k)
    want: dict[str, float] = {}
    for i, lp in sorted({*zip(ids.tolist(), vals.tolist()), (token_id, ref_row[token_id].item())},
                        key=lambda e: -e[1]):
        want.setdefault(text_of(i), lp)
    assert list(top) == list(want)
    assert list(top.values()) == pytest.approx(list(want.values()), abs=ATOL)
    assert list(top.values()) == sorted(top.values(), reverse=True)


# ---------------------------------------------------------------- completions
def test_completion_logprobs_and_echo_equal_the_reference(run, booted):
    """Greedy and sampled (temperature, top-k: processed logits differ from raw ones) requests with echo:
    every prompt token's logprob (the first None) and every output token's equal the reference's raw log-softmax,
    the prompt scored across its two prefill chunks."""
    runner = booted[0]

    async def body(c, app):
        async with client(c) as oa:
            return [await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=k,
                                                echo=True, temperature=p.temperature, seed=p.seed,
                                                extra_body={"ignore_eos": True, "top_k": p.top_k})
                    for p, k in zip(PARAMS, (5, 3))]
    for r, k, params in zip(run(body), (5, 3), PARAMS):
        ch = r.choices[0]
        lp = ch.logprobs
        n = len(PROMPT)
        seq = PROMPT + LLMEngine(runner).generate([PROMPT], params, max_tokens=6)[0]
        assert len(lp.tokens) == n + 6 == r.usage.prompt_tokens + r.usage.completion_tokens
        ref = reference(runner, seq)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = ref[torch.arange(len(seq) - 1), torch.tensor(seq[1:])].tolist()
        assert lp.token_logprobs[1:] == pytest.approx(want, abs=ATOL)
        for p in range(1, len(seq)):
            check_top(lp.top_logprobs[p], k, seq[p], ref[p - 1])
        assert lp.tokens == [text_of(t) for t in seq]
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(seq))]
        assert ch.text == "".join(lp.tokens)


def same_entries(a: list, b: list) -> None:
    """Chat logprob entries alike: the same tokens, logprobs equal up to float error (a request that takes its
    prompt's pages from the prefix cache computes its last positions through another attention path)."""
    flat = lambda es: [(e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs]) for e in es]  # noqa
    values = lambda es: [v for e in es for v in (e.logprob, *(t.logprob for t in e.top_logprobs))]  # noqa
    assert flat(a) == flat(b) and values(a) == pytest.approx(values(b), abs=ATOL)


def chat_prompt_ids(messages) -> list[int]:
    limits = protocol.Limits(("tiny",), CFG.context_len, CFG.model_config.vocab_size)
    return protocol.parse_chat({"messages": messages}, limits, TOKENIZER).prompt_ids


def test_chat_logprobs_equal_the_reference_streamed_or_not(run, booted):
    """Chat `logprobs` with `top_logprobs`: each token's logprob and its top-k (descending, k entries) equal
    the reference's; the streamed chunks carry the same entries as the whole response; top_logprobs 0 gives
    none; a seeded sampled request streams what it returns whole."""
    runner = booted[0]
    kw = dict(model="tiny", messages=MSG, max_tokens=5, logprobs=True, extra_body={"ignore_eos": True})

    async def body(c, app):
        async with client(c) as oa:
            whole = await oa.chat.completions.create(**kw, top_logprobs=4, temperature=0)
            stream = [ch async for ch in await oa.chat.completions.create(**kw, top_logprobs=4, temperature=0,
                                                                          stream=True)]
            seeded = await oa.chat.completions.create(**kw, top_logprobs=0, temperature=0.9, seed=3)
            seeded_stream = [ch async for ch in await oa.chat.completions.create(
                **kw, top_logprobs=0, temperature=0.9, seed=3, stream=True)]
            return whole, stream, seeded, seeded_stream
    whole, stream, seeded, seeded_stream = run(body)
    prompt = chat_prompt_ids(MSG)
    seq = prompt + LLMEngine(runner).generate([prompt], max_tokens=5)[0]
    ref = reference(runner, seq)
    content = whole.choices[0].logprobs.content
    assert len(content) == 5
    for i, entry in enumerate(content):
        p = len(prompt) + i  # scores seq[p] from position p - 1
        assert entry.token == text_of(seq[p]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(ref[p - 1, seq[p]].item(), abs=ATOL)
        vals, ids = ref[p - 1].topk(4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(vals.tolist(), abs=ATOL)
        assert [t.token for t in entry.top_logprobs] == [text_of(i) for i in ids.tolist()]
    streamed = [e for ch in stream for c in ch.choices if c.logprobs for e in c.logprobs.content]
    same_entries(streamed, content)
    s_content = seeded.choices[0].logprobs.content
    assert len(s_content) == 5 and all(e.top_logprobs == [] for e in s_content)
    s_streamed = [e for ch in seeded_stream for c in ch.choices if c.logprobs for e in c.logprobs.content]
    same_entries(s_streamed, s_content)
    assert "".join(c.delta.content or "" for ch in seeded_stream for c in ch.choices) == \
        seeded.choices[0].message.content


def test_streamed_completion_with_echo_equals_the_whole_response(run):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=5, logprobs=2, echo=True, temperature=0.8, seed=9,
              extra_body={"ignore_eos": True})

    async def body(c, app):
        async with client(c) as oa:
            whole = await oa.completions.create(**kw)
            chunks = [ch async for ch in await oa.completions.create(**kw, stream=True)]
            return whole, chunks
    whole, chunks = run(body)
    lp = whole.choices[0].logprobs
    parts = [c for ch in chunks for c in ch.choices]
    assert "".join(c.text for c in parts) == whole.choices[0].text
    got = {key: [x for c in parts if c.logprobs for x in getattr(c.logprobs, key)]
           for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert got["tokens"] == lp.tokens and got["text_offset"] == lp.text_offset
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert got["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:], abs=ATOL)
    for mine, theirs in zip(got["top_logprobs"][1:], lp.top_logprobs[1:]):
        assert list(mine) == list(theirs) and list(mine.values()) == pytest.approx(list(theirs.values()),
                                                                                   abs=ATOL)
    assert len(lp.tokens) == len(PROMPT) + 5


def test_lm_eval_loglikelihood_request_max_tokens_0_or_1(run, booted):
    """What lm-evaluation-harness's local-completions sends for a loglikelihood (echo, logprobs 1, max_tokens
    1; some clients send 0): the prompt's logprobs, the first None; with 0 nothing generated is returned."""
    runner = booted[0]

    async def body(c, app):
        async with client(c) as oa:
            one = await oa.completions.create(model="tiny", prompt=PROMPT[:40], max_tokens=1, logprobs=1,
                                              echo=True, temperature=0, seed=1234)
            zero = await oa.completions.create(model="tiny", prompt=PROMPT[:40], max_tokens=0, logprobs=1,
                                               echo=True, temperature=0)
            return one, zero
    one, zero = run(body)
    ref = reference(runner, PROMPT[:40])
    want = ref[torch.arange(39), torch.tensor(PROMPT[1:40])].tolist()
    assert one.choices[0].logprobs.token_logprobs[1:40] == pytest.approx(want, abs=ATOL)
    assert len(one.choices[0].logprobs.tokens) == 41 and one.usage.completion_tokens == 1
    assert zero.choices[0].logprobs.token_logprobs[0] is None
    assert zero.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want, abs=ATOL)
    assert zero.choices[0].text == TOKENIZER.decode(PROMPT[:40]) and zero.usage.completion_tokens == 0


# ---------------------------------------------------------------- n, best_of
def test_n_choices_share_the_prompts_pages(run, engine):
    """n=4: the first choice prefills the prompt, the other three take its full pages from the prefix cache
    (100 tokens, 16-token pages: 6 full pages before the last token); each computes only the rest."""
    before = engine.stats.prefix_hit_tokens

    async def body(c, app):
        async with client(c) as oa:
            return await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=4,
                                               temperature=1.0, extra_body={"ignore_eos": True})
    r = run(body)
    full_pages = (len(PROMPT) - 1) // CFG.page_size
    assert engine.stats.prefix_hit_tokens - before == 3 * full_pages * CFG.page_size
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == len(PROMPT)


def test_seeded_choices_are_distinct_and_reproducible(run):
    """With `seed`, choice i draws from its own generator seeded seed + i: the same request gives the same
    choices, each choice the text of an n=1 request with seed + i; greedy n gives identical choices."""
    kw = dict(model="tiny", prompt="Once upon", max_tokens=8, temperature=1.0,
              extra_body={"ignore_eos": True})

    async def body(c, app):
        async with client(c) as oa:
            a = await oa.completions.create(**kw, n=3, seed=7)
            b = await oa.completions.create(**kw, n=3, seed=7)
            alone = [await oa.completions.create(**kw, seed=7 + i) for i in range(3)]
            chunks = [ch async for ch in await oa.completions.create(**kw, n=3, seed=7, stream=True)]
            greedy = await oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, n=3,
                                                      temperature=0)
            return a, b, alone, chunks, greedy
    a, b, alone, chunks, greedy = run(body)
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices] == [r.choices[0].text for r in alone]
    assert len(set(texts)) == 3
    streamed = ["".join(c.text for ch in chunks for c in ch.choices if c.index == i) for i in range(3)]
    assert streamed == texts
    assert len({c.message.content for c in greedy.choices}) == 1 and len(greedy.choices) == 3


def test_best_of_returns_the_choices_of_highest_cumulative_logprob(run):
    """best_of=4, n=2, seeded: the four generated choices are the n=1 requests with seed + i; the two returned
    are those of the highest cumulative logprob, best first; usage counts the two returned (vLLM's rule)."""
    kw = dict(model="tiny", prompt="The cat", max_tokens=6, temperature=1.2, extra_body={"ignore_eos": True})

    async def body(c, app):
        async with client(c) as oa:
            best = await oa.completions.create(**kw, n=2, best_of=4, seed=21)
            alone = [await oa.completions.create(**kw, seed=21 + i, logprobs=0) for i in range(4)]
            return best, alone
    best, alone = run(body)
    ranked = sorted(alone, key=lambda r: -sum(r.choices[0].logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [r.choices[0].text for r in ranked[:2]]
    assert len({r.choices[0].text for r in alone}) == 4
    assert best.choices[0].logprobs is None and best.usage.completion_tokens == 12


def test_choices_beyond_what_the_server_holds_are_a_400(run):
    async def body(c, app):
        async with client(c) as oa:
            return await refused(oa.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=11))
    err = run(body)
    assert err.status_code == 400 and err.param == "n" and "at most 10" in err.message


# ---------------------------------------------------------------- the stress
def test_the_stress_runs_the_logprob_buffers_at_their_limits():
    """Every stress row asks for MAX_LOGPROBS: the sampled rows' log-softmax and top-k at the envelope's
    sampled_rows, prefill (and decode) corners alike; prompt logprobs on every prefill token, in chunks of
    PROMPT_CHUNK rows of logits, the largest step's tokens all scored."""
    r = ModelRunner(validate(ServerConfig(**{**test_server.FLAGS, "batch_max_tokens": PROMPT_CHUNK + 44,
                                             "max_req_total_len": 512})))
    init_random(r.model, seed=1, std=0.08)
    r.build(2048)
    env = r.envelope
    r.sampler.logprob_log = []
    r.stress_prefill()
    prefill = list(r.sampler.logprob_log)
    r.sampler.logprob_log = []
    r.stress_decode()
    decode = r.sampler.logprob_log
    r.teardown()
    sampled = [rows for kind, rows, k in prefill + decode if kind == "sampled"]
    assert {k for _, _, k in prefill + decode} == {MAX_LOGPROBS}
    assert max(sampled) == env.sampled_rows and max(rows for kind, rows, _ in decode) == env.decode_rows
    chunks = [rows for kind, rows, _ in prefill if kind == "prompt"]
    assert max(chunks) == PROMPT_CHUNK == min(PROMPT_CHUNK, env.prefill_tokens)
    assert PROMPT_CHUNK + 44 - PROMPT_CHUNK in chunks  # corner (b): one request of every token of a step


# ---------------------------------------------------------------- a real client: lm-evaluation-harness
def bpe_folder(folder) -> str:
    """A byte-level BPE tokenizer folder for the tiny model (its 4096 ids), as transformers loads it."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, said the cat"] * 50, trainer)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([f"<t{i}>" for i in range(tok.get_vocab_size(), 4096)])  # every id of the model has text
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "bos_token": "<s>",
        "unk_token": "<unk>"}))
    return str(folder)


def test_lm_eval_local_completions_loglikelihood_and_generate_until(run, booted, tmp_path):
    """lm-evaluation-harness's `local-completions` model against the server: its loglikelihoods equal the
    reference's sums over the continuation tokens (and is_greedy its argmax test); generate_until returns
    text."""
    pytest.importorskip("lm_eval")
    import asyncio

    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoTokenizer

    from autoprofile.model_config import load_model_config
    from autoprofile.serving.tokenizer import HFTokenizer
    folder = bpe_folder(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(folder)
    pairs = [("the quick brown fox", " jumps over"), ("said the", " lazy dog")]

    async def body(c, app):
        url = str(c.make_url("/v1/completions"))
        assert url.startswith("http://127.0.0.1:")
        lm = LocalCompletionsAPI(base_url=url, model="tiny", tokenizer_backend="huggingface",
                                 tokenizer=folder, max_length=200, max_gen_toks=8)
        ll = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
        gen = [Instance("generate_until", {}, ("the quick", {"until": ["\n"], "max_gen_toks": 8}), 0)]
        async with client(c) as oa:
            direct = await oa.completions.create(model="tiny", prompt=hf("the quick").input_ids, max_tokens=8,
                                                 temperature=0, stop=["\n"])
        return (await asyncio.to_thread(lm.loglikelihood, ll, disable_tqdm=True),
                await asyncio.to_thread(lm.generate_until, gen, disable_tqdm=True), direct)
    scores, texts, direct = run(body, tokenizer=HFTokenizer(Path(folder), load_model_config("tiny").raw))
    for (ctx, cont), (logprob, is_greedy) in zip(pairs, scores, strict=True):
        ctx_ids, cont_ids = (hf(t, add_special_tokens=False).input_ids for t in (ctx, cont))
        seq = ctx_ids + cont_ids
        ref = reference(booted[0], seq)
        want = [ref[p - 1, seq[p]].item() for p in range(len(ctx_ids), len(seq))]
        assert logprob == pytest.approx(sum(want), abs=1e-3)
        assert is_greedy == all(ref[p - 1].argmax().item() == seq[p] for p in range(len(ctx_ids), len(seq)))
    assert texts == [direct.choices[0].text] and texts[0]
