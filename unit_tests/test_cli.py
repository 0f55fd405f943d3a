"""The CLI commands on a CPU machine (the server itself: test_server.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from autoprofile import cli
from autoprofile.config import ServerConfig


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


def test_serve_starts_the_server_with_the_profiler_boot(mocker):
    from autoprofile.profiler import boot
    mocker.patch("torch.cuda.is_available", return_value=True)
    run = mocker.patch("autoprofile.server.run_server", return_value=0)
    assert cli.main(["serve", "--model", "tiny", "--port", "0", "--max_waiting_requests", "7"]) == 0
    (cfg, boot_fn), _ = run.call_args
    assert cfg.port == 0 and cfg.max_waiting_requests == 7 and boot_fn is boot


def test_serve_exit_code_is_the_servers(mocker):
    mocker.patch("torch.cuda.is_available", return_value=True)
    mocker.patch("autoprofile.server.run_server", return_value=1)
    assert cli.main(["serve", "--model", "tiny"]) == 1
