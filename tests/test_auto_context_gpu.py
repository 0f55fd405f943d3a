"""GPU: --max_req_total_len auto on a card that does not hold one request of the model's context.

qwen3-30b-a3b in bf16 (random weights) on an 80 GB H100: its 262,144-token context needs a cache of 262,160
tokens, and about 199,700 fit beside 57 GiB of weights. Unset, the context is cut to the longest request the
measured cache holds; the rebuild and the stress run the shorter envelope; the engine serves it."""
from __future__ import annotations

import json

import pytest
import torch

from autoprofile import budget
from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.profiler import boot
from tests.conftest import require_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GiB = 1 << 30


def test_auto_context_is_cut_to_what_the_measured_cache_holds(tmp_path):
    require_backend("aiter_triton")
    if torch.cuda.mem_get_info()[1] > 100 * GiB:
        pytest.skip("an H200 holds qwen3-30b-a3b's whole context: nothing to cut")
    cfg = validate(ServerConfig(model="qwen3-30b-a3b", load_format="dummy", profile_cache=None,
                                report_dir=str(tmp_path)))
    assert cfg.max_req_total_len is None and cfg.context_len == 262144
    runner, result = boot(cfg)
    try:
        cut = result.cfg.context_len
        assert result.context_cut_from == 262144 and cut < 262144
        assert cut == (result.tokens // 16 - 1) * 16  # one request of it and the pad page: the whole cache
        rows = cfg.graph_max_batch_size
        assert budget.min_usable_tokens(cut, 16, cfg.batch_max_tokens, rows) == result.tokens
        assert runner.envelope.max_req_total_len == cut and runner.cfg.context_len == cut
        report = json.loads((tmp_path / "budget_report.json").read_text())
        assert report["max_req_total_len"] == cut and report["context_cut_from"] == 262144
        engine = LLMEngine(runner)
        out = engine.generate([[5] * 4000, list(range(100, 300))], max_tokens=8)
        assert [len(o) for o in out] == [8, 8] and engine.stats.ooms == 0
        print(f"auto context: {cut} of 262144 tokens, KV {result.tokens} tokens, attempts {result.attempts}")
    finally:
        runner.teardown()
        torch.cuda.empty_cache()
