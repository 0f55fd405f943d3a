"""Images inside the envelope, host side: the encoder's limits, its buffer slots, chunks over images,
the image corners of the stress, the prefix-cache key of image tokens. The scheduler runs for real with
the model-free step runner of test_scheduler, which also checks every step's image spans here."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.envelope import Envelope, VisionLimits
from autoprofile.engine.multimodal import (ImageInput, MultiModalInput, image_key_tokens, window_count,
                                           worst_image_grid)
from autoprofile.engine.request import RequestError
from unit_tests.test_scheduler import VOCAB, StepRunner, assert_corners_reach_every_limit, invariants

SIDE = 28 * 28


def vl_envelope(kv_pages=64, page_size=4, context=96, batch=16, running=4, graph=4, visual=2, max_tokens=6,
                images=3) -> Envelope:
    return Envelope.build(kv_pages=kv_pages, page_size=page_size, context_len=context, batch_max_tokens=batch,
                          running_max_req_size=running, graph_max_batch_size=graph, use_graphs=False,
                          vision=VisionLimits(visual, SIDE, max_tokens * SIDE, images))


class ImageStepRunner(StepRunner):
    """Also checks the encoder: every image token a row computes reads an image already encoded into the
    slot the span names, in this step or an earlier one, and not freed since."""

    def __init__(self, env, kv_pages):
        super().__init__(env, kv_pages)
        self.slot_holds: dict[int, tuple[str, int]] = {}  # encoder buffer slot -> (request id, image index)
        self.encoded = 0

    def execute(self, step):
        for slot, im in step.encode:
            owner = next((r.request, i) for r in step.rows if r.mm is not None
                         for i, x in enumerate(r.mm.images) if x is im)
            self.slot_holds[slot] = (owner[0].request_id, owner[1])
            self.encoded += 1
        for row in step.rows:
            mm = row.mm
            if mm is None or not row.spans:
                continue
            covered = set()
            for at, slot, first, n in row.spans:
                i = self.slot_holds[slot][1]
                assert self.slot_holds[slot][0] == row.request.request_id, \
                    "a span reads another request's image"
                im = mm.images[i]
                assert row.start + at == im.offset + first and first + n <= im.num_tokens
                covered |= set(range(row.start + at, row.start + at + n))
            chunk = set(range(row.start, row.start + len(row.ids)))
            want = {p for im in mm.images for p in range(im.offset, im.end)} & chunk
            assert covered == want, ("every image token of the chunk, and only those, comes from the encoder "
                                     "buffer")
        return super().execute(step)


def image_request(rng: random.Random, max_tokens: int, images: int, seed: int) -> tuple[list[int],
                                                                                        MultiModalInput]:
    """A prompt with `images` images (1..max_tokens tokens each) between random text."""
    ids, ims = [], []
    for i in range(images):
        ids += [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 5))]
        n = rng.randrange(1, max_tokens + 1)
        ims.append(ImageInput(None, (1, 2, 2 * n), len(ids), hash((seed, i))))
        ids += [7] * n
    ids += [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 5))]
    return ids, MultiModalInput(ims, positions=None, delta=0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.integers(1, 3), st.integers(1, 8), st.integers(16, 96))
def test_image_requests_complete_inside_the_envelope(seed, visual, batch, kv_pages):
    """Random image and text requests through the real scheduler: every step inside the envelope (the
    runner checks it), image tokens always read from a resident encoded image, every request completes,
    and every encoder slot comes back."""
    rng = random.Random(seed)
    env = vl_envelope(kv_pages=kv_pages, batch=batch, visual=visual)
    runner = ImageStepRunner(env, kv_pages)
    engine = LLMEngine(runner)
    rids = []
    for i in range(rng.randrange(1, 8)):
        if rng.random() < 0.7:
            prompt, mm = image_request(rng, 6, rng.randrange(1, 4), seed * 100 + i)
        else:
            prompt, mm = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))], None
        try:
            rids.append(engine.add_request(prompt, max_tokens=rng.randrange(1, 8), mm=mm))
        except RequestError as e:
            assert e.field == "max_tokens"  # a request larger than this small cache
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
        invariants(engine)
    assert not engine.has_unfinished()
    assert sorted(engine.scheduler.free_mm_slots) == list(range(env.encoder_images))
    shapes = runner.shapes
    assert all(s.encoder_images <= env.encoder_images for s in shapes)


def test_an_image_spans_chunks_and_is_encoded_once():
    """A 6-token image under a 4-token prefill budget: its embeddings wait in the buffer across chunks."""
    env = vl_envelope(batch=4, visual=1)
    runner = ImageStepRunner(env, 64)
    engine = LLMEngine(runner)
    prompt = [5, 6, 7] + [9] * 6 + [8]
    engine.add_request(prompt, max_tokens=2,
                       mm=MultiModalInput([ImageInput(None, (1, 2, 12), 3, 1)], None, 0))
    while engine.has_unfinished():
        engine.step()
    assert runner.encoded == 1
    spans = [s for st_ in runner.steps for r in st_.rows for s in r.spans]
    assert [(first, n) for _, _, first, n in spans] == [(0, 1), (1, 4), (5, 1)]


def test_encoder_limits_hold_back_images_not_text():
    """visual_batch_size 1: two image requests cannot encode in one step; the second waits for the slot
    while a text request beside it is prefilled."""
    env = vl_envelope(batch=64, visual=1)
    runner = ImageStepRunner(env, 64)
    engine = LLMEngine(runner)
    a = MultiModalInput([ImageInput(None, (1, 2, 12), 0, 1)], None, 0)
    b = MultiModalInput([ImageInput(None, (1, 2, 12), 0, 2)], None, 0)
    engine.add_request([9] * 6 + [1], max_tokens=2, mm=a)
    engine.add_request([9] * 6 + [2], max_tokens=2, mm=b)
    engine.add_request([3, 4, 5], max_tokens=2)
    engine.step()
    first = runner.steps[0]
    assert len(first.encode) == 1 and len(first.rows) == 2  # image request a and the text request
    while engine.has_unfinished():
        engine.step()
    assert runner.encoded == 2


def test_requests_outside_the_image_limits_are_refused_naming_the_field():
    env = vl_envelope(visual=1, max_tokens=6, images=2)
    engine = LLMEngine(ImageStepRunner(env, 64))
    assert env.image_tokens == 34  # a thin image keeps its 28-pixel side: isqrt(200 * 6) tokens, past 6
    n = env.image_tokens + 1
    big = MultiModalInput([ImageInput(None, (1, 2, 2 * n), 0, 1)], None, 0)
    with pytest.raises(RequestError, match="larger than the encoder's stress ran") as e:
        engine.add_request([9] * n + [1], mm=big)
    assert e.value.field == "images"
    many = MultiModalInput([ImageInput(None, (1, 2, 2), i, i) for i in range(3)], None, 0)
    with pytest.raises(RequestError, match="at most 2 per request"):
        engine.add_request([9] * 3 + [1], mm=many)
    outside = MultiModalInput([ImageInput(None, (1, 2, 4), 2, 1)], None, 0)
    with pytest.raises(RequestError, match="inside the prompt"):
        engine.add_request([9, 9, 9], mm=outside)
    text_env = Envelope.build(kv_pages=64, page_size=4, context_len=96, batch_max_tokens=16,
                              running_max_req_size=4, graph_max_batch_size=4, use_graphs=False)
    with pytest.raises(RequestError, match="takes no images"):
        LLMEngine(StepRunner(text_env, 64)).add_request([9, 9, 1], mm=MultiModalInput(
            [ImageInput(None, (1, 2, 2), 0, 1)], None, 0))


def test_prefix_cache_key_same_image_shares_different_image_does_not():
    """Two requests with the same image share the image's full pages; the same text with another image
    (same token ids: the pad token) shares none of them."""
    env = vl_envelope(batch=64, visual=2, max_tokens=12)
    runner = ImageStepRunner(env, 64)
    engine = LLMEngine(runner)
    prompt = [9] * 12 + [1, 2, 3]

    def run(h):
        engine.add_request(prompt, max_tokens=1,
                           mm=MultiModalInput([ImageInput(None, (1, 2, 24), 0, h)], None, 0))
        while engine.has_unfinished():
            engine.step()
        return engine.scheduler.prefix_hit_tokens

    assert run(11) == 0
    assert run(11) == 12  # three full pages of the same image
    assert run(22) == 12  # another image: no new hit
    key = image_key_tokens([9, 9, 5], 4, [ImageInput(None, (1, 2, 4), 3, 42)])
    assert key[0] == (42, 1) and key[1] == 9 and key[2] == 5  # token 4 is the image's second, 5 and 6 text


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 400), st.sampled_from([1, 4, 16]), st.integers(8, 300), st.integers(1, 200),
       st.integers(1, 40), st.integers(1, 6), st.integers(1, 6), st.integers(1, 4))
def test_image_stress_reaches_every_encoder_limit_and_stays_inside(kv_pages, page_size, context, batch,
                                                                    running, visual, max_tokens, images):
    vision = VisionLimits(visual, SIDE, max_tokens * SIDE, images)
    t, h, w = vision.worst_grid
    assume(h * w // 4 <= context - 2)  # the config's rule: the largest image fits a request
    env = Envelope.build(kv_pages=kv_pages, page_size=page_size, context_len=context, batch_max_tokens=batch,
                         running_max_req_size=running, graph_max_batch_size=running, use_graphs=False,
                         vision=vision)
    assert env.encoder_images >= 1 and env.mm_tokens >= 1
    assert_corners_reach_every_limit(env)


def test_worst_grid_has_the_most_patches_then_windows():
    t, h, w = worst_image_grid(SIDE, 1280 * SIDE)
    grids = [(4 * a * b, window_count(2 * a, 2 * b)) for a in range(1, 1281) for b in range(1, 1280 // a + 1)
             if max(a, b) <= 200 * min(a, b)]
    assert (t, h * w, window_count(h, w)) == (1, *max(grids))


def test_a_vision_model_under_tensor_parallelism_is_a_valid_config():
    """The TP step broadcast carries the rows' images (unit_tests/test_tp_images.py serves one at --tp 2)."""
    from autoprofile.config import ServerConfig, validate
    assert validate(ServerConfig(model="qwen2.5-vl-7b", tp=2)).tp == 2


