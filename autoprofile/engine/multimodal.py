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

from dataclasses import dataclass, field

from autoprofile.resize import (FACTOR, MERGE, PATCH, WINDOW_PATCHES, ImageError,  # noqa: F401
                                max_resized_pixels, smart_resize, window_count, worst_image_grid)


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
def image_key_tokens(tokens: list[int], start: int, images: list[ImageInput]) -> tuple:
    """The prefix-cache key of tokens[start:start+len]: an image's pad tokens are replaced by its content
    hash (with the token's place in the image), so the same image shares pages and two images never do."""
    key = list(tokens)
    end = start + len(tokens)
    for im in images:
        for p in range(max(start, im.offset), min(end, im.end)):
            key[p - start] = (im.hash, p - im.offset)
    return tuple(key)
