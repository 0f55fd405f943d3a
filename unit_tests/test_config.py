"""Bad flags end in exit code 2 with `error: --flag: ...` and a value that works, before any torch.cuda
call; valid combinations get past validation."""
from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest

from autoprofile import cli
from autoprofile.config import FLA_REQUIREMENT, ConfigError, ServerConfig, config_from_args, validate
from autoprofile.model_config import CONFIG_DIR

CUDA_ENTRY_POINTS = ("is_available", "init", "mem_get_info", "device_count", "current_device",
                     "get_device_properties", "memory_reserved", "synchronize", "set_device")


@pytest.fixture
def cuda_spy(mocker):
    """Every torch.cuda entry point the runtime could reach: records calls, raises if used."""
    return {name: mocker.patch(f"torch.cuda.{name}", side_effect=AssertionError(f"torch.cuda.{name} touched"))
            for name in CUDA_ENTRY_POINTS}


def assert_cuda_untouched(spy) -> None:
    touched = [name for name, m in spy.items() if m.called]
    assert not touched, f"torch.cuda touched before validation: {touched}"


# (bad argv, flag named, suggested working value as printed, argv with the suggestion applied)
BAD = [
    (["--tp", "0"], "tp", "--tp 1", ["--tp", "1"]),
    (["--tp", "3"], "tp", "--tp 2", ["--tp", "2"]),  # the nearest --tp that divides 32 and 8 heads
    (["--tp", "16"], "tp", "--tp 8", ["--tp", "8"]),
    (["--tp", "2", "--engine_process"], "engine_process", "drop --engine_process", ["--tp", "2"]),
    (["--tp", "abc"], "tp", "--tp 1", ["--tp", "1"]),
    (["--mem_fraction", "0"], "mem_fraction", "try --mem_fraction 1.0", ["--mem_fraction", "1.0"]),
    (["--mem_fraction", "1.5"], "mem_fraction", "try --mem_fraction 1.0", ["--mem_fraction", "1.0"]),
    (["--mem_fraction", "x"], "mem_fraction", "--mem_fraction 1.0", ["--mem_fraction", "1.0"]),
    (["--batch_max_tokens", "0"], "batch_max_tokens", "try --batch_max_tokens 8192",
     ["--batch_max_tokens", "8192"]),
    (["--graph_max_batch_size", "0"], "graph_max_batch_size", "try --graph_max_batch_size 256",
     ["--graph_max_batch_size", "256"]),
    (["--graph_max_batch_size", "2048"], "graph_max_batch_size", "try --graph_max_batch_size 256",
     ["--graph_max_batch_size", "256"]),
    (["--piecewise_cuda_graph_max_tokens", "-1"], "piecewise_cuda_graph_max_tokens",
     "try --piecewise_cuda_graph_max_tokens 512", ["--piecewise_cuda_graph_max_tokens", "512"]),
    (["--piecewise_cuda_graph_max_tokens", "100000"], "piecewise_cuda_graph_max_tokens",
     "try --piecewise_cuda_graph_max_tokens 512", ["--piecewise_cuda_graph_max_tokens", "512"]),
    (["--running_max_req_size", "0"], "running_max_req_size", "try --running_max_req_size 1000",
     ["--running_max_req_size", "1000"]),
    (["--running_max_req_size", "100"], "graph_max_batch_size", "--graph_max_batch_size 100",
     ["--running_max_req_size", "100", "--graph_max_batch_size", "100"]),
    (["--max_total_token_num", "0"], "max_total_token_num", "leave it unset", []),
    (["--max_total_token_num", "1000"], "max_total_token_num", "--max_total_token_num 131088",
     ["--max_total_token_num", "131088"]),
    (["--max_total_token_num", "5000", "--max_req_total_len", "4096"], "max_total_token_num",
     "--max_total_token_num 8208", ["--max_total_token_num", "8208", "--max_req_total_len", "4096"]),
    (["--max_req_total_len", "1"], "max_req_total_len", "try --max_req_total_len 4096",
     ["--max_req_total_len", "4096"]),
    (["--max_req_total_len", "200000"], "max_req_total_len", "try --max_req_total_len 131072",
     ["--max_req_total_len", "131072"]),
    (["--attention_backend", "flash"], "attention_backend", "aiter_triton",
     ["--attention_backend", "aiter_triton"]),
    (["--kv_cache_dtype", "fp8"], "kv_cache_dtype", "fp8_e4m3", ["--kv_cache_dtype", "fp8_e4m3"]),
    (["--kv_cache_dtype", "float32"], "kv_cache_dtype", "--kv_cache_dtype auto",
     ["--kv_cache_dtype", "auto"]),
    (["--kv_cache_dtype", "fp8_e4m3", "--attention_backend", "aiter"], "kv_cache_dtype",
     "--attention_backend aiter_triton", ["--kv_cache_dtype", "fp8_e4m3", "--attention_backend",
                                          "aiter_triton"]),
    (["--kv_scales", "max"], "kv_scales", "first_batch", ["--kv_scales", "first_batch"]),
    (["--dtype", "int8"], "dtype", "bfloat16", ["--dtype", "bfloat16"]),
    (["--page_size", "24"], "page_size", "try --page_size 16", ["--page_size", "16"]),
    (["--page_size", "8"], "page_size", "try --page_size 16", ["--page_size", "16"]),
    (["--page_size", "512"], "page_size", "try --page_size 16", ["--page_size", "16"]),
    (["--canary_mb", "-1"], "canary_mb", "try --canary_mb 256", ["--canary_mb", "256"]),
    (["--shrink_ratio", "1.0"], "shrink_ratio", "try --shrink_ratio 0.95", ["--shrink_ratio", "0.95"]),
    (["--shrink_ratio", "0.1"], "shrink_ratio", "try --shrink_ratio 0.95", ["--shrink_ratio", "0.95"]),
    (["--max_retries", "-1"], "max_retries", "try --max_retries 3", ["--max_retries", "3"]),
    (["--max_retries", "50"], "max_retries", "try --max_retries 3", ["--max_retries", "3"]),
    (["--port", "70000"], "port", "try --port 8000", ["--port", "8000"]),
    (["--host", " "], "host", "try --host 127.0.0.1", ["--host", "127.0.0.1"]),
    (["--max_waiting_requests", "-1"], "max_waiting_requests", "try --max_waiting_requests 1024",
     ["--max_waiting_requests", "1024"]),
    (["--stream_interval", "0"], "stream_interval", "try --stream_interval 1", ["--stream_interval", "1"]),
    (["--model", "no-such-model"], "model", "llama-3.1-8b", ["--model", "llama-3.1-8b"]),
    (["--model", "deepseek-v2-lite", "--attention_backend", "aiter"], "attention_backend",
     "try --attention_backend aiter_triton", ["--model", "deepseek-v2-lite", "--attention_backend", "torch"]),
    (["--deterministic", "--attention_backend", "aiter"], "deterministic", "try --attention_backend aiter_triton",
     ["--deterministic", "--attention_backend", "aiter_triton"]),
    (["--deterministic", "--attention_backend", "torch"], "deterministic", "try --attention_backend aiter_triton",
     ["--deterministic", "--attention_backend", "aiter_triton"]),
    (["--seed", "1e23"], "seed", "try --seed 0", ["--seed", "0"]),
    (["--seed", str(10 ** 23)], "seed", "try --seed 0", ["--seed", "0"]),
    (["--seed", "-1"], "seed", "try --seed 0", ["--seed", "0"]),
    (["--report_dir", f"{__file__}/reports"], "report_dir", "(or --report_dir '' for no report)",
     ["--report_dir", ""]),
    (["--load_format", "npcache"], "load_format", "choose one of auto, safetensors, pt, dummy",
     ["--load_format", "dummy"]),
    (["--load_format", "safetensors"], "load_format", "built-in config without weights (served with random "
     "weights); try --load_format auto", ["--load_format", "auto"]),
]


