"""Serving under TP: rank 0 ships each step over the control group, every rank runs it in its guard's
section and votes on its errors (StepFailed: the step's requests end, serving goes on). An image's pixels
travel once, as a tensor, with the step that encodes it; no other step carries pixels."""
from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from autoprofile import memory
from autoprofile.engine.multimodal import ImageInput, MultiModalInput
from autoprofile.engine.envelope import Envelope
from autoprofile.engine.host_kv import HostKVPool
from autoprofile.engine.sampler import SampledTokens, StepTokens
from autoprofile.engine.scheduler import Step, StepRow
from autoprofile.engine.step_clock import StepClock
from autoprofile.model_config import ModelConfig
from autoprofile.tp.channel import HEARTBEAT_S, GuardedRunner, StepFailed, TPError, is_consequence
from autoprofile.tp.votes import describe, gather_errors

log = logging.getLogger(__name__)
PEER_CHECK_S = 0.5  # the idle rank 0 looks for a peer that ended this often


# ---------------------------------------------------------------- serving: the step broadcast
# What rank 0 ships per step: one pickled message of O(rows + prefill tokens) bytes (an image row carries
# its images' grids and its chunk's M-RoPE positions, never pixels), then, as raw tensors, the pixels of the
# images the step encodes: at most envelope.encoder_images images of envelope.encoder_patches patches in all.
def encode(step: Step) -> tuple:
    """What a worker needs of a Step, without pixels (requests stay on rank 0: only rank 0 samples for real).
    A vision-language row carries its images' grids, the M-RoPE positions of its own tokens and the delta;
    the images this step encodes travel apart (`pixels`), and every rank encodes them with its own replica
    of the tower."""
    rows = [[(r.slot, r.start, r.ids, r.sample, r.params, None, _row_images(r), r.spans) for r in part]
            for part in (step.rows, step.decode)]
    encode_images = [(slot, _image_meta(im), im.pixel_values is not None) for slot, im in step.encode]
    # the host tier's copies (page ids): each rank moves its own shard of the same pages, its forward waits
    # for its own copies of the loads rank 0 found done (kv_ready)
    return (step.is_prefill, rows, step.page_writes, step.running, step.pages_used, encode_images,
            step.routing, step.kv_saves, step.kv_loads, step.kv_load_id, step.kv_ready)


def pixels(step: Step) -> list[torch.Tensor]:
    """The pixels of the images the step encodes (host tensors, in step.encode's order), shipped after
    `encode(step)`."""
    return [im.pixel_values.contiguous() for _, im in step.encode if im.pixel_values is not None]


def decode(msg: tuple, pixel_values: Sequence[torch.Tensor] = ()) -> Step:
    (is_prefill, (rows, decode_rows), page_writes, running, pages_used, encode_images, routing, kv_saves,
     kv_loads, kv_load_id, kv_ready) = msg
    if len(pixel_values) != sum(has_pixels for _, _, has_pixels in encode_images):
        raise ValueError(f"the step encodes {len(encode_images)} images; {len(pixel_values)} pixel tensors "
                         "came with it")
    shipped = iter(pixel_values)
    images = [(slot, ImageInput(next(shipped) if has_pixels else None, *meta))
              for slot, meta, has_pixels in encode_images]
    return Step(is_prefill, [_step_row(r) for r in rows], page_writes, running, pages_used, images,
                decode=[_step_row(r) for r in decode_rows], routing=routing, kv_saves=kv_saves,
                kv_loads=kv_loads, kv_load_id=kv_load_id, kv_ready=kv_ready)


def _image_meta(im: ImageInput) -> tuple:
    return im.grid, im.offset, im.hash


def _row_images(r: StepRow) -> tuple | None:
    """A row's MultiModalInput on the wire: its images without pixels, and of the prompt's M-RoPE positions
    only those of the row's own tokens (none for a decode row)."""
    mm = r.mm
    if mm is None:
        return None
    end = r.start + len(r.ids)
    own = None
    if mm.positions is not None and r.start < mm.positions.shape[1]:
        own = mm.positions[:, r.start:end].clone()  # NOTE: a view would pickle the whole prompt's positions
    return [_image_meta(im) for im in mm.images], own, mm.delta, dict(mm.slots)


def _step_row(wire: tuple) -> StepRow:
    slot, start, ids, sample, params, request, mm, spans = wire
    if mm is not None:
        images, own, delta, slots = mm
        positions = None
        if own is not None:
            # NOTE: ModelRunner._mrope reads a row's positions[:, start:end] only: the columns before start
            # are zeros here, and the width (start + own's) places the tail after the prompt as the full
            # prompt's width would
            positions = torch.zeros(3, start + own.shape[1], dtype=own.dtype)
            positions[:, start:] = own
        mm = MultiModalInput([ImageInput(None, *meta) for meta in images], positions, delta, slots)
    return StepRow(slot, start, ids, sample, params, request, mm, spans)


def send(group, kind: str, payload=None, tensors: Sequence[torch.Tensor] = ()) -> tuple[int, int]:
    """Rank 0: (kind, payload) pickled, then each tensor's raw bytes; returns (message bytes, tensor
    bytes)."""
    data = torch.frombuffer(bytearray(pickle.dumps((kind, payload, [(t.shape, t.dtype) for t in tensors]))),
                            dtype=torch.uint8)
    dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), src=0, group=group)
    dist.broadcast(data, src=0, group=group)
    for t in tensors:
        dist.broadcast(t, src=0, group=group)
    return data.numel(), sum(t.nbytes for t in tensors)


