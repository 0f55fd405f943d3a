"""`autoprofile serve | profile | plan`: parse, validate on the CPU, then (serve/profile) touch the GPU.

Bad flags end with `error: --flag: ...` on stderr and exit code 2 before any torch.cuda call.
"""
from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence

from autoprofile.config import ConfigError, add_server_args, config_from_args

log = logging.getLogger("autoprofile")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A flag argparse rejected; carries the flag and a value that would work."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag}: {message}")


class _Parser(argparse.ArgumentParser):
    """argparse that names the flag and suggests a working value instead of exiting on its own."""

    def error(self, message: str):
        m = re.match(r"argument (--\w+)(?:/-\w+)?: (.*)", message)
        if m:
            flag, why = m.groups()
            raise UsageError(flag, why if "choose from" in why else f"{why}; {self._suggest(flag)}")
        m = re.match(r"unrecognized arguments: (\S+)", message)
        if m:
            raise UsageError(m.group(1), f"unknown flag; see `{self.prog} --help`")
        raise UsageError("command", f"{message}; try `autoprofile plan --gpu h100` or `autoprofile --help`")

    def _suggest(self, flag: str) -> str:
        action = next((a for a in self._actions if flag in a.option_strings), None)
        if action is not None and action.choices:
            return f"choose one of {', '.join(map(str, action.choices))}"
        if action is not None and action.default is not None:
            return f"try {flag} {action.default}"
        return f"see `{self.prog} --help`"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="autoprofile", description="LLM serving that sizes its KV cache from a measured profile")
    sub = p.add_subparsers(dest="command", required=True, metavar="{serve,profile,plan}")
    serve = sub.add_parser("serve", help="profile the GPU, size the KV cache, serve HTTP")
    add_server_args(serve)
    profile = sub.add_parser("profile", help="profile the GPU and print the budget report, then exit")
    add_server_args(profile)
    plan = sub.add_parser("plan", help="the budget on paper for a card, no GPU needed")
    add_server_args(plan)
    from autoprofile.plan import GPUS  # NOTE: plan imports no torch; keeps `plan` usable anywhere
    plan.add_argument("--gpu", choices=sorted(GPUS), default=None,
                      help="a known card (its driver-reported total)")
    plan.add_argument("--gpu_memory_gib", type=float, default=None, help="or any card's total memory in GiB")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
        cfg = config_from_args(ns, serving=ns.command != "plan")
        if ns.command == "plan":
            card = _plan_card(ns)
    except (ConfigError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # --help
        return int(e.code or 0)
    setup_logging()
    if ns.command == "plan":
        return _cmd_plan(cfg, card, ns.json)
    if not _gpu_present():
        print(f"error: `autoprofile {ns.command}` measures GPU memory and needs a CUDA/ROCm GPU, and none is "
              f"visible here (torch.cuda.is_available() is False).\n"
              f"To see the memory budget on paper, run: autoprofile plan --model {cfg.model} --gpu h100",
              file=sys.stderr)
        return EXIT_FAILED
    return _cmd_profile(cfg) if ns.command == "profile" else _cmd_serve(cfg)


def _plan_card(ns: argparse.Namespace):
    from autoprofile.plan import card_for
    if (ns.gpu is None) == (ns.gpu_memory_gib is None):
        raise UsageError("--gpu", "give exactly one of --gpu NAME or --gpu_memory_gib N; try --gpu h100")
    if ns.gpu_memory_gib is not None and not ns.gpu_memory_gib > 0:
        raise UsageError("--gpu_memory_gib", f"must be > 0, got {ns.gpu_memory_gib}; try --gpu_memory_gib 80")
    return card_for(ns.gpu, ns.gpu_memory_gib)


def _gpu_present() -> bool:
    import torch
    return torch.cuda.is_available()


def _cmd_plan(cfg, card, as_json: bool) -> int:
    from autoprofile.plan import format_plan, make_plan
    p = make_plan(cfg, card)
    print(p.to_json() if as_json else format_plan(p))
    return EXIT_OK


def _cmd_profile(cfg) -> int:
    from autoprofile.profiler import ProfileError, profile
    try:
        result = profile(cfg)
    except ProfileError as e:
        print(str(e), file=sys.stderr)
        return EXIT_FAILED
    print(result.report_text())
    return EXIT_OK


def _cmd_serve(cfg) -> int:
    from autoprofile.profiler import boot
    from autoprofile.server import run_server
    if cfg.tp > 1:
        print("error: --tp: `serve` runs one rank for now; try --tp 1 "
              "(`autoprofile profile --tp N` sizes a TP deployment)", file=sys.stderr)
        return EXIT_FAILED
    return run_server(cfg, boot)  # binds, boots (load, probe, measure, rebuild, validate), serves, drains


if __name__ == "__main__":
    sys.exit(main())
