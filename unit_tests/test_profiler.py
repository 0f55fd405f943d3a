"""The profiler's decision logic against a simulated GPU (only the torch.cuda memory API is faked)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autoprofile import budget, profile_cache
from autoprofile.config import ServerConfig
from autoprofile.profiler import LeakError, Profiler, ProfileError
from unit_tests.fakes import GiB, FakeGPU, FakeRunner, llama8b_sizing

CFG = ServerConfig(model="llama-3.1-8b", max_req_total_len=8192, canary_mb=1, batch_max_tokens=8192,
                   graph_max_batch_size=256, report_dir=None)


@pytest.fixture
def gpu():
    g = FakeGPU()
    with g.patched():
        yield g


def make(gpu, cfg=CFG, fault=None, **kw):
    runner = FakeRunner(gpu, llama8b_sizing(cfg.page_size, cfg.context_len), **kw)
    prof = Profiler(cfg, runner, checkpoint=fault)
    runner.profiler = prof
    return runner, prof


def builds(runner):
    return [e[1] for e in runner.events if e[0] == "build"]


def expected_target(gpu, runner, cfg):
    """Independent of the solver: overhead is constant here (the request table of the envelope's rows)."""
    non_kv = runner.weight_bytes + runner.graph_pool + max(runner.prefill_act, runner.decode_act)
    available = gpu.total - gpu.non_torch - gpu.peers - non_kv - cfg.canary_bytes - budget.DRIVER_RESERVE
    overhead = budget.reserved_bytes(budget.req_table_bytes(runner.sizing.running_reqs, cfg.context_len,
                                                            cfg.page_size))
    return (available - overhead) // runner.sizing.cell_bytes // cfg.page_size * cfg.page_size


def test_phase_order_and_target(gpu):
    runner, prof = make(gpu)
    points = []
    prof.fault = points.append
    result = prof.run()
    probe = budget.probe_tokens(CFG.batch_max_tokens, CFG.graph_max_batch_size, CFG.page_size)
    assert [e[0] for e in runner.events] == ["build", "stress_prefill", "stress_decode", "teardown",
                                             "build", "stress_prefill", "stress_decode"]
    assert builds(runner) == [probe, expected_target(gpu, runner, CFG)]
    assert points == ["kv_alloc", "graph_capture", "probe_prefill", "probe_decode", "after_measure",
                      "kv_alloc",
                      "graph_capture", "canary", "validate_prefill", "validate_decode", "validated"]
    assert result.tokens == runner.built_tokens and result.attempts == 1 and not result.pinned
    assert [p for p, _ in result.phases] == ["probe", "measure", "rebuild+validate#1"]
    # each phase's timed steps are the runner's, in the phase that ran them (the fake's "seconds": GiB)
    stresses = [("stress prefill", 3.0), ("stress decode", 1.0)]
    assert list(result.phase_steps) == [("probe", *s) for s in stresses] + [("rebuild+validate#1", *s)
                                                                           for s in stresses]
    assert "    probe: stress prefill 3.00s, stress decode 1.00s" in result.report_text().splitlines()
    m = result.measurement
    assert m.non_kv_peak == runner.weight_bytes + runner.graph_pool + runner.prefill_act
    # the validated build leaves exactly the canary (plus page rounding) unused
    left = gpu.total - gpu.non_torch - gpu.peak - CFG.canary_bytes - budget.DRIVER_RESERVE
    assert 0 <= left < CFG.page_size * runner.sizing.cell_bytes
    assert result.terms["graph_pools"] == runner.graph_pool
    assert runner.forgot_warm_ups == 0  # the rebuild after a passed probe keeps its warm-ups


def test_mem_fraction_scales_the_budget(gpu):
    full = make(gpu)[1].run().tokens
    gpu2 = FakeGPU()
    with gpu2.patched():
        half = make(gpu2, CFG.replace(mem_fraction=0.5))[1].run().tokens
    assert abs(half - full / 2) <= 2 * CFG.page_size + 100


def test_canary_released_before_each_rebuild(gpu):
    fails = iter([True, True, False])

    def fault(point):
        if point == "validate_decode" and next(fails):
            raise torch.OutOfMemoryError("injected")

    runner, prof = make(gpu, fault=fault)
    result = prof.run()
    assert result.attempts == 3
    assert [e[2] for e in runner.events if e[0] == "build"] == [None] * 4  # no canary alive at any build
    assert prof.canary is None


def test_shrink_schedule_and_attempt_cap(gpu):
    def fault(point):
        if point == "validate_prefill":
            raise torch.OutOfMemoryError("CUDA out of memory. injected")

    runner, prof = make(gpu, fault=fault)
    with pytest.raises(ProfileError) as ei:
        prof.run()
    target = expected_target(gpu, runner, CFG)
    assert builds(runner)[1:] == budget.shrink_schedule(target, 0.95, 3, 16)
    text = str(ei.value)
    for needle in ("4 attempt(s)", f"initial target      : {target}", "OutOfMemoryError",
                   "--batch_max_tokens",
                   "--graph_max_batch_size", "--max_req_total_len", "--mem_fraction", "--max_total_token_num",
                   "--canary_mb", "--tp"):
        assert needle in text
    assert gpu.allocated == runner.weight_bytes  # nothing half-built left


def _shape_error(at: str):
    def fault(point):
        if point == at:
            torch.zeros(2, 3) @ torch.zeros(4, 5)  # a real shape error, raised by torch
    return fault


@pytest.mark.parametrize("at, stage, attempts", [("probe_prefill", "probe", 1),
                                                 ("validate_decode", "validation", 2)])
def test_an_error_that_is_not_a_memory_failure_is_reported_as_itself_with_its_traceback(
        gpu, caplog, at, stage, attempts):
    runner, prof = make(gpu, fault=_shape_error(at))
    with pytest.raises(ProfileError) as ei:
        prof.run()
    text = str(ei.value)
    assert text.startswith(f"autoprofile: the {stage} at ") and "not a memory failure" in text, text
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied" in text
    assert not any(s in text for s in ("Turn one of these knobs", "--mem_fraction", "does not fit"))
    assert len(builds(runner)) == attempts  # never retried: a smaller cache cannot fix a shape error
    assert "Traceback (most recent call last)" in caplog.text and "in fault" in caplog.text
    assert gpu.allocated == runner.weight_bytes  # still torn down


def test_an_assertion_in_a_pinned_build_is_reported_as_itself_without_a_probe(gpu):
    def fault(point):
        if point == "validate_decode":
            raise AssertionError("decode produced NaN")

    runner, prof = make(gpu, CFG.replace(max_total_token_num=100_000), fault=fault)
    with pytest.raises(ProfileError, match="AssertionError: decode produced NaN") as ei:
        prof.run()
    assert "not a memory failure" in str(ei.value) and "try --max_total_token_num" not in str(ei.value)
    assert builds(runner) == [100_000]  # no probe to say what fits: memory is not the problem


def test_a_memory_failure_in_validation_is_retried_and_ends_in_the_memory_diagnostic(gpu, caplog):
    def fault(point):
        if point == "validate_decode":
            raise torch.OutOfMemoryError("CUDA out of memory. injected")

    runner, prof = make(gpu, fault=fault)
    with pytest.raises(ProfileError) as ei:
        prof.run()
    assert "no KV cache size survived" in str(ei.value) and "Turn one of these knobs" in str(ei.value)
    assert len(builds(runner)) == 1 + 1 + CFG.max_retries
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize("err, memory", [
    ("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", True),
    ("rank 1: OutOfMemoryError: injected", True),
    ("RuntimeError: CUDA error: out of memory", True),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)", True),
    ("RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)", False),
    ("AssertionError: decode produced NaN", False),
    ("rank 0: ValueError: bad shape", False),
])
def test_memory_failures_are_told_apart_from_other_errors(err, memory):
    from autoprofile.profiler import is_memory_failure, not_memory_failures
    assert is_memory_failure(err) is memory
    assert not_memory_failures([err, "rank 1: PeerFailed: rank 0 failed"]) == ([] if memory else [err])


