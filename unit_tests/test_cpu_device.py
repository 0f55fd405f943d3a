"""`autoprofile serve --device cpu` (autoprofile.cpu): its defaults, its refusals, its sizing against the host's
memory, and the real command answering over HTTP."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import urllib.request

import pytest

from autoprofile import cli
from autoprofile.config import ConfigError, ServerConfig, validate
from autoprofile.cpu import (CPU_HEADROOM_BYTES, CPUSizeError, boot_cpu, build_cpu, cpu_kv_tokens, cpu_threads,
                             load_cpu, weights_problem)
from unit_tests.cpu_server import bound_url

GiB = 1 << 30
TINY = ServerConfig(model="tiny", dtype="float32", attention_backend="torch", device="cpu", report_dir=None)


def parsed(*argv: str) -> ServerConfig:
    ns = cli.build_parser().parse_args(["serve", *argv])
    return cli.config_from_args(ns)


# ---------------------------------------------------------------- flags
def test_device_cpu_serves_the_tiny_model_in_float32_on_the_torch_backend():
    cfg = parsed("--device", "cpu")
    assert (cfg.device, cfg.model, cfg.dtype, cfg.attention_backend) == ("cpu", "tiny", "float32", "torch")
    given = parsed("--device", "cpu", "--model", "tiny-moe", "--dtype", "bfloat16")
    assert (given.model, given.dtype) == ("tiny-moe", "bfloat16")
    gpu = parsed()
    assert (gpu.device, gpu.model, gpu.dtype, gpu.attention_backend) == ("cuda", "llama-3.1-8b", "bfloat16", "auto")
    assert parsed("--device", "cpu", "--deterministic").deterministic  # the torch CPU path is batch-invariant


@pytest.mark.parametrize("argv, flag, fix", [
    (["--tp", "2"], "--tp", "try --tp 1"),
    (["--attention_backend", "aiter_triton"], "--attention_backend", "try --attention_backend torch"),
    (["--host_kv", "auto"], "--host_kv", "use --host_kv off"),
])
def test_device_cpu_refuses_what_it_cannot_run_naming_the_flag(argv, flag, fix, capsys):
    assert cli.main(["serve", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}: --device cpu") and fix in err, err


def test_profile_on_the_cpu_is_refused_naming_device(capsys):
    assert cli.main(["profile", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device:") and "autoprofile serve --device cpu" in err


def test_no_gpu_points_to_device_cpu(mocker, capsys):
    mocker.patch("torch.cuda.is_available", return_value=False)
    assert cli.main(["serve"]) == 1
    assert "autoprofile serve --device cpu" in capsys.readouterr().err


def test_device_cpu_keeps_the_runner_off_a_visible_gpu(mocker):
    from autoprofile.engine.runner import runner_device
    mocker.patch("torch.cuda.is_available", return_value=True)
    assert runner_device(0, "cpu").type == "cpu" and runner_device(0).type == "cuda"


# ---------------------------------------------------------------- sizing
def test_the_cache_holds_the_models_whole_context_when_memory_allows():
    cfg = validate(TINY)
    assert cpu_kv_tokens(cfg, 2048, 0, 16 * GiB) == cfg.min_usable_tokens
    assert cpu_kv_tokens(cfg.replace(max_total_token_num=16384), 2048, 0, 16 * GiB) == 16384


def test_too_little_memory_cuts_the_context_and_the_log_says_so(caplog):
    room = CPU_HEADROOM_BYTES + 2048 * 2048 + 100  # 2,048 tokens of 2,048 bytes, and a little more
    cfg = validate(TINY.replace(batch_max_tokens=512, graph_max_batch_size=8))
    assert cpu_kv_tokens(cfg, 2048, 0, room) == 2048
    with caplog.at_level(logging.WARNING):
        runner, result = build_cpu(load_cpu(cfg), available=room)
    try:
        assert result.tokens == 2048 and result.cfg.context_len == 2032 < cfg.context_len
        assert "--max_req_total_len auto" in caplog.text and "serving requests of at most 2032" in caplog.text
    finally:
        runner.teardown()


def test_what_cannot_fit_names_the_flag_and_a_value_that_fits():
    cfg = validate(TINY)
    room = CPU_HEADROOM_BYTES + 1000 * 2048
    with pytest.raises(CPUSizeError, match=r"--max_total_token_num: 16384 tokens .* try --max_total_token_num "
                                           r"992$"):
        cpu_kv_tokens(cfg.replace(max_total_token_num=16384), 2048, 0, room)
    with pytest.raises(CPUSizeError, match=r"^--batch_max_tokens: .*try --batch_max_tokens 496"):
        cpu_kv_tokens(cfg, 2048, 0, room)  # 992 tokens hold no prefill batch of 8192
    with pytest.raises(CPUSizeError, match="--batch_max_tokens"):  # a hybrid model's state slots count too
        cpu_kv_tokens(cfg, 2048, 1 << 40, 16 * GiB)


def test_weights_larger_than_the_hosts_memory_are_refused_before_loading():
    assert weights_problem(validate(TINY), 4 * GiB) is None
    big = ServerConfig(model="llama-3.1-8b", dtype="float32", attention_backend="torch", device="cpu")
    assert weights_problem(big, 24 * GiB).startswith("--dtype: llama-3.1-8b's weights take 29.92 GiB")
    assert weights_problem(big, 24 * GiB).endswith("try --dtype bfloat16")
    assert "try --model tiny" in weights_problem(big, 8 * GiB)


def test_boot_refuses_weights_the_host_cannot_hold(mocker):
    mocker.patch("psutil.virtual_memory").return_value.available = 2 * GiB
    big = ServerConfig(model="llama-3.1-8b", dtype="float32", attention_backend="torch", device="cpu")
    with pytest.raises(CPUSizeError, match="--model: llama-3.1-8b's weights"):
        boot_cpu(big)


def test_threads_follow_the_weights():
    assert cpu_threads(15 << 20, 2) == 1  # the tiny model: one thread (see BYTES_PER_THREAD)
    assert cpu_threads(2 << 30, 2) == 2 and cpu_threads(2 << 30, 64) == 8


def test_config_error_for_an_unknown_device():
    with pytest.raises(ConfigError, match="--device: unknown 'tpu'; choose one of cuda, cpu"):
        validate(TINY.replace(device="tpu"))


# ---------------------------------------------------------------- the command
def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def _post(url: str, body: dict):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=120)


@pytest.mark.slow
def test_autoprofile_serve_device_cpu_answers_over_http():
    """The command a newcomer types (with a free port): the whole default context is served, a request
    without max_tokens is accepted, a 16-token answer comes back."""
    proc = subprocess.Popen([sys.executable, "-m", "autoprofile.cli", "serve", "--device", "cpu", "--port", "0",
                             "--report_dir", "", "--profile_cache", ""],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = iter(proc.stdout.readline, "")
        url = bound_url(lines)
        assert url, "the server never bound"
        ready = next((line for line in lines if "ready:" in line or "Error" in line), "")
        assert "ready:" in ready, ready
        threading.Thread(target=lambda: [None for _ in lines], daemon=True).start()  # drain the pipe
        models = _get(url + "/v1/models")["data"]
        assert models[0]["id"] == "tiny" and models[0]["max_model_len"] == 4096
        with _post(url + "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 16,
                                             "temperature": 0, "ignore_eos": True}) as r:
            out = json.loads(r.read())
        assert out["usage"]["completion_tokens"] == 16 and out["choices"][0]["text"]
        stream = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}  # no max_tokens
        with _post(url + "/v1/chat/completions", stream) as r:
            assert r.status == 200
            first = next(line for line in r if line.startswith(b"data: "))
        assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
