"""The stress: the envelope's corners as steps (pure: no torch). The runner executes them through the
same `execute` as serving, in the probe and in every validation attempt.

Prefill corners, every row sampled with the full sampler (consecutive corners alternate the two worst
sampler paths, STRESS_PARAMS; corner (a) runs twice, so each path samples the most prefill rows):
  (a) the most rows sharing the most new tokens, once per sampler path;
  (b) one request of as many new tokens as a step takes;
  (c) chunks over the longest cached prefixes, prefix + new = prefill_kv_tokens;
  (d) one token over the longest prefix any chunk can have;
  (e) one fresh request of one page: the shortest prefill, so a launch config picked by length runs too
      (aiter_triton's short prefill config, triton_prefill's on NVIDIA: a call whose requests read at most
      SHORT_PREFILL_KEYS keys).
Mixed corners (a prefill step with decode rows, as serving runs whenever both kinds of work exist): the
most decode rows a mixed step can hold (running requests but one) at the longest contexts (the first at
--max_req_total_len: the largest bucket, decoded eagerly) beside one chunk over the longest prefix; and,
when that falls short of mixed_tokens, one decode row beside chunks of the rest of the budget; with
piecewise graphs (engine.piecewise), their largest bucket: the most decode rows beside one fresh chunk of
the rest (its attention runs eagerly between the pieces, at that bucket's most rows).
Decode corners: the most decode rows (eager above the graph size), and the largest graph when it is
smaller; every row sampled with the full sampler; the envelope's pages spread over the rows (the
longest contexts the cache allows), the first row at --max_req_total_len; DECODE_STEPS steps each.
The first row makes every decode corner run attention at the largest max_seq_len bucket (the runner
picks the bucket from the longest row): the decode kernels' scratch grows with max_seq_len at a given
row count (AITER Triton's v2 partials: rows x heads x ceil(max_seq_len/1024); its v1 path, taken at
<= 8192, allocates none), so the eager corner at the most rows and the largest bucket holds the most
any eager decode step holds. Graphs allocate nothing at replay: every (batch, bucket) graph is captured
at build, in the probe and the target alike, into one pool that the probe measures.
Image corners (vision-language models): one prefill step that encodes the most images (encoder_images)
at the grid with the most patches and then the most window padding (multimodal.worst_image_grid) and
reads the most image tokens (mm_tokens) from the encoder buffer, each row a request carrying the most
images; every decode corner's rows carry images too (the M-RoPE decode path, rope delta included).
MoE corners (an MoE model): the steps with the most tokens again under each forced routing (layers.moe:
every token to the same top_k experts, and tokens spread evenly): prefill corners (a) and (b), the first
mixed corner, and the decode corners. The mixed corner's chunk runs fresh there (its prefix's attention
ran under the model's routing already): an expert's scratch follows the tokens routed to it, not the keys
an attention read, and a layer's gathered prefix is freed before its experts run. Measured on an H200
(docs/measurements.md, "The experts' corners over no prefix"): the same peak, 2 x 3 s less a stress at a
262k context. The router's own choice depends on the tokens, so serving can route
anywhere between those ends, whatever the stress's random tokens happened to reach.
Prefixes and contexts need no real cache: rows take the cache's pages cyclically (the memory a step
needs does not depend on what the pages hold), so the probe's small cache runs the same corners.
"""
from __future__ import annotations

import dataclasses
import math
import random

from autoprofile.engine.envelope import Envelope, StepShape
from autoprofile.engine.multimodal import ImageInput, MultiModalInput
from autoprofile.engine.sampling_params import STRESS_PARAMS
from autoprofile.engine.scheduler import Step, StepRow, image_spans

DECODE_STEPS = 2
Rows = list[tuple[int, int]]  # (start, new tokens) per row


def prefill_corners(env: Envelope) -> list[Rows]:
    longest = env.max_req_total_len - 1
    rows = min(env.prefill_rows, env.prefill_tokens)
    share, extra = divmod(env.prefill_tokens, rows)
    most_rows = [(0, share + (i < extra)) for i in range(rows)]
    return [most_rows] * len(STRESS_PARAMS) + [[(0, min(env.prefill_tokens, longest))],
            prefix_corner(env),
            [(env.max_prefix_len, 1)],
            [(0, min(env.page_size, env.prefill_tokens, longest))]]


