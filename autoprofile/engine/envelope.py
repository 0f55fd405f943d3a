"""The envelope: every limit one serving step obeys, derived from the config and the built KV size.

A measured profile is a promise only for the steps the stress ran. So the scheduler reads its limits
from here and nowhere else, the runner refuses any step outside them (`Envelope.check`), and the
stress (`ModelRunner.stress_prefill` / `stress_decode`) runs every limit at its maximum.

A step may be mixed: decode rows and prefill chunks in one forward (the scheduler builds one whenever both
kinds of work exist), its new tokens at most mixed_tokens (--batch_max_tokens): the decode rows count against
the budget; its decode rows run eagerly.

Decode rows above --graph_max_batch_size: by default they do not exist (running requests default to
--graph_max_batch_size, so every decode step replays a captured graph). A user who sets
--running_max_req_size above it gets eager decode steps of up to that many rows, and the stress then
runs an eager decode step at that many rows besides the graph corner.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autoprofile.budget import running_reqs
from autoprofile.engine.multimodal import MERGE, worst_image_grid


class EnvelopeError(RuntimeError):
    """A step outside the validated envelope: a bug in whoever built the step, never run."""


def mixed_tokens(batch_max_tokens: int, running: int, prefill_rows: int, longest_kv: int) -> int:
    """The most new tokens of a mixed step (0: none can exist): at least one decode row and one chunk token,
    each row a request of its own, each chunk at most a request's K/V. One decode row leaves the most room."""
    if running < 2 or batch_max_tokens < 2:
        return 0
    return 1 + min(batch_max_tokens - 1, min(running - 1, prefill_rows) * longest_kv)


@dataclass(frozen=True)
class StepShape:
    """What one step does, in the envelope's terms (every field has a limit of the same name)."""

    decode_rows: int = 0  # decode rows of a step (a decode step's, or a mixed step's beside its prefill rows)
    graph_rows: int = 0  # rows of a decode step replayed through a captured graph
    mixed_tokens: int = 0  # new tokens of a mixed step: its prefill tokens plus one per decode row
    prefill_tokens: int = 0  # new tokens of a prefill step
    prefill_rows: int = 0  # requests of a prefill step
    prefill_kv_tokens: int = 0  # tokens (cached prefix + new) the prefill attention reads, all rows
    max_prefix_len: int = 0  # longest cached prefix a prefill row attends to
    sampled_rows: int = 0
    max_req_total_len: int = 0  # longest request after this step's sampled token
    running_reqs: int = 0  # request slots in use
    pages: int = 0  # KV pages in use
    encoder_images: int = 0  # images the vision encoder runs in this step
    encoder_patches: int = 0  # their patches
    mm_tokens: int = 0  # image tokens of this prefill step (embeddings read from the encoder buffer)
    images_per_request: int = 0  # most images of one request in the step
    image_tokens_per_request: int = 0  # most image tokens of one request in the step


STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepShape))


@dataclass(frozen=True)
class VisionLimits:
    """The flags that bound the vision encoder: --visual_batch_size, --max_image_pixels,
    --max_images_per_request (each image at most max_pixels pixels, sides multiples of 28)."""

    visual_batch_size: int
    min_pixels: int
    max_pixels: int
    max_images_per_request: int

    @property
    def worst_grid(self) -> tuple[int, int, int]:
        return worst_image_grid(self.min_pixels, self.max_pixels)

    def limits(self, prefill_rows: int, prefill_tokens: int) -> dict[str, int]:
        t, h, w = self.worst_grid
        image_tokens = t * h * w // (MERGE * MERGE)
        # a step encodes at most one image per row (the scheduler's rule), each with a token in its chunk
        images = min(self.visual_batch_size, prefill_rows, prefill_tokens)
        return dict(encoder_images=images, encoder_patches=images * t * h * w,
                    mm_tokens=min(prefill_tokens, images * image_tokens),
                    images_per_request=self.max_images_per_request,
                    image_tokens_per_request=self.max_images_per_request * image_tokens)


