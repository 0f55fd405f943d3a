"""autoprofile/serving/images.py: Qwen's resize and patches against transformers' Qwen2-VL image processor,
decoding every format and the bad ones, the URL rules against a local HTTP server, content-part parsing."""
from __future__ import annotations

import asyncio
import base64
import io
import math
import struct
import subprocess
import sys
import zlib

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from autoprofile.resize import max_resized_pixels, resize_witnesses, window_count, worst_image_grid
from autoprofile.serving import images
from autoprofile.serving.images import ContentError, ImageError, ImagePart, TextPart

SIDE = 28 * 28
# Qwen/Qwen2.5-VL-7B-Instruct's preprocessor_config.json
QWEN_CONFIG = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
               "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
               "image_std": [0.26862954, 0.26130258, 0.27577711]}


def hf_processor(**overrides):
    try:  # transformers 5.x keeps the PIL processor under this name; 4.x calls it Qwen2VLImageProcessor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as P
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as P
    return P(**{**QWEN_CONFIG, **overrides})


def hf_smart_resize():
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
    return smart_resize


def ours(image: Image.Image, **overrides):
    c = {**QWEN_CONFIG, **overrides}
    return images.preprocess(image, min_pixels=c["min_pixels"], max_pixels=c["max_pixels"],
                             patch_size=c["patch_size"], temporal_patch_size=c["temporal_patch_size"],
                             merge_size=c["merge_size"], mean=c["image_mean"], std=c["image_std"])


