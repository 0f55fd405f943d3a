"""Issue 50: LLMEngine and the TP step broadcast meet the runner through one declared Protocol
(engine.step_runner.StepRunner), not getattr: every runner has every member."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from autoprofile.engine import engine
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.step_runner import StepRunner
from autoprofile.tp.broadcast import StepBroadcaster
from unit_tests.test_host_kv import ContentRunner
from unit_tests.test_scheduler import StepRunner as FakeStepRunner
from unit_tests.test_scheduler import fake_engine, tiny_runner


def protocol_members() -> set[str]:
    methods = {name for name, value in vars(StepRunner).items()
               if inspect.isfunction(value) and not name.startswith("_")}
    return set(StepRunner.__annotations__) | methods


def test_the_protocol_declares_what_the_engine_reads():
    assert protocol_members() == {"envelope", "kv", "model_config", "clock", "host_kv", "overlaps", "execute",
                                  "launch", "wait_load", "loads_ready"}


def test_llm_engine_asks_no_runner_for_a_member_through_getattr():
    tree = ast.parse(Path(engine.__file__).read_text())
    calls = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")]
    assert not calls, f"engine.py calls getattr/hasattr at lines {calls}"


def test_the_broadcaster_declares_every_member_itself():
    """No pass-through by __getattr__: what the engine reads of the TP runner is on the class."""
    missing = sorted(protocol_members() - {name for cls in StepBroadcaster.__mro__ for name in vars(cls)})
    assert not missing and "__getattr__" not in vars(StepBroadcaster), missing
    assert StepBroadcaster.overlaps is False


def test_the_model_runner_and_the_tests_step_runners_have_every_member():
    real = tiny_runner(256)
    _, fake = fake_engine()
    for runner in (real, fake):
        missing = sorted(name for name in protocol_members() if not hasattr(runner, name))
        assert not missing, (type(runner).__name__, missing)
    assert real.overlaps and fake.overlaps and real.host_kv is None and fake.host_kv is None
    assert fake.loads_ready([3, 5]) == {3, 5}  # no host tier: any load is done
    assert issubclass(ContentRunner, FakeStepRunner)


def test_a_runner_that_does_not_overlap_is_refused_for_overlap_and_served_without():
    _, runner = fake_engine()

    class NoOverlap(FakeStepRunner):
        overlaps = False
    quiet = NoOverlap(runner.envelope, runner.kv.num_pages)
    with pytest.raises(ValueError, match="overlap needs a runner .*NoOverlap does not"):
        LLMEngine(quiet, overlap=True)
    assert LLMEngine(quiet).generate([[1, 2, 3]], max_tokens=4) == LLMEngine(runner).generate(
        [[1, 2, 3]], max_tokens=4)
