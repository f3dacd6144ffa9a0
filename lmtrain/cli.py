"""Command line: ``python -m lmtrain {fit,validate,test,bench,estimate,analyze,prepare,generate} ...``.

``fit``, ``validate`` and ``test`` are LightningCLI subcommands over ``LMModule`` and ``LMDataModule``
(``--config``, ``--print_config``, dotted overrides such as ``--model.context_length 1024``), built in
``lmtrain.cli_config``, which also resolves the configs of ``estimate`` and every ``bench`` command.
``bench NAME`` runs one of the benchmarks in ``lmtrain.bench``; ``estimate`` prints the memory plan of a
config; ``analyze`` reads saved profiling records; ``prepare`` trains a byte-level BPE tokenizer and writes token
files; ``generate`` samples text from a checkpoint.

Errors in the arguments, the configuration or the data stop the command with one line,
``error: <field>: <problem> Fix: <fix>``, exit status 2, before anything is written. Ctrl-C stops a
command with one line and exit status 130; a benchmark keeps the results it has written so far. ``fit``,
``validate`` and ``test`` stopped by SIGINT or SIGTERM exit 128 + the signal's number (130, 143), ``fit`` after
saving ``last.ckpt`` where it checkpoints.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
import sys
from collections.abc import Sequence
from typing import NoReturn

from lmtrain import __version__
from lmtrain.cli_config import PROG, SUBCOMMANDS
from lmtrain.errors import LmtrainError

#: ``bench`` subcommands and the modules that implement them. Each module provides
#: ``add_arguments(parser)`` and ``run(args) -> int``; its docstring's first line is its help.
BENCH_COMMANDS: dict[str, str] = {
    "model": "lmtrain.bench.model",
    "attention": "lmtrain.bench.attention",
    "precision": "lmtrain.bench.precision",
    "report": "lmtrain.bench.report",
    "overhead": "lmtrain.bench.overhead",
    "callbacks": "lmtrain.bench.callbacks",
    "optimizer": "lmtrain.bench.optimizer",
    "comm": "lmtrain.bench.comm",
}
#: Other commands, same protocol. ``analyze`` may be missing from a checkout: help then says so.
TOOL_COMMANDS: dict[str, str] = {"estimate": "lmtrain.estimate", "analyze": "lmtrain.analysis.cli",
                                 "prepare": "lmtrain.prepare", "generate": "lmtrain.generate"}
#: One line per Lightning subcommand for the top-level help.
LIGHTNING_HELP: dict[str, str] = {
    "fit": "train a model from a YAML config (LightningCLI: --config, --model.*, --data.*, --trainer.*)",
    "validate": "evaluate a model on the validation split (same options as fit)",
    "test": "evaluate a model on the test split (same options as fit)",
}


class _ArgumentParser(argparse.ArgumentParser):
    """argparse with lmtrain's error line (``error: <option>: <problem> Fix: <fix>``) and no abbreviations."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)  # a misspelt option must fail, not match a longer one
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        fix = f"see `{self.prog} --help`."
        if match := re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message):
            raise LmtrainError(match.group(1), _sentence(match.group(2)), fix)
        if match := re.match(r"unrecognized arguments: (\S+)", message):
            raise LmtrainError(match.group(1), "is not an option of this command.", fix)
        if match := re.match(r"the following arguments are required: (.*)", message):
            raise LmtrainError(match.group(1).split(",")[0].strip(), "is required.", fix)
        raise LmtrainError("arguments", _sentence(message), fix)


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith(".") else text + "."


def _first_doc_line(module: str) -> str:
    """The first docstring line of ``module``, or a note when it cannot be imported."""
    if importlib.util.find_spec(module.rsplit(".", 1)[0]) is None or importlib.util.find_spec(module) is None:
        return "(not available in this installation)"
    try:
        doc = importlib.import_module(module).__doc__ or ""
    except ImportError as exc:
        return f"(not available: {exc})"
    lines = doc.strip().splitlines()
    return lines[0] if lines else ""


