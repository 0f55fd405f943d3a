"""A chat request's images -> the engine's MultiModalInput: load (data: URLs decoded, allow-listed http(s)
URLs fetched), resize and patch off the event loop, place each image's tokens in the prompt, and give the
prompt its M-RoPE positions.

The chat template sees each image part as Qwen's own text, IMAGE_MARK (`<|vision_start|><|image_pad|>
<|vision_end|>`, what Qwen2.5-VL's template writes for an image); the rendered text is split at each of
the server's marks (not at one a client wrote: that is text), each piece encoded, and the image's start /
pad x tokens / end ids put between them: the tokenizer never has to know the special tokens (the byte
tokenizer of the built-in configs does not).
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from autoprofile.engine.multimodal import ImageInput, MultiModalInput
from autoprofile.serving.images import (ContentError, ImageError, ImagePart, content_hash, data_url_bytes,
                                        decode_image, gather_in_order, image_tokens, load_image,
                                        preprocess)
from autoprofile.serving.tokenizer import RenderedChat, Span

IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass(frozen=True)
class PreparedImage:
    pixel_values: object  # [patches, 3 * 2 * 14 * 14] float32
    grid: tuple[int, int, int]
    hash: int


@dataclass(frozen=True)
class ImageOptions:
    """The server flags that shape image intake."""

    min_pixels: int
    max_pixels: int
    allowed_domains: tuple[str, ...]
    max_bytes: int
    timeout_s: float


def prepare(part: ImagePart, image, opts: ImageOptions) -> PreparedImage:
    """Resize and patch (CPU work: run it on a worker thread); a size Qwen refuses is a 400 naming the
    part."""
    try:
        pixel_values, grid = preprocess(image, min_pixels=opts.min_pixels, max_pixels=opts.max_pixels)
    except ImageError as e:
        raise ContentError(part.param, f"'{part.param}': {e}") from None
    return PreparedImage(pixel_values, grid, content_hash(pixel_values))


def _decode_data_url(part: ImagePart, opts: ImageOptions) -> PreparedImage:
    try:
        image = decode_image(data_url_bytes(part.url, opts.max_bytes))
    except ImageError as e:
        raise ContentError(part.param, f"'{part.param}': {e}") from None
    return prepare(part, image, opts)


async def load_prepared(parts: Sequence[ImagePart], opts: ImageOptions, executor: Executor,
                        session=None) -> list[PreparedImage]:
    """Every part's image, loaded at once (decoding and resizing on `executor`); the first bad part in
    request order is the 400."""
    loop = asyncio.get_running_loop()

    async def one(part: ImagePart) -> PreparedImage:
        if part.url[:5].lower() == "data:":
            return await loop.run_in_executor(executor, _decode_data_url, part, opts)
        try:
            image = await load_image(part.url, allowed_domains=opts.allowed_domains, max_bytes=opts.max_bytes,
                                     timeout_s=opts.timeout_s, session=session)
        except ImageError as e:
            raise ContentError(part.param, f"'{part.param}': {e}") from None
        return await loop.run_in_executor(executor, prepare, part, image, opts)

    return await gather_in_order(one(p) for p in parts)


def image_marks(text: str, client: Sequence[Span] | None) -> list[int]:
    """Where the server's IMAGE_MARKs start in text: every one outside the clients' text (all of them when
    that text's place is unknown)."""
    marks, at = [], 0
    while (k := text.find(IMAGE_MARK, at)) >= 0:
        if client is None or not any(a <= k < b for a, b in client):
            marks.append(k)
            at = k + len(IMAGE_MARK)
        else:
            at = k + 1
    return marks


def _within(spans: Sequence[Span], start: int, end: int) -> list[Span]:
    return [(max(a, start) - start, min(b, end) - start) for a, b in spans if a < end and start < b]


def encode_with_images(tokenizer, rendered: RenderedChat, images: Sequence[PreparedImage], mc) -> list[int]:
    """The rendered chat's ids, each of the server's IMAGE_MARKs replaced by start, image_pad x its tokens,
    end; the clients' text (special-token text included) encoded as text."""
    text, marks = rendered.text, image_marks(rendered.text, rendered.client)
    if len(marks) != len(images):
        raise ContentError("messages", f"the chat template placed {len(marks)} images for {len(images)} "
                           "image parts (a message's text must not hold the image placeholder itself)")
    ids: list[int] = []
    for k, end in enumerate([*marks, len(text)]):
        start = marks[k - 1] + len(IMAGE_MARK) if k else 0
        if end > start:
            ids += tokenizer.encode(text[start:end], add_special_tokens=False,
                                    plain=_within(rendered.client or (), start, end))
        if k < len(images):
            ids += [mc.vision_start_token_id] + [mc.image_token_id] * image_tokens(images[k].grid)
            ids.append(mc.vision_end_token_id)
    return ids


def multimodal_input(ids: Sequence[int], images: Sequence[PreparedImage], mc) -> MultiModalInput:
    """The engine's view: each image at its first pad token, and the prompt's M-RoPE positions."""
    from models.qwen2_5_vl import mrope_positions
    positions, delta = mrope_positions(ids, [im.grid for im in images], mc)
    offsets, at = [], 0
    for im in images:
        at = ids.index(mc.image_token_id, at)
        offsets.append(at)
        at += image_tokens(im.grid)
    return MultiModalInput([ImageInput(im.pixel_values, im.grid, off, im.hash) for im,
                            off in zip(images, offsets)],
                           positions, delta)