def prefix_corner(env: Envelope) -> Rows:
    """Rows whose prefix + new tokens fill prefill_kv_tokens, each at most the longest request's K/V,
    with as many new tokens as the step takes (at least one each)."""
    longest = env.max_req_total_len - 1
    kv, left = [], env.prefill_kv_tokens
    while left > 0 and len(kv) < env.prefill_rows:
        kv.append(min(left, longest))
        left -= kv[-1]
    rows, new_left = [], env.prefill_tokens
    for i, k in enumerate(kv):
        n = max(1, min(k - 1, new_left - (len(kv) - i - 1)))
        rows.append((k - n, n))
        new_left -= n
    return rows


def mixed_corners(env: Envelope) -> list[tuple[Rows, Rows]]:
    """(chunk rows, decode rows) of the mixed corners; none when no mixed step can exist."""
    if not env.mixed_tokens:
        return []
    longest = env.max_req_total_len - 1
    d = min(env.decode_rows, env.running_reqs - 1, env.mixed_tokens - 1)
    n = min(env.mixed_tokens - d, longest)
    corners = [([(min(longest, env.prefill_kv_tokens) - n, n)], spread_rows(env, d)[-1])]
    if d + n < env.mixed_tokens:  # the most tokens: one decode row, fresh chunks of the rest
        left, chunks = env.mixed_tokens - 1, []
        while left:
            chunks.append((0, min(left, longest)))
            left -= chunks[-1][1]
        corners.append((chunks, spread_rows(env, 1)[-1]))
    if env.piecewise_tokens:
        d = min(env.decode_rows, env.running_reqs - 1, env.piecewise_tokens - 1)
        corners.append(([(0, min(env.piecewise_tokens - d, longest))], spread_rows(env, d)[-1]))
    return corners


def spread_rows(env: Envelope, n: int) -> list[Rows]:
    """DECODE_STEPS steps of n decode rows: the envelope's pages spread over them, the first row at the
    longest context (the largest bucket)."""
    base, extra = divmod(env.pages, n)
    lens = [min(max(base + (i < extra), 1) * env.page_size, env.max_req_total_len - 1) for i in range(n)]
    lens[0] = env.max_req_total_len - 1  # the largest bucket (pages are taken cyclically: any cache holds it)
    return [[(max(length - 1 - back, 0), 1) for length in lens] for back in range(DECODE_STEPS - 1, -1, -1)]


def decode_corners(env: Envelope) -> list[Rows]:
    sizes = [env.decode_rows] + ([env.graph_rows] if 0 < env.graph_rows < env.decode_rows else [])
    return [rows for n in sizes for rows in spread_rows(env, n)]


def corner_step(env: Envelope, is_prefill: bool, rows: Rows, usable_pages: int, vocab_size: int,
                seed: int) -> Step:
    """One step of fake requests in slots 0.., pages 1..usable_pages taken cyclically, random ids. Its
    `running` and `pages_used` are the slots and distinct pages the step really holds."""
    rng = random.Random(seed)
    step, nxt = Step(is_prefill=is_prefill, rows=[]), 0
    for slot, (start, n) in enumerate(rows):
        count = math.ceil((start + n) / env.page_size)
        step.page_writes.append((slot, 0, [(nxt + j) % usable_pages + 1 for j in range(count)]))
        nxt += count
        params = STRESS_PARAMS[seed % len(STRESS_PARAMS)]  # consecutive corners: both worst sampler paths
        step.rows.append(StepRow(slot, start, [rng.randrange(vocab_size) for _ in range(n)], True, params))
    step.running = len({r.slot for r in step.rows})
    step.pages_used = len({p for _, _, pages in step.page_writes for p in pages})
    return step


# ---------------------------------------------------------------- images
def stress_images(env: Envelope, count: int, seed: int) -> MultiModalInput:
    """A fake request's images: `count` images of the envelope's largest grid, back to back from token 0
    (pixel_values None: the runner encodes random patches of that grid)."""
    tokens = env.image_tokens
    return MultiModalInput([ImageInput(None, env.image_grid, i * tokens,
                                       hash((seed, i))) for i in range(count)],
                           positions=None, delta=0)


def image_corner_rows(env: Envelope) -> Rows:
    """One row per encoded image, its chunk inside its first image, the chunks together mm_tokens long."""
    k = env.encoder_images
    share, extra = divmod(env.mm_tokens, k)
    return [(0, share + (i < extra)) for i in range(k)]


