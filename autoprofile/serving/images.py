"""Images in through the OpenAI API: chat content parts, image URLs (data: and allow-listed http(s)),
decoding, and Qwen2-VL's resize and patches (equal to transformers' Qwen2VLImageProcessor).

Every client mistake is an ImageError (a message) or a ContentError (a 400 naming the OpenAI `param`)."""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import aiohttp
import numpy as np
import torch
import yarl
from PIL import Image, ImageOps, UnidentifiedImageError

# the resize and the largest grid it gives live with the encoder's limits (one truth for both)
from autoprofile.resize import (MAX_PIXELS, MAX_RATIO, MIN_PIXELS, ImageError,  # noqa: F401
                                max_resized_pixels, smart_resize)
from autoprofile.serving.errors import APIError

# Qwen2.5-VL's preprocessor_config.json (the OpenAI CLIP statistics)
QWEN_MEAN = (0.48145466, 0.4578275, 0.40821073)
QWEN_STD = (0.26862954, 0.26130258, 0.27577711)
PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE_SIZE = 14, 2, 2

# Raster formats Pillow decodes itself, tried in this order (TGA has no signature: last).
# NOTE: never let Pillow pick any format: EPS runs Ghostscript, WMF and the scientific formats need handlers
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "DIB", "TIFF", "ICO", "JPEG2000", "AVIF", "QOI", "PPM", "PCX",
           "SGI", "TGA")
DECODE_MAX_PIXELS = 1 << 26  # 8192 x 8192: more is refused before decoding (a decompression bomb)
MAX_IMAGE_BYTES = 20 << 20
FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 5
CHUNK_BYTES = 64 << 10
DETAILS = ("auto", "low", "high")


class ContentError(APIError):
    """A 400 naming the OpenAI param path of the bad field (e.g. messages[0].content[1].image_url.url)."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(400, message, param=param, code=code)


# ---------------------------------------------------------------- Qwen's resize and patches
def normalized(image: Image.Image, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """[3, H, W] float32: x / 255, then (x - mean) / std, in transformers' order of casts."""
    x = (np.asarray(image, dtype=np.uint8).astype(np.float64) * (1 / 255)).astype(np.float32)
    return np.moveaxis((x - np.array(mean, dtype=np.float32)) / np.array(std, dtype=np.float32), -1, 0)


