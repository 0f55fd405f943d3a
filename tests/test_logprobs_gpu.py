"""GPU: logprobs on CUDA (autoprofile.engine.logprobs). The overlapped engine's launches stay free of any
host sync with logprobs and prompt logprobs on; the logprobs of generated tokens (decode steps, graphs) equal
the prompt logprobs of the same tokens fed back as a prompt (prefill chunks); a greedy token is its row's
best; and the stress reaches the logprob buffers at the envelope's sampled rows and PROMPT_CHUNK."""
from __future__ import annotations

import random

import pytest
import torch

from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.logprobs import PROMPT_CHUNK
from autoprofile.engine.sampling import MAX_LOGPROBS, SamplingParams
from tests.test_overlap_gpu import crowd, runner, strict_serve  # noqa: F401 - the module's runner fixture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ATOL = 0.08  # bf16 logits through two attention paths (prefill chunks vs paged decode)


def with_logprobs(requests, k: int, prompt_k: int | None):
    return [(p, SamplingParams(sp.temperature, sp.top_p, sp.top_k, sp.seed, logprobs=k,
                               prompt_logprobs=prompt_k), n) for p, sp, n in requests]


def test_a_launch_with_logprobs_never_waits_for_the_gpu(runner):  # noqa: F811
    first = crowd(60, seed=3)
    waves = [with_logprobs(first[:30], MAX_LOGPROBS, 5) + with_logprobs(first[30:], 2, None)]
    engine, log, out, ids = strict_serve(runner, waves)
    assert engine.stats.failed_steps == 0, "a launch synchronised (see the log)"
    assert {rid: len(t) for rid, t in out.items()} == ids


def run_all(engine: LLMEngine, prompt: list[int], params: SamplingParams, n: int):
    rid = engine.add_request(prompt, params, n)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    tokens = [t for o in outs for t in o.new_token_ids]
    lps = [e for o in outs for e in (o.logprobs or [])]
    prompt_lps = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
    return tokens, lps, prompt_lps


@pytest.mark.parametrize("overlap", [True, False])
def test_generated_logprobs_equal_the_prompt_logprobs_of_the_same_tokens(runner, overlap):  # noqa: F811
    rng = random.Random(7)
    prompt = [rng.randrange(3, 31000) for _ in range(700)]  # two prefill chunks of --batch_max_tokens 512
    engine = LLMEngine(runner, overlap=overlap)
    tokens, lps, _ = run_all(engine, prompt, SamplingParams(logprobs=MAX_LOGPROBS), 24)
    assert len(lps) == len(tokens) == 24
    for t, (tid, lp, top) in zip(tokens, lps):
        # greedy: the best of its row (among its ties: bf16 logits tie, and top-k orders a tie either way;
        # an H200 run had 4219 sampled, 25299 listed first at the same -5.7589)
        assert tid == t and len(top) == MAX_LOGPROBS and top[0][1] == lp
        assert t in {i for i, v in top if v == lp}
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    _, _, again = run_all(engine, prompt + tokens, SamplingParams(prompt_logprobs=MAX_LOGPROBS), 1)
    assert again[0] is None and len(again) == len(prompt) + len(tokens)
    fed = again[len(prompt):]
    assert [e[0] for e in fed] == tokens
    assert [e[1] for e in fed] == pytest.approx([e[1] for e in lps], abs=ATOL)
    overlap_ids = [len({i for i, _ in a[2]} & {i for i, _ in b[2]}) for a, b in zip(fed, lps)]
    assert min(overlap_ids) >= MAX_LOGPROBS - 4, overlap_ids
    assert engine.stats.pages_used == 0


def test_the_stress_reaches_the_logprob_buffers(runner):  # noqa: F811
    runner.sampler.logprob_log = []
    try:
        runner.stress_prefill()
        runner.stress_decode()
        log = runner.sampler.logprob_log
    finally:
        runner.sampler.logprob_log = None
    env = runner.envelope
    assert max(rows for kind, rows, _ in log if kind == "sampled") == env.sampled_rows
    assert max(rows for kind, rows, _ in log if kind == "prompt") == min(PROMPT_CHUNK, env.prefill_tokens)
    assert {k for _, _, k in log} == {MAX_LOGPROBS}