# ---------------------------------------------------------------- the real engine on tiny-vl
def tiny_vl(kv_tokens: int):
    from autoprofile.config import ServerConfig, validate
    from unit_tests.cpu_server import boot_cpu
    cfg = validate(ServerConfig(model="tiny-vl", dtype="float32", attention_backend="torch",
                                max_req_total_len=96, batch_max_tokens=16, graph_max_batch_size=4,
                                running_max_req_size=4, page_size=16, report_dir=None, visual_batch_size=1,
                                max_images_per_request=1,
                                min_image_pixels=4 * SIDE, max_image_pixels=16 * SIDE))
    return boot_cpu(cfg, kv_tokens=kv_tokens)[0]


@pytest.fixture(scope="module")
def vl_runner():
    runner = tiny_vl(1024)
    yield runner
    runner.teardown()


@pytest.fixture(scope="module")
def small_vl_runner():
    runner = tiny_vl(7 * 16)  # 6 pages of 16 tokens and the pad page
    yield runner
    runner.teardown()


def vl_request(mc, grid=(1, 8, 24), seed=0):
    """A prompt of text, then one image (start, pad x its tokens, end), then text; its MultiModalInput."""
    import torch

    from models.qwen2_5_vl import mrope_positions
    t, h, w = grid
    ids = [9, 10, 11, mc.vision_start_token_id] + [mc.image_token_id] * (t * h * w // 4) + \
        [mc.vision_end_token_id, 12]
    positions, delta = mrope_positions(ids, [grid], mc)
    pixels = torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(seed))
    return ids, MultiModalInput([ImageInput(pixels, grid, 4, seed)], positions, delta)


