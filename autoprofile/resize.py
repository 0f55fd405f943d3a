"""Qwen2-VL's image resize (transformers' smart_resize, floats and all) and the largest patch grid it gives an
image under the pixel limits: pure arithmetic, the one truth that the config check, the envelope (and so the
encoder's stress and buffer), and the server's image intake all read."""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator

PATCH = 14  # pixels per patch side (Qwen2.5-VL)
MERGE = 2  # merged patch groups are MERGE x MERGE patches: one LLM token each
FACTOR = PATCH * MERGE  # image sides are multiples of 28 pixels
WINDOW_PATCHES = 8  # window attention: 112-pixel windows = 8 x 8 patches
MAX_RATIO = 200  # Qwen refuses a longer side over 200x the shorter
# transformers' Qwen2VLImageProcessor defaults
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
NOISE_SCALES = 12  # inputs of one aspect ratio at this many sizes: the float rounding of the resize differs


class ImageError(ValueError):
    """An image the server cannot take: the message says why."""


def window_count(h: int, w: int) -> int:
    """Windows of the encoder's window attention over an (h, w)-patch image (padded to whole windows)."""
    return math.ceil(h / WINDOW_PATCHES) * math.ceil(w / WINDOW_PATCHES)


def smart_resize(height: int, width: int, factor: int = FACTOR, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """Qwen2-VL's rule (transformers' Qwen2VLImageProcessor, floats and all): both sides multiples of
    `factor`, area within [min_pixels, max_pixels] where the aspect ratio allows, the aspect ratio kept as
    closely as possible. NOTE: a thin image keeps a short side of `factor` and can end past max_pixels."""
    if height <= 0 or width <= 0:
        raise ImageError(f"the image has zero size ({width}x{height} pixels)")
    if max(height, width) / min(height, width) > MAX_RATIO:
        ratio = max(height, width) / min(height, width)
        raise ImageError(f"the image is {width}x{height} pixels: its aspect ratio {ratio:.1f} is over the "
                         f"{MAX_RATIO} the model accepts")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        return (max(factor, math.floor(height / beta / factor) * factor),
                max(factor, math.floor(width / beta / factor) * factor))
    if h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        return math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_witnesses(min_pixels: int, max_pixels: int) -> Iterator[tuple[int, int]]:
    """Image sizes (h, w) whose resized grids include the largest smart_resize gives any image: per short
    side (kept: rounded), the longest long side; per long side (scaled down: h/w sets both), the ratio that
    gives the most short side, at several sizes (float rounding); per size that is scaled up, the narrowest
    image of each long side."""
    n, m, f = max_pixels // (FACTOR * FACTOR), max(min_pixels // (FACTOR * FACTOR), 1), FACTOR
    for a in range(1, math.isqrt(n) + 1):  # kept: a short side of a blocks, the widest b with a * b <= n
        h = f * a + (14 if a % 2 == 0 else 13)  # the largest h that rounds to a blocks
        widest = min(n // a, (MAX_RATIO * h + 14) // f)  # or one less: the ratio's bound, to a pixel
        for b in (widest, widest - 1):  # the smallest w that rounds to b blocks
            yield h, f * b - (14 if b % 2 == 0 else 13)
    for b in range(1, math.isqrt(MAX_RATIO * n) + 2):  # scaled down: w / h = b^2 / n gives b blocks
        num, den = b * b, n
        if num * MAX_RATIO < den:
            num, den = 1, MAX_RATIO
        elif num > MAX_RATIO * den:
            num, den = MAX_RATIO, 1
        g = math.gcd(num, den)
        k0 = 2 * f * (math.isqrt(n) + 1) // min(num // g, den // g) + 1
        for k in range(k0, k0 + NOISE_SCALES):
            yield den // g * k, num // g * k
            yield den // g * k, num // g * k + 1
    for h in range(1, f * math.isqrt(m) + f):  # scaled up: the narrowest w of each long side
        rounded = round(h / f)
        w_max = MAX_RATIO * h if rounded == 0 else min(MAX_RATIO * h, f * -(-m // rounded) + f)
        for b in range(max(math.isqrt(m), 1), math.isqrt(w_max * m // h) + 3):
            w = h * (b - 1) ** 2 // m
            for w in (w, w + 1):
                if h <= w <= MAX_RATIO * h and rounded * round(w / f) * f * f < min_pixels:
                    yield h, w


def resized_grids(min_pixels: int, max_pixels: int) -> set[tuple[int, int]]:
    """The (h, w) patch grids smart_resize gives the witnesses: among them the most patches and the most
    windows any image can reach."""
    grids = set()
    for hw in resize_witnesses(min_pixels, max_pixels):
        try:
            rh, rw = smart_resize(*hw, FACTOR, min_pixels, max_pixels)
        except ImageError:
            continue
        grids.add((rh // PATCH, rw // PATCH))
    return grids


@functools.lru_cache(maxsize=64)
def worst_image_grid(min_pixels: int, max_pixels: int) -> tuple[int, int, int]:
    """The (1, h, w) patch grid the encoder's stress runs, the truth of every bound on an image's size: the
    most patches any resized image has, and at least the most windows (window padding) any has. That is the
    grid of an image where one has both (the usual case); else the grid of those patches with the fewest
    windows that are enough (a thin one always is)."""
    grids = resized_grids(min_pixels, max_pixels)
    patches, windows = max(h * w for h, w in grids), max(window_count(h, w) for h, w in grids)
    h, w = max(grids, key=lambda g: (g[0] * g[1], window_count(*g)))
    if window_count(h, w) < windows:
        _, h, w = min((window_count(h, patches // h), h, patches // h)
                      for h in range(MERGE, patches + 1, MERGE)
                      if patches % h == 0 and patches // h % MERGE == 0
                      and window_count(h, patches // h) >= windows)
    return 1, h, w


def max_resized_pixels(min_pixels: int, max_pixels: int) -> int:
    """The most pixels smart_resize gives any image under these limits (the worst grid's)."""
    _, h, w = worst_image_grid(min_pixels, max_pixels)
    return h * w * PATCH * PATCH