def test_leak_is_a_hard_error_not_retried(gpu):
    held = []

    def fault(point):
        if point == "probe_decode":
            held.append(runner.kv_buffer)

    runner, prof = make(gpu, fault=fault)
    with pytest.raises(LeakError, match="still referenced by a list"):
        prof.run()
    assert len(builds(runner)) == 1  # never rebuilt


def test_leak_detected_from_reserved_memory(gpu):
    runner, prof = make(gpu)
    real_teardown = runner.teardown

    def leaky_teardown():  # drops the tensor but "forgets" to free its memory
        runner._held -= runner.kv_bytes
        real_teardown()

    runner.teardown = leaky_teardown
    with pytest.raises(LeakError, match="reserved memory fell by"):
        prof.run()


def test_peer_growth_after_measure_is_absorbed_by_a_retry(gpu):
    def fault(point):
        if point == "after_measure":
            gpu.peers += 2 * GiB  # another process grabs memory between measure and rebuild

    runner, prof = make(gpu, fault=fault)
    result = prof.run()
    assert result.attempts >= 2 and result.tokens < builds(runner)[1]
    assert "OutOfMemoryError" in result.errors[0]
    # each failed attempt makes the next build warm every graph again (a capture cut short: partial warm-ups)
    assert runner.forgot_warm_ups == result.attempts - 1


