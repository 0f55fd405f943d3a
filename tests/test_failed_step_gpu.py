"""GPU: a mixed step that fails before the device's page table learns a decode row's new page leaves no stale
column (unit_tests/test_failed_step.py on the CPU): the row's next steps (decode graphs here, or the eager
decode) write K/V into its own page, not into the page the prefix cache maps to another prompt. Compared with
the same sequence served without the failure (bf16 is not batch-invariant: A and B may differ, D may not)."""
from __future__ import annotations

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.envelope import EnvelopeError
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.weights import init_random
from tests.conftest import require_backend
from unit_tests.test_failed_step import A, B, C, D, fail_once, grows_a_decode_row, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CASES = [("torch", "float32"), ("aiter_triton", "bfloat16")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{b}-{d}" for b, d in CASES])
def runner(request):
    backend, dtype = request.param
    require_backend(backend)
    r = ModelRunner(validate(ServerConfig(model="tiny", dtype=dtype, attention_backend=backend,
                                          max_req_total_len=128, batch_max_tokens=64, graph_max_batch_size=4,
                                          running_max_req_size=4, report_dir=None)))
    init_random(r.model, seed=1, std=0.08)
    r.build(1024)
    yield r
    r.teardown()


def serve(engine: LLMEngine) -> dict[str, tuple[list[int], str]]:
    """C, then A with B arriving when A's next decode row needs its second page, then D; by name."""
    out = run_named(engine, C=C)
    a = engine.add_request(A, max_tokens=14)
    req_a, names, got = engine.scheduler.waiting[0], {a: "A"}, {}
    while engine.has_unfinished():
        if "B" not in names.values() and req_a.num_computed == 16:
            names[engine.add_request(B, max_tokens=4)] = "B"
        for o in engine.step():
            tokens, _ = got.get(names[o.request_id], ([], ""))
            got[names[o.request_id]] = (tokens + o.new_token_ids, o.finish_reason)
    return {**out, **got, **run_named(engine, D=D)}


def run_named(engine: LLMEngine, **prompts) -> dict[str, tuple[list[int], str]]:
    ids = {engine.add_request(p, max_tokens=8): name for name, p in prompts.items()}
    return {ids[rid]: v for rid, v in run(engine).items()}


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_mixed_step_leaves_no_stale_page_on_the_gpu(runner, monkeypatch, overlap):
    want = serve(LLMEngine(runner, overlap=overlap))
    engine = LLMEngine(runner, overlap=overlap)
    fired = fail_once(monkeypatch, runner, "launch", grows_a_decode_row, EnvelopeError("injected"))
    got = serve(engine)
    assert fired and got["B"][1] == "error" and want["B"][1] == "length"
    assert got["A"][1] == "length" and engine.stats.prefix_hit_tokens == 32
    assert got["D"] == want["D"]
    assert engine.stats.pages_used == 0