def random_image(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    channels = len(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, channels), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


def encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def png_header(w: int, h: int) -> bytes:
    """A PNG declaring w x h pixels with no pixel data: what a decompression bomb looks like up front."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


# ---------------------------------------------------------------- resize and patches
def test_defaults_are_qwens_preprocessor_config():
    assert images.QWEN_MEAN == pytest.approx(QWEN_CONFIG["image_mean"], abs=0)
    assert images.QWEN_STD == pytest.approx(QWEN_CONFIG["image_std"], abs=0)
    assert images.MIN_PIXELS == QWEN_CONFIG["min_pixels"]
    assert (images.PATCH_SIZE, images.TEMPORAL_PATCH_SIZE, images.MERGE_SIZE) == (14, 2, 2)


SIZES = [  # (width, height, overrides)
    (1, 1, {}),  # upscaled to min_pixels (transformers accepts it)
    (29, 1000, {}),
    (333, 777, {}),
    (1000, 28, {}),
    (4000, 3000, {"max_pixels": 28 * 28 * 1280}),
    (2, 400, {}),  # aspect ratio exactly 200
    (641, 479, {}),
    (27, 27, {}),
    (7000, 40, {"max_pixels": 28 * 28 * 64}),  # the short side clamps to 28: the area goes over max_pixels
    (1919, 1081, {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 256}),
    (56, 56, {}),
]


@pytest.mark.parametrize("w,h,overrides", SIZES, ids=[f"{w}x{h}" for w, h, _ in SIZES])
def test_preprocess_equals_transformers(w, h, overrides):
    image = random_image(w, h, seed=w * 7919 + h)
    ref = hf_processor(**overrides)(images=image, return_tensors="np")
    pixels, grid = ours(image, **overrides)
    assert pixels.dtype == torch.float32 and pixels.shape == ref["pixel_values"].shape
    assert grid == tuple(ref["image_grid_thw"][0].tolist())
    np.testing.assert_allclose(pixels.numpy(), ref["pixel_values"], rtol=0, atol=1e-5)
    assert images.image_tokens(grid) * 4 == pixels.shape[0]


def test_transparent_and_palette_images_match_transformers():
    """decode_image composites transparency onto white, as transformers' convert_to_rgb does."""
    rgba = random_image(97, 61, seed=3, mode="RGBA")
    pal = random_image(50, 70, seed=4).convert("P", palette=Image.Palette.ADAPTIVE)
    pal.info["transparency"] = 0
    for original in (rgba, pal):
        extra = {"transparency": 0} if original.mode == "P" else {}
        decoded = images.decode_image(encode(original, "PNG", **extra))
        ref = hf_processor()(images=original, return_tensors="np")
        np.testing.assert_allclose(ours(decoded)[0].numpy(), ref["pixel_values"], rtol=0, atol=1e-5)


@settings(max_examples=300, deadline=None)
@given(h=st.integers(1, 6000), w=st.integers(1, 6000), lo=st.integers(1, 64), hi=st.integers(1, 2048))
def test_smart_resize_equals_transformers(h, w, lo, hi):
    lo, hi = lo * 784, max(lo, hi) * 784
    try:
        expected = hf_smart_resize()(h, w, 28, lo, hi)
    except ValueError:
        with pytest.raises(ImageError, match="aspect ratio"):
            images.smart_resize(h, w, 28, lo, hi)
        return
    assert images.smart_resize(h, w, 28, lo, hi) == expected


FLAG_SETS = [(4, 1280), (1, 4), (4, 16), (4, 64), (16, 20), (1, 200), (100, 100), (4, 100), (30, 300), (1, 1)]


def within(grid, worst) -> bool:
    return grid[0] * grid[1] <= worst[1] * worst[2] and window_count(*grid) <= window_count(*worst[1:])


def resized(h, w, lo, hi):
    rh, rw = images.smart_resize(h, w, 28, lo, hi)
    return rh // 14, rw // 14


@settings(max_examples=400, deadline=None)
@given(lo=st.sampled_from([1, 2, 4, 9, 16, 30]), extra=st.sampled_from([0, 1, 3, 12, 60, 96, 170, 300, 1276]),
       short=st.integers(1, 3000), ratio=st.floats(1, 200), k=st.integers(1, 4000), b=st.integers(1, 600),
       exact=st.booleans(), flip=st.booleans())
def test_every_resized_image_lies_within_the_worst_grid(lo, extra, short, ratio, k, b, exact, flip):
    """Any image (any size, aspect ratio up to 200, and the exact ratios b^2 / n where the resize's floors
    turn) resizes to a grid within the worst grid: no more patches, no more windows."""
    lo, hi = lo * SIDE, (lo + extra) * SIDE
    n = hi // SIDE
    h, w = (n * k, b * b * k) if exact else (short, max(1, round(short * ratio)))
    h, w = (w, h) if flip else (h, w)
    if max(h, w) > 200 * min(h, w):
        return
    worst = worst_image_grid(lo, hi)
    assert within(resized(h, w, lo, hi), worst), ((h, w), resized(h, w, lo, hi), worst)


@pytest.mark.parametrize("lo,hi", FLAG_SETS)
def test_the_worst_grid_is_reached_and_is_the_one_truth(lo, hi):
    """Its patches are those of some image, its windows at least those of every image (the grid of one
    image where one image has both); max_resized_pixels and the envelope's grid are the same grid."""
    from autoprofile.engine.envelope import VisionLimits
    lo, hi = lo * SIDE, hi * SIDE
    worst = worst_image_grid(lo, hi)
    witnesses = {resized(h, w, lo, hi) for h, w in resize_witnesses(lo, hi)
                 if max(h, w) <= 200 * min(h, w)}
    assert all(within(g, worst) for g in witnesses)
    assert max(h * w for h, w in witnesses) == worst[1] * worst[2]
    most_windows = max(window_count(*g) for g in witnesses)
    if worst[1:] not in witnesses:  # no one image has the most patches and the most windows
        assert window_count(*worst[1:]) >= most_windows > max(window_count(*g) for g in witnesses
                                                              if g[0] * g[1] == worst[1] * worst[2])
    assert images.max_resized_pixels(lo, hi) == worst[1] * worst[2] * 14 * 14
    assert VisionLimits(1, lo, hi, 1).worst_grid == worst


def test_a_thin_image_past_max_pixels_is_inside_the_worst_grid():
    """--max_image_pixels 78400: a 28 x 5600 image keeps a short side of 28 and resizes to 141 tokens (past
    the 100 of max_pixels); the encoder's worst grid holds it (it was refused as larger than the stress)."""
    grid = resized(28, 5600, 4 * SIDE, 78400)
    assert grid[0] * grid[1] // 4 == 141
    assert worst_image_grid(4 * SIDE, 78400) == (1, *grid)


def test_max_resized_pixels_is_max_pixels_for_qwens_defaults():
    assert images.max_resized_pixels(images.MIN_PIXELS, images.MAX_PIXELS) == images.MAX_PIXELS == \
        math.prod(images.smart_resize(1120, 896))


@pytest.mark.parametrize("h,w,match", [(0, 10, "zero size"), (10, 0, "zero size"),
                                       (1, 201, "aspect ratio 201.0"), (3000, 5, "aspect ratio 600.0")])
def test_smart_resize_refuses(h, w, match):
    with pytest.raises(ImageError, match=match):
        images.smart_resize(h, w)


def test_preprocess_refuses_a_non_rgb_image():
    with pytest.raises(ImageError, match="RGB"):
        images.preprocess(random_image(30, 30, 0, "RGBA"))


def test_pixel_limits():
    assert images.pixel_limits_error(images.MIN_PIXELS, images.MAX_PIXELS) is None
    for lo, hi in [(100, 784 * 10), (784, 785), (784 * 4, 784 * 2), (0, 784)]:
        msg = images.pixel_limits_error(lo, hi)
        assert "--min_image_pixels" in msg and "--max_image_pixels" in msg and "784" in msg


# ---------------------------------------------------------------- decoding
@pytest.mark.parametrize("fmt,kw,exact", [
    ("PNG", {}, True), ("WEBP", {"lossless": True}, True), ("JPEG", {"quality": 95}, False),
    ("BMP", {}, True), ("DIB", {}, True), ("TIFF", {}, True), ("TIFF", {"compression": "tiff_lzw"}, True),
    ("ICO", {"sizes": [(37, 23)]}, True), ("JPEG2000", {"irreversible": False}, True), ("QOI", {}, True),
    ("PPM", {}, True), ("PCX", {}, True), ("SGI", {}, True), ("TGA", {}, True),
    ("TGA", {"compression": "tga_rle"}, True)])
def test_decode_formats(fmt, kw, exact):
    """Every raster format Pillow decodes by itself, made here by Pillow, decodes to the same RGB pixels."""
    original = random_image(37, 23, seed=5)
    decoded = images.decode_image(encode(original, fmt, **kw))
    assert decoded.mode == "RGB" and decoded.size == (37, 23)
    if exact:
        assert np.array_equal(np.asarray(decoded), np.asarray(original))


def test_decode_an_ico_takes_its_largest_icon():
    data = encode(random_image(64, 64, seed=3), "ICO", sizes=[(16, 16), (64, 64), (32, 32)])
    assert images.decode_image(data).size == (64, 64)


def test_decode_a_16_bit_tiff_and_a_cmyk_tiff():
    gray = Image.fromarray(np.arange(0, 60000, 100, dtype=np.uint16).reshape(20, 30))
    assert images.decode_image(encode(gray, "TIFF")).size == (30, 20)
    cmyk = random_image(30, 20, seed=4).convert("CMYK")
    assert np.array_equal(np.asarray(images.decode_image(encode(cmyk, "TIFF"))),
                          np.asarray(cmyk.convert("RGB")))


def test_formats_that_run_programs_or_are_not_raster_are_refused():
    """EPS would run Ghostscript, SVG is markup, PDF and WMF need outside handlers: all refused by name."""
    eps = encode(random_image(8, 8, 1), "EPS")
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="8" height="8"><rect width="8" height="8"/></svg>'
    pdf = encode(random_image(8, 8, 1), "PDF")
    for data in (eps, svg, pdf, b"%!PS-Adobe-3.0\n", b"\xd7\xcd\xc6\x9a" + bytes(40)):
        with pytest.raises(ImageError, match="not a PNG, JPEG, WEBP, GIF, BMP"):
            images.decode_image(data)


def test_decode_gif_takes_the_first_frame():
    red, blue = Image.new("RGB", (9, 5), (255, 0, 0)), Image.new("RGB", (9, 5), (0, 0, 255))
    data = encode(red, "GIF", save_all=True, append_images=[blue])
    assert Image.open(io.BytesIO(data)).n_frames == 2
    decoded = images.decode_image(data)
    assert decoded.mode == "RGB" and np.asarray(decoded).reshape(-1, 3).tolist() == [[255, 0, 0]] * 45


def test_decode_applies_exif_orientation():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise
    decoded = images.decode_image(encode(random_image(40, 10, 6), "PNG", exif=exif))
    assert decoded.size == (10, 40)


BAD = {
    "garbage": (b"this is not an image at all", "not a PNG, JPEG, WEBP, GIF, BMP"),
    "empty": (b"", "not a PNG"),
    "zero width": (png_header(0, 5), "not a PNG"),
    "bomb beyond Pillow's limit": (png_header(20000, 20000), "too large to decode"),
    "bomb beyond ours": (png_header(9000, 9000), "9000x9000 pixels, over the 67108864"),
    "a truncated BMP": (encode(random_image(40, 40, 0), "BMP")[:300], "corrupt or truncated"),
    "a TIFF bomb": (encode(Image.new("1", (9000, 9000)), "TIFF", compression="group4"), "9000x9000 pixels"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_decode_refuses(name):
    data, match = BAD[name]
    with pytest.raises(ImageError, match=match):
        images.decode_image(data)


def test_decode_refuses_truncated_bytes():
    data = encode(random_image(64, 64, 8), "PNG")
    with pytest.raises(ImageError, match="corrupt or truncated"):
        images.decode_image(data[: len(data) // 2])
    jpeg = encode(random_image(64, 64, 8), "JPEG")
    with pytest.raises(ImageError, match="corrupt or truncated"):
        images.decode_image(jpeg[: len(jpeg) // 3])


def test_content_hash():
    a, b = encode(random_image(8, 8, 1), "PNG"), encode(random_image(8, 8, 2), "PNG")
    assert images.content_hash(a) == images.content_hash(bytes(a)) != images.content_hash(b)
    pixels, _ = images.preprocess(random_image(56, 56, 1))
    assert images.content_hash(pixels) == images.content_hash(pixels.clone())
    assert images.content_hash(pixels) != images.content_hash(pixels.reshape(8, -1))  # same bytes
    assert images.content_hash(pixels) != images.content_hash(pixels + 1e-3)
    h = images.content_hash(a)
    assert torch.tensor([h], dtype=torch.int64).item() == h  # fits a page-key tensor
    script = ("import sys; from autoprofile.serving.images import content_hash; "
              "print(content_hash(sys.stdin.buffer.read()))")
    other = subprocess.run([sys.executable, "-c", script], input=a, capture_output=True, check=True)
    assert int(other.stdout) == h  # stable across processes (no PYTHONHASHSEED)


# ---------------------------------------------------------------- URLs
PNG = encode(random_image(30, 20, 9), "PNG")


def test_data_urls():
    image = asyncio.run(images.load_image(data_url(PNG)))
    assert image.size == (30, 20)
    upper = data_url(PNG, "IMAGE/PNG").replace("data:", "DATA:")
    assert asyncio.run(images.load_image(upper)).size == (30, 20)


@pytest.mark.parametrize("url,match", [
    (data_url(PNG, "text/plain"), "media type is 'text/plain'"),
    ("data:image/png," + "abc", "data:image/<type>;base64"),
    ("data:image/png;base64,@@@@", "base64 is invalid"),
    ("data:image/png;base64", "data:image/<type>;base64"),
    (data_url(b"not an image"), "not a PNG"),
    ("file:///etc/passwd", "got a file: URL"),
    ("ftp://127.0.0.1/a.png", "got a ftp: URL"),
    ("gopher://127.0.0.1/", "got a gopher: URL"),
    ("/relative/a.png", "got a relative: URL"),
    ("", "non-empty string"),
])
def test_bad_urls(url, match):
    with pytest.raises(ImageError, match=match):
        asyncio.run(images.load_image(url, allowed_domains=["127.0.0.1"]))


def test_data_url_over_the_byte_limit():
    with pytest.raises(ImageError, match="over 100 bytes"):
        asyncio.run(images.load_image(data_url(PNG), max_bytes=100))
    assert asyncio.run(images.load_image(data_url(PNG), max_bytes=len(PNG))).size == (30, 20)


class Origin:
    """A local image server on 127.0.0.1 that counts what it is asked and what it sends."""

    def __init__(self):
        self.hits: list[str] = []
        self.chunks_sent = 0
        self.stream_done = asyncio.Event()
        app = web.Application()
        app.router.add_get("/{name}", self.handle)
        self.server = TestServer(app, host="127.0.0.1")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.hits.append(name)
        port = self.server.port
        if name == "img.png":
            return web.Response(body=PNG, content_type="image/png")
        if name == "announced_big":
            return web.Response(body=b"\0" * 300_000, content_type="image/png")
        if name == "slow":
            await asyncio.sleep(5)
            return web.Response(body=PNG, content_type="image/png")
        if name == "to_inside":
            raise web.HTTPFound(f"http://127.0.0.1:{port}/img.png")
        if name == "to_outside":
            raise web.HTTPFound(f"http://localhost:{port}/img.png")
        if name == "loop":
            raise web.HTTPFound("/loop")
        if name == "endless":
            resp = web.StreamResponse()  # chunked: no Content-Length to refuse up front
            await resp.prepare(request)
            try:
                for _ in range(4000):
                    await resp.write(b"\0" * 65536)
                    self.chunks_sent += 1
            except (ConnectionError, RuntimeError):
                pass
            finally:
                self.stream_done.set()
            return resp
        raise web.HTTPNotFound()

    def url(self, name: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.server.port}/{name}"


def fetch(body, **kw):
    """body(origin, load) with load(url) fetching through images.load_image (allowed: 127.0.0.1)."""
    async def go():
        origin = Origin()
        await origin.server.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                async def load(url: str, **extra):
                    args = {"allowed_domains": ["127.0.0.1"], "max_bytes": 100_000, "timeout_s": 2.0,
                            "session": session, **kw, **extra}
                    return await images.load_image(url, **args)
                return await body(origin, load)
        finally:
            await origin.server.close()
    return asyncio.run(go())


def test_fetch_from_an_allowed_host():
    async def body(origin, load):
        image = await load(origin.url("img.png"))
        assert image.size == (30, 20) and origin.hits == ["img.png"]
        assert (await load(origin.url("to_inside"))).size == (30, 20)
        assert (await load(origin.url("img.png"), allowed_domains=["127.0.0.1"])).size == (30, 20)
    fetch(body)


def test_no_allowed_domains_refuses_every_remote_url_without_a_request():
    async def body(origin, load):
        with pytest.raises(ImageError, match="--allowed_media_domains"):
            await load(origin.url("img.png"), allowed_domains=[])
        with pytest.raises(ImageError, match=r"'localhost' is not in --allowed_media_domains \(127.0.0.1\)"):
            await load(origin.url("img.png", host="localhost"))
        with pytest.raises(ImageError, match="'localhost' is not in"):  # user info is not the host
            await load(f"http://127.0.0.1@localhost:{origin.server.port}/img.png")
        assert origin.hits == []
    fetch(body)


def test_redirect_to_a_host_not_allowed_is_refused():
    async def body(origin, load):
        with pytest.raises(ImageError, match="'localhost' is not in --allowed_media_domains"):
            await load(origin.url("to_outside"))
        assert origin.hits == ["to_outside"]  # the redirect target was never asked
        with pytest.raises(ImageError, match="redirected more than 5 times"):
            await load(origin.url("loop"))
    fetch(body)


def test_too_large_is_refused_announced_or_streamed():
    async def body(origin, load):
        with pytest.raises(ImageError, match="body is 300000 bytes, over the 100000-byte limit"):
            await load(origin.url("announced_big"))
        with pytest.raises(ImageError, match="over the 100000-byte limit"):
            await load(origin.url("endless"))
        await asyncio.wait_for(origin.stream_done.wait(), 10)
        assert origin.chunks_sent < 4000  # the client hung up instead of reading the rest
    fetch(body)


def test_too_slow_times_out():
    async def body(origin, load):
        start = asyncio.get_running_loop().time()
        with pytest.raises(ImageError, match="did not answer within 0.3 s"):
            await load(origin.url("slow"), timeout_s=0.3)
        assert asyncio.get_running_loop().time() - start < 2
    fetch(body)


def test_http_errors_and_unreachable_hosts():
    async def body(origin, load):
        with pytest.raises(ImageError, match="answered HTTP 404"):
            await load(origin.url("missing"))
        with pytest.raises(ImageError, match="could not be fetched"):
            await load("http://127.0.0.1:1/img.png")
    fetch(body)


def test_load_prepared_names_the_first_bad_part():
    from concurrent.futures import ThreadPoolExecutor

    from autoprofile.serving.vision import ImageOptions, load_prepared
    parts = [ImagePart(data_url(PNG), "messages[0].content[0].image_url.url"),
             ImagePart("file:///etc/passwd", "messages[1].content[2].image_url.url"),
             ImagePart(data_url(b"junk"), "messages[2].content[0].image_url.url")]
    opts = ImageOptions(images.MIN_PIXELS, images.MAX_PIXELS, (), images.MAX_IMAGE_BYTES, 1.0)
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(ContentError) as e:
            asyncio.run(load_prepared(parts, opts, pool))
        assert e.value.status == 400 and e.value.param == "messages[1].content[2].image_url.url"
        assert "file: URL" in e.value.message
        loaded = asyncio.run(load_prepared(parts[:1] * 3, opts, pool))
    rh, rw = images.smart_resize(20, 30)
    assert [im.grid for im in loaded] == [(1, rh // 14, rw // 14)] * 3
    assert len({im.hash for im in loaded}) == 1


# ---------------------------------------------------------------- content parts
def test_parse_content():
    assert images.parse_content("hello", 0) == [TextPart("hello")]
    parts = images.parse_content([{"type": "text", "text": "a"},
                                  {"type": "image_url", "image_url": {"url": "data:x", "detail": "low"}},
                                  {"type": "image_url", "image_url": "http://h/i.png"}], 3)
    assert parts == [TextPart("a"), ImagePart("data:x", "messages[3].content[1].image_url.url"),
                     ImagePart("http://h/i.png", "messages[3].content[2].image_url.url")]
    assert images.parse_content([], 0) == []


@pytest.mark.parametrize("content,param", [
    (None, "messages[2].content"),
    (7, "messages[2].content"),
    (["text"], "messages[2].content[0]"),
    ([{"type": "text", "text": 1}], "messages[2].content[0].text"),
    ([{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}],
     "messages[2].content[1].type"),
    ([{"text": "no type"}], "messages[2].content[0].type"),
    ([{"type": "image_url"}], "messages[2].content[0].image_url"),
    ([{"type": "image_url", "image_url": 5}], "messages[2].content[0].image_url"),
    ([{"type": "image_url", "image_url": {}}], "messages[2].content[0].image_url.url"),
    ([{"type": "image_url", "image_url": {"url": ""}}], "messages[2].content[0].image_url.url"),
    ([{"type": "image_url", "image_url": {"url": ["x"]}}], "messages[2].content[0].image_url.url"),
    ([{"type": "image_url", "image_url": {"url": "data:x", "detail": "max"}}],
     "messages[2].content[0].image_url.detail"),
])
def test_parse_content_errors_name_the_param(content, param):
    with pytest.raises(ContentError) as e:
        images.parse_content(content, 2)
    assert e.value.status == 400 and e.value.param == param
    assert f"'{param}'" in e.value.message
    assert e.value.body()["error"]["param"] == param


def test_image_count():
    img = ImagePart("data:x", "p")
    messages = [[TextPart("a"), img], [img, img]]
    assert images.check_image_count(messages, 3) == 3
    with pytest.raises(ContentError) as e:
        images.check_image_count(messages, 2)
    assert e.value.param == "messages" and "3 images" in e.value.message
    assert "--max_images_per_request" in e.value.message


def test_the_config_refuses_pixel_limits_whose_thin_images_outgrow_a_request():
    """--max_image_pixels 98 x 28^2 with 100-token requests: a thin image resizes to 140 tokens (past 98), so
    no request could hold it and the stress could not run it: refused before any allocation, with a value
    that works."""
    from autoprofile.config import ConfigError, ServerConfig, validate
    flags = dict(model="tiny-vl", dtype="float32", attention_backend="torch", max_req_total_len=100,
                 report_dir=None, min_image_pixels=4 * SIDE)
    with pytest.raises(ConfigError, match="resize to 109760 pixels, 140 tokens") as e:
        validate(ServerConfig(**flags, max_image_pixels=98 * SIDE))
    fits = int(str(e.value).split("try --max_image_pixels ")[1].split()[0])
    assert max_resized_pixels(4 * SIDE, fits) <= 98 * SIDE < max_resized_pixels(4 * SIDE, fits + SIDE)
    validate(ServerConfig(**flags, max_image_pixels=fits))
