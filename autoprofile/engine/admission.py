"""Admission under an estimate of the output to come: SGLang's new_token_ratio, host-side only (no torch);
and when new requests join running decode rows (TGI's waiting_served_ratio and max_waiting_tokens: admit_now).

A request is admitted with the pages of its first chunk; nothing is reserved for the output it will write.
Admitted on free pages alone, a crowd of long outputs outgrows the cache together and the running set is
preempted and recomputed over and over. So the scheduler admits a request only when the free tokens cover
its prompt still to compute plus, for it and for every running request, the prompt still to compute and the
output still to come times `new_token_ratio`. The ratio starts at init_new_token_ratio (0.7), falls by
new_token_ratio_decay each decode step that preempts nothing, down to min_new_token_ratio (0.1: SGLang's
0.7 x 0.14), and jumps back after a preemption to what the running requests have written of their
max_tokens plus RETRACT_DECODE_STEPS tokens each (retract_decode's estimate). With the ratio at its floor,
admission is nearly free-pages-only; preemption stays the safety net, the estimate only makes it rare.
schedule_conservativeness scales the ratios (SGLang's --schedule-conservativeness): the server's engine takes
1 (LLMEngine.from_config); 0, LLMEngine's and Scheduler's default, admits on free pages alone (the preemption
tests' tight caches).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autoprofile.engine.request import Request

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # the floor, as a fraction of the initial ratio
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # decode steps from the initial ratio to the floor
RETRACT_DECODE_STEPS = 20  # tokens of room a preemption's new ratio gives each running request
CLIP_MAX_NEW_TOKENS = 4096  # an output longer than this is estimated as this long (SGLang's clip)


def decayed(ratio: float, decay: float, floor: float) -> float:
    """The ratio after a decode step that preempted nothing."""
    return max(ratio - decay, floor)


def ratio_after_retract(decoded: int, max_new: int, running: int) -> float:
    """After a preemption: the share of their max_tokens the running requests wrote, plus
    RETRACT_DECODE_STEPS tokens each, at most 1 (1 when none is left to judge by)."""
    return min(1.0, (decoded + RETRACT_DECODE_STEPS * running) / max_new) if max_new else 1.0


def future_tokens(to_compute: int, output_left: int, ratio: float) -> float:
    """Tokens a request will still need pages for: the prompt (or recompute) it has yet to store, and its
    output to come (clipped at CLIP_MAX_NEW_TOKENS) times the ratio."""
    return to_compute + min(output_left, CLIP_MAX_NEW_TOKENS) * ratio


def reserved_tokens(requests: Iterable[Request], page_size: int, ratio: float) -> float:
    """The future_tokens of requests holding pages: those they know beyond their pages, and their output."""
    return sum(future_tokens(max(0, r.num_tokens - len(r.pages) * page_size),
                             r.max_tokens - len(r.output_ids), ratio) for r in requests)


HOLD_MIN_DECODE_ROWS = 64  # fewer decode rows: waiting requests join at once (admit_now)


def admit_now(decoding: int, waiting: int, held_steps: int, max_waiting_steps: int, ratio: float,
              min_rows: int = HOLD_MIN_DECODE_ROWS) -> bool:
    """Whether this step admits waiting requests beside `decoding` decode rows (TGI's rule, its
    max_waiting_tokens counted in steps). A step that admits is a prefill step: eager, where decode rows alone
    replay their CUDA graph, so requests arriving one by one into a busy batch would make nearly every step
    one (H100, llama-3.1-8b, c256 chat answers of their own lengths: 167 of 319 steps, at 71 ms of forward
    against 19-22 ms a decode step). Waiting requests join at once when fewer than `min_rows` rows decode
    (a light load: a held request would wait several short steps for little gain; measured on a multi-turn
    run of 32 conversations, TTFT p50 107 ms held against 48 ms at once), when they are at least `ratio` of
    the decode rows, or once they were held `max_waiting_steps` steps; max_waiting_steps 0: always at once.
    The scheduler also admits what this holds once the waiting prompts fill a step
    (Scheduler._waiting_fill)."""
    if max_waiting_steps <= 0 or decoding < max(min_rows, 1) or waiting == 0:
        return True
    return held_steps >= max_waiting_steps or waiting >= ratio * decoding


def admits(free_tokens: int, reserved: float, need: float) -> bool:
    """Whether a request needing `need` tokens fits the free tokens left over the running set's `reserved`."""
    return need + reserved <= free_tokens


@dataclass
class NewTokenRatio:
    """The ratio's state: one per scheduler. conservativeness scales the initial ratio and the floor."""

    conservativeness: float = 1.0
    value: float = field(init=False)

    def __post_init__(self):
        if self.conservativeness < 0:
            raise ValueError(f"schedule_conservativeness must be >= 0, got {self.conservativeness}")
        self.value = self.init

    @property
    def init(self) -> float:
        return min(INIT_NEW_TOKEN_RATIO * self.conservativeness, 1.0)

    @property
    def floor(self) -> float:
        return self.init * MIN_NEW_TOKEN_RATIO_FACTOR

    @property
    def decay(self) -> float:
        return (self.init - self.floor) / NEW_TOKEN_RATIO_DECAY_STEPS

    def update(self, preempted: bool, decoded: bool, running: list[Request]) -> None:
        """After a step is scheduled: up from the running set after a preemption, else down a notch if it
        decodes (a prefill-only step says nothing of the output to come)."""
        if preempted:
            self.retracted(sum(len(r.output_ids) for r in running), sum(r.max_tokens for r in running),
                           len(running))
        elif decoded:
            self.step()

    def step(self) -> None:
        """A decode step preempted nothing: estimate a little less output to come."""
        self.value = decayed(self.value, self.decay, self.floor)

    def retracted(self, decoded: int, max_new: int, running: int) -> None:
        """A step preempted: estimate from what the requests still running have written (never lower than
        the estimate that let them in)."""
        if self.conservativeness:
            self.value = max(self.value, ratio_after_retract(decoded, max_new, running))

    def reset(self) -> None:
        """Nothing running or waiting (SGLang resets when idle)."""
        self.value = self.init