def patchify(x: np.ndarray, patch_size: int, temporal_patch_size: int, merge_size: int) -> np.ndarray:
    """[C, H, W] -> [grid_h * grid_w, C * T * P * P], rows in merge-window order (each merge_size^2 block of
    patches consecutive), the one frame repeated over the temporal patch."""
    c, h, w = x.shape
    gh, gw = h // patch_size, w // patch_size
    x = x.reshape(c, gh // merge_size, merge_size, patch_size, gw // merge_size, merge_size, patch_size)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, P, P)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal_patch_size, *x.shape[5:]))
    return x.reshape(gh * gw, c * temporal_patch_size * patch_size * patch_size)


def preprocess(image: Image.Image, *, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
               patch_size: int = PATCH_SIZE, temporal_patch_size: int = TEMPORAL_PATCH_SIZE,
               merge_size: int = MERGE_SIZE, mean: Sequence[float] = QWEN_MEAN,
               std: Sequence[float] = QWEN_STD) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An RGB image -> (pixel_values float32 [patches, 3 * T * P * P], grid (t, h, w) in patches)."""
    if image.mode != "RGB":
        raise ImageError(f"preprocess takes an RGB image (decode_image makes one), got mode {image.mode}")
    h, w = smart_resize(image.height, image.width, patch_size * merge_size, min_pixels, max_pixels)
    resized = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    patches = patchify(normalized(resized, mean, std), patch_size, temporal_patch_size, merge_size)
    return torch.from_numpy(np.ascontiguousarray(patches)), (1, h // patch_size, w // patch_size)


def image_tokens(grid: Sequence[int], merge_size: int = MERGE_SIZE) -> int:
    """Tokens the image takes in the LLM's prompt: its patches after the merger (merge_size^2 to one)."""
    t, h, w = grid
    return t * h * w // (merge_size * merge_size)


def pixel_limits_error(min_pixels: int, max_pixels: int, factor: int = PATCH_SIZE * MERGE_SIZE) -> str | None:
    """What is wrong with --min_image_pixels / --max_image_pixels (None when they work)."""
    unit = factor * factor
    if min_pixels < unit or min_pixels % unit or max_pixels % unit or max_pixels < min_pixels:
        return (f"--min_image_pixels ({min_pixels}) and --max_image_pixels ({max_pixels}) must be multiples "
                f"of {unit} ({factor}x{factor}), min >= {unit} and min <= max, e.g. --min_image_pixels "
                f"{MIN_PIXELS} --max_image_pixels {MAX_PIXELS}")
    return None


# ---------------------------------------------------------------- bytes -> RGB
def to_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency composited onto white (as transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def decode_image(data: bytes, max_pixels: int = DECODE_MAX_PIXELS) -> Image.Image:
    """Bytes of one of FORMATS (the first frame of an animation, the largest icon of an ICO) -> an RGB image,
    EXIF orientation applied."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:
        raise ImageError(f"the image is too large to decode: {e}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError):
        raise ImageError(f"the bytes are not a {', '.join(FORMATS)} image ({len(data)} bytes, starting "
                         f"{data[:8]!r})") from None
    w, h = image.size
    if w * h > max_pixels:
        raise ImageError(f"the image is {w}x{h} pixels, over the {max_pixels} pixels this server decodes")
    if w == 0 or h == 0:
        raise ImageError(f"the image has zero size ({w}x{h} pixels)")
    try:
        image.load()
        return to_rgb(ImageOps.exif_transpose(image))
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"the image is corrupt or truncated: {e}") from None


def content_hash(data: bytes | torch.Tensor | np.ndarray) -> int:
    """A stable signed 64-bit hash of image bytes or pixel values (their shape and dtype too): page keys."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().contiguous().numpy()
    if isinstance(data, np.ndarray):
        h.update(f"{data.dtype.str}{data.shape}".encode())
        data = np.ascontiguousarray(data).data
    h.update(data)
    return int.from_bytes(h.digest(), "little", signed=True)


# ---------------------------------------------------------------- URLs -> bytes
def data_url_bytes(url: str, max_bytes: int) -> bytes:
    """data:image/<type>;base64,<payload> -> the payload's bytes."""
    header, sep, payload = url[5:].partition(",")
    media, *params = header.split(";")
    if not sep or "base64" not in params:
        raise ImageError("a data: URL must be data:image/<type>;base64,<data>, "
                         "e.g. data:image/png;base64,iVBOR...")
    if not media.lower().startswith("image/"):
        raise ImageError(f"the data: URL's media type is {media or 'missing'!r}; an image/* type is needed")
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise ImageError(f"the data: URL's image is over {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"the data: URL's base64 is invalid: {e}") from None


def checked_remote(url: yarl.URL, allowed_domains: Iterable[str]) -> yarl.URL:
    """url if it is http(s) to an allowed host, else an ImageError saying why."""
    if url.scheme not in ("http", "https"):
        raise ImageError(f"image URLs must be data: or http(s) URLs, got a {url.scheme or 'relative'}: URL")
    allowed = {d.lower() for d in allowed_domains}
    if not allowed:
        raise ImageError("this server fetches no remote image URLs (start it with --allowed_media_domains "
                         "HOST to allow some); send the image as a data: URL")
    host = (url.host or "").lower()
    if host not in allowed:
        raise ImageError(f"the image host {host!r} is not in --allowed_media_domains "
                         f"({', '.join(sorted(allowed))})")
    return url


async def read_capped(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The body, refused as soon as it is over max_bytes (announced or read)."""
    if resp.content_length is not None and resp.content_length > max_bytes:
        raise ImageError(f"the image URL's body is {resp.content_length} bytes, over the {max_bytes}-byte "
                         "limit")
    body = bytearray()
    async for chunk in resp.content.iter_chunked(CHUNK_BYTES):
        body += chunk
        if len(body) > max_bytes:
            raise ImageError(f"the image URL's body is over the {max_bytes}-byte limit")
    return bytes(body)


async def fetch_bytes(url: yarl.URL, allowed_domains: Iterable[str], max_bytes: int,
                      session: aiohttp.ClientSession) -> bytes:
    """GET url, following redirects only to allowed hosts."""
    for _ in range(MAX_REDIRECTS + 1):
        async with session.get(checked_remote(url, allowed_domains), allow_redirects=False) as resp:
            if resp.status in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                url = url.join(yarl.URL(resp.headers["Location"]))
                continue
            if resp.status != 200:
                raise ImageError(f"the image URL answered HTTP {resp.status}")
            return await read_capped(resp, max_bytes)
    raise ImageError(f"the image URL redirected more than {MAX_REDIRECTS} times")


async def load_image(url: str, *, allowed_domains: Iterable[str] = (), max_bytes: int = MAX_IMAGE_BYTES,
                     timeout_s: float = FETCH_TIMEOUT_S, session: aiohttp.ClientSession | None = None
                     ) -> Image.Image:
    """An image URL (data:, or http(s) to a host in allowed_domains) -> an RGB image."""
    if not isinstance(url, str) or not url:
        raise ImageError("the image URL must be a non-empty string")
    if url[:5].lower() == "data:":
        return decode_image(data_url_bytes(url, max_bytes))
    try:
        parsed = checked_remote(yarl.URL(url), allowed_domains)
    except ValueError as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"the image URL is malformed: {e}") from None
    if session is None:
        raise ImageError("fetching image URLs needs an HTTP session")
    try:
        data = await asyncio.wait_for(fetch_bytes(parsed, allowed_domains, max_bytes, session), timeout_s)
    except asyncio.TimeoutError:
        raise ImageError(f"the image URL did not answer within {timeout_s:g} s") from None
    except aiohttp.ClientError as e:
        raise ImageError(f"the image URL could not be fetched: {type(e).__name__}: {e}"[:300]) from None
    return decode_image(data)


# ---------------------------------------------------------------- chat content
@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    url: str
    param: str  # its OpenAI path, e.g. messages[0].content[1].image_url.url


def image_part(part: dict, where: str) -> ImagePart:
    image_url = part.get("image_url")
    if isinstance(image_url, str):  # some clients send the URL bare
        image_url = {"url": image_url}
    if not isinstance(image_url, dict):
        raise ContentError(f"{where}.image_url", f"'{where}.image_url' must be an object {{\"url\": ...}}")
    url = image_url.get("url")
    if not isinstance(url, str) or not url:
        raise ContentError(f"{where}.image_url.url", f"'{where}.image_url.url' must be a non-empty string "
                           "(a data:image/...;base64 URL, or http(s) to an allowed host)")
    if image_url.get("detail", "auto") not in DETAILS:
        raise ContentError(f"{where}.image_url.detail", f"'{where}.image_url.detail' must be one of "
                           f"{', '.join(DETAILS)}, got {image_url.get('detail')!r:.40}")
    return ImagePart(url, f"{where}.image_url.url")


def content_part(part, where: str) -> TextPart | ImagePart:
    if not isinstance(part, dict):
        raise ContentError(where, f"'{where}' must be an object with a 'type'")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ContentError(f"{where}.text", f"'{where}.text' must be a string")
        return TextPart(part["text"])
    if kind == "image_url":
        return image_part(part, where)
    raise ContentError(f"{where}.type", f"'{where}.type' must be 'text' or 'image_url', got {kind!r:.40}",
                       code="unsupported_value")


def parse_content(content, i: int) -> list[TextPart | ImagePart]:
    """messages[i].content (a string, or a list of text / image_url parts) -> its parts, in order."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return [TextPart(content)]
    if not isinstance(content, list):
        raise ContentError(where, f"'{where}' must be a string or a list of content parts")
    return [content_part(p, f"{where}[{j}]") for j, p in enumerate(content)]


def check_image_count(messages: Sequence[Sequence[TextPart | ImagePart]], max_images: int) -> int:
    """The request's image count, or a 400 naming messages when it is over max_images."""
    n = sum(isinstance(p, ImagePart) for parts in messages for p in parts)
    if n > max_images:
        raise ContentError("messages", f"the request has {n} images; this server takes at most {max_images} "
                           "per request (--max_images_per_request)")
    return n


async def gather_in_order(coros) -> list:
    """Run coros at once; their results, or the exception of the first failed one in request order (whichever
    failed first in time)."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results
