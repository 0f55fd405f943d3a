"""`autoprofile serve | profile | plan`: parse, validate on the CPU, then (serve/profile) touch the GPU.

Bad flags end with `error: --flag: ...` on stderr and exit code 2 before any torch.cuda call.
"""
from __future__ import annotations

import argparse
import difflib
import logging
import math
import os
import re
import sys
import textwrap
from collections.abc import Sequence

from autoprofile import __version__
from autoprofile.config import COMMANDS, ConfigError, add_flag, add_server_args, config_from_args
from autoprofile.model_config import unsupported_architecture

log = logging.getLogger("autoprofile")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A flag argparse rejected; carries the flag and a value that would work."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag}: {message}")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help written as sentences: argparse wraps them (never inside a word, never at a hyphen) and appends
    every flag's default."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False, break_long_words=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "(default: " in text:
            return text
        return f"{text} (default: {_shown(action.default)})"


def _shown(default) -> str:
    """A default as the user would write it (%-escaped for argparse's formatting)."""
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, tuple):
        return ",".join(default) or "none"
    return str(default).replace("%", "%%") or "''"


class _Parser(argparse.ArgumentParser):
    """argparse that names the flag and suggests a working value instead of exiting on its own."""

    def error(self, message: str):
        m = re.match(r"argument (--\w+)(?:/\S+)?: (.*)", message)
        if m:
            flag, why = m.groups()
            raise UsageError(flag, self._explain(flag, why))
        m = re.match(r"unrecognized arguments: (\S+)", message)
        if m:
            flag = m.group(1).split("=")[0]
            switch = self._switch_before(m.group(1))
            if switch is not None:
                raise UsageError(switch, _takes_no_value(switch, m.group(1)))
            raise UsageError(flag, self._unknown(flag))
        m = re.match(r"argument \S+: invalid choice: '([^']*)'", message)
        if m:
            near = difflib.get_close_matches(m.group(1), COMMANDS, n=1)
            raise UsageError("command", f"unknown command '{m.group(1)}'; "
                                        f"{f'did you mean {near[0]}? ' if near else ''}choose one of "
                                        f"{', '.join(COMMANDS)}")
        raise UsageError("command", f"{message}; try `autoprofile plan --gpu h100` or `autoprofile --help`")

    def _explain(self, flag: str, why: str) -> str:
        """argparse's complaint about a flag's value, with a value that works."""
        action = self._action(flag)
        m = re.match(r"invalid choice: '([^']*)'", why)
        if m and action is not None:
            choices = [str(c) for c in action.choices]
            near = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.5)
            hint = f"did you mean {near[0]}? " if near else ""
            return f"unknown value '{m.group(1)}'; {hint}choose one of {', '.join(choices)}"
        m = re.match(r"ignored explicit argument '([^']*)'", why)
        if m:
            return _takes_no_value(flag, m.group(1))
        return f"{why}; {self._suggest(flag)}"

    def _action(self, flag: str) -> argparse.Action | None:
        """The action of `flag` in the sub-command being parsed (or in this parser)."""
        parsers = [self, *self._subparsers_of(self._command())]
        return next((a for p in parsers for a in p._actions if flag in a.option_strings), None)

    def _subparsers_of(self, command: str | None) -> list[argparse.ArgumentParser]:
        subs = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
        return [subs[command]] if command in subs else []

    def _switch_before(self, word: str) -> str | None:
        """The switch (a flag that takes no value) written just before a stray word: `--disable_cudagraph
        true`."""
        argv = getattr(self, "_argv", [])
        if word.startswith("-"):
            return None
        switches = [before for before, a in zip(argv, argv[1:])
                    if a == word and (action := self._action(before)) is not None and action.nargs == 0]
        return switches[0] if switches else None

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
        action = self._action(flag)
        if action is not None and action.choices:
            return f"choose one of {', '.join(map(str, action.choices))}"
        if action is not None and action.nargs == 0:  # a switch (store_true): its presence is the value
            return f"it is a switch that takes no value: try {flag}"
        if action is not None and action.default is not None:
            return f"try {flag} {action.default}"
        return f"see `{self.prog} --help`"


def _takes_no_value(switch: str, value: str) -> str:
    """A switch written with a value (`--disable_cudagraph true`, `--disable_cudagraph=0`)."""
    if value.lower() in ("0", "false", "no", "off"):
        return f"takes no value ('{value}' is not one): it is off unless written, so leave it out"
    return f"takes no value ('{value}' is not one): write the switch alone; try {switch}"


RENAMED = {"--kv_dtype": "--kv_cache_dtype"}  # old spelling -> the flag's name now (vLLM's)
MAX_GPU_MEMORY_GIB = 4096.0