def test_probe_failure_gives_diagnostic_and_releases_everything(gpu):
    def fault(point):
        if point == "probe_prefill":
            raise torch.OutOfMemoryError("CUDA out of memory. injected")

    runner, prof = make(gpu, fault=fault)
    with pytest.raises(ProfileError, match="even with the small probe cache"):
        prof.run()
    assert gpu.allocated == runner.weight_bytes


def test_target_below_one_request_is_a_clear_error():
    gpu = FakeGPU(total=32 * GiB)
    with gpu.patched():
        runner, prof = make(gpu, CFG.replace(max_req_total_len=131072))
        with pytest.raises(ProfileError, match="fewer than the 131088"):
            prof.run()


def test_escape_hatch_single_build(gpu):
    cfg = CFG.replace(max_total_token_num=100_000)
    runner, prof = make(gpu, cfg)
    result = prof.run()
    assert builds(runner) == [100_000] and result.pinned and result.attempts == 1
    assert result.probe_tokens is None and [p for p, _ in result.phases] == ["build+validate"]


def test_escape_hatch_that_does_not_fit_says_what_fits(gpu):
    cfg = CFG.replace(max_total_token_num=600_000)  # 73 GiB of KV beside 16 GiB of weights
    runner, prof = make(gpu, cfg)
    with pytest.raises(ProfileError) as ei:
        prof.run()
    fits = expected_target(gpu, runner, cfg)
    assert f"try --max_total_token_num {fits}" in str(ei.value)
    assert 600_000 not in builds(runner)[1:]  # never shrunk silently: the only other build is the probe
    assert gpu.allocated == runner.weight_bytes


# ---------------------------------------------------------------- the profile cache
def shutdown(gpu, runner) -> None:
    """The process ends: its KV and its weights leave the (fake) GPU."""
    runner.teardown()
    gpu.free(runner.weight_bytes)
    gpu.empty_cache()
    gpu.peak = 0


