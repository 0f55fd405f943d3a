"""Tensor parallelism on CPU with real gloo ranks (spawned by autoprofile.launch.launch): a failure on any
rank, between two collectives or inside one, ends every rank with the same text within the bound; the
profiler retries after an abort; TP=2 serving through the engine equals TP=1.

Every launch has a timeout: a hang fails the test instead of blocking CI."""
from __future__ import annotations

import os
import signal
import threading
import time
import types

import pytest
import torch

from autoprofile import memory
from autoprofile import launch
from autoprofile.tp import broadcast, channel
from autoprofile.config import ServerConfig
from autoprofile.engine.engine import LLMEngine
from autoprofile.layers.parallel import TP
from autoprofile.engine.runner import ModelRunner
from autoprofile.profiler import Profiler
from autoprofile.tp.votes import describe, gather_errors
from unit_tests.fakes import GiB, FakeGPU, FakeRunner, llama8b_sizing
from unit_tests.test_engine_cpu import QWEN_SMALL, small_cfg, write_checkpoint

TIMEOUT = 90  # per launch, spawn and imports included
PROMPTS = [[1, 2, 3, 4, 5], [9] * 12, list(range(30, 70))]


def run(target, world, *args, **kw) -> tuple[list[launch.Outcome], float]:
    t0 = time.time()
    out = launch.launch(target, world, args, device="cpu", timeout_s=TIMEOUT, **kw)
    return out, t0


def vote_and_raise(guard, err: str | None) -> None:
    """What the profiler and run_step do after a section: the vote, then the gathered errors."""
    if not memory.all_ok(err is None, guard.control):
        raise channel.TPError("; ".join(gather_errors(err, guard.control)))


# ---------------------------------------------------------------- between two collectives
def _fails_between(guard):
    memory.all_ok(True, guard.control)
    if guard.rank == 1:
        raise ValueError("rank 1 broke between two votes")
    memory.all_ok(True, guard.control)  # rank 1 never comes: its exit frees this wait
    return "unreachable"


@pytest.mark.slow
def test_a_rank_failing_between_two_collectives_ends_every_rank_with_its_text():
    out, t0 = run(_fails_between, 3)
    texts = {o.value for o in out}
    assert not any(o.ok for o in out) and texts == {"rank 1: ValueError: rank 1 broke between two votes"}, out
    assert max(o.ended for o in out) - out[1].ended < 10


# ---------------------------------------------------------------- inside a collective
def _fails_inside(guard):
    err = None
    try:
        with guard.section("test"):
            if guard.rank == 1:
                raise RuntimeError("rank 1 raised before its all-reduce")
            TP(guard.rank, guard.world, guard.data, guard.wait).all_reduce(torch.ones(4))  # waits for rank 1
    except Exception as e:  # noqa: BLE001
        err = describe(e)
    try:
        vote_and_raise(guard, err)
    except channel.TPError as e:
        text = str(e)
    guard.heal()  # the aborted data group is replaced on every rank: collectives work again
    x = torch.full((2,), float(guard.rank + 1))
    TP(guard.rank, guard.world, guard.data, guard.wait).all_reduce(x)
    return text, x.tolist(), time.time()


@pytest.mark.slow
def test_a_rank_failing_inside_a_collective_frees_the_waiting_rank_and_both_agree_then_recover():
    out, t0 = run(_fails_inside, 2)
    assert all(o.ok for o in out), out
    (t_0, x_0, end_0), (t_1, x_1, end_1) = out[0].value, out[1].value
    assert t_0 == t_1
    assert "rank 1: RuntimeError: rank 1 raised before its all-reduce" in t_0
    assert "PeerFailed" not in t_0  # rank 0's wait is a consequence: the text names the cause only
    assert x_0 == x_1 == [3.0, 3.0]
    assert abs(end_0 - end_1) < 10 and max(end_0, end_1) - t0 < TIMEOUT


