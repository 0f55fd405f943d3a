"""Images inside the envelope: what a request carries, and the pure arithmetic of the encoder's limits.

A request's images are preprocessed on the host (autoprofile/serving/images.py) into patches
(`pixel_values`, Qwen2.5-VL's 14-pixel patches with temporal patch 2) and a grid (t, h, w) in patches.
Its prompt holds one image-pad token per merged 2x2 patch group at each image's place. The encoder runs
inside a prefill step (`Step.encode`): at most `encoder_images` images and `encoder_patches` patches per
step, each into one slot of the runner's encoder buffer (`ModelRunner.mm_buffer`: `encoder_images` slots
of `image_tokens` embeddings), where its embeddings wait for the prefill chunks that cover its tokens
(an image may span chunks); the slot is freed once its last token is computed. So no more images, and no
larger ones, run at once than the stress ran, and the buffer is declared from the envelope.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

PATCH = 14  # pixels per patch side (Qwen2.5-VL)
MERGE = 2  # merged patch groups are MERGE x MERGE patches: one LLM token each
FACTOR = PATCH * MERGE  # image sides are multiples of 28 pixels
WINDOW_PATCHES = 8  # window attention: 112-pixel windows = 8 x 8 patches


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One preprocessed image of a request. offset: the index of its first image token in the prompt."""

    pixel_values: object  # [patches, 3 * 2 * 14 * 14] float (host tensor)
    grid: tuple[int, int, int]  # (t, h, w) in patches
    offset: int
    hash: int  # content hash: part of the prefix-cache key of the pages its tokens fill

    @property
    def patches(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def num_tokens(self) -> int:
        return self.patches // (MERGE * MERGE)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass(eq=False)
class MultiModalInput:
    """A request's images, in prompt order, and its M-RoPE positions ([3, prompt len] host tensor) with the
    delta that places every later token: a token at sequence position p >= prompt len has rope position
    p + delta in all three sections."""

    images: list[ImageInput]
    positions: object
    delta: int
    # image index -> encoder buffer slot (resident images)
    slots: dict[int, int] = field(default_factory=dict)

    def overlapping(self, start: int, end: int) -> list[int]:
        """Indices of the images with a token in [start, end)."""
        return [i for i, im in enumerate(self.images) if im.offset < end and start < im.end]


# ---------------------------------------------------------------- pure arithmetic
def tokens_of_pixels(pixels: int) -> int:
    """LLM tokens of an image of `pixels` pixels (sides multiples of 28)."""
    return pixels // (FACTOR * FACTOR)


def window_count(h: int, w: int) -> int:
    """Windows of the encoder's window attention over an (h, w)-patch image (padded to whole windows)."""
    return math.ceil(h / WINDOW_PATCHES) * math.ceil(w / WINDOW_PATCHES)


def worst_image_grid(min_pixels: int, max_pixels: int) -> tuple[int, int, int]:
    """The (1, h, w) patch grid allowed by the pixel limits that holds the most patches, and of those the
    most windows (the most window padding). Sides are multiples of 28 pixels, aspect ratio at most 200."""
    best = (0, 0, (1, MERGE, MERGE))
    for hb in range(1, max_pixels // (FACTOR * FACTOR) + 1):  # h in 28-pixel blocks
        wb = max_pixels // (FACTOR * FACTOR * hb)
        wb = min(wb, hb * 200)
        if wb < 1 or max(hb, wb) > 200 * min(hb, wb) or hb * wb * FACTOR * FACTOR < min_pixels:
            continue
        h, w = hb * MERGE, wb * MERGE
        key = (h * w, window_count(h, w), (1, h, w))
        best = max(best, key)
    return best[2]


def max_image_tokens(max_pixels: int) -> int:
    return tokens_of_pixels(max_pixels)


def image_key_tokens(tokens: list[int], start: int, images: list[ImageInput]) -> tuple:
    """The prefix-cache key of tokens[start:start+len]: an image's pad tokens are replaced by its content
    hash (with the token's place in the image), so the same image shares pages and two images never do."""
    key = list(tokens)
    end = start + len(tokens)
    for im in images:
        for p in range(max(start, im.offset), min(end, im.end)):
            key[p - start] = (im.hash, p - im.offset)
    return tuple(key)
