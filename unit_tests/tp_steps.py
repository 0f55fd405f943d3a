"""What each step of the TP step broadcast shipped, noted on rank 0 (shared by the CPU test of
autoprofile.tp.broadcast and the 2-GPU one; imports nothing beyond the runtime, as rank processes load it)."""
from __future__ import annotations


class Recorder:
    """Rank 0's runner for the engine: the StepBroadcaster, noting per step its kind, rows, prefill tokens,
    the pixel bytes of the images it encodes, the (message, pixel) bytes it shipped and its tokens."""

    def __init__(self, b):
        self.b, self.steps = b, []

    def __getattr__(self, name: str):
        return getattr(self.b, name)

    def execute(self, step) -> list[int]:
        tokens = self.b.execute(step)
        image_rows = sum(r.mm is not None for r in step.all_rows)
        encoded = sum(im.pixel_values.nbytes for _, im in step.encode)
        self.steps.append(dict(prefill=step.is_prefill, rows=len(step.all_rows), image_rows=image_rows,
                               tokens=sum(len(r.ids) for r in step.rows), encoded=encoded,
                               message=self.b.shipped[0], pixels=self.b.shipped[1], sampled=tokens))
        return tokens