def image_corner_step(env: Envelope, usable_pages: int, vocab_size: int, seed: int) -> Step:
    step = corner_step(env, True, image_corner_rows(env), usable_pages, vocab_size, seed)
    for slot, row in enumerate(step.rows):
        row.mm = stress_images(env, env.images_per_request, seed)
        row.mm.slots[0] = slot
        step.encode.append((slot, row.mm.images[0]))
        row.spans = image_spans(row.mm, row.start, len(row.ids))
    return step


def with_images(env: Envelope, step: Step, seed: int) -> Step:
    """A decode corner whose rows carry images (their tokens all computed: nothing to encode)."""
    for row in step.rows:
        row.mm = stress_images(env, env.images_per_request, seed)
    return step


# ---------------------------------------------------------------- the steps the runner executes
def forced(steps: list[Step], routings: tuple[str, ...]) -> list[Step]:
    """Copies of `steps` under each forced routing."""
    return [dataclasses.replace(step, routing=r) for r in routings for step in steps]


def fresh_chunks(corners: list[tuple[Rows, Rows]]) -> list[tuple[Rows, Rows]]:
    """The mixed corners with each chunk's new tokens over no prefix: the same tokens through every
    layer's GEMMs and experts, attention over the chunk alone."""
    return [([(0, n) for _, n in chunks], decode) for chunks, decode in corners]


def mixed_steps(env: Envelope, usable_pages: int, vocab_size: int, seed: int,
                corners: list[tuple[Rows, Rows]]) -> list[Step]:
    """Mixed corners (mixed_corners, fresh_chunks) as steps: chunks in rows, decode rows (other slots) in
    decode; a vision-language model's decode rows carry images."""
    steps = []
    for i, (chunks, decode) in enumerate(corners):
        step = corner_step(env, True, chunks + decode, usable_pages, vocab_size, seed + i)
        step.rows, step.decode = step.rows[:len(chunks)], step.rows[len(chunks):]
        if env.encoder_images:
            for row in step.decode:
                row.mm = stress_images(env, env.images_per_request, seed)
        steps.append(step)
    return steps


def prefill_steps(env: Envelope, usable_pages: int, vocab_size: int, seed: int,
                  routings: tuple[str, ...] = ()) -> list[Step]:
    """The prefill corners as steps, the mixed corners, the image corner (vision-language models), then
    the MoE corners under each of `routings`: corners (a) and (b), and the first mixed corner with its
    chunk fresh (fresh_chunks: its attention over the longest prefix ran under the model's routing)."""
    steps = [corner_step(env, True, rows, usable_pages, vocab_size, seed + i)
             for i, rows in enumerate(prefill_corners(env))]
    most = steps[len(STRESS_PARAMS) - 1:len(STRESS_PARAMS) + 1]  # corners (a) and (b): the most tokens
    mixed = mixed_corners(env)
    steps += mixed_steps(env, usable_pages, vocab_size, seed + len(steps), mixed)
    if env.encoder_images:
        steps.append(image_corner_step(env, usable_pages, vocab_size, seed))
    if not routings:
        return steps
    experts = mixed_steps(env, usable_pages, vocab_size, seed + len(steps), fresh_chunks(mixed[:1]))
    return steps + forced(most + experts, routings)


def decode_steps(env: Envelope, usable_pages: int, vocab_size: int, seed: int,
                 routings: tuple[str, ...] = ()) -> list[Step]:
    """The decode corners as steps (a vision-language model's rows carry images), then again under each
    of `routings` (an MoE model)."""
    steps = [corner_step(env, False, rows, usable_pages, vocab_size, seed + i)
             for i, rows in enumerate(decode_corners(env))]
    if env.encoder_images:
        steps = [with_images(env, step, seed + i) for i, step in enumerate(steps)]
    return steps + forced(steps, routings)


CORNER = "corner: "  # a timed boot step that is one stress corner (runner.take_boot_steps): this + its label


def corner_label(shape: StepShape, routing: str = "model") -> str:
    """A corner in a few words, for the boot's report: "8192 new in 256 rows, kv 8192",
    "1 new in 1 row, kv 131071 + 255 decode rows (worst)", "256 decode rows to 131072"."""
    if shape.prefill_rows:
        text = (f"{shape.prefill_tokens} new in {shape.prefill_rows} row{'s' * (shape.prefill_rows > 1)}, "
                f"kv {shape.prefill_kv_tokens}")
        if shape.decode_rows:
            text += f" + {shape.decode_rows} decode rows"
    else:
        text = f"{shape.decode_rows} decode rows to {shape.max_req_total_len}"
    return text if routing == "model" else f"{text} ({routing})"
