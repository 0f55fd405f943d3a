"""StepClock's reading of a step's CUDA events (faked: a timestamp each, set by the test, and whether the
stream has reached it): prepare, forward and the GPU's idle gaps between steps of one busy stretch."""
from __future__ import annotations

import pytest
import torch

from autoprofile.engine.step_clock import StepClock


class FakeEvent:
    """A CUDA event the stream reaches at `at` milliseconds (None: not reached yet)."""

    def __init__(self, at):
        self.at = at

    def query(self) -> bool:
        return self.at is not None

    def elapsed_time(self, other: "FakeEvent") -> float:
        assert self.at is not None and other.at is not None, "elapsed_time of an unreached event"
        return other.at - self.at


@pytest.fixture
def clock(monkeypatch):
    c = StepClock(torch.device("cpu"))
    c.timed = True  # a GPU's clock, its events faked
    marks: list = []
    monkeypatch.setattr(c, "_record", lambda: marks.pop(0))
    c.marks = marks
    return c


def run_step(clock, kind, start, launch, end, tokens=1):
    events = [FakeEvent(start), FakeEvent(launch), FakeEvent(end)]
    clock.marks.extend(events)
    clock.begin(kind, tokens)
    clock.launched()
    clock.ended()
    return events


def test_prepare_forward_and_the_idle_gap_between_busy_steps(clock):
    run_step(clock, "prefill", 0.0, 2.0, 30.0, tokens=2048)
    run_step(clock, "decode", 33.0, 34.0, 40.0)  # the GPU waited 3 ms for the host
    t = clock.read()
    assert t.steps == {"prefill": 1, "decode": 1} and t.tokens == {"prefill": 2048, "decode": 1}
    assert t.gpu[("prefill", "prepare")] == pytest.approx(0.002)
    assert t.gpu[("prefill", "forward")] == pytest.approx(0.028)
    assert t.gpu[("decode", "prepare")] == pytest.approx(0.001)
    assert t.gpu[("decode", "forward")] == pytest.approx(0.006)
    assert t.gpu["idle"] == pytest.approx(0.003)


def test_a_gap_after_the_engine_ran_out_of_work_is_not_idle_overhead(clock):
    run_step(clock, "decode", 0.0, 1.0, 5.0)
    clock.idle()  # no request for a while
    run_step(clock, "decode", 900.0, 901.0, 905.0)
    run_step(clock, "decode", 906.0, 907.0, 911.0)
    assert clock.read().gpu["idle"] == pytest.approx(0.001)


def test_a_step_still_on_the_stream_is_read_once_it_completes(clock):
    events = run_step(clock, "prefill", 0.0, 1.0, None)  # no sampled row: returned unsynchronised
    assert clock.read().gpu[("prefill", "forward")] == 0 and clock.read().steps["prefill"] == 1
    events[2].at = 50.0
    run_step(clock, "decode", 50.0, 51.0, 55.0)
    t = clock.read()
    assert t.gpu[("prefill", "forward")] == pytest.approx(0.049)
    assert t.gpu[("decode", "forward")] == pytest.approx(0.004)
    assert t.gpu["idle"] == 0


def test_a_step_that_raised_is_dropped_and_measures_no_gap(clock):
    run_step(clock, "decode", 0.0, 1.0, 5.0)
    clock.marks.extend([FakeEvent(6.0), FakeEvent(7.0)])
    clock.begin("prefill", 64)
    clock.launched()  # the forward raised: no end mark
    run_step(clock, "decode", 20.0, 21.0, 25.0)
    run_step(clock, "decode", 26.0, 27.0, 31.0)
    t = clock.read()
    assert t.gpu[("prefill", "forward")] == 0
    assert t.gpu[("decode", "forward")] == pytest.approx(0.012)
    assert t.gpu["idle"] == pytest.approx(0.001)  # 25 -> 26 only: not 5 -> 20 across the failed step


def test_reset_starts_over_and_a_cpu_clock_counts_steps_without_events():
    c = StepClock(torch.device("cpu"))
    c.begin("decode", 3)
    c.launched()
    c.ended()
    c.host("schedule", 0.5)
    t = c.read()
    assert t.steps["decode"] == 1 and t.tokens["decode"] == 3 and t.host["schedule"] == 0.5 and not t.gpu
    c.reset()
    assert not c.read().steps
