"""An MoE model (tiny-moe: Qwen3-MoE) and an MLA + MoE model (tiny-mla: DeepSeek-V2) behind the real HTTP
server on CPU: 48 concurrent completions whose K/V is three times the cache (preemption), then the routing
corners' worst case as traffic (every prompt one repeated token); every request answered, 0 OOM, every
page back."""
from __future__ import annotations

import asyncio
import random

import pytest

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from unit_tests.cpu_server import boot_cpu
from unit_tests.test_server import serve

KV_TOKENS = 1024


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-mla"])
def booted(request):
    cfg = validate(ServerConfig(model=request.param, dtype="float32", attention_backend="torch",
                                max_req_total_len=256, batch_max_tokens=128, running_max_req_size=16,
                                graph_max_batch_size=4, max_waiting_requests=64, report_dir=None))
    runner, result = boot_cpu(cfg, KV_TOKENS)
    runner.stress_prefill()  # the routing corners run on this cache too
    runner.stress_decode()
    yield cfg, runner, result
    runner.teardown()


def test_concurrent_requests_past_the_cache_are_all_answered(booted):
    cfg, runner, result = booted
    engine = LLMEngine(runner)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 4000) for _ in range(rng.randrange(40, 120))] for _ in range(40)]
    prompts += [[7] * 100] * 8  # identical tokens: every token of a step to the same experts

    async def body(client, app):
        async def one(ids):
            req = {"prompt": ids, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
            r = await client.post("/v1/completions", json=req)
            return r.status, await r.json()
        return await asyncio.gather(*(one(p) for p in prompts))

    answers = serve(engine, result, body, cfg=cfg)
    assert [status for status, _ in answers] == [200] * len(prompts), answers[:3]
    assert all(a["usage"]["completion_tokens"] == 12 for _, a in answers)
    stats = engine.stats
    assert stats.preemptions > 0 and stats.ooms == 0 and stats.failed_steps == 0
    assert stats.pages_used == 0 and not engine.has_unfinished()
    same = {tuple(a["choices"][0]["text"]) for _, a in answers[40:]}
    assert len(same) == 1  # greedy, one prompt: one answer, through preemption and the prefix cache
