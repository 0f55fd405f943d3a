"""What the TP step broadcast ships (autoprofile.tp.broadcast): an image row's pixels travel once, with the
step that encodes its image, as a tensor; every other step (decode steps with image rows, prefill chunks over
an image already encoded) ships a message whose size does not grow with the image. Checked on the encoding
alone and on gloo ranks serving the tiny Qwen2.5-VL (fp32, torch backend), where rank 1 still computes the
tokens rank 0 and --tp 1 compute."""
from __future__ import annotations

import pickle

import pytest
import torch

from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.sampling import GREEDY, SamplingParams
from autoprofile.engine.scheduler import Step, StepRow, image_spans
from autoprofile.model_config import load_model_config
from autoprofile.tp import broadcast
from unit_tests.test_multimodal_engine import image_input
from unit_tests.test_qwen2_5_vl import ONE, models, prompt  # noqa: F401 - a fixture
from unit_tests.test_tp import run
from unit_tests.test_tp_images import generate, vl_cfg
from unit_tests.tp_steps import Recorder

pytest.importorskip("transformers")

BIG = [(1, 16, 24)]  # 96 tokens: vl_cfg's --max_image_pixels; ONE's 60 tokens are 0.625 of it
# A decode row on the wire: slot, start, one id, its sampling parameters, its images' grids and the delta
ROW_BYTES = 600
STEP_BYTES = 400  # the step's own fields (page writes, counts, routing) and the pickle's frame
TOKEN_BYTES = 32  # a prefill token: its id and its three M-RoPE positions (int64)


def image_step(grids, seed: int = 1) -> tuple[Step, Step]:
    """A mixed step of an image request's chunk over its image (which this step encodes) and two decode rows
    of image requests whose prompts are done, and the decode step of the three; pixels of `grids`."""
    ids = prompt(grids)
    mms = [image_input(ids, grids, load_model_config("tiny-vl"), seed=seed + k) for k in range(3)]
    for slot, mm in enumerate(mms):
        mm.slots[0] = slot
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=5)
    chunk = StepRow(0, 2, ids[2:30], True, params, mm=mms[0], spans=image_spans(mms[0], 2, 28))
    done = [StepRow(slot, len(ids) + 4, [17], True, GREEDY, mm=mm) for slot, mm in enumerate(mms[1:], 1)]
    mixed = Step(True, [chunk], [(0, 0, [1, 2])], running=3, pages_used=9, encode=[(0, mms[0].images[0])],
                 decode=done)
    decoding = Step(False, done + [StepRow(0, len(ids) + 2, [40], True, params, mm=mms[0])], running=3,
                    pages_used=9)
    return mixed, decoding


def over_the_wire(step: Step) -> tuple[Step, int, list[torch.Tensor]]:
    msg, pixels = broadcast.encode(step), broadcast.pixels(step)
    data = pickle.dumps(msg)
    return broadcast.decode(pickle.loads(data), [p.clone() for p in pixels]), len(data), pixels


def test_a_decode_step_with_image_rows_ships_no_pixels_and_the_same_bytes_for_any_image_size():
    sizes = {}
    for grids in (ONE, BIG):
        mixed, decoding = image_step(grids)
        back, size, pixels = over_the_wire(decoding)
        assert pixels == [] and size <= STEP_BYTES + ROW_BYTES * len(decoding.rows), size
        assert back.shape(4) == decoding.shape(4)  # the envelope check on every rank sees the same step
        for mine, theirs in zip(decoding.rows, back.rows):
            assert torch.equal(ModelRunner._mrope(theirs), ModelRunner._mrope(mine))
            assert theirs.mm.delta == mine.mm.delta and theirs.request is None
        sizes[grids[0]] = size
    small, big = sizes.values()
    assert abs(small - big) <= 16, sizes  # 1.6x the patches, the same message