@dataclass(frozen=True)
class Envelope:
    page_size: int
    pages: int  # most pages in use at once: min(cache pages - pad page, running_reqs * pages of a request)
    running_reqs: int
    max_req_total_len: int  # longest request, prompt + output (--max_req_total_len)
    decode_rows: int
    graph_rows: int  # 0: no graphs (eager decode only)
    mixed_tokens: int  # a mixed step's new tokens (--batch_max_tokens: decode rows count against it)
    prefill_tokens: int  # --batch_max_tokens (or fewer, when no step could hold that many)
    prefill_rows: int
    prefill_kv_tokens: int
    max_prefix_len: int
    sampled_rows: int
    encoder_images: int = 0  # 0: a text model (no encoder)
    encoder_patches: int = 0
    mm_tokens: int = 0
    images_per_request: int = 0
    image_tokens_per_request: int = 0
    # the largest image's grid (multimodal.worst_image_grid): what the stress encodes; no image is larger
    image_grid: tuple[int, int, int] = (0, 0, 0)
    # the piecewise graphs' largest bucket (engine.piecewise; 0: none): a stress corner of its own
    piecewise_tokens: int = 0

    @classmethod
    def build(cls, *, kv_pages: int, page_size: int, context_len: int, batch_max_tokens: int,
              running_max_req_size: int | None, graph_max_batch_size: int, use_graphs: bool,
              vision: VisionLimits | None = None, piecewise_tokens: int = 0) -> Envelope:
        """kv_pages: pages of the built cache, the pad page included. vision: the encoder's limits (VL
        models). piecewise_tokens: the piecewise graphs' largest bucket (0: none)."""
        reqs = running_reqs(running_max_req_size, graph_max_batch_size)
        # The longest request holds prompt + output - 1 tokens of K/V: the last sampled token is never fed.
        longest_kv = context_len - 1
        prefill_rows = min(reqs, batch_max_tokens)
        # no row computes more than a request
        prefill_tokens = min(batch_max_tokens, prefill_rows * longest_kv)
        mixed = mixed_tokens(batch_max_tokens, reqs, prefill_rows, longest_kv)
        return cls(
            page_size=page_size,
            pages=min(kv_pages - 1, reqs * math.ceil(longest_kv / page_size)),
            running_reqs=reqs,
            max_req_total_len=context_len,
            decode_rows=reqs,
            graph_rows=min(graph_max_batch_size, reqs) if use_graphs else 0,
            mixed_tokens=mixed,
            prefill_tokens=prefill_tokens,
            prefill_rows=prefill_rows,
            # one chunk at the end of the longest prompt, or a full batch of fresh prompts
            prefill_kv_tokens=max(longest_kv, prefill_tokens),
            max_prefix_len=longest_kv - 1,
            sampled_rows=max(reqs, prefill_rows),
            **(vision.limits(prefill_rows, prefill_tokens) if vision else {}),
            image_grid=vision.worst_grid if vision else (0, 0, 0),
            piecewise_tokens=min(piecewise_tokens, mixed),
        )

    @property
    def image_tokens(self) -> int:
        """Tokens of the largest image: the encoder buffer holds encoder_images of them."""
        return self.encoder_patches // max(self.encoder_images, 1) // (MERGE * MERGE)

    def limits(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in STEP_FIELDS}

    def check(self, shape: StepShape) -> None:
        over = [f"{name} {getattr(shape, name)} > {limit}" for name, limit in self.limits().items()
                if getattr(shape, name) > limit]
        mixed = shape.decode_rows and shape.prefill_rows
        if mixed and shape.mixed_tokens != shape.prefill_tokens + shape.decode_rows:
            over.append("a mixed step's tokens are its prefill tokens and one per decode row")
        if shape.graph_rows and (shape.graph_rows != shape.decode_rows or shape.prefill_rows):
            over.append("a graph step replays every decode row, and only decode rows")
        if over:
            raise EnvelopeError(f"step outside the validated envelope: {', '.join(over)}")