def receive(group) -> tuple[str, object, list[torch.Tensor]]:
    """Ranks > 0: what rank 0's `send` shipped: (kind, payload, tensors)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    kind, payload, specs = pickle.loads(data.numpy().tobytes())
    tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    for t in tensors:
        dist.broadcast(t, src=0, group=group)
    return kind, payload, tensors


def run_step(runner: GuardedRunner, step) -> SampledTokens:
    """Every rank: execute the step, then the error vote. Workers execute exactly what rank 0 does,
    sampling and logprobs included (the memory the profile measured); their results are dropped: the LM head
    gathers the full logits on every rank, so rank 0's SampledTokens are the step's."""
    guard = runner.guard
    err, out = None, None
    try:
        out = runner.execute(step)
    except Exception as e:  # noqa: BLE001 - every failure goes to the vote
        err = describe(e)
    if memory.all_ok(err is None, guard.control):
        return out
    text = "; ".join(gather_errors(err, guard.control))
    if memory.all_reduce_max(int(guard.aborted), guard.control):
        raise TPError(f"tensor-parallel serving stopped: a step failed inside a collective and the data "
                      f"plane was aborted ({text})")
    guard.heal()
    raise StepFailed(text)


class StepBroadcaster:
    """Rank 0's runner for LLMEngine and the server (engine.step_runner.StepRunner): `execute(step)` ships the
    step to every rank over the control group, runs it here too and returns rank 0's tokens; the envelope,
    KV, model, clock, host tier and device are the runner's. It does not overlap: a worker would feed decode
    tokens it never sampled. `close()` ends the workers. Thread-safe (the heartbeat)."""

    overlaps = False

    def __init__(self, runner: GuardedRunner, on_fatal: Callable[[str], None] | None = None,
                 heartbeat_s: float = HEARTBEAT_S):
        self.runner, self.guard = runner, runner.guard
        self.on_fatal = on_fatal or (lambda text: None)
        self.fatal: str | None = None
        self.shipped = (0, 0)  # the last step's (message bytes, pixel bytes)
        self.totals = [0, 0, 0]  # steps, message bytes, pixel bytes
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True)
        self._beat.start()

    @property
    def envelope(self) -> Envelope | None:
        return self.runner.envelope

    @property
    def kv(self):
        return self.runner.kv

    @property
    def model_config(self) -> ModelConfig:
        return self.runner.model_config

    @property
    def clock(self) -> StepClock:
        return self.runner.clock

    @property
    def host_kv(self) -> HostKVPool | None:
        return self.runner.host_kv

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def launch(self, step) -> StepTokens:
        raise RuntimeError("the TP step broadcast does not overlap (overlaps is False): call execute(step)")

    def wait_load(self, load_id: int) -> None:
        self.runner.wait_load(load_id)

    def loads_ready(self, ids: list[int]) -> set[int]:
        return self.runner.loads_ready(ids)

    def teardown(self) -> None:
        self.runner.teardown()

    def execute(self, step) -> SampledTokens:
        with self._lock:
            if self.fatal is not None:
                raise TPError(self.fatal)
            try:
                self.shipped = self._send("step", encode(step), pixels(step))
                self.totals = [self.totals[0] + 1, self.totals[1] + self.shipped[0],
                               self.totals[2] + self.shipped[1]]
                return run_step(self.runner, step)
            except TPError as e:
                self._fail(str(e))
                raise
            except Exception as e:
                if not is_consequence(e):
                    raise
                # a peer is gone (killed, or ended itself: 2b): no step can run any more, on any rank
                text = f"tensor-parallel serving stopped: {self.guard.diagnose(e)}"
                self._fail(text)
                raise TPError(text) from e

    def _fail(self, text: str) -> None:
        self.fatal = text
        self.on_fatal(text)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self.fatal is None:
                self._send("stop")
                self.fatal = "closed"
        steps, message, pixel = self.totals
        log.info("step broadcast: %d steps shipped %.1f MiB of steps and %.1f MiB of pixels", steps,
                 message / 2**20, pixel / 2**20)

    def _send(self, kind: str, payload=None, tensors: Sequence[torch.Tensor] = ()) -> tuple[int, int]:
        shipped = send(self.guard.control, kind, payload, tensors)
        self._last = time.monotonic()
        return shipped

    def _heartbeat(self, every: float) -> None:
        """Pings idle workers; stops serving as soon as the watchdog saw a peer end (a dead rank, a host
        gone), idle or not: no step could run any more."""
        while not self._stop.wait(min(every / 4, PEER_CHECK_S)):
            gone = self.guard.fatal_peers()
            with self._lock:
                if self.fatal is None and gone:
                    self._fail(f"tensor-parallel serving stopped: {gone}")
                elif self.fatal is None and time.monotonic() - self._last >= every:
                    self._send("ping")


def worker_loop(runner: GuardedRunner, on_step: Callable[[Step, SampledTokens], None] | None = None) -> int:
    """Ranks > 0: run every step rank 0 ships until it says stop; returns the steps run. on_step(step, this
    rank's SampledTokens) after each step that ran. A fatal step raises TPError (the same text as rank 0's);
    rank 0 dying ends the loop with a gloo error."""
    steps = 0
    while True:
        kind, payload, tensors = receive(runner.guard.control)
        if kind == "stop":
            return steps
        if kind == "step":
            steps += 1
            step = decode(payload, tensors)
            try:
                sampled = run_step(runner, step)
            except StepFailed as e:
                log.warning("step %d failed on some rank (rank 0 ends its requests): %s", steps, e)
                continue
            if on_step is not None:
                on_step(step, sampled)