def test_a_second_boot_reuses_the_probe_and_still_rebuilds_and_validates(gpu, tmp_path):
    cfg = CFG.replace(profile_cache=str(tmp_path))
    runner, prof = make(gpu, cfg)
    first = prof.run()
    assert [p for p, _ in first.phases][0] == "probe" and first.reused_probe is None
    assert len(list(tmp_path.glob("*.json"))) == 1
    shutdown(gpu, runner)
    runner2, prof2 = make(gpu, cfg)
    second = prof2.run()
    # no probe build: fit's release tears down nothing, then the one build at the target
    assert [e[0] for e in runner2.events] == ["teardown", "build", "stress_prefill", "stress_decode"]
    assert builds(runner2) == builds(runner)[1:]
    assert [p for p, _ in second.phases] == ["measure (profile cache)", "rebuild+validate#1"]
    assert second.tokens == first.tokens and second.reused_probe is not None
    assert second.measurement.non_kv_peak == first.measurement.non_kv_peak


def test_a_changed_budget_flag_or_gpu_probes_again(gpu, tmp_path):
    cfg = CFG.replace(profile_cache=str(tmp_path))
    runner, prof = make(gpu, cfg)
    prof.run()
    shutdown(gpu, runner)
    for changed in (cfg.replace(batch_max_tokens=4096), cfg):
        r, p = make(gpu, changed)
        if changed is cfg:
            r.fingerprint = lambda: {"gpu": "another card", "total_memory": gpu.total}
        result = p.run()
        assert [ph for ph, _ in result.phases][0] == "probe", changed
        shutdown(gpu, r)
    assert len(list(tmp_path.glob("*.json"))) == 3


# Every ServerConfig field is either host-only (the probe does not measure it: serving-side, applied after the
# measurement, or the cache's own) or changes the key; a new field must be classified here or the test fails.
HOST_ONLY = {"host", "port", "max_waiting_requests", "stream_interval", "seed", "report_dir", "profile_dir",
             "engine_process",
             "allowed_media_domains", "tokenizer", "mem_fraction", "shrink_ratio", "max_retries",
             "max_total_token_num",
             "profile_cache", "served_model_name", "api_key", "host_kv", "reasoning_parser",
             "node_rank", "dist_init_addr", "dist_timeout",  # the key holds the global rank and world size
             "device",  # only --device cuda probes
             "max_waiting_steps", "waiting_served_ratio"}  # when requests join, inside the same envelope
MEASURED = {"model": "qwen3-8b", "tp": 2, "batch_max_tokens": 4096, "running_max_req_size": 64,
            "max_req_total_len": 4096, "graph_max_batch_size": 128, "disable_cudagraph": True,
            "disable_prefix_caching": True, "disable_overlap_schedule": True, "attention_backend": "torch",
            "kv_cache_dtype": "fp8_e4m3", "kv_scales": "unit", "dtype": "float16", "page_size": 32,
            "canary_mb": 512, "deterministic": True, "visual_batch_size": 8, "min_image_pixels": 28 * 28,
            "max_image_pixels": 640 * 28 * 28, "max_images_per_request": 8, "load_format": "dummy",
            "quantization": "fp8", "nnodes": 2,  # nnodes: NCCL's transport across hosts
            "state_checkpoints": 16, "piecewise_cuda_graph_max_tokens": 0}  # the pieces' pool
FINGERPRINT = {"gpu": "NVIDIA H100 80GB HBM3", "total_memory": 80 * GiB}


