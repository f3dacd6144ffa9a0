"""Command line: ``python -m lmtrain {fit,validate,test,bench,estimate} ...``.

``fit``, ``validate`` and ``test`` are LightningCLI subcommands over ``LMModule`` and ``LMDataModule``
(``--config``, ``--print_config``, dotted overrides such as ``--model.context_length 1024``).
``bench NAME`` runs one of the benchmark studies in ``lmtrain.bench``; ``estimate`` prints the
memory planner's estimate for a config.

Errors in the configuration or the data stop the command with one line naming the field and the
fix, and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from collections.abc import Sequence

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
}
#: Other non-Lightning commands, same protocol.
TOOL_COMMANDS: dict[str, str] = {"estimate": "lmtrain.bench.estimate"}

LOG_DIR = "logs"


def _lightning_cli(args: Sequence[str] | None) -> None:
    from lightning.pytorch.cli import LightningCLI

    from lmtrain.data import LMDataModule
    from lmtrain.module import LMModule

    class LMCli(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 (jsonargparse parser)
            # One source of truth for the shapes that the data must match.
            parser.link_arguments("model.context_length", "data.context_length")
            parser.link_arguments("model.vocab_size", "data.vocab_size")

        def before_fit(self) -> None:
            # The memory planner's estimate against the GPU's memory: a warning before hours of set-up.
            from lmtrain.memory_plan import warn_if_too_large

            warn_if_too_large(self.model, self.datamodule, self.trainer)

    LMCli(
        LMModule,
        LMDataModule,
        args=None if args is None else list(args),  # None: sys.argv, without LightningCLI's warning
        trainer_defaults={
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": LOG_DIR, "name": "lmtrain"},
            },
        },
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": "Train or evaluate a GPT-style LM. Every option can go in a YAML --config."},
    )


def _tool(name: str, module: str, args: Sequence[str], prog: str) -> int:
    mod = importlib.import_module(module)
    parser = argparse.ArgumentParser(prog=prog, description=(mod.__doc__ or "").strip().splitlines()[0])
    mod.add_arguments(parser)
    ns = parser.parse_args(list(args))
    ns.command_line = shlex.join([*prog.split(), *args])  # as typed, for the records the tool writes
    return int(mod.run(ns) or 0)


def _bench(args: Sequence[str]) -> int:
    if not args or args[0] in ("-h", "--help") or args[0] not in BENCH_COMMANDS:
        lines = ["usage: python -m lmtrain bench {" + ",".join(BENCH_COMMANDS) + "} [options]", "", "studies:"]
        for name, module in BENCH_COMMANDS.items():
            doc = (importlib.import_module(module).__doc__ or "").strip().splitlines()
            lines.append(f"  {name:<10} {doc[0] if doc else ''}")
        print("\n".join(lines), file=sys.stderr if args and args[0] not in ("-h", "--help") else sys.stdout)
        if args and args[0] not in ("-h", "--help"):
            print(f"error: unknown study {args[0]!r}", file=sys.stderr)
            return 2
        return 0 if args else 2
    return _tool(args[0], BENCH_COMMANDS[args[0]], args[1:], f"python -m lmtrain bench {args[0]}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m lmtrain`` and the ``lmtrain`` script. Returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] == "bench":
            return _bench(args[1:])
        if args and args[0] in TOOL_COMMANDS:
            return _tool(args[0], TOOL_COMMANDS[args[0]], args[1:], f"python -m lmtrain {args[0]}")
        _lightning_cli(None if argv is None else args)
        return 0
    except LmtrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # configuration errors that Lightning raises itself
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        if isinstance(e, MisconfigurationException):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise
