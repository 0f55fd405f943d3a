"""GPU: the overlapped engine (LLMEngine(overlap=True), the server's default on one GPU). Its launch of a step
never waits for the GPU (torch's sync debug mode raises on any synchronizing call: a blocking copy, .item(),
.tolist()), through prefill chunks, mixed steps, eager decode and decode graphs fed PENDING ids from the
request table, on a llama-shaped model, an MoE, an MLA and a vision-language one; and it serves the tokens of
the plain engine on the llama-shaped model."""
from __future__ import annotations

import json
import random

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.sampling import GREEDY, SamplingParams
from autoprofile.engine.weights import init_random
from tests.conftest import require_backend
from tests.test_deterministic_gpu import SMALL_LLAMA

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    require_backend("aiter_triton")
    folder = tmp_path_factory.mktemp("small-llama")
    (folder / "config.json").write_text(json.dumps(SMALL_LLAMA))
    # 48 running requests over a graph limit of 32: both graph replays and eager decode steps run
    cfg = validate(ServerConfig(model=str(folder), load_format="dummy",
                                attention_backend="aiter_triton", max_req_total_len=2048,
                                batch_max_tokens=512, graph_max_batch_size=32, running_max_req_size=48,
                                report_dir=None))
    r = ModelRunner(cfg)
    init_random(r.model, seed=1, std=0.02)
    r.build(65536)
    yield r
    r.teardown()


def crowd(n: int, seed: int = 0, vocab: int = 31000) -> list[tuple[list[int], SamplingParams, int]]:
    rng = random.Random(seed)
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, seed=5)]
    return [([rng.randrange(3, vocab) for _ in range(rng.randrange(1, 900))], params[i % 3],
             rng.randrange(1, 40)) for i in range(n)]


def strict_serve(runner: ModelRunner, waves: list[list]) -> tuple[LLMEngine, list, dict, dict]:
    """Serve the waves on an overlapped engine, each launch under torch's sync debug mode "error" (a launch
    that synchronises raises: a failed step). -> the engine, the step log, the tokens and the max_tokens of
    every request."""
    engine = LLMEngine(runner, overlap=True)
    launch = runner.launch

    def strict(step):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    runner.launch = strict
    log = runner.step_log = []
    out: dict[str, list[int]] = {}
    ids = {}
    try:
        for wave in waves:
            ids |= {engine.add_request(p, sp, n, mm=r[0] if r else None): n for p, sp, n, *r in wave}
            while engine.has_unfinished():
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
    finally:
        del runner.launch
        runner.step_log = None
    return engine, log, out, ids


def test_a_launch_never_waits_for_the_gpu(runner):
    # a crowd of prompts up to 900 tokens, then 48 short ones at once: decode steps of 48 rows, eager
    waves = [crowd(120), [([7 + i, 8], GREEDY, 12) for i in range(48)]]
    engine, log, out, ids = strict_serve(runner, waves)
    assert engine.stats.failed_steps == 0, "a launch synchronised (see the log)"
    assert {rid: len(t) for rid, t in out.items()} == ids
    assert engine.stats.pages_used == 0
    kinds = {(bool(s.prefill_rows), bool(s.decode_rows), bool(s.graph_rows)) for s in log}
    assert {(True, True, False), (False, True, True), (False, True, False)} <= kinds, kinds