def cache_key(cfg, env=None):
    return profile_cache.key(cfg, CFG.model_config, FINGERPRINT, 0, 1, env={} if env is None else env)


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ServerConfig)])
def test_every_field_but_the_host_only_ones_changes_the_cache_key(field):
    assert field in HOST_ONLY | MEASURED.keys(), f"classify the new ServerConfig field {field!r} here"
    if field in HOST_ONLY:
        assert field in profile_cache.NOT_MEASURED
        return
    changed = CFG.replace(**{field: MEASURED[field]})
    assert getattr(changed, field) != getattr(CFG, field)
    assert cache_key(changed) != cache_key(CFG), f"--{field} does not change the profile cache key"


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                                  "PYTORCH_NO_CUDA_MEMORY_CACHING", "CUDA_MODULE_LOADING"])
def test_the_allocators_environment_changes_the_cache_key(name, monkeypatch):
    setting = {name: "expandable_segments:True"}
    other = {name: "garbage_collection_threshold:0.6"}
    assert cache_key(CFG, setting) != cache_key(CFG) != cache_key(CFG, other) != cache_key(CFG, setting)
    assert cache_key(CFG, {"HOME": "/elsewhere"}) == cache_key(CFG)  # an unrelated variable does not
    monkeypatch.delenv(name, raising=False)
    before = profile_cache.key(CFG, CFG.model_config, FINGERPRINT, 0, 1)  # os.environ by default
    monkeypatch.setenv(name, "expandable_segments:True")
    assert profile_cache.key(CFG, CFG.model_config, FINGERPRINT, 0, 1) == cache_key(CFG, setting) != before