def build_parser() -> argparse.ArgumentParser:
    # NOTE: allow_abbrev=False: `--mem` must not silently mean --mem_fraction (no fuzzy flag matching)
    kw = dict(allow_abbrev=False, formatter_class=_HelpFormatter)
    p = _Parser(prog="autoprofile", **kw,
                description="LLM serving that sizes its KV cache from a measured profile.")
    p.add_argument("--version", action="version", version=f"autoprofile {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{serve,profile,plan}")
    for command, text in (("serve", "Profile the GPU, size the KV cache and serve the OpenAI API over HTTP."),
                          ("profile", "Profile the GPU, print the budget report and exit."),
                          ("plan", "The memory budget on paper for a card; needs no GPU.")):
        add_server_args(sub.add_parser(command, help=text, description=text, **kw), command)
    plan = sub.choices["plan"]
    from autoprofile.plan import GPUS  # NOTE: plan imports no torch; keeps `plan` usable anywhere
    card = plan.add_argument_group("the card (one of the two)")
    add_flag(card, "gpu", choices=sorted(GPUS), default=None,
             help="A known card, by the total memory its driver reports.")
    add_flag(card, "gpu_memory_gib", type=float, default=None,
             help=f"Any card's total memory in GiB, in (0, {MAX_GPU_MEMORY_GIB:g}].")
    add_flag(plan, "json", action="store_true", help="Print the plan as JSON.")
    add_flag(plan, "dp_attention", action="store_true",
             help="MLA models under --tp: plan SGLang's data-parallel attention layout (each rank caches its "
                  "own requests' latents, the attention weights whole on every rank, MoE and MLP split) "
                  "beside the TP layout. On paper only: the engine runs TP attention.")
    return p


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # the reader left early (`autoprofile plan ... | head -1`): end quietly
        # NOTE: the interpreter flushes stdout again at exit: point it at devnull, or that flush raises
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # a bare `autoprofile`: its usage, then what to type
        parser.print_help()
        print(f"error: command: say which one: {', '.join(COMMANDS)}; try `autoprofile plan --gpu h100` or "
              "`autoprofile serve --help`", file=sys.stderr)
        return EXIT_USAGE
    try:
        ns = parser.parse_args(argv)
        cfg = config_from_args(ns, serving=ns.command != "plan")
        if ns.command == "plan":
            card = _plan_card(ns)
            if ns.dp_attention:
                from autoprofile.plan import dp_attention_problem
                problem = dp_attention_problem(cfg)
                if problem:
                    raise ConfigError("dp_attention", problem)
    except (ConfigError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # --help
        return int(e.code or 0)
    setup_logging()
    if ns.command == "plan":
        return _cmd_plan(cfg, card, ns.json, ns.dp_attention)
    remote = _engine_process(cfg) if ns.command == "serve" else None  # booting beside our own imports
    if remote is None and cfg.device != "cpu":  # this process boots: Triton's key hashed beside its imports
        from autoprofile.kernels import triton_key
        triton_key.start()
    if cfg.device == "cpu":
        return _cmd_serve_cpu(cfg, remote) if ns.command == "serve" else _profile_on_cpu()
    if not _gpu_present():
        if remote is not None:
            remote.kill()
        print(f"error: `autoprofile {ns.command}` measures GPU memory and needs a CUDA/ROCm GPU, and none is "
              f"visible here (torch.cuda.is_available() is False).\n"
              f"To see the memory budget on paper, run: autoprofile plan --model {cfg.model} --gpu h100\n"
              f"To try the API on this CPU, run: autoprofile serve --device cpu --model tiny",
              file=sys.stderr)
        return EXIT_FAILED
    return _cmd_profile(cfg) if ns.command == "profile" else _cmd_serve(cfg, remote)


def _engine_process(cfg):
    """The engine process (cfg.uses_engine_process) spawned now, before this process imports torch and the
    server (its boot function named, not imported), so that the two processes' imports overlap; else None."""
    if not cfg.uses_engine_process:
        return None
    from autoprofile.serving.engine_process import BootRef, EngineProcess
    where = ("autoprofile.cpu", "boot_cpu") if cfg.device == "cpu" else ("autoprofile.profiler", "boot")
    boot = BootRef(*where)
    return EngineProcess(cfg, boot).start()


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


def _cmd_plan(cfg, card, as_json: bool, dp_attention: bool = False) -> int:
    from autoprofile.plan import format_plan, make_plan
    if not cfg.model_config.runnable:  # nothing in the plan would be served: the error alone
        print(f"error: --model: {unsupported_architecture(cfg.model_config.architecture)}", file=sys.stderr)
        return EXIT_USAGE
    p = make_plan(cfg, card, dp_attention)
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


def _profile_on_cpu() -> int:
    print("error: --device: `autoprofile profile` measures a GPU's memory, and there is none to measure with "
          "--device cpu; try `autoprofile serve --device cpu` (or --device cuda)", file=sys.stderr)
    return EXIT_USAGE


def _cmd_serve_cpu(cfg, remote=None) -> int:
    from autoprofile.cpu import boot_cpu
    from autoprofile.server import run_server
    return run_server(cfg, boot_cpu, remote)  # no probe: the cache is sized from the context and host memory


def _cmd_serve(cfg, remote=None) -> int:
    from autoprofile.profiler import boot
    from autoprofile.server import run_server
    if cfg.tp > 1:  # one process per GPU: rank 0 serves HTTP and ships each step to the others
        from autoprofile.launch import serve_tp
        return serve_tp(cfg)
    return run_server(cfg, boot, remote)  # binds, boots (load, probe, measure, rebuild, validate), serves


if __name__ == "__main__":
    sys.exit(main())
