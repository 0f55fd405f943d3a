"""Logprobs, echo, n and best_of through HTTP with the real `openai` client against the real server (the tiny
model with random weights on the CPU, torch backend, 127.0.0.1), on the overlapped and the plain engine;
logprobs checked against the log-softmax of the model's own forward over the whole sequence."""
from __future__ import annotations

import math

import openai
import pytest
import torch

from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.kv_cache import KVCache
from autoprofile.engine.logprobs import PROMPT_CHUNK
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.sampling import MAX_LOGPROBS, SamplingParams
from autoprofile.engine.weights import init_random
from autoprofile.layers.attention import AttentionMetadata
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
    """Greedy and sampled (temperature, top-k: processed logits differ from raw ones) requests with echo: every
    prompt token's logprob (the first None) and every output token's equal the reference's raw log-softmax,
    the prompt scored across its two prefill chunks."""
    runner = booted[0]

    async def body(c, app):
        async with client(c) as oa:
            return [await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=k, echo=True,
                                                temperature=p.temperature, seed=p.seed,
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