def run_until_done(engine, limit=400) -> dict[str, list[int]]:
    """Every request's output ids; an AssertionError if requests are left after `limit` steps (one that waits
    for an encoder slot that never comes back)."""
    outs: dict[str, list[int]] = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError(f"requests still unfinished after {limit} steps: {engine.scheduler.waiting}")


@pytest.mark.parametrize("overlap", [False, True])
def test_an_aborted_image_request_gives_its_encoder_slot_back(vl_runner, overlap):
    """The only encoder slot (--visual_batch_size 1) is held by an image whose 48 tokens span 4 chunks of 16.
    The request is aborted after its first chunk: the slot comes back, and a later image request runs (a
    leaked slot would make it wait forever)."""
    engine = LLMEngine(vl_runner, overlap=overlap)
    mc, sched = vl_runner.model_config, engine.scheduler
    ids, mm = vl_request(mc)
    first = engine.add_request(ids, max_tokens=2, mm=mm)
    while not mm.slots:
        engine.step()
    assert sched.free_mm_slots == [] and engine._requests[first].num_computed < mm.images[0].end
    engine.abort(first)
    assert sched.free_mm_slots == [0] and mm.slots == {}
    ids2, mm2 = vl_request(mc, seed=1)
    second = engine.add_request(ids2, max_tokens=2, mm=mm2)
    outs = run_until_done(engine)
    assert len(outs[second]) == 2 and sched.free_mm_slots == [0] and engine.stats.pages_used == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_an_image_request_preempted_mid_image_gives_its_slot_back_and_reruns(small_vl_runner, overlap):
    """A text request holds 3 of the cache's 6 pages and grows; the image request after it (4 pages) runs
    out of pages inside its image and is preempted (the youngest) while its image holds the only encoder
    slot. The slot comes back at once (a waiting request holds none); once the text request is done the image
    request re-encodes and finishes."""
    engine = LLMEngine(small_vl_runner, overlap=overlap)
    mc, sched = small_vl_runner.model_config, engine.scheduler
    holding = []
    real = sched._preempt

    def preempt(req):  # a spy: did the request hold a slot, and is every slot free once it left
        held = bool(req.mm and req.mm.slots)
        real(req)
        holding.append((held, list(sched.free_mm_slots), dict(req.mm.slots) if req.mm else {}))
    sched._preempt = preempt
    text = engine.add_request(list(range(20, 60)), max_tokens=40)
    ids, mm = vl_request(mc)
    image = engine.add_request(ids, max_tokens=2, mm=mm)
    outs = run_until_done(engine)
    assert (True, [0], {}) in holding, holding  # preempted mid-image, its slot given back
    assert len(outs[text]) == 40 and len(outs[image]) == 2
    assert sched.free_mm_slots == [0] and engine.stats.pages_used == 0
