"""What each step of the TP step broadcast shipped, noted on rank 0 (shared by the CPU test of
autoprofile.tp.broadcast and the 2-GPU one; imports nothing beyond the runtime, as rank processes load it)."""
from __future__ import annotations


class Recorder:
    """Rank 0's runner for the engine (engine.step_runner.StepRunner): the StepBroadcaster, noting per step its kind, rows, prefill tokens,
    the pixel bytes of the images it encodes, the (message, pixel) bytes it shipped and its tokens."""

    overlaps = False  # the broadcaster's

    def __init__(self, b):
        self.b, self.steps = b, []

    @property
    def envelope(self):
        return self.b.envelope

    @property
    def kv(self):
        return self.b.kv

    @property
    def model_config(self):
        return self.b.model_config

    @property
    def clock(self):
        return self.b.clock

    @property
    def host_kv(self):
        return self.b.host_kv

    def launch(self, step):
        return self.b.launch(step)

    def wait_load(self, load_id: int) -> None:
        self.b.wait_load(load_id)

    def loads_ready(self, ids: list[int]) -> set[int]:
        return self.b.loads_ready(ids)

    def execute(self, step) -> list[int]:
        tokens = self.b.execute(step)
        image_rows = sum(r.mm is not None for r in step.all_rows)
        encoded = sum(im.pixel_values.nbytes for _, im in step.encode)
        self.steps.append(dict(prefill=step.is_prefill, rows=len(step.all_rows), image_rows=image_rows,
                               tokens=sum(len(r.ids) for r in step.rows), encoded=encoded,
                               message=self.b.shipped[0], pixels=self.b.shipped[1], sampled=tokens))
        return tokens