def test_an_encoding_step_ships_exactly_its_images_pixels_and_its_chunks_positions():
    mixed, _ = image_step(ONE)
    back, size, pixels = over_the_wire(mixed)
    (slot, image), = mixed.encode
    assert len(pixels) == 1 and pixels[0].data_ptr() == image.pixel_values.data_ptr()  # no copy on rank 0
    (slot_back, image_back), = back.encode
    assert slot_back == slot and torch.equal(image_back.pixel_values, image.pixel_values)
    assert (image_back.grid, image_back.offset, image_back.hash) == (image.grid, image.offset, image.hash)
    tokens = sum(len(r.ids) for r in mixed.rows)
    assert size <= STEP_BYTES + ROW_BYTES * len(mixed.all_rows) + TOKEN_BYTES * tokens, size
    assert size < image.pixel_values.nbytes // 20
    assert back.shape(4) == mixed.shape(4)
    for mine, theirs in zip(mixed.all_rows, back.all_rows):
        assert torch.equal(ModelRunner._mrope(theirs), ModelRunner._mrope(mine))
        assert theirs.spans == mine.spans and theirs.ids == mine.ids and theirs.params == mine.params
        assert [im.pixel_values for im in theirs.mm.images] == [None]  # rows never carry pixels
    # a chunk past the prompt (a preempted request's recompute of its output) has no prompt positions left
    mm = mixed.rows[0].mm
    late = StepRow(0, mm.positions.shape[1] + 1, [7, 8], True, GREEDY, mm=mm)
    back, _, _ = over_the_wire(Step(True, [late]))
    assert torch.equal(ModelRunner._mrope(back.rows[0]), ModelRunner._mrope(late))


# ---------------------------------------------------------------- served by gloo ranks
def _serve_two_images(guard, folder: str):
    runner = ModelRunner(vl_cfg(folder, 2), rank=guard.rank, world_size=2, group=guard.data)
    guarded = guard.bind(runner)
    guarded.build(4096)
    if guard.rank:
        sampled = []
        broadcast.worker_loop(guarded, lambda step, tokens: sampled.append(tokens))
        return sampled
    b = broadcast.StepBroadcaster(guarded)
    out = []
    try:
        for grids in (ONE, BIG):
            rec = Recorder(b)
            ids = prompt(grids)
            mm = image_input(ids, grids, runner.model_config)
            out.append((generate(LLMEngine(rec), ids, mm), rec.steps))
    finally:
        b.close()
    return out


@pytest.mark.slow
def test_tp2_ships_pixels_only_with_the_step_that_encodes_them_and_rank_1_samples_what_rank_0_does(
        models):  # noqa: F811
    _, _, folder = models
    one = ModelRunner(vl_cfg(str(folder), 1))
    one.build(4096)
    want = [generate(LLMEngine(one), prompt(g), image_input(prompt(g), g, one.model_config))
            for g in (ONE, BIG)]
    out, _ = run(_serve_two_images, 2, str(folder))
    assert out[0].ok and out[1].ok, out
    (got_one, steps_one), (got_big, steps_big) = out[0].value
    assert [got_one, got_big] == want
    steps = steps_one + steps_big
    assert [s["sampled"] for s in steps] == out[1].value  # rank 1 sampled rank 0's very tokens, step by step
    decode = {}
    for run_steps, grids in ((steps_one, ONE), (steps_big, BIG)):
        encoding = [s for s in run_steps if s["encoded"]]
        assert len(encoding) == 1 and encoding[0]["pixels"] == encoding[0]["encoded"]  # its pixels, once
        # every other step: chunks over the encoded image, mixed and decode steps with the image row
        assert all(s["pixels"] == 0 for s in run_steps if not s["encoded"]), run_steps
        assert sum(s["prefill"] and s["image_rows"] and not s["encoded"] for s in run_steps) >= 2
        decoding = [s for s in run_steps if not s["prefill"] and s["image_rows"]]
        assert len(decoding) >= 3, run_steps
        for s in run_steps:
            assert s["message"] <= STEP_BYTES + ROW_BYTES * s["rows"] + TOKEN_BYTES * s["tokens"], s
        decode[grids[0]] = max(s["message"] for s in decoding)
    print(f"--tp 2 broadcast, per step (message bytes, pixel bytes, rows): "
          f"{[(s['message'], s['pixels'], s['rows']) for s in steps]}")
    small, big = decode.values()
    assert abs(small - big) <= 16, decode  # independent of the image's size
