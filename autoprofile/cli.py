"""`autoprofile serve | profile | plan`: parse, validate on the CPU, then (serve/profile) touch the GPU.

Bad flags end with `error: --flag: ...` on stderr and exit code 2 before any torch.cuda call.
"""
from __future__ import annotations

import argparse
import difflib
import logging
import math
import re
import sys
from collections.abc import Sequence

from autoprofile.config import ConfigError, add_flag, add_server_args, config_from_args

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
        m = re.match(r"argument (--\w+)(?:/\S+)?: (.*)", message)
        if m:
            flag, why = m.groups()
            raise UsageError(flag, why if "choose from" in why else f"{why}; {self._suggest(flag)}")
        m = re.match(r"unrecognized arguments: (\S+)", message)
        if m:
            flag = m.group(1).split("=")[0]
            raise UsageError(flag, self._unknown(flag))
        m = re.match(r"argument \S+: invalid choice: '([^']*)'", message)
        if m:
            near = difflib.get_close_matches(m.group(1), COMMANDS, n=1)
            raise UsageError("command", f"unknown command '{m.group(1)}'; "
                                        f"{f'did you mean {near[0]}? ' if near else ''}choose one of "
                                        f"{', '.join(COMMANDS)}")
        raise UsageError("command", f"{message}; try `autoprofile plan --gpu h100` or `autoprofile --help`")

    def parse_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def _command(self) -> str | None:
        """The sub-command being parsed (the first word that names one), if any."""
        return next((a for a in getattr(self, "_argv", []) if a in COMMANDS), None)

    def _flags(self, command: str | None) -> dict[str, list[str]]:
        """Each sub-command's long options (only `command`'s when given)."""
        subs = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
        return {name: sorted(o for a in p._actions for o in a.option_strings if o.startswith("--"))
                for name, p in subs.items() if command is None or name == command}

    def _unknown(self, flag: str) -> str:
        command = self._command()
        others = [c for c, flags in self._flags(None).items() if flag in flags and c != command]
        if others and command:
            return (f"{flag} is a flag of `{self.prog} {others[0]}`, not of `{command}`; "
                    f"see `{self.prog} {command} --help`")
        near = self._near(flag, sorted({o for fs in self._flags(command).values() for o in fs}))
        hint = f"did you mean {near}? " if near else ""
        return f"unknown flag; {hint}see `{self.prog}{f' {command}' if command else ''} --help`"

    @staticmethod
    def _near(flag: str, flags: list[str]) -> str | None:
        """A known flag close to a mistyped one (hyphens and underscores alike), or a renamed flag's new
        name."""
        known = {o.replace("-", "_"): o for o in flags if "_" in o or "-" not in o[2:]}
        typed = flag.replace("-", "_")
        renamed = RENAMED.get("--" + typed[2:], "").replace("-", "_")
        if renamed in known:
            return known[renamed]
        prefixed = [k for k in known if k.startswith(typed)]
        if len(prefixed) == 1:
            return known[prefixed[0]]
        near = difflib.get_close_matches(typed, list(known), n=1, cutoff=0.75)
        return known[near[0]] if near else None

    def _suggest(self, flag: str) -> str:
        action = next((a for a in self._actions if flag in a.option_strings), None)
        if action is not None and action.choices:
            return f"choose one of {', '.join(map(str, action.choices))}"
        if action is not None and action.nargs == 0:  # a switch (store_true): its presence is the value
            return f"it is a switch that takes no value: try {flag}"
        if action is not None and action.default is not None:
            return f"try {flag} {action.default}"
        return f"see `{self.prog} --help`"


COMMANDS = ("serve", "profile", "plan")
RENAMED = {"--kv_dtype": "--kv_cache_dtype"}  # old spelling -> the flag's name now (vLLM's)
MAX_GPU_MEMORY_GIB = 4096.0


def build_parser() -> argparse.ArgumentParser:
    # NOTE: allow_abbrev=False: `--mem` must not silently mean --mem_fraction (no fuzzy flag matching)
    p = _Parser(prog="autoprofile", description="LLM serving that sizes its KV cache from a measured profile",
                allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="{serve,profile,plan}")
    serve = sub.add_parser("serve", help="profile the GPU, size the KV cache, serve HTTP", allow_abbrev=False)
    add_server_args(serve)
    profile = sub.add_parser("profile", help="profile the GPU and print the budget report, then exit",
                             allow_abbrev=False)
    add_server_args(profile)
    plan = sub.add_parser("plan", help="the budget on paper for a card, no GPU needed", allow_abbrev=False)
    add_server_args(plan)
    from autoprofile.plan import GPUS  # NOTE: plan imports no torch; keeps `plan` usable anywhere
    add_flag(plan, "gpu", choices=sorted(GPUS), default=None, help="a known card (its driver-reported total)")
    add_flag(plan, "gpu_memory_gib", type=float, default=None,
             help=f"or any card's total memory in GiB, in (0, {MAX_GPU_MEMORY_GIB:g}]")
    add_flag(plan, "json", action="store_true", help="print the plan as JSON")
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
    if ns.gpu is not None and ns.gpu_memory_gib is not None:
        raise UsageError("--gpu", f"give one of --gpu NAME or --gpu_memory_gib N, not both; drop one: "
                                  f"--gpu {ns.gpu} or --gpu_memory_gib {ns.gpu_memory_gib:g}")
    if ns.gpu is None and ns.gpu_memory_gib is None:
        raise UsageError("--gpu", "say which card: --gpu NAME or --gpu_memory_gib N; try --gpu h100")
    gib = ns.gpu_memory_gib
    if gib is not None and not (math.isfinite(gib) and 0 < gib <= MAX_GPU_MEMORY_GIB):
        raise UsageError("--gpu_memory_gib",
                         f"must be a number of GiB in (0, {MAX_GPU_MEMORY_GIB:g}], got {gib}; "
                                             "try --gpu_memory_gib 80")
    return card_for(ns.gpu, ns.gpu_memory_gib)


def _gpu_present() -> bool:
    import torch
    return torch.cuda.is_available()


def _cmd_plan(cfg, card, as_json: bool) -> int:
    from autoprofile.plan import format_plan, make_plan
    p = make_plan(cfg, card)
    print(p.to_json() if as_json else format_plan(p))
    if p.problem:  # the model cannot be served as configured: name the flag and a value that works
        print(f"error: --{p.problem_flag}: {p.problem}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def _cmd_profile(cfg) -> int:
    from autoprofile.profiler import ProfileError, profile
    # one process per GPU: any rank's failure is one ProfileError
    from autoprofile.launch import profile_tp
    try:
        result = profile_tp(cfg) if cfg.tp > 1 else profile(cfg)
    except ProfileError as e:
        print(str(e), file=sys.stderr)
        return EXIT_FAILED
    print(result.report_text())
    return EXIT_OK


def _cmd_serve(cfg) -> int:
    from autoprofile.profiler import boot
    from autoprofile.server import run_server
    if cfg.tp > 1:  # one process per GPU: rank 0 serves HTTP and ships each step to the others
        from autoprofile.launch import serve_tp
        return serve_tp(cfg)
    return run_server(cfg, boot)  # binds, boots (load, probe, measure, rebuild, validate), serves, drains


if __name__ == "__main__":
    sys.exit(main())
