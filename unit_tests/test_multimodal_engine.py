"""Images through the real engine on the tiny Qwen2.5-VL (fp32, CPU, torch backend): the runner's encoder
step, its buffer, M-RoPE positions over chunks and in decode, the image stress corner, prefix caching of
image pages; greedy tokens against Hugging Face transformers' generate with the same weights."""
from __future__ import annotations

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.envelope import EnvelopeError
from autoprofile.engine.multimodal import ImageInput, MultiModalInput
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.scheduler import Step
from models.qwen2_5_vl import mrope_positions
from unit_tests.test_qwen2_5_vl import IMG, ONE, TWO, models, pixels, prompt  # noqa: F401 - a fixture

transformers = pytest.importorskip("transformers")
NEW = 6


def runner_for(folder, batch: int, visual: int = 2) -> ModelRunner:
    cfg = validate(ServerConfig(model=str(folder), attention_backend="torch", dtype="float32", page_size=16,
                                batch_max_tokens=batch, max_req_total_len=512, graph_max_batch_size=4,
                                max_image_pixels=96 * 28 * 28, visual_batch_size=visual, report_dir=None))
    runner = ModelRunner(cfg)
    runner.build(4096)
    return runner


def image_input(ids: list[int], grids, model_config, seed: int = 1) -> MultiModalInput:
    positions, delta = mrope_positions(ids, grids, model_config)
    at = [i for i, t in enumerate(ids) if t == IMG and (i == 0 or ids[i - 1] != IMG)]
    values = pixels(grids, seed).split([t * h * w for t, h, w in grids])
    return MultiModalInput([ImageInput(v, g, a, hash((seed, k))) for k, (v, g, a) in
                            enumerate(zip(values, grids, at))], positions, delta)


@torch.no_grad()
def hf_greedy(hf, ids, grids, seed: int = 1) -> list[int]:
    input_ids = torch.tensor([ids])
    out = hf.generate(input_ids=input_ids, pixel_values=pixels(grids, seed),
                      image_grid_thw=torch.tensor(grids),
                      mm_token_type_ids=(input_ids == IMG).int(), max_new_tokens=NEW, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("batch, overlap", [(512, False), (24, False), (24, True)],
                         ids=["one-chunk", "image-spans-chunks", "image-spans-chunks-overlap"])
@pytest.mark.parametrize("grids", [ONE, TWO], ids=["one-image", "two-images"])
def test_image_requests_generate_what_hf_generates(models, grids, batch, overlap):
    """overlap: the server's engine (M-RoPE decode rows fed PENDING ids, mixed steps with image chunks)."""
    hf, _, folder = models
    runner = runner_for(folder, batch)
    engine = LLMEngine(runner, overlap=overlap)
    ids = prompt(grids)
    rid = engine.add_request(ids, max_tokens=NEW, mm=image_input(ids, grids, runner.model_config))
    text = engine.add_request([5, 6, 7, 8], max_tokens=NEW)  # a text request in the same steps
    out = {rid: [], text: []}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert out[rid] == hf_greedy(hf, ids, grids)
    with torch.no_grad():
        want_text = hf.generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=NEW, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    assert out[text] == want_text


def test_the_same_image_hits_the_prefix_cache_and_answers_the_same(models):
    hf, _, folder = models
    runner = runner_for(folder, 512)
    engine = LLMEngine(runner)
    ids = prompt(ONE)
    got = []
    for _ in range(2):
        rid = engine.add_request(ids, max_tokens=NEW, mm=image_input(ids, ONE, runner.model_config))
        toks = []
        while engine.has_unfinished():
            toks += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
        got.append(toks)
    assert engine.stats.prefix_hit_tokens >= 16 * (len(ids) // 16) - 16
    assert got[0] == got[1] == hf_greedy(hf, ids, ONE)
    other = image_input(ids, ONE, runner.model_config, seed=2)  # another image, the same token ids
    hits = engine.stats.prefix_hit_tokens
    engine.add_request(ids, max_tokens=1, mm=other)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.prefix_hit_tokens - hits == 0  # every page holds tokens of the image (from token 4)


def test_the_image_stress_runs_through_execute_and_an_encoder_step_past_it_is_refused(models):
    _, _, folder = models
    runner = runner_for(folder, 512, visual=2)
    env = runner.envelope
    shapes = runner.stress_prefill() + runner.stress_decode()
    assert max(s.encoder_images for s in shapes) == env.encoder_images == 2
    assert max(s.mm_tokens for s in shapes) == env.mm_tokens
    big = ImageInput(None, env.image_grid, 0, 1)
    step = Step(is_prefill=True, rows=[], encode=[(0, big), (1, big), (0, big)])
    with pytest.raises(EnvelopeError, match="encoder_images 3 > 2"):
        runner.execute(step)


def test_the_encoder_buffer_is_declared_from_the_envelope_and_dropped_by_teardown(models):
    _, _, folder = models
    runner = runner_for(folder, 512, visual=3)
    env, mc = runner.envelope, runner.model_config
    # a thin image keeps its 28-pixel side: 138 tokens (isqrt(200 * 96)), past the 96 of --max_image_pixels
    assert runner.mm_buffer.shape == (env.encoder_images, env.image_tokens, mc.hidden_size) == (3, 138, 64)
    runner.teardown()
    assert runner.mm_buffer is None and runner.envelope is None
    runner.build(4096)  # a rebuild owns a new one
    assert runner.mm_buffer.shape[0] == 3
    runner.teardown()