def _wedged_inside(guard):
    """Rank 0 waits where no abort reaches (as on an NCCL kernel whose abort hangs: the H200 run);
    rank 1 fails inside the same section and goes to the vote."""
    err = None
    try:
        with guard.section("test"):
            if guard.rank == 1:
                raise RuntimeError("rank 1 ran out of memory inside its forward")
            threading.Event().wait(120)  # deaf to PeerFailed: only the stuck timer ends this rank
    except Exception as e:  # noqa: BLE001
        err = describe(e)
    vote_and_raise(guard, err)
    return "unreachable"


@pytest.mark.slow
def test_a_rank_the_abort_cannot_free_ends_itself_and_every_rank_ends_with_the_same_text():
    out, t0 = run(_wedged_inside, 2)
    assert not out[0].ok and not out[1].ok, out
    assert out[0].value == out[1].value == "rank 1: RuntimeError: rank 1 ran out of memory inside its forward"
    # rank 1 failed at once; rank 0 gives up GRACE_S + STUCK_S later; rank 1 sees it gone at the vote
    assert max(o.ended for o in out) - t0 < channel.GRACE_S + channel.STUCK_S + 30, out


def _killed_inside(guard):
    with guard.section("test"):
        if guard.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        TP(guard.rank, guard.world, guard.data, guard.wait).all_reduce(torch.ones(4))
    return "unreachable"


@pytest.mark.slow
def test_a_killed_rank_is_reported_by_the_parent_and_frees_its_peer():
    out, t0 = run(_killed_inside, 2)
    assert not out[0].ok and not out[1].ok
    assert out[0].value == out[1].value == "rank 1: the rank's process died (signal SIGKILL) before reporting"
    assert out[0].ended - t0 < TIMEOUT


# ---------------------------------------------------------------- the profiler: retry after an abort
CFG = ServerConfig(model="llama-3.1-8b", max_req_total_len=8192, canary_mb=1, report_dir=None, tp=2)


class CollectiveFakeRunner(FakeRunner):
    """The FakeGPU engine double whose decode stress all-reduces over the data group; rank 1 raises in
    its first decode stress after the probe, before that all-reduce (as an OOM inside a layer would)."""

    def stress_decode(self) -> None:
        super().stress_decode()
        self.decodes = getattr(self, "decodes", 0) + 1
        if self.tp.rank == 1 and self.decodes == 2:
            raise torch.OutOfMemoryError("injected inside rank 1's decode forward")
        self.tp.all_reduce(torch.ones(1))


def _profile_with_abort(guard):
    gpu = FakeGPU(peers=guard.rank * 3 * GiB)
    with gpu.patched():
        fake = CollectiveFakeRunner(gpu, llama8b_sizing(CFG.page_size, CFG.context_len))
        fake.tp = TP(guard.rank, guard.world)
        first_group = guard.data
        res = Profiler(CFG, guard.bind(fake), group=guard.control, on_error=guard.post).run()
    return res.tokens, res.attempts, res.errors, guard.data is not first_group, b"x" * (4 << 20)


@pytest.mark.slow
def test_profiler_retries_on_every_rank_after_one_rank_failed_inside_a_collective():
    out, _ = run(_profile_with_abort, 2)
    assert all(o.ok for o in out), out
    (tok0, att0, err0, new0, big), (tok1, att1, err1, new1, _) = out[0].value, out[1].value
    assert tok0 == tok1 and att0 == att1 == 2 and err0 == err1
    assert "rank 1: OutOfMemoryError: injected" in err0[0] and "PeerFailed" not in err0[0]
    assert new0 and new1  # the aborted data group was replaced before the retry
    assert len(big) == 4 << 20  # a result larger than a pipe's buffer came back (read before joining)


