"""The step the scheduler hands the runner: its rows (prefill chunks, decode rows), the pages they are
granted, the copies around the forward (host tier, state checkpoints), and its shape against the envelope.
Host-side only (no torch), as the scheduler that builds it."""
from __future__ import annotations

from dataclasses import dataclass, field

from autoprofile.engine.envelope import StepShape
from autoprofile.engine.multimodal import ImageInput, MultiModalInput
from autoprofile.engine.request import Request
from autoprofile.engine.sampling_params import SamplingParams


@dataclass
class StepRow:
    slot: int
    start: int  # tokens already in the cache: the row computes positions start .. start + len(ids) - 1
    ids: list[int]
    sample: bool  # its last position's logits are sampled (the request's tokens are all computed)
    params: SamplingParams
    request: Request | None = None  # None in the stresses
    mm: MultiModalInput | None = None  # the request's images (M-RoPE positions, rope delta)
    # image tokens of this row: (index in ids, encoder buffer slot, first token in the image, count)
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    applied: bool = False  # Scheduler.launched counted it (its request was running when the step launched)
    preemptions: int = 0  # its request's preemptions when the step launched: a later one leaves these pages


@dataclass
class Step:
    is_prefill: bool  # rows are prefill rows (and `decode` the decode rows of a mixed step), else decode rows
    rows: list[StepRow]
    page_writes: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (slot, first column, pages)
    running: int = 0  # request slots in use during the step
    pages_used: int = 0
    # (encoder buffer slot, image), run first
    encode: list[tuple[int, ImageInput]] = field(default_factory=list)
    decode: list[StepRow] = field(default_factory=list)  # a mixed step's decode rows, after its prefill rows
    routing: str = "model"  # an MoE model's routing (layers.moe.ROUTINGS): the stress forces the others
    # host tier copies, before the forward, saves first: (gpu page, host page), then (host page, gpu page)
    kv_saves: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)
    kv_load_id: int = 0  # the loads' id (0: none): the runner reports it done (ModelRunner.loads_ready)
    kv_ready: list[int] = field(default_factory=list)  # load ids done since the step before
    # a hybrid model's state checkpoints: (checkpoint, slot) copied before the forward, (slot, checkpoint)
    # after it (engine.state_cache)
    state_loads: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)

    @property
    def all_rows(self) -> list[StepRow]:
        """Every row in the order its tokens are computed and sampled: prefill rows, then decode rows."""
        return self.rows + self.decode

    def shape(self, graph_rows: int) -> StepShape:
        """graph_rows: the runner's graph limit (a decode step of at most that many rows replays a graph)."""
        rows = self.all_rows
        common = dict(sampled_rows=sum(r.sample for r in rows), running_reqs=self.running,
                      pages=self.pages_used,
                      max_req_total_len=max((r.start + len(r.ids) + 1 for r in rows), default=0))
        images = [r.mm.images for r in rows if r.mm is not None]
        common.update(images_per_request=max(map(len, images), default=0),
                      image_tokens_per_request=max((sum(im.num_tokens for im in ims) for ims in images),
                                                   default=0))
        if not self.is_prefill:
            return StepShape(decode_rows=len(rows), graph_rows=len(rows) if len(rows) <= graph_rows else 0,
                             **common)
        rows, tokens = self.rows, sum(len(r.ids) for r in self.rows)
        return StepShape(prefill_tokens=tokens, prefill_rows=len(rows),
                         prefill_kv_tokens=sum(r.start + len(r.ids) for r in rows),
                         max_prefix_len=max((r.start for r in rows), default=0),
                         decode_rows=len(self.decode),
                         mixed_tokens=tokens + len(self.decode) if self.decode else 0,
                         encoder_images=len(self.encode), encoder_patches=sum(im.patches for _,
                                                                              im in self.encode),
                         mm_tokens=sum(s[3] for r in rows for s in r.spans), **common)


def image_spans(mm: MultiModalInput, start: int, n: int) -> list[tuple[int, int, int, int]]:
    """The image tokens of a chunk [start, start + n) of a request whose images are all resident:
    (index in the chunk, encoder buffer slot, first token in the image, count) per image."""
    spans = []
    for i in mm.overlapping(start, start + n):
        im = mm.images[i]
        a, b = max(start, im.offset), min(start + n, im.end)
        spans.append((a - start, mm.slots[i], a - im.offset, b - a))
    return spans
