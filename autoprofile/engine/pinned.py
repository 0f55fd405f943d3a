"""Pinned host buffers that the device reads after the host wrote them (a step's input upload, the host tier's
page lists): a buffer is written again only once what read it has run (its event, never waited for), so no
launch waits for the GPU; when every buffer is still queued, one more is made. Host memory only."""
from __future__ import annotations

from collections.abc import Callable

import torch


def pick_buffer(buffers: list[tuple[int, bool]], n: int) -> tuple[int | None, bool]:
    """The choice for n elements among the buffers [(capacity, free)]: (index, grow). The smallest free buffer
    that holds n (grow False); else a free one to replace by a larger one (grow True); else (None, True): a
    new buffer (every buffer's reader is still queued)."""
    fits = [(cap, i) for i, (cap, free) in enumerate(buffers) if free and cap >= n]
    if fits:
        return min(fits)[1], False
    free = [i for i, (_, ok) in enumerate(buffers) if ok]
    return (free[0] if free else None), True


class PinnedBuffers:
    def __init__(self, dtype: torch.dtype, min_bits: int, pin_memory: bool = True,
                 new_event: Callable[[], torch.cuda.Event] = torch.cuda.Event):
        """min_bits: the smallest buffer is 2**min_bits elements (powers of two: few sizes, each made once).
        new_event, pin_memory: the tests' seam (on the CPU, a fake event and pageable buffers)."""
        self.buffers: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self.dtype, self.min_bits = dtype, min_bits
        self.new_event, self.pin_memory = new_event, pin_memory

    def take(self, n: int) -> tuple[int, torch.Tensor]:
        """(index, buffer) of a free buffer of at least n elements; release(index) once its reader is queued."""
        i, grow = pick_buffer([(b.numel(), ev is None or ev.query()) for b, ev in self.buffers], n)
        if grow:
            size = 1 << max(self.min_bits, (n - 1).bit_length())
            buf = torch.empty(size, dtype=self.dtype, pin_memory=self.pin_memory)
            if i is None:
                i = len(self.buffers)
                self.buffers.append((buf, None))
            else:
                self.buffers[i] = (buf, None)
        return i, self.buffers[i][0]

    def release(self, i: int, event: torch.cuda.Event | None = None) -> torch.cuda.Event:
        """Buffer i is free again once `event` has completed (default: one recorded now on the current
        stream, after what was queued to read it)."""
        if event is None:
            event = self.new_event()
            event.record()
        self.buffers[i] = (self.buffers[i][0], event)
        return event
