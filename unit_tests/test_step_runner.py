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
from autoprofile.tp.channel import GuardedRunner
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


def runner_reads(path: Path) -> set[str]:
    """The attributes a module reads or writes of its runner: `runner.x`, `self.runner.x`, and
    getattr(runner, "x", ...)."""
    def is_runner(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "runner") or (
            isinstance(node, ast.Attribute) and node.attr == "runner" and isinstance(node.value, ast.Name)
            and node.value.id == "self")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and is_runner(node.value):
            out.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and is_runner(node.args[0]) and isinstance(node.args[1], ast.Constant)):
            out.add(node.args[1].value)
    return out


def test_the_guarded_runner_declares_the_protocol_and_what_the_profiler_and_launcher_read():
    """tp.channel.GuardedRunner (the profiler's and the broadcaster's runner under TP) names every member it
    hands on; no __getattr__ pass-through that would hide a missing one (fingerprint: the profile cache)."""
    from autoprofile import launch, profiler
    declared = {name for cls in GuardedRunner.__mro__ for name in vars(cls)}
    wanted = protocol_members() | runner_reads(Path(profiler.__file__)) | runner_reads(Path(launch.__file__))
    assert "__getattr__" not in vars(GuardedRunner)
    assert not sorted(wanted - declared), sorted(wanted - declared)
    assert GuardedRunner.overlaps is False
    with pytest.raises(RuntimeError, match="does not overlap"):
        GuardedRunner(object(), guard=None).launch(None)


def test_a_flag_set_on_the_guarded_runner_reaches_the_runner_that_builds():
    """profiler.choose_state_slots sets the hybrid's state slots as `runner.cfg` after guard.bind: the
    ModelRunner under the guard must build with them (a pass-through __getattr__ kept them on the wrapper)."""
    real = tiny_runner(256)
    guarded = GuardedRunner(real, guard=None)
    slots = real.cfg.replace(running_max_req_size=7)
    guarded.cfg = slots
    assert real.cfg is slots and guarded.cfg is slots
    assert real.sizing.running_reqs == guarded.sizing.running_reqs == 7
    guarded.host_kv = None
    assert "host_kv" not in vars(guarded) and "cfg" not in vars(guarded)
    assert guarded.model_config is real.model_config and guarded.fingerprint() is None


def test_the_tp_tests_recorder_declares_every_member_itself():
    from unit_tests.tp_steps import Recorder
    missing = sorted(protocol_members() - {name for cls in Recorder.__mro__ for name in vars(cls)})
    assert not missing and "__getattr__" not in vars(Recorder), missing