SERVE_ONLY = ("host", "port", "max_waiting_requests", "stream_interval", "engine_process")


def test_at_least_22_bad_cases():
    assert len(BAD) >= 22


@pytest.mark.parametrize("command", ["serve", "profile"])
@pytest.mark.parametrize("argv, flag, suggestion, fixed", BAD, ids=[" ".join(c[0]) for c in BAD])
def test_bad_flag_exits_2_naming_flag_and_fix(command, argv, flag, suggestion, fixed, cuda_spy, capsys):
    assert cli.main([command, *argv]) == 2
    err = capsys.readouterr().err
    if command == "profile" and flag in SERVE_ONLY:  # not a flag of profile at all
        assert err.startswith(f"error: --{flag}: --{flag} is a flag of `autoprofile serve`, not of `profile`")
        return
    assert err.startswith(f"error: --{flag}: "), err
    assert suggestion in err, err
    assert_cuda_untouched(cuda_spy)


@pytest.mark.parametrize("argv, flag, suggestion, fixed", BAD, ids=[" ".join(c[0]) for c in BAD])
def test_suggested_value_really_works(argv, flag, suggestion, fixed, cuda_spy, capsys):
    """The suggestion applied: validation passes (serve gets as far as looking for a GPU)."""
    cuda_spy["is_available"].side_effect = None
    cuda_spy["is_available"].return_value = False
    assert cli.main(["serve", *fixed]) == 1
    assert "autoprofile plan" in capsys.readouterr().err