# ---------------------------------------------------------------- serving over the step broadcast
class FailingLayer:
    """A forward pre-hook raising on one rank at its n-th call (inside the model forward)."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, module, args):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("rank 1 raised inside layer 1's forward")


def _serve(guard, model_dir: str):
    runner = ModelRunner(small_cfg(model=model_dir, tp=2), rank=guard.rank, world_size=2, group=guard.data)
    guarded = guard.bind(runner)
    guarded.build(512)
    if guard.rank:
        hook = FailingLayer(n=10 ** 9)
        runner.model.model.layers[1].register_forward_pre_hook(hook)
        broadcast.worker_loop(guarded)  # until rank 0's stop
        hook.n = hook.calls + 3  # the third forward of the next serving run fails
        broadcast.worker_loop(guarded)  # raises the fatal TPError
        return "unreachable"
    out = []
    for _ in range(2):
        broadcaster = broadcast.StepBroadcaster(guarded)
        engine = LLMEngine(broadcaster)
        out.append(engine.generate(PROMPTS, max_tokens=8))
        out.append(engine.stats.failed_steps)
        if broadcaster.fatal is None:
            broadcaster.close()
        out.append(broadcaster.fatal)
    return out


@pytest.mark.slow
def test_tp2_serving_on_cpu_equals_tp1_and_a_forward_failure_stops_every_rank_with_one_text(tmp_path):
    write_checkpoint(tmp_path / "qwen", QWEN_SMALL, seed=6)
    one = ModelRunner(small_cfg(model=str(tmp_path / "qwen")))
    one.build(512)
    want = LLMEngine(one).generate(PROMPTS, max_tokens=8)
    out, t0 = run(_serve, 2, str(tmp_path / "qwen"))
    assert out[0].ok, out
    tokens, failed, closed, _, failed_after, fatal = out[0].value
    assert tokens == want and failed == 0 and closed == "closed"
    assert failed_after == 1 and fatal.startswith("tensor-parallel serving stopped")
    assert "rank 1: RuntimeError: rank 1 raised inside layer 1's forward" in fatal
    assert not out[1].ok and out[1].value == fatal  # the worker ends with the very same text


def test_serve_with_tp_spawns_the_ranks_and_returns_their_exit_code(mocker):
    from autoprofile import cli
    mocker.patch("autoprofile.cli._gpu_present", return_value=True)
    serve_tp = mocker.patch("autoprofile.launch.serve_tp", return_value=1)
    assert cli.main(["serve", "--model", "tiny", "--tp", "2"]) == 1
    (cfg,), _ = serve_tp.call_args
    assert cfg.tp == 2


def test_a_step_survives_the_broadcast_encoding():
    from autoprofile.engine.sampling import SamplingParams
    from autoprofile.engine.scheduler import Step, StepRow
    step = Step(True,
                [StepRow(3, 16, [5, 6, 7], True, SamplingParams(temperature=0.5, seed=9), request=object()),
                       StepRow(0, 0, [1], False,
                               SamplingParams())], [(3, 1, [4, 8])], running=2, pages_used=5)
    import pickle
    back = broadcast.decode(pickle.loads(pickle.dumps(broadcast.encode(step))))
    assert back.rows[0].request is None and back.rows[0].params == step.rows[0].params
    assert [(r.slot, r.start, r.ids, r.sample) for r in back.rows] == [(r.slot, r.start, r.ids, r.sample)
                                                                       for r in step.rows]
    assert (back.is_prefill, back.page_writes, back.running, back.pages_used) == (True, [(3, 1, [4, 8])], 2,
                                                                                  5)


def _worker_dies_while_serving(guard, model_dir: str):
    runner = ModelRunner(small_cfg(model=model_dir, tp=2), rank=guard.rank, world_size=2, group=guard.data)
    guarded = guard.bind(runner)
    guarded.build(512)
    if guard.rank:
        calls = {"n": 0}

        def die(module, args):  # the OOM killer, mid-serving, inside the second decode's forward
            calls["n"] += 1
            if calls["n"] == 3:
                os.kill(os.getpid(), signal.SIGKILL)
        runner.model.model.layers[0].register_forward_pre_hook(die)
        broadcast.worker_loop(guarded)
        return "unreachable"
    broadcaster = broadcast.StepBroadcaster(guarded)
    engine = LLMEngine(broadcaster)
    t = time.time()
    first = engine.generate(PROMPTS, max_tokens=8)
    failed = engine.stats.failed_steps
    again = engine.generate(PROMPTS, max_tokens=8)  # the broadcaster is fatal now: every step refuses
    return first, failed, broadcaster.fatal, time.time() - t, (again, engine.stats.failed_steps - failed)


@pytest.mark.slow
def test_a_worker_killed_while_serving_stops_rank_0_at_once_with_the_launchers_record(tmp_path):
    write_checkpoint(tmp_path / "qwen", QWEN_SMALL, seed=6)
    out, t0 = run(_worker_dies_while_serving, 2, str(tmp_path / "qwen"))
    assert out[0].ok and not out[1].ok, out
    first, failed, fatal, took, again = out[0].value
    assert fatal.startswith("tensor-parallel serving stopped: rank 1: the rank's process died (signal "
                            "SIGKILL)")
    assert failed >= 1 and any(len(o) < 8 for o in first)  # the in-flight requests ended with an error
    assert took < 10  # not the launcher's 60-s backstop: rank 0 stops itself
    outputs, refused = again  # nothing runs any more: the requests end at once, their steps refused
    assert refused >= 1 and all(len(o) == 0 for o in outputs), again


# ---------------------------------------------------------------- SIGTERM to the launcher; the launcher gone
def _serves_until_sigterm(guard):
    """Rank 0 stands in for the server: SIGTERM makes it stop the worker and return; rank 1 waits for it."""
    if guard.rank:
        memory.all_ok(True, guard.control)
        memory.all_ok(True, guard.control)
        return "worker stopped"
    import threading
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    memory.all_ok(True, guard.control)  # NOTE: both ranks are past their setup: serving
    print("serving", flush=True)
    assert stop.wait(60), "no SIGTERM reached rank 0"
    memory.all_ok(True, guard.control)
    return "rank 0 drained"


LAUNCHER = """
import sys
from autoprofile import launch
from unit_tests.test_tp import _serves_until_sigterm
out = launch.launch(_serves_until_sigterm, 2, (), device="cpu", timeout_s=80)
print([(o.rank, o.ok, o.value) for o in out], flush=True)
sys.exit(0 if all(o.ok for o in out) else 1)
"""


def _launcher(tmp_path):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.Popen([sys.executable, "-c", LAUNCHER], cwd=root, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": root})


@pytest.mark.slow
def test_sigterm_to_the_launcher_reaches_rank_0_which_stops_every_rank(tmp_path):
    import psutil
    proc = _launcher(tmp_path)
    try:
        assert proc.stdout.readline().strip() == "serving"  # rank 0 inherits the launcher's stdout
        ranks = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, rest
    assert "'rank 0 drained'" in rest and "'worker stopped'" in rest
    assert not psutil.wait_procs(ranks, timeout=10)[1]  # the launcher joined every rank


@pytest.mark.slow
def test_ranks_whose_launcher_was_killed_end_instead_of_serving_as_orphans(tmp_path):
    import psutil
    proc = _launcher(tmp_path)
    try:
        assert proc.stdout.readline().strip() == "serving"
        ranks = [c for c in psutil.Process(proc.pid).children(recursive=True)]
        proc.kill()  # SIGKILL: the launcher (and the store it hosts) is gone without a word
        proc.wait()
        gone, alive = psutil.wait_procs(ranks, timeout=30)
    finally:
        for c in psutil.Process().children(recursive=True):
            c.kill()
    assert not alive, [p.pid for p in alive]
    assert len(gone) >= 2


# ---------------------------------------------------------------- a wait slice that times out as the work ends
class _EndsDuringTheSlice:
    """A gloo work whose timed wait ran out just as it completed (a loaded host), then done."""

    def __init__(self, error: Exception | None = None):
        self.error, self.waits = error, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if timeout is not None and len(self.waits) == 1:
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error

    def is_completed(self):
        return True


def test_a_slice_that_times_out_as_the_collective_completes_is_not_a_failure():
    guard = types.SimpleNamespace(aborted=False)
    work = _EndsDuringTheSlice()
    channel.RankGuard.wait(guard, work)  # returns: the collective succeeded
    assert work.waits == [channel.WAIT_SLICE, None]
    failed = _EndsDuringTheSlice(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):  # its own error, not the slice's
        channel.RankGuard.wait(guard, failed)