def top_level_help() -> str:
    """``python -m lmtrain --help``: every command with one line."""
    lines = [f"usage: {PROG} [-h] [--version] {{{','.join([*SUBCOMMANDS, 'bench', *TOOL_COMMANDS])}}} ...", "",
             "Train, measure and benchmark GPT-style language models.", "", "commands:"]
    for name, text in LIGHTNING_HELP.items():
        lines.append(f"  {name:<10} {text}")
    lines.append(f"  {'bench':<10} benchmarks: {{{','.join(BENCH_COMMANDS)}}} (`{PROG} bench --help`)")
    for name, module in TOOL_COMMANDS.items():
        lines.append(f"  {name:<10} {_first_doc_line(module)}")
    lines += ["", "options:", "  -h, --help  show this message and exit", "  --version   print the version and exit",
              "", f"`{PROG} COMMAND --help` lists a command's options."]
    return "\n".join(lines)


def bench_help() -> str:
    """``python -m lmtrain bench --help``: every benchmark with one line."""
    lines = [f"usage: {PROG} bench {{{','.join(BENCH_COMMANDS)}}} [options]", "", "benchmarks:"]
    for name, module in BENCH_COMMANDS.items():
        lines.append(f"  {name:<10} {_first_doc_line(module)}")
    lines += ["", f"`{PROG} bench NAME --help` lists a benchmark's options."]
    return "\n".join(lines)


def _tool(module: str, args: Sequence[str], prog: str) -> int:
    mod = importlib.import_module(module)
    doc = (mod.__doc__ or "").strip().splitlines()
    parser = _ArgumentParser(prog=prog, description=doc[0] if doc else None,
                             epilog=mod.help_epilog() if hasattr(mod, "help_epilog") else None,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_arguments(parser)
    parse_known = getattr(mod, "PASS_UNKNOWN_ARGUMENTS", False)  # estimate: the rest goes to the fit parser
    if parse_known:
        ns, rest = parser.parse_known_args(list(args))
        ns.config_args = rest
    else:
        ns = parser.parse_args(list(args))
    ns.command_line = shlex.join([*prog.split(), *args])  # as typed, for the records the tool writes
    return int(mod.run(ns) or 0)


def _bench(args: Sequence[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(bench_help())
        return 0 if args else 2
    if args[0] not in BENCH_COMMANDS:
        raise LmtrainError("bench", f"there is no benchmark named {args[0]!r}.",
                           f"use one of {', '.join(BENCH_COMMANDS)} (`{PROG} bench --help`).")
    return _tool(BENCH_COMMANDS[args[0]], args[1:], f"{PROG} bench {args[0]}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m lmtrain`` and the ``lmtrain`` script. Returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if not args or args[0] in ("-h", "--help"):
            print(top_level_help())
            return 0 if args else 2
        if args[0] == "--version":
            print(f"lmtrain {__version__}")
            return 0
        if args[0] == "bench":
            return _bench(args[1:])
        if args[0] in TOOL_COMMANDS:
            if importlib.util.find_spec(TOOL_COMMANDS[args[0]].rsplit(".", 1)[0]) is None or \
                    importlib.util.find_spec(TOOL_COMMANDS[args[0]]) is None:
                raise LmtrainError(args[0], "this command is not available in this installation.",
                                   f"see `{PROG} --help` for the commands there are.")
            return _tool(TOOL_COMMANDS[args[0]], args[1:], f"{PROG} {args[0]}")
        if args[0] not in SUBCOMMANDS:
            raise LmtrainError("command", f"there is no command {args[0]!r}.",
                               f"use one of {', '.join([*SUBCOMMANDS, 'bench', *TOOL_COMMANDS])} "
                               f"(`{PROG} --help`).")
        from lmtrain.cli_config import run_lightning

        return run_lightning(args)
    except LmtrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"interrupted: {e}" if str(e) else "interrupted (Ctrl-C).", file=sys.stderr)
        return 130
    except Exception as e:  # configuration errors that Lightning raises itself
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        if isinstance(e, MisconfigurationException):
            first = (str(e).strip().splitlines() or ["invalid configuration"])[0]
            print(f"error: trainer: {_sentence(first)} Fix: change the trainer options named there "
                  f"(`{PROG} fit --help`).", file=sys.stderr)
            return 2
        raise