@pytest.mark.parametrize("typed, meant", [("--mem-fractoin", "--mem_fraction"), ("--mem", "--mem_fraction"),
                                          ("--kv_dtype", "--kv_cache_dtype"),
                                          ("--kv-dtype", "--kv_cache_dtype"),
                                          ("--max_total_tokens", "--max_total_token_num"),
                                          ("--graph-max-bs", "--graph_max_batch_size")])
def test_unknown_flag_exits_2_with_did_you_mean(typed, meant, cuda_spy, capsys):
    assert cli.main(["serve", typed, "0.9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {typed}: unknown flag; did you mean {meant}?"), err
    assert_cuda_untouched(cuda_spy)


def test_hyphen_spelling_of_every_flag_works(cuda_spy):
    """--mem-fraction (vLLM/SGLang spelling) means --mem_fraction, for every flag."""
    parser = cli.build_parser()
    ns = parser.parse_args(["plan", "--mem-fraction", "0.9", "--max-req-total-len", "4096",
                            "--gpu-memory-gib",
                            "80", "--graph-max-batch-size", "64", "--disable-cudagraph", "--page-size", "32"])
    assert (ns.mem_fraction, ns.max_req_total_len, ns.gpu_memory_gib, ns.graph_max_batch_size,
            ns.disable_cudagraph, ns.page_size) == (0.9, 4096, 80.0, 64, True, 32)
    assert parser.parse_args(["serve", "--report-dir", ""]).report_dir == ""
    sub = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    for action in sub._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if any("_" in o for o in longs):
            assert {"--" + o[2:].replace("-", "_") for o in longs} == {f"--{action.dest}"} and len(longs) == 2
    assert_cuda_untouched(cuda_spy)


def test_bad_value_through_the_hyphen_spelling_names_the_flag(cuda_spy, capsys):
    assert cli.main(["serve", "--mem-fraction", "x"]) == 2
    assert capsys.readouterr().err.startswith("error: --mem_fraction: invalid float value")


def test_unknown_command_did_you_mean(capsys):
    assert cli.main(["serv"]) == 2
    assert "did you mean serve?" in capsys.readouterr().err


def test_missing_command_exits_2(cuda_spy, capsys):
    assert cli.main([]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert_cuda_untouched(cuda_spy)


def test_help_exits_0(capsys):
    assert cli.main(["serve", "--help"]) == 0
    assert "--max_total_token_num" in capsys.readouterr().out


VALID = [
    [],
    ["--tp", "8"],
    ["--tp", "2", "--mem_fraction", "0.9", "--port", "0"],
    ["--max_total_token_num", "131088"],
    ["--attention_backend", "torch", "--page_size", "1", "--kv_cache_dtype", "float32"],
    ["--attention_backend", "aiter", "--page_size", "256", "--dtype", "float16"],
    ["--model", "tiny", "--max_req_total_len", "2048", "--batch_max_tokens", "1024",
     "--max_total_token_num", "4112"],
    ["--model", "qwen2.5-7b", "--tp", "4", "--running_max_req_size", "4096",
     "--graph_max_batch_size", "1024"],
    ["--model", "qwen3-8b", "--disable_cudagraph", "--report_dir", "", "--canary_mb", "0",
     "--max_retries", "0"],
]


@pytest.mark.parametrize("argv", VALID, ids=[" ".join(a) or "defaults" for a in VALID])
def test_valid_combinations_pass_validation(argv, cuda_spy, capsys):
    cuda_spy["is_available"].side_effect = None
    cuda_spy["is_available"].return_value = False
    assert cli.main(["serve", *argv]) == 1  # validation passed; no GPU here
    err = capsys.readouterr().err
    assert "needs a CUDA/ROCm GPU" in err and "autoprofile plan" in err


def test_model_folder_with_config_json(tmp_path, cuda_spy, capsys):
    cfg = json.loads((CONFIG_DIR / "tiny/config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    cuda_spy["is_available"].side_effect = None
    cuda_spy["is_available"].return_value = False
    assert cli.main(["serve", "--model", str(tmp_path), "--load_format", "dummy"]) == 1
    assert cli.main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "error: --model: no config.json" in capsys.readouterr().err


def test_a_hybrid_on_a_gpu_without_fla_core_exits_2_naming_the_install(monkeypatch, cuda_spy, capsys):
    """fla-core's chunked kernels run a hybrid model's prefill on a GPU (without them each row's prefill ran
    as torch ops, 64 tokens at a time). Hidden from import, serve exits 2 naming --model and the pip line
    before any torch.cuda call; --device cpu and plan do not need it. Installed (a Linux dependency), serve
    passes."""
    monkeypatch.setitem(sys.modules, "fla", None)  # as Python blocks an import: find_spec gives None
    for model in ("qwen3.5-35b-a3b-fp8", "tiny-hybrid"):
        assert cli.main(["serve", "--model", model]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --model: {model} is a hybrid model"), err
        assert f"pip install {FLA_REQUIREMENT}" in err and "--device cpu" in err
    assert_cuda_untouched(cuda_spy)
    on_cpu = cli.build_parser().parse_args(["serve", "--model", "tiny-hybrid", "--device", "cpu"])
    assert config_from_args(on_cpu).model_config.is_hybrid
    assert cli.main(["plan", "--model", "qwen3.5-35b-a3b-fp8", "--gpu", "h100"]) == 0
    cuda_spy["is_available"].side_effect = None
    cuda_spy["is_available"].return_value = False
    capsys.readouterr()
    assert cli.main(["serve", "--model", "tiny"]) == 1  # no linear-attention layers: past validation, no GPU
    monkeypatch.delitem(sys.modules, "fla")
    if sys.platform == "linux":
        assert cli.main(["serve", "--model", "qwen3.5-35b-a3b-fp8"]) == 1
    assert capsys.readouterr().err.count("needs a CUDA/ROCm GPU") == (2 if sys.platform == "linux" else 1)


def test_the_fla_core_the_error_names_is_the_one_pyproject_pins():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    deps = pyproject["project"]["dependencies"]
    assert f"{FLA_REQUIREMENT}; platform_system == 'Linux'" in deps


def test_mla_is_served_by_aiter_triton_and_torch_not_by_the_native_aiter_backend():
    for backend in ("auto", "aiter_triton", "torch"):
        assert validate(ServerConfig(model="deepseek-v2-lite", attention_backend=backend)).model_config.is_mla
    cfg = ServerConfig(model="deepseek-v2-lite", attention_backend="aiter")
    assert validate(cfg, serving=False) is cfg
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.flag == "attention_backend"
    with pytest.raises(ConfigError) as e:
        validate(ServerConfig(model="deepseek-v2-lite", attention_backend="torch", kv_cache_dtype="fp8_e4m3"))
    assert e.value.flag == "kv_cache_dtype"


def test_report_dir_empty_means_none():
    ns = cli.build_parser().parse_args(["profile", "--report_dir", ""])
    from autoprofile.config import config_from_args
    assert config_from_args(ns).report_dir is None


def test_a_pinned_size_past_the_kernels_32_bit_offsets_is_refused_naming_the_bound():
    """AITER's unified attention (--deterministic) and native kernels offset a layer's cache in 32 bits: a pin
    past that is refused, naming the flag and the bound. The default backend's kernels (and torch's) offset
    in 64 bits there: the same pin is served, up to the int32 slots' bound."""
    from autoprofile.budget import INDEX_LIMIT, max_indexable_tokens
    bound = max_indexable_tokens(8, 128, 16)
    for backend in ("auto", "aiter_triton"):
        with pytest.raises(ConfigError, match=f"--deterministic\\); try --max_total_token_num {bound}$"):
            validate(ServerConfig(max_total_token_num=bound + 16, deterministic=True, attention_backend=backend))
        validate(ServerConfig(max_total_token_num=bound, deterministic=True, attention_backend=backend))
        validate(ServerConfig(max_total_token_num=bound + 16, attention_backend=backend))
    validate(ServerConfig(max_total_token_num=bound + 16, attention_backend="torch", deterministic=True))
    wide = max_indexable_tokens(8, 128, 16, wide=True)
    assert wide == INDEX_LIMIT // 16 * 16
    with pytest.raises(ConfigError, match=f"try --max_total_token_num {wide}$"):
        validate(ServerConfig(max_total_token_num=wide + 16))


def test_a_report_dir_this_user_cannot_write_is_refused_before_any_gpu_work(tmp_path, cuda_spy, capsys):
    import os
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("this user (root) writes anywhere")
        for path in (locked, locked / "new" / "reports"):
            assert cli.main(["serve", "--report_dir", str(path)]) == 2
            assert capsys.readouterr().err.startswith(f"error: --report_dir: '{path}' ")
    finally:
        locked.chmod(0o700)
    assert_cuda_untouched(cuda_spy)


def test_a_report_dir_still_to_be_made_in_a_writable_folder_is_accepted_and_not_made(tmp_path):
    from autoprofile.config import report_dir_problem
    assert report_dir_problem(str(tmp_path / "a" / "b")) is None and not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("x")
    assert "is a file" in report_dir_problem(str(tmp_path / "file" / "b"))
    assert report_dir_problem(str(tmp_path / "file")) == "exists and is not a folder"


# ---------------------------------------------------------------- suggestions that work
def test_a_flag_of_another_command_is_named_as_such_not_suggested_as_itself(cuda_spy, capsys):
    assert cli.main(["serve", "--json"]) == 2
    err = capsys.readouterr().err
    assert "did you mean --json" not in err, err
    assert err.startswith("error: --json: --json is a flag of `autoprofile plan`, not of `serve`"), err
    assert cli.main(["plan", "--gpu", "h100", "--jsn"]) == 2
    assert "did you mean --json?" in capsys.readouterr().err
    assert cli.main(["serve", "--jsn"]) == 2
    assert "did you mean" not in capsys.readouterr().err  # serve has no --json to mean


@pytest.mark.parametrize("typed", [["--disable-cudagraph=1"], ["--disable_cudagraph=true"],
                                   ["--disable_cudagraph", "true"], ["--disable-prefix-caching=0"],
                                   ["--disable_prefix_caching", "false"]])
def test_a_value_given_to_a_switch_gets_a_suggestion_that_parses(typed, cuda_spy, capsys):
    assert cli.main(["serve", *typed]) == 2
    err = capsys.readouterr().err
    switch = typed[0].split("=")[0].replace("-", "_").replace("__", "--", 1)
    value = typed[0].split("=")[1] if "=" in typed[0] else typed[1]
    assert err.startswith(f"error: {switch}: takes no value ('{value}' is not one)"), err
    on = value in ("1", "true")
    assert (f"try {switch}" in err) == on and ("leave it out" in err) != on
    suggestion = [switch] if on else []
    cuda_spy["is_available"].side_effect = None
    cuda_spy["is_available"].return_value = False
    assert cli.main(["serve", *suggestion]) == 1, capsys.readouterr().err  # parsed and validated; no GPU


@pytest.mark.parametrize("argv, blamed", [
    (["--running_max_req_size", "4000", "--graph_max_batch_size", "8", "--max_req_total_len", "4096"],
     "--running_max_req_size"),
    (["--graph_max_batch_size", "1024", "--max_req_total_len", "4096", "--batch_max_tokens", "1024"],
     "--graph_max_batch_size"),
    (["--max_req_total_len", "65536"], "--max_req_total_len"),
    (["--batch_max_tokens", "65536", "--max_req_total_len", "4096"], "--batch_max_tokens"),
])
def test_a_pinned_size_below_the_floor_blames_the_flag_that_set_the_floor(argv, blamed, cuda_spy, capsys):
    assert cli.main(["serve", *argv, "--max_total_token_num", "1024"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --max_total_token_num: "), err
    assert err.rstrip().endswith(f"or lower {blamed}"), err
    rows = "--running_max_req_size 4000 decode rows" if "--running_max_req_size" in argv else "decode rows ("
    assert rows in err, err


def test_plan_blames_running_max_req_size_when_its_rows_set_the_floor(capsys):
    argv = ["plan", "--gpu", "h100", "--running_max_req_size", "200000", "--max_req_total_len", "4096"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --running_max_req_size: "), err
    value = err.split("try --running_max_req_size ")[1].split()[0]
    assert cli.main([*argv, "--running_max_req_size", value]) == 0, capsys.readouterr().err


# ---------------------------------------------------------------- config.json refused before loading
TINY = json.loads((CONFIG_DIR / "tiny/config.json").read_text())


@pytest.mark.parametrize("change, key, fix", [
    ({"head_dim": 33}, "head_dim", {"head_dim": 34}),
    ({"head_dim": None, "hidden_size": 264, "num_attention_heads": 8}, "head_dim", {"head_dim": 34}),
    ({"vocab_size": 200}, "vocab_size", {"vocab_size": 259}),
    ({"eos_token_id": 5000}, "vocab_size", {"vocab_size": 5001}),
    ({"bos_token_id": [1, 4096]}, "vocab_size", {"vocab_size": 4097}),
    ({"rope_scaling": TINY["rope_scaling"] | {"low_freq_factor": 4.0}}, "low_freq_factor",
     {"rope_scaling": TINY["rope_scaling"] | {"low_freq_factor": 1.0, "high_freq_factor": 4.0}}),
    ({"rope_scaling": TINY["rope_scaling"] | {"low_freq_factor": 5.0}}, "low_freq_factor",
     {"rope_scaling": TINY["rope_scaling"] | {"low_freq_factor": 1.0, "high_freq_factor": 4.0}}),
])
@pytest.mark.parametrize("command", ["serve", "profile"])
def test_a_config_json_the_engine_cannot_run_exits_2_naming_file_key_and_a_value_that_works(
        tmp_path, change, key, fix, command, cuda_spy, capsys):
    def write(d):
        (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in d.items() if v is not None}))
    write(TINY | change)
    assert cli.main([command, "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model: {tmp_path / 'config.json'}: key ") and f"key '{key}'" in err, err
    assert_cuda_untouched(cuda_spy)
    write(TINY | change | fix)
    cuda_spy["is_available"].side_effect = None
    cuda_spy["is_available"].return_value = False
    dummy = [command, "--model", str(tmp_path), "--load_format", "dummy"]
    assert cli.main(dummy) == 1, capsys.readouterr().err


def test_vocab_size_below_a_tokenizer_json_is_refused(tmp_path, cuda_spy, capsys):
    from tokenizers import Tokenizer, models
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(5000)}, unk_token="w0"))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps(TINY))  # vocab_size 4096 < 5000
    assert cli.main(["serve", "--model", str(tmp_path), "--load_format", "dummy"]) == 2
    err = capsys.readouterr().err
    assert "key 'vocab_size' (4096) is below the 5000 ids its tokenizer.json holds" in err, err
    assert cli.main(["plan", "--gpu", "h100", "--model", str(tmp_path)]) == 0  # plan tokenizes nothing


# ---------------------------------------------------------------- a folder's weights and tokenizer
def no_gpu(cuda_spy) -> None:
    cuda_spy["is_available"].side_effect = None
    cuda_spy["is_available"].return_value = False


def word_tokenizer(folder, words: int) -> str:
    from tokenizers import Tokenizer, models
    folder.mkdir(parents=True, exist_ok=True)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0")).save(
        str(folder / "tokenizer.json"))
    return str(folder)


@pytest.mark.parametrize("command", ["serve", "profile"])
def test_a_folder_without_weights_is_refused_naming_the_files_unless_dummy(tmp_path, command, cuda_spy,
                                                                           capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert cli.main([command, "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model: {tmp_path}: holds no weights (looked for "
                          "model.safetensors.index.json / *.safetensors or pytorch_model.bin.index.json / "
                          "*.bin); add the checkpoint's files, or try --load_format dummy (random "
                          "weights)"), err
    assert_cuda_untouched(cuda_spy)
    assert cli.main(["plan", "--gpu", "h100", "--model", str(tmp_path)]) == 0  # a plan loads no weights
    no_gpu(cuda_spy)
    dummy = [command, "--model", str(tmp_path), "--load_format", "dummy"]
    assert cli.main(dummy) == 1, capsys.readouterr().err


def test_a_load_format_the_folder_does_not_hold_names_the_flag_and_auto(tmp_path, cuda_spy, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "model.safetensors").write_bytes(b"")  # validation reads no tensor
    word_tokenizer(tmp_path, 100)
    assert cli.main(["serve", "--model", str(tmp_path), "--load_format", "pt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --load_format: {tmp_path}: holds no weights (looked for "
                          "pytorch_model.bin.index.json / *.bin)") and "or --load_format auto" in err, err
    assert_cuda_untouched(cuda_spy)
    no_gpu(cuda_spy)
    for fmt in ("auto", "safetensors"):
        argv = ["serve", "--model", str(tmp_path), "--load_format", fmt]
        assert cli.main(argv) == 1, capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "profile"])
def test_a_checkpoint_without_a_tokenizer_is_refused_unless_tokenizer_names_one(tmp_path, command, cuda_spy,
                                                                                capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    (model / "model.safetensors").write_bytes(b"")
    assert cli.main([command, "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --tokenizer: {model} has no tokenizer.json; give one with --tokenizer "
                          "FOLDER"), err
    assert "--load_format dummy" in err, err
    assert cli.main([command, "--model", str(model), "--tokenizer", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --tokenizer: '{tmp_path / 'missing'}' holds no tokenizer.json"), err
    big = word_tokenizer(tmp_path / "big", 5000)  # more ids than the config's 4096
    assert cli.main([command, "--model", str(model), "--tokenizer", big]) == 2
    err = capsys.readouterr().err
    assert f"is below the 5000 ids {big}/tokenizer.json holds" in err, err
    assert_cuda_untouched(cuda_spy)
    no_gpu(cuda_spy)
    fits = word_tokenizer(tmp_path / "fits", 300)
    assert cli.main([command, "--model", str(model), "--tokenizer", fits]) == 1, capsys.readouterr().err
    assert cli.main([command, "--model", str(model), "--load_format", "dummy"]) == 1, capsys.readouterr().err


def test_profile_cache_defaults_to_the_user_cache_folder_and_empty_means_always_probe(tmp_path, monkeypatch):
    from autoprofile.config import config_from_args
    from autoprofile.profile_cache import default_folder
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    parser = cli.build_parser()
    on = config_from_args(parser.parse_args(["serve", "--attention_backend", "torch"]))
    assert on.profile_cache == default_folder() == str(tmp_path / "autoprofile" / "profiles")
    off = config_from_args(parser.parse_args(["serve", "--profile_cache", ""]))
    assert off.profile_cache is None and ServerConfig().profile_cache is None  # code and tests: off
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="--profile_cache: .* is a file, not a folder; try --profile_cache"):
        config_from_args(parser.parse_args(["serve", "--profile_cache", str(a_file)]))


@pytest.mark.parametrize("argv, in_process", [
    ([], True),  # one CUDA GPU: the engine loop in a process of its own, as vLLM's EngineCore
    (["--engine_thread"], False),
    (["--engine-thread"], False),
    (["--engine_process"], True),
    (["--device", "cpu"], False),  # the forward runs on the same cores: no second process by default
    (["--device", "cpu", "--engine_process"], True),
    (["--tp", "2"], False),  # rank 0's engine serves the ranks' step broadcast in the server's process
    (["--tp", "2", "--engine_thread"], False),
])
def test_serve_runs_its_engine_in_a_process_of_its_own_with_one_cuda_gpu(argv, in_process):
    from autoprofile.config import config_from_args
    cfg = validate(config_from_args(cli.build_parser().parse_args(["serve", "--profile_cache", "", *argv])))
    assert cfg.uses_engine_process is in_process


def test_engine_process_and_engine_thread_together_are_refused(capsys):
    assert cli.main(["serve", "--engine_process", "--engine_thread"]) == 2
    assert "--engine_thread: not allowed with argument --engine_process" in capsys.readouterr().err