def image_requests(mc, n: int) -> list[tuple]:
    """n requests of tiny-vl, each a 12 x 20-patch image (60 image tokens) between text, with its M-RoPE
    positions, as the server's preprocessing hands them over (pixels in host memory)."""
    from autoprofile.engine.multimodal import ImageInput, MultiModalInput
    from models.qwen2_5_vl import mrope_positions

    grid = (1, 12, 20)
    ids = [5, 6, mc.vision_start_token_id] + [mc.image_token_id] * 60 + [mc.vision_end_token_id, 9, 10]
    out = []
    for i in range(n):
        positions, delta = mrope_positions(ids, [grid], mc)
        pixels = torch.randn(240, mc.vision.patch_dim, generator=torch.Generator().manual_seed(i))
        out.append((ids, GREEDY, 8, MultiModalInput([ImageInput(pixels, grid, 3, i)], positions, delta)))
    return out


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-mla", "tiny-vl"])
def test_moe_mla_and_vl_launches_never_wait_for_the_gpu(model):
    """The server serves MoE (AITER's Triton experts, our router), MLA (latent cache, our MLA decode,
    AITER's varlen prefill) and vision-language models (images encoded in a step, M-RoPE positions)
    overlapped too: their launches, prefill, mixed, graph and eager decode, never synchronise either."""
    require_backend("aiter_triton")
    cfg = validate(ServerConfig(model=model, attention_backend="aiter_triton", max_req_total_len=2048,
                                batch_max_tokens=512, graph_max_batch_size=16, running_max_req_size=32,
                                report_dir=None))
    runner = ModelRunner(cfg)
    runner.build(64 * 1024)
    try:
        first = crowd(60, seed=2, vocab=runner.model_config.vocab_size)
        if runner.is_vl:
            first = first[:40] + image_requests(runner.model_config, 20)
        waves = [first, [([7 + i, 8], GREEDY, 12) for i in range(32)]]
        engine, log, out, ids = strict_serve(runner, waves)
    finally:
        runner.teardown()
    assert engine.stats.failed_steps == 0, "a launch synchronised (see the log)"
    assert {rid: len(t) for rid, t in out.items()} == ids
    kinds = {(bool(s.prefill_rows), bool(s.decode_rows), bool(s.graph_rows)) for s in log}
    assert {(True, True, False), (False, True, True), (False, True, False)} <= kinds, kinds


def test_overlap_serves_the_greedy_tokens_of_one_step_at_a_time(runner):
    """Greedy, same batches: the overlapped engine schedules what the plain one does (no stop tokens), so the
    tokens match bit for bit even with batch-dependent kernels."""
    prompts = [p for p, _, _ in crowd(40, seed=1)]
    want = LLMEngine(runner).generate(prompts, GREEDY, max_tokens=24)
    got = LLMEngine(runner, overlap=True).generate(prompts, GREEDY, max_tokens=24)
    assert got == want


PENALIZED = [SamplingParams(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3,
                            logit_bias=((11, 2.0),)),
             SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, min_p=0.05, min_tokens=4),
             GREEDY]


def test_sampling_controls_overlapped_never_wait_and_equal_the_plain_engine(runner):
    """Penalties, logit_bias, min_p and min_tokens (logits_process): their token counts read the PENDING last
    token on the device, so an overlapped launch never synchronises, and the greedy penalized tokens equal the
    plain engine's (the same batches, bit for bit)."""
    rng = random.Random(3)
    wave = [([rng.randrange(3, 31000) for _ in range(rng.randrange(1, 400))], PENALIZED[i % 3], 20)
            for i in range(60)]
    engine, log, out, ids = strict_serve(runner, [wave])
    assert engine.stats.failed_steps == 0, "a launch synchronised (see the log)"
    assert {rid: len(t) for rid, t in out.items()} == ids
    # at most the 48 running requests: the plain and overlapped engines then build the same batches (more,
    # and the overlapped engine frees a finished slot one step later: other batches, other greedy tokens
    # from batch-dependent kernels, with or without penalties; measured on an H100)
    prompts = [p for p, _, _ in wave][:40]
    want = LLMEngine(runner).generate(prompts, PENALIZED[0], max_tokens=24)
    got = LLMEngine(runner, overlap=True).generate(prompts, PENALIZED[0], max_tokens=24)
    assert got == want
    assert got != LLMEngine(runner).generate(prompts, GREEDY, max_tokens=24)  # the penalties changed tokens