def test_a_boot_under_another_allocator_setting_probes_again(gpu, tmp_path, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cfg = CFG.replace(profile_cache=str(tmp_path))
    runner, prof = make(gpu, cfg)
    prof.run()
    shutdown(gpu, runner)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    r, p = make(gpu, cfg)
    assert [ph for ph, _ in p.run().phases][0] == "probe"
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_stale_entry_is_absorbed_by_the_validation_and_dropped(gpu, tmp_path):
    """An entry whose non-KV peak is too low (the code it measured differs in a way the key missed): the
    validation at the target fails, a 5% smaller build passes, and the entry goes (the next boot probes)."""
    import json
    cfg = CFG.replace(profile_cache=str(tmp_path))
    runner, prof = make(gpu, cfg)
    prof.run()
    shutdown(gpu, runner)
    path, = tmp_path.glob("*.json")
    entry = json.loads(path.read_text())
    entry["non_kv_peak"] -= 2 * GiB
    path.write_text(json.dumps(entry))
    r, p = make(gpu, cfg)
    result = p.run()
    assert result.attempts > 1 and result.reused_probe is not None
    assert not path.exists()


def test_no_cache_folder_never_writes(gpu, tmp_path):
    runner, prof = make(gpu, CFG)
    assert CFG.profile_cache is None and prof.cache_name() is None
    prof.run()
    assert not list(tmp_path.iterdir())


def test_the_cached_non_torch_memory_counts_when_above_what_the_process_holds_before_a_kernel(gpu, tmp_path):
    """The stress's kernels reserve local memory (non-torch) that a boot without a probe has not reserved yet
    when it sizes: the entry's figure is the one to plan for."""
    import json
    cfg = CFG.replace(profile_cache=str(tmp_path))
    runner, prof = make(gpu, cfg)
    first = prof.run()
    shutdown(gpu, runner)
    path, = tmp_path.glob("*.json")
    entry = json.loads(path.read_text())
    entry["own_non_torch"] += GiB
    path.write_text(json.dumps(entry))
    second = make(gpu, cfg)[1].run()
    assert second.measurement.own_non_torch == entry["own_non_torch"]
    assert first.tokens - second.tokens == pytest.approx(GiB / first.cell_bytes, abs=2 * CFG.page_size)


def test_the_report_says_which_routings_an_moe_models_stress_forced(gpu):
    from autoprofile.report import format_report, to_dict
    cfg = ServerConfig(model="qwen3-30b-a3b", max_req_total_len=8192, canary_mb=1, report_dir=None)
    result = make(gpu, cfg, forced_routings=("worst", "balanced"))[1].run()
    assert result.forced_routings == ("worst", "balanced") and to_dict(result)["forced_routings"] == [
        "worst", "balanced"]
    assert "under worst and balanced routing (worst: every token to the same 8 of 128 experts)" in \
        format_report(result)
    assert "routing" not in format_report(dataclasses.replace(result, forced_routings=()))  # a dense model


# ---------------------------------------------------------------- --max_req_total_len auto
AUTO = CFG.replace(max_req_total_len=None)  # llama-3.1-8b's context: 131,072 tokens


def test_auto_context_is_cut_to_the_longest_request_the_measured_cache_holds(caplog):
    gpu = FakeGPU(total=32 * GiB)
    with gpu.patched(), caplog.at_level("WARNING"):
        runner, prof = make(gpu, AUTO)
        result = prof.run()
    target = builds(runner)[1]
    assert target < budget.min_usable_tokens(131072, 16, 8192, 256)  # the model's context does not fit
    cut = (target // 16 - 1) * 16  # one request of it plus the pad page: exactly the target
    assert result.cfg.max_req_total_len == cut and result.cfg.context_len == cut
    assert budget.min_usable_tokens(cut, 16, 8192, 256) == target
    assert ("cut_context", cut) in runner.events  # before the rebuild: the validated envelope is the cut one
    rebuild = [i for i, e in enumerate(runner.events) if e[0] == "build"][1]
    assert runner.events.index(("cut_context", cut)) < rebuild
    assert runner.sizing.context_len == cut and prof.sizing.context_len == cut
    assert result.tokens == target and result.attempts == 1
    assert f"serving requests of at most {cut} tokens" in caplog.text and "131072" in caplog.text
    assert result.context_cut_from == 131072
    assert f"max_req_total_len = {cut} tokens (auto: the model's 131072 do not fit" in result.report_text()


def test_auto_context_that_fits_is_the_models_own():
    gpu = FakeGPU(total=80 * GiB)
    with gpu.patched():
        runner, prof = make(gpu, AUTO)
        result = prof.run()
    assert result.cfg.max_req_total_len is None and result.cfg.context_len == 131072
    assert result.context_cut_from is None and "max_req_total_len = 131072 tokens\n" in result.report_text()
    assert not [e for e in runner.events if e[0] == "cut_context"]


def test_auto_context_cannot_help_when_the_decode_rows_alone_do_not_fit():
    gpu = FakeGPU(total=32 * GiB)  # about 90,000 KV tokens: fewer than a page for each of 8192 rows
    with gpu.patched():
        runner, prof = make(gpu, AUTO.replace(running_max_req_size=8192))
        with pytest.raises(ProfileError, match="fewer than the 131088"):
            prof.run()
    assert not [e for e in runner.events if e[0] == "cut_context"]


def test_a_pinned_cache_with_auto_context_is_built_as_given_and_cuts_the_context(gpu):
    runner, prof = make(gpu, AUTO.replace(max_total_token_num=50_000))
    result = prof.run()
    assert builds(runner) == [50_000] and result.pinned
    assert result.cfg.context_len == (50_000 // 16 - 1) * 16


def test_a_boot_from_the_profile_cache_cuts_the_same_context(tmp_path):
    gpu = FakeGPU(total=32 * GiB)
    with gpu.patched():
        runner, prof = make(gpu, AUTO.replace(profile_cache=str(tmp_path)))
        first = prof.run()
        shutdown(gpu, runner)
        runner, prof = make(gpu, AUTO.replace(profile_cache=str(tmp_path)))
        second = prof.run()
    assert second.reused_probe is not None
    assert second.cfg.context_len == first.cfg.context_len < 131072


def test_the_start_phase_counts_the_process_s_time_before_the_boot_once():
    """phases: `start` is the time from the process's creation to its boot (interpreter, imports, an engine
    process's spawn): a process that sleeps 0.5 s before importing counts at least that; a second boot in
    the same process (a test's) counts none."""
    import subprocess
    import sys
    code = ("import time; time.sleep(0.5); from autoprofile.profiler import start_phase; "
            "print(repr((start_phase(), start_phase())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    first, again = eval(out.stdout.strip())
    (name, took), = first
    assert name == "start" and 0.5 <= took < 60 and again == []
