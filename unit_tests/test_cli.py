"""The CLI commands on a CPU machine (the server itself: test_server.py)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from autoprofile import cli
from autoprofile.config import ServerConfig

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- commands
def test_plan_prints_the_breakdown(capsys):
    assert cli.main(["plan", "--model", "llama-3.1-8b", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    for text in ("llama-3.1-8b", "weights", "14.96", "KV cache", "request table", "decode graph pools",
                 "CUDA context", "ESTIMATED", "predicted --max_total_token_num"):
        assert text in out, text


def test_plan_takes_server_flags(capsys):
    assert cli.main(["plan", "--gpu", "h100", "--json"]) == 0
    default = capsys.readouterr().out
    assert cli.main(["plan", "--gpu", "h100", "--json", "--max_req_total_len", "8192", "--tp", "2"]) == 0
    short = capsys.readouterr().out
    assert '"context_len": 8192' in short and '"tp": 2' in short and short != default


def test_plan_never_asks_for_a_gpu(mocker, capsys):
    avail = mocker.patch("torch.cuda.is_available", side_effect=AssertionError("plan touched torch.cuda"))
    assert cli.main(["plan", "--gpu", "mi300x", "--model", "qwen3-8b"]) == 0
    assert cli.main(["plan", "--gpu", "mi300x", "--model", "deepseek-v2-lite"]) == 0  # MLA + MoE
    assert not avail.called
    out = capsys.readouterr()
    assert "aiter" in out.out and "31,104 B/token" in out.out


@pytest.mark.parametrize("command", ["serve", "profile"])
def test_no_gpu_exits_1_pointing_to_plan(command, mocker, capsys):
    mocker.patch("torch.cuda.is_available", return_value=False)
    assert cli.main([command, "--model", "qwen3-8b"]) == 1
    err = capsys.readouterr().err
    assert "needs a CUDA/ROCm GPU" in err
    assert "autoprofile plan --model qwen3-8b --gpu h100" in err


@dataclass
class FakeResult:
    cfg: ServerConfig
    tokens: int = 4096
    cell_bytes: int = 16384
    phases: list = field(default_factory=lambda: [("probe", 1.5), ("measure", 0.25),
                                                  ("rebuild+validate#1", 3.0)])

    @property
    def kv_bytes(self) -> int:
        return self.tokens * self.cell_bytes

    def report_text(self) -> str:
        return f"REPORT {self.tokens} tokens"


def test_profile_with_a_gpu_prints_the_report(mocker, capsys):
    mocker.patch("torch.cuda.is_available", return_value=True)
    prof = mocker.patch("autoprofile.profiler.profile", create=True,
                        side_effect=lambda cfg: FakeResult(cfg))
    argv = ["profile", "--model", "tiny", "--max_req_total_len", "1024", "--batch_max_tokens", "512"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.strip() == "REPORT 4096 tokens"
    cfg = prof.call_args.args[0]
    assert (cfg.model, cfg.max_req_total_len, cfg.batch_max_tokens) == ("tiny", 1024, 512)


def test_profile_give_up_exits_1_with_the_diagnostic(mocker, capsys):
    from autoprofile.profiler import ProfileError
    mocker.patch("torch.cuda.is_available", return_value=True)
    mocker.patch("autoprofile.profiler.profile", create=True,
                 side_effect=ProfileError("no size survived: knobs"))
    assert cli.main(["profile", "--model", "tiny"]) == 1
    assert "no size survived: knobs" in capsys.readouterr().err


def test_serve_starts_the_server_with_the_profiler_boot_in_an_engine_process(mocker):
    """One CUDA GPU: the engine process is spawned with the profiler's boot (by name) and handed to the
    server."""
    from autoprofile.profiler import boot
    from autoprofile.serving.engine_process import BootRef, EngineProcess
    mocker.patch("torch.cuda.is_available", return_value=True)
    run = mocker.patch("autoprofile.server.run_server", return_value=0)
    assert cli.main(["serve", "--model", "tiny", "--port", "0", "--max_waiting_requests", "7"]) == 0
    (cfg, boot_fn, remote), _ = run.call_args
    try:
        assert cfg.port == 0 and cfg.max_waiting_requests == 7 and boot_fn is boot
        assert isinstance(remote, EngineProcess) and remote.proc.pid is not None
        assert remote.boot_fn == BootRef("autoprofile.profiler", "boot")
    finally:
        remote.kill()  # NOTE: the server that would stop it is mocked


def test_serve_engine_thread_boots_in_the_server_s_process(mocker):
    from autoprofile.profiler import boot
    mocker.patch("torch.cuda.is_available", return_value=True)
    run = mocker.patch("autoprofile.server.run_server", return_value=0)
    assert cli.main(["serve", "--model", "tiny", "--port", "0", "--engine_thread"]) == 0
    (cfg, boot_fn, remote), _ = run.call_args
    assert boot_fn is boot and remote is None


def test_serve_exit_code_is_the_servers(mocker):
    mocker.patch("torch.cuda.is_available", return_value=True)
    mocker.patch("autoprofile.server.run_server", return_value=1)
    assert cli.main(["serve", "--model", "tiny", "--engine_thread"]) == 1


# ---------------------------------------------------------------- help and messages (issue 35)
def _help(command: str, columns: int, monkeypatch, capsys) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert cli.main([command, "--help"]) == 0
    return capsys.readouterr().out


def _subparser(command: str):
    parser = cli.build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices[command]


def _options(command: str) -> set[str]:
    return {a.option_strings[0] for a in _subparser(command)._actions if a.option_strings} - {"-h"}


def _entries(text: str) -> dict[str, str]:
    """Each option of a --help text and its help, as one line."""
    out, current = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            out[current] = line
        elif current and line.startswith("      "):
            out[current] += " " + line.strip()
        else:
            current = None
    return out


@pytest.mark.parametrize("command", ["serve", "profile", "plan"])
def test_help_shows_every_flags_default_and_its_text(command, monkeypatch, capsys):
    entries = _entries(_help(command, 100, monkeypatch, capsys))
    assert set(entries) - {"-h"} == _options(command)
    for flag, entry in entries.items():
        if flag != "-h":
            assert re.search(r" [A-Z][^()]*.*\. \(default: [^)]+\)$", entry), entry  # a sentence, its default
    if command == "serve":
        host, context = entries["--host"], entries["--max_req_total_len"]
        assert "The address the HTTP server binds" in host and host.endswith("(default: 127.0.0.1)")
        assert context.endswith("(default: auto)") and entries["--shrink_ratio"].endswith("(default: 0.95)")
        assert entries["--disable_cudagraph"].endswith("(default: off)")


@pytest.mark.parametrize("columns", [40, 57, 64, 79, 100, 131])
def test_help_is_wrapped_by_argparse_never_at_a_hyphen(columns, monkeypatch, capsys):
    text = _help("serve", columns, monkeypatch, capsys)
    assert not [line for line in text.splitlines() if line.rstrip().endswith("-") and line.strip() != "-"]
    assert "vision-language" in text and "Batch-invariant" in text
    assert "Batch-invariant kernels (the GEMMs" in " ".join(text.split())  # one sentence, one flow


def test_deterministic_points_to_a_readme_section_that_the_lead_keeps(monkeypatch, capsys):
    from autoprofile.config import README_REPRODUCIBLE
    text = " ".join(_help("serve", 100, monkeypatch, capsys).split())
    assert README_REPRODUCIBLE == "Reproducible output"
    assert f'See the README section "{README_REPRODUCIBLE}".' in text and '"Seeds"' not in text


SERVE_ONLY = {"--host", "--port", "--max_waiting_requests", "--allowed_media_domains", "--served_model_name",
              "--api_key", "--reasoning_parser", "--profile_dir", "--stream_interval", "--engine_process",
              "--engine_thread"}
MEASURING = {"--load_format", "--tokenizer", "--seed", "--kv_scales", "--piecewise_cuda_graph_max_tokens",
             "--disable_overlap_schedule", "--max_waiting_steps", "--waiting_served_ratio", "--shrink_ratio",
             "--max_retries",
             "--report_dir", "--profile_cache"}


def test_plan_lists_only_the_flags_plan_uses():
    plan, profile, serve = _options("plan"), _options("profile"), _options("serve")
    plan_only = {"--gpu", "--gpu_memory_gib", "--json", "--dp_attention"}  # the card, the output, the layout
    assert not plan & (SERVE_ONLY | MEASURING) and plan_only <= plan
    assert profile == serve - SERVE_ONLY and plan - plan_only < profile
    # every flag plan takes changes its plan (or names the card): none is there for show
    from autoprofile import plan as plan_module
    import inspect
    used = set(re.findall(r"cfg\.(\w+)", inspect.getsource(plan_module)))
    derived = {"context_len": "max_req_total_len", "canary_bytes": "canary_mb", "model_config": "model",
               "kv_dtype_bytes": "kv_cache_dtype", "kv_dtype_name": "kv_cache_dtype"}
    card = {"--quantization", *plan_only}  # quantization: via model_config
    flags = {f"--{derived.get(u, u)}" for u in used} | card
    assert plan <= flags, plan - flags


@pytest.mark.parametrize("flag, value", [("--host", "0.0.0.0"), ("--port", "9000"), ("--api_key", "k"),
                                         ("--report_dir", "x"), ("--seed", "1"), ("--profile_cache", "")])
def test_plan_refuses_a_flag_it_does_not_use(flag, value, capsys):
    assert cli.main(["plan", "--gpu", "h100", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}: {flag} is a flag of `autoprofile serve`, not of `plan`"), err


def test_choices_are_argparse_choices():
    from autoprofile import config
    from autoprofile.model_config import LOAD_FORMATS
    from autoprofile.plan import GPUS
    actions = {a.dest: a for p in ("serve", "plan") for a in _subparser(p)._actions}
    expect = {"attention_backend": config.ATTENTION_BACKENDS, "kv_cache_dtype": config.KV_DTYPES,
              "dtype": config.MODEL_DTYPES, "kv_scales": config.KV_SCALES, "load_format": LOAD_FORMATS,
              "quantization": config.QUANTIZATIONS, "gpu": tuple(sorted(GPUS))}
    for dest, choices in expect.items():
        assert tuple(actions[dest].choices) == tuple(choices), dest


@pytest.mark.parametrize("argv, text", [
    (["serve", "--kv_cache_dtype", "fp8"], "--kv_cache_dtype: unknown value 'fp8'; did you mean fp8_e4m3? "
                                           "choose one of auto, bfloat16, float16, float32, fp8_e4m3"),
    (["plan", "--gpu", "h300"], "--gpu: unknown value 'h300'; did you mean h200?"),
    (["serve", "--attention_backend", "flash"], "--attention_backend: unknown value 'flash'; choose one of "
                                                "auto, aiter, aiter_triton, torch"),
])
def test_a_bad_choice_names_the_flag_and_the_choices(argv, text, capsys):
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith(f"error: {text}")


def test_a_switch_written_with_a_value_says_it_takes_none(capsys):
    assert cli.main(["serve", "--disable_cudagraph", "true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --disable_cudagraph: takes no value ('true' is not one)"), err
    assert "unknown flag" not in err and "try --disable_cudagraph" in err
    assert cli.main(["serve", "--model", "tiny", "--disable_cudagraph", "--tp", "2", "yes"]) == 2
    assert "error: yes: unknown flag" in capsys.readouterr().err  # a stray word after a flag with a value


@pytest.mark.parametrize("tp, model, heads, fits", [(3, "llama-3.1-8b", "32 query and 8 KV heads", 2),
                                                    (6, "llama-3.1-8b", "32 query and 8 KV heads", 4),
                                                    (16, "llama-3.1-8b", "32 query and 8 KV heads", 8),
                                                    (3, "qwen2.5-7b", "28 query and 4 KV heads", 2),
                                                    (5, "qwen2.5-7b", "28 query and 4 KV heads", 4)])
def test_a_tp_that_does_not_divide_the_heads_suggests_the_nearest_that_does(tp, model, heads, fits, capsys):
    assert cli.main(["serve", "--model", model, "--tp", str(tp)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --tp: {model} has {heads}, which --tp {tp} does not divide"), err
    assert err.rstrip().endswith(f"try --tp {fits}")


def test_nearest_divisor():
    from autoprofile.config import nearest_divisor
    assert [nearest_divisor(n, 8) for n in range(1, 12)] == [1, 2, 2, 4, 4, 4, 8, 8, 8, 8, 8]
    assert nearest_divisor(5, 768) == 4 and nearest_divisor(7, 768) == 6 and nearest_divisor(3, 0) == 3


def test_plan_takes_deterministic_and_plans_its_fixed_splits(capsys):
    assert cli.main(["plan", "--gpu", "h100", "--model", "deepseek-v2-lite", "--deterministic"]) == 0
    assert "splits (--deterministic)" in capsys.readouterr().out
    assert cli.main(["plan", "--gpu", "h100", "--model", "deepseek-v2-lite"]) == 0
    assert "(--deterministic)" not in capsys.readouterr().out


def test_plan_of_an_unsupported_architecture_prints_the_error_alone(tmp_path, capsys):
    config = json.loads((ROOT / "models" / "configs" / "tiny" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": ["MixtralForCausalLM"]}))
    for extra in ([], ["--json"]):
        assert cli.main(["plan", "--gpu", "h100", "--model", str(tmp_path), *extra]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: --model: architecture MixtralForCausalLM") and \
            err.count("\n") == 1, (out, err)


@pytest.mark.parametrize("typed, meant", [("llama-3.1-8", "llama-3.1-8b"), ("Qwen3-8B-", "qwen3-8b"),
                                          ("deepseek-v2-light", "deepseek-v2-lite")])
def test_a_mistyped_model_name_gets_a_did_you_mean(typed, meant, capsys):
    assert cli.main(["plan", "--gpu", "h100", "--model", typed]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model: no config.json at '{typed}'") and \
        err.rstrip().endswith(f"did you mean {meant}?"), err
    assert cli.main(["plan", "--gpu", "h100", "--model", "zzz"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_a_bare_autoprofile_prints_its_usage(capsys):
    assert cli.main([]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("usage: autoprofile") and "{serve,profile,plan}" in out and "--version" in out
    assert err.startswith("error: command: say which one: serve, profile, plan; try") and err.count("\n") == 1


def test_version_is_the_packages(capsys):
    import tomllib
    from autoprofile import __version__
    assert cli.main(["--version"]) == 0
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out == f"autoprofile {version}\n" and __version__ == version


def test_the_license_is_apache_2_0_in_full():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.split()) > 1500


@pytest.mark.parametrize("command", [["serve"], ["plan", "--gpu", "h100"]])
def test_an_unsupported_architecture_names_the_supported_ones_by_family(command, tmp_path, capsys):
    config = json.loads((ROOT / "models" / "configs" / "tiny" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": ["MixtralForCausalLM"]}))
    assert cli.main([*command, "--model", str(tmp_path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--model: architecture MixtralForCausalLM is not one the engine serves" in err
    for arch, family in [("LlamaForCausalLM", "dense"), ("Qwen2ForCausalLM", "dense"),
                         ("Qwen3ForCausalLM", "dense"), ("Qwen3MoeForCausalLM", "MoE"),
                         ("DeepseekV2ForCausalLM", "MLA + MoE"),
                         ("Qwen2_5_VLForConditionalGeneration", "vision-language")]:
        assert f"{arch} ({family})" in err
    assert "dense Llama/Qwen" not in err


@pytest.mark.parametrize("argv", [["plan", "--gpu", "h100"], ["plan", "--gpu", "h100", "--json"],
                                  ["serve", "--help"]])
def test_a_reader_that_leaves_early_ends_the_output_quietly(argv):
    """`autoprofile plan ... | head -1`: the reader closes the pipe before the output is written."""
    proc = subprocess.Popen([sys.executable, "-m", "autoprofile.cli", *argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc.stdout.close()  # long before the interpreter has started: every write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 1)
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


def test_plan_checks_no_flag_it_does_not_take(monkeypatch):
    """plan writes no report and reads no API key: their checks (a writable --report_dir, a sendable
    $AUTOPROFILE_API_KEY) would name flags that plan refuses."""
    from autoprofile.config import API_KEY_ENV, config_from_args
    monkeypatch.setenv(API_KEY_ENV, "not sendable")
    ns = cli.build_parser().parse_args(["plan", "--gpu", "h100"])
    cfg = config_from_args(ns, serving=False)
    assert cfg.report_dir is None and cfg.api_key is None
    serve = cli.build_parser().parse_args(["serve", "--api_key", "sk-1"])
    assert config_from_args(serve, serving=False).report_dir == "autoprofile_report"
