"""A vision-language model under tensor parallelism on CPU (gloo ranks, the tiny Qwen2.5-VL, fp32, torch
backend): the step broadcast carries each row's images, so --tp 2 answers an image request (its image spanning
chunks, beside a text request, in mixed steps) with the very tokens --tp 1 gives."""
from __future__ import annotations

import pickle

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.runner import ModelRunner
from autoprofile.tp import broadcast
from unit_tests.test_multimodal_engine import NEW, image_input
from unit_tests.test_qwen2_5_vl import ONE, models, prompt  # noqa: F401 - a fixture
from unit_tests.test_tp import run

pytest.importorskip("transformers")


def vl_cfg(folder: str, tp: int) -> ServerConfig:
    return validate(ServerConfig(model=folder, attention_backend="torch", dtype="float32", page_size=16,
                                 batch_max_tokens=24, max_req_total_len=512, graph_max_batch_size=4,
                                 max_image_pixels=96 * 28 * 28, visual_batch_size=2, report_dir=None, tp=tp))


def generate(engine: LLMEngine, ids: list[int], mm) -> list[list[int]]:
    rid = engine.add_request(ids, max_tokens=NEW, mm=mm)
    text = engine.add_request([5, 6, 7, 8], max_tokens=NEW)
    out = {rid: [], text: []}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[rid], out[text]]


def _serve_images(guard, folder: str, ids: list[int]):
    runner = ModelRunner(vl_cfg(folder, 2), rank=guard.rank, world_size=2, group=guard.data)
    guarded = guard.bind(runner)
    guarded.build(4096)
    if guard.rank:
        return broadcast.worker_loop(guarded)
    broadcaster = broadcast.StepBroadcaster(guarded)
    out = generate(LLMEngine(broadcaster), ids, image_input(ids, ONE, runner.model_config))
    broadcaster.close()
    return out


@pytest.mark.slow
def test_tp2_answers_an_image_request_as_tp1_does(models):
    _, _, folder = models
    ids = prompt(ONE)
    one = ModelRunner(vl_cfg(str(folder), 1))
    one.build(4096)
    want = generate(LLMEngine(one), ids, image_input(ids, ONE, one.model_config))
    out, _ = run(_serve_images, 2, str(folder), ids)
    assert out[0].ok and out[1].ok, out
    assert out[0].value == want
    assert out[1].value > 3  # the worker ran every step: the encoder step and the chunks over the image


def test_a_step_with_images_survives_the_broadcast_encoding(models):
    from autoprofile.engine.scheduler import Step, StepRow
    from autoprofile.engine.sampling import GREEDY
    _, _, folder = models
    ids = prompt(ONE)
    mm = image_input(ids, ONE, ModelRunner(vl_cfg(str(folder), 1)).model_config)
    mm.slots[0] = 1
    step = Step(True, [StepRow(2, 0, ids[:10], False, GREEDY, object(), mm, [(3, 1, 0, 7)])], [(2, 0, [5])],
                running=1, pages_used=1, encode=[(1, mm.images[0])])
    back = broadcast.decode(pickle.loads(pickle.dumps(broadcast.encode(step))), broadcast.pixels(step))
    row = back.rows[0]
    assert row.request is None and row.spans == [(3, 1, 0, 7)] and row.mm.delta == mm.delta
    assert torch.equal(ModelRunner._mrope(row), ModelRunner._mrope(step.rows[0])) and row.mm.slots == {0: 1}
    (slot, image), = back.encode
    assert slot == 1 and image.grid == mm.images[0].grid
    assert torch.equal(image.pixel_values, mm.images[0].pixel_values)
