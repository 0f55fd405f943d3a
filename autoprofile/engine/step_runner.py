"""The runner as LLMEngine meets it: one declared Protocol, implemented by ModelRunner, the TP step
broadcaster (tp.broadcast.StepBroadcaster) and the tests' step runners. Every member is there on every
runner; a runner without the feature says so through it (`overlaps` False, `host_kv` None, loads that are
done at once), so the engine asks no runner whether it has a method.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from autoprofile.engine.envelope import Envelope
    from autoprofile.engine.host_kv import HostKVPool
    from autoprofile.engine.kv_cache import KVCache
    from autoprofile.engine.sampler import SampledTokens, StepTokens
    from autoprofile.engine.scheduler import Step
    from autoprofile.engine.step_clock import StepClock
    from autoprofile.model_config import ModelConfig


class StepRunner(Protocol):
    envelope: Envelope | None  # None until built
    kv: KVCache | None  # the engine reads its num_pages
    model_config: ModelConfig
    clock: StepClock
    host_kv: HostKVPool | None  # the prefix cache's host tier (--host_kv); None: off
    # launch() returns before the GPU is done, so the engine may schedule the next step meanwhile (overlap)
    overlaps: bool

    def execute(self, step: Step) -> SampledTokens:
        """Run one step within the envelope; its sampled tokens."""

    def launch(self, step: Step) -> StepTokens:
        """execute() without the wait: the step's tokens in flight (`result()` reads them)."""

    def wait_load(self, load_id: int) -> None:
        """Until this host tier load has landed (done at once where loads copy synchronously)."""

    def loads_ready(self, ids: list[int]) -> set[int]:
        """Which of these host tier loads have landed; never waits."""

