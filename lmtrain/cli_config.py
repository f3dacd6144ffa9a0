"""The command-line configuration (``lmtrain.cli_config``): the LightningCLI parser of ``python -m lmtrain fit``,
used by every command. The option schema itself is ``lmtrain.config``.

``fit``, ``validate`` and ``test`` run :class:`LMCli`; ``estimate`` and every ``bench`` command resolve their
YAML and dotted overrides with :func:`resolve_config`, which parses them with the same class and the same
parser (the model-to-data links, every default, the trainer's precision names, ``class_path`` entries) but
builds nothing: no model, no data, no trainer, no log folder.

    >>> cfg = resolve_config("configs/tiny.yaml", ["--model.context_length", "64"])
    >>> cfg.model["context_length"], cfg.data["context_length"], cfg.precision
    (64, 64, '32-true')

Errors of the parser (a missing or malformed config file, an unknown option or key, a value of the wrong
type, an unknown callback class) become one :class:`~lmtrain.errors.LmtrainError` naming the field and the
fix (:func:`parser_error`), which the command line prints as one line, exit status 2.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
import signal
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtrain.config import ModelConfig, TrainerSettings
from lmtrain.errors import LmtrainError

#: Default TensorBoard folder of ``fit`` (``logs/lmtrain/version_N``).
LOG_DIR = "logs"
#: What the commands call themselves in usage lines and errors.
PROG = "python -m lmtrain"
#: The Lightning subcommands that lmtrain offers (``predict`` is left out: the model does not generate).
SUBCOMMANDS = ("fit", "validate", "test")
#: Lightning's short precision names and what they mean.
PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
#: The precisions lmtrain trains in (Lightning knows a few more, 64-true and transformer-engine: refused).
PRECISION_CHOICES = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")

_TRAINER_DEFAULTS: dict[str, Any] = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        # No placeholder hp_metric scalar: lmtrain logs its own metrics.
        "init_args": {"save_dir": LOG_DIR, "name": "lmtrain", "default_hp_metric": False},
    },
}
_PARSER_KWARGS: dict[str, Any] = {
    "exit_on_error": False,  # errors reach main() as exceptions and are printed as one line
    "allow_abbrev": False,  # --trainer.max_step must not quietly mean --trainer.max_steps
}


@dataclass(frozen=True)
class ResolvedConfig:
    """A config file plus overrides, resolved by the ``fit`` parser.

    Attributes:
        model: ``LMModule`` keyword arguments (every parameter, defaults filled in).
        data: ``LMDataModule`` keyword arguments (``context_length`` and ``vocab_size`` linked from the model).
        trainer: ``lightning.pytorch.Trainer`` keyword arguments as the parser gives them (every parameter;
            ``logger`` and ``callbacks`` as ``class_path`` / ``init_args`` dictionaries).
        seed: ``seed_everything`` of the config (None, True or an integer).
        source: the config file (None: defaults and overrides only).
        config_class: the option schema of the ``model`` section (the module class's ``config_class``).
    """

    model: dict[str, Any]
    data: dict[str, Any]
    trainer: dict[str, Any]
    seed: Any = None
    source: str | None = None
    config_class: type[ModelConfig] = ModelConfig

    @property
    def precision(self) -> str:
        """``trainer.precision`` in Lightning's long form (``32`` -> ``32-true``, ``bf16`` -> ``bf16-mixed``)."""
        return normalize_precision(self.trainer.get("precision"))

    def model_config(self) -> ModelConfig:
        """The ``ModelConfig`` that ``LMModule(**self.model)`` builds (validated; no torch model is created)."""
        return self.config_class.from_module_kwargs(self.model)


def normalize_precision(precision: Any) -> str:
    """Lightning's long precision name of ``precision`` (None: ``32-true``, Lightning's default)."""
    if precision is None:
        return "32-true"
    text = str(precision)
    return PRECISION_ALIASES.get(text, text)


def _lm_cli_class() -> type:
    """``LMCli``, built on first use: importing Lightning takes seconds, and ``--help`` of other commands skips it."""
    global _LMCLI
    if _LMCLI is not None:
        return _LMCLI
    from lightning.pytorch.cli import LightningCLI

    class LMCli(LightningCLI):
        """LightningCLI over ``LMModule`` and ``LMDataModule`` with lmtrain's links, defaults and checks."""

        @staticmethod
        def subcommands() -> dict[str, set[str]]:
            return {k: v for k, v in LightningCLI.subcommands().items() if k in SUBCOMMANDS}

        def add_arguments_to_parser(self, parser: Any) -> None:
            # One source of truth for the shapes that the data must match.
            parser.link_arguments("model.context_length", "data.context_length")
            parser.link_arguments("model.vocab_size", "data.vocab_size")
            # Where compiled kernels are kept between runs: a property of the machine, not of the model, so not a
            # model option (those go into the checkpoint and the bench cells).
            parser.add_argument("--compile_cache", type=str | None, default=None,
                                help="folder of torch.compile's and Triton's caches when the model compiles or "
                                "runs lmtrain's Triton kernels (lmtrain.compile_cache), so that the second run of a "
                                "config loads its kernels instead of compiling them; null: compile_cache under the "
                                "logger's save_dir (logs/compile_cache), shared by the runs logged there; off: "
                                "torch's own per-user temporary folder.")

        def parse_arguments(self, parser: Any, args: Any) -> None:
            # As LightningCLI's, without its warning about args given next to sys.argv: lmtrain's commands
            # always pass their arguments explicitly.
            self.config = parser.parse_args(args)
            subcommand = self.config.get("subcommand")
            if subcommand is not None and list(args[:1]) == [subcommand]:
                from lmtrain.checkpoints import checkpoint_data_options

                # validate/test of a checkpoint alone: its run's data options first, the given ones over them.
                data = checkpoint_data_options(self.config[subcommand], subcommand)
                if data is not None:
                    args = [subcommand, "--data", json.dumps(data), *args[1:]]
                    self.config = parser.parse_args(args)
            self.config = with_strategy_class(parser, args, self.config)
            # Checked right after the parse, before LightningCLI seeds, builds or writes anything.
            if subcommand is not None:
                section = self.config[subcommand]
                check_has_config(subcommand, section)
                check_runnable(subcommand, section)
                check_log_folder(section)
                check_compile_cache(section)
                # Every option and the combinations that cannot work, checked by the schema at parse time; then the
                # trainer settings the options cannot work with (strategy, devices, precision, accumulation,
                # clipping): here, not only when the fit starts, where Lightning has printed its device lines.
                model_config = self.model_class.config_class.from_module_kwargs(section["model"].as_dict())
                settings = parsed_trainer_settings(section["trainer"])
                self.model_class.check_settings(model_config, settings, training=subcommand == "fit")
                check_parsed_mesh(section["trainer"], settings)
                # Before LightningCLI takes the model's options from a checkpoint: `last` found, the run folder
                # of the checkpoint reused, and a checkpoint of another architecture refused in one line.
                from lmtrain.checkpoints import resolve_ckpt_path

                resolve_ckpt_path(section, subcommand, settings.world_size or 1)  # expected_processes' count

        def instantiate_classes(self) -> None:
            super().instantiate_classes()
            # Again with the number of processes the trainer found (``devices: auto``), before fit/validate/test
            # opens the log folder (Lightning creates it just before the callbacks' setup).
            check_callbacks(self.trainer.callbacks, self.trainer.world_size, self.datamodule, self.model)
            cache = compile_cache_callback(self.config[self.subcommand])
            if cache is not None:
                # First, so that its clock brackets the first step and not the other callbacks' work around it.
                self.trainer.callbacks.insert(0, cache)

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            # `trainer.strategy: ddp` (the name) gets lmtrain's DDP arguments; a class_path is taken as written.
            from lmtrain.distributed import builds_lmtrain_ddp, ddp_strategy

            section = self.config_init[self.subcommand] if self.subcommand else self.config_init
            trainer = section.get("trainer") or {}
            if "strategy" not in kwargs and builds_lmtrain_ddp(trainer.get("strategy")):
                kwargs["strategy"] = ddp_strategy(int(trainer.get("accumulate_grad_batches") or 1))
            # The callbacks' arguments and prompts, checked before the trainer says which devices it found: a bad
            # one stops with its one line alone.
            check_callbacks(trainer.get("callbacks") or [], expected_processes(trainer), self.datamodule, self.model)
            return super().instantiate_trainer(**kwargs)

        def before_fit(self) -> None:
            # The memory planner's estimate against the GPU's memory: a warning before hours of set-up.
            from lmtrain.memory_plan import warn_if_too_large

            warn_if_too_large(self.model, self.datamodule, self.trainer)

    _LMCLI = LMCli
    return LMCli


_LMCLI: type | None = None


def strategy_of(trainer: Any, count_auto: bool = False) -> tuple[str, int | None]:
    """The strategy kind (``lmtrain.module.strategy_kind_of``'s names) and the number of processes of a parsed
    ``trainer`` section; None processes where ``devices`` is ``auto`` or -1 (known only once the trainer exists),
    unless ``count_auto``: then ``auto`` counts one process per visible GPU (one on the CPU), as Lightning does.

    ``strategy: auto`` on more than one process is ``ddp``: Lightning's ``auto`` then builds a ``DDPStrategy`` (with
    PyTorch's own DDP arguments, not lmtrain's ``DDP_DEFAULTS``)."""
    from lmtrain.memory_plan import strategy_kind

    strategy = trainer.get("strategy") if hasattr(trainer, "get") else None
    if strategy is not None and not isinstance(strategy, str):  # a class_path entry, or a strategy object
        strategy = strategy.get("class_path", type(strategy).__name__) if hasattr(strategy, "get") else strategy
    try:
        kind = strategy_kind(strategy if strategy is not None else "auto")
    except ValueError:
        kind = "other"
    devices = trainer.get("devices", "auto") if hasattr(trainer, "get") else "auto"
    if isinstance(devices, (list, tuple)):
        count: int | None = len(devices)
    elif isinstance(devices, str) and "," in devices:
        count = len([d for d in devices.split(",") if d.strip()])
    else:
        try:
            count = int(devices)
        except (TypeError, ValueError):
            count = None
    if count is not None and count < 1:
        count = None
    if count is None and count_auto:
        import torch

        count = 1 if _runs_on_cpu(accelerator_name(trainer.get("accelerator"))) else max(1, torch.cuda.device_count())
    nodes = trainer.get("num_nodes", 1) if hasattr(trainer, "get") else 1
    processes = None if count is None else count * int(nodes or 1)
    if kind == "single" and processes is not None and processes > 1 and str(strategy or "auto") == "auto":
        kind = "ddp"
    elif kind == "single" and str(strategy or "auto") != "auto":
        processes = 1  # single_device (SingleDeviceStrategy) runs one process whatever devices says
    return kind, processes


def expected_processes(trainer: Any) -> int:
    """The number of processes a parsed ``trainer`` section will run, before the trainer exists: its devices and
    nodes, or for ``devices: auto`` one per visible GPU (one on the CPU), as Lightning counts them."""
    return strategy_of(trainer, count_auto=True)[1] or 1


def parsed_trainer_settings(trainer: Any) -> TrainerSettings:
    """The settings a parsed ``trainer`` section will give the trainer, for ``LMModule.check_settings`` before the
    trainer exists: precision, strategy kind and processes (:func:`strategy_of`, ``devices: auto`` counted),
    accumulation and clipping. The device is known only for a run that can train on the CPU alone (which GPU, and so
    its compute capability, is known once the trainer exists)."""
    kind, processes = strategy_of(trainer, count_auto=True)
    on_cpu = _runs_on_cpu(accelerator_name(trainer.get("accelerator")))
    return TrainerSettings(precision=normalize_precision(trainer.get("precision")), strategy=kind,
                           world_size=processes, device="cpu" if on_cpu else None,
                           accumulate_grad_batches=int(trainer.get("accumulate_grad_batches") or 1),
                           gradient_clip_val=trainer.get("gradient_clip_val"))


def strategy_class_path(strategy: Any) -> str | None:
    """The import path of the ``Strategy`` class that a ``trainer.strategy`` string names: a full import path
    (``lightning.pytorch.strategies.ModelParallelStrategy``) or a class name of ``lightning.pytorch.strategies``
    (``ModelParallelStrategy``). None for Lightning's strategy names (``auto``, ``ddp``, ``fsdp``, ..., in any case,
    as the trainer reads them) and for what is not a string (a ``class_path`` entry, a strategy object).

    Raises:
        LmtrainError: the string is neither a strategy name of Lightning's nor a ``Strategy`` class.
    """
    if not isinstance(strategy, str):
        return None
    import importlib

    from lightning.pytorch import strategies

    if strategy.lower() == "auto" or strategy.lower() in strategies.StrategyRegistry.available_strategies():
        return None
    module_name, _, class_name = strategy.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name) if module_name else strategies, class_name, None)
    except Exception:  # noqa: BLE001 - whatever stops the import, the string names no strategy class
        found = None
    if isinstance(found, type) and issubclass(found, strategies.Strategy):
        return strategy if module_name else f"{strategies.__name__}.{class_name}"
    raise LmtrainError("trainer.strategy", f"{strategy!r} is neither a strategy name of Lightning's nor the import "
                       "path of a Strategy class.",
                       "give a name (auto, ddp, ddp_spawn, fsdp, ...) or a class, e.g. "
                       "lightning.pytorch.strategies.ModelParallelStrategy (FSDP2, as in configs/2.7B_bf16_fsdp.yaml).")


def with_strategy_class(parser: Any, args: Sequence[str], config: Any) -> Any:
    """``config``, parsed from ``args``, or where its ``trainer.strategy`` is a string that names a ``Strategy`` class
    (:func:`strategy_class_path`), parsed again with that class as a ``class_path`` entry (its default
    ``init_args``): LightningCLI keeps such a string as a strategy name, which the trainer refuses in a traceback.

    Raises:
        LmtrainError: ``trainer.strategy`` is a string that names neither a strategy of Lightning's nor a class.
    """
    subcommand = config.get("subcommand")
    class_path = strategy_class_path(config[subcommand]["trainer"].get("strategy")) if subcommand else None
    if class_path is None:
        return config
    return parser.parse_args([*args, "--trainer.strategy", json.dumps({"class_path": class_path})])


def check_parsed_mesh(trainer: Any, settings: TrainerSettings) -> None:
    """FSDP2 given as a ``ModelParallelStrategy`` entry: the device mesh its sizes will make (``auto``: Lightning's
    default, resolved as Lightning does, ``lmtrain.distributed.mesh_sizes``) against the processes of the run
    (``settings``: :func:`parsed_trainer_settings` of the same section), checked before the trainer exists
    (``lmtrain.distributed.check_mesh_sizes``; the fit checks the mesh itself again, once every process has started
    and the logger has written).

    Raises:
        LmtrainError: the mesh is not as large as the run's processes, or has a tensor-parallel dimension.
    """
    from lmtrain.distributed import check_mesh_sizes

    processes = settings.world_size
    strategy = trainer.get("strategy")
    if settings.strategy != "fsdp" or processes is None or not hasattr(strategy, "get"):
        return
    init_args = strategy.get("init_args") or {}
    nodes = int(trainer.get("num_nodes") or 1)
    check_mesh_sizes(init_args.get("data_parallel_size", "auto"), init_args.get("tensor_parallel_size", "auto"),
                     nodes, processes // nodes)


def check_callbacks(callbacks: Sequence[Any], world_size: int, datamodule: Any, module: Any) -> None:
    """Every callback's ``check_arguments(world_size)`` and, where it has one, ``check_data(datamodule, module)``
    (``GenerateSamples``: its prompts against the data's tokenizer, the tokenizer against the model's vocabulary),
    before anything is written.

    Raises:
        LmtrainError: a callback argument or prompt is wrong, naming it.
    """
    for callback in callbacks:
        check = getattr(callback, "check_arguments", None)
        if callable(check):
            check(world_size)
        check_data = getattr(callback, "check_data", None)
        if callable(check_data) and datamodule is not None:
            check_data(datamodule, module)


def parser_kwargs() -> dict[str, Any]:
    """``parser_kwargs`` of :class:`LMCli`: for the main parser and each subcommand's."""
    main = {**_PARSER_KWARGS, "prog": PROG,
            "description": "Train or evaluate a GPT-style LM. Every option can go in a YAML --config."}
    return {**main, **{name: dict(_PARSER_KWARGS) for name in SUBCOMMANDS}}


def run_lightning(args: Sequence[str]) -> int:
    """Run ``fit``, ``validate`` or ``test`` (``args`` starts with the subcommand); returns the exit status.

    0 after a finished run; 128 + the signal's number (130 for SIGINT, 143 for SIGTERM) after a run that a signal
    stopped (``fit`` once its checkpoint was saved, where it checkpoints), so that a scheduler can tell an
    interrupted run from a finished one. A second Ctrl+C, which Lightning ends with ``SystemExit(1)``, is a SIGINT
    too.

    Raises:
        LmtrainError: the arguments or the config are wrong (see :func:`parser_error`).
    """
    from jsonargparse import ArgumentError

    check_config_files(args)
    from lmtrain.checkpoints import CheckpointOnSignal, LogAtCheckpointStep, ResumedProgressBar, StepFlopsSummary
    from lmtrain.data import LMDataModule
    from lmtrain.module import LMModule

    # Callbacks given here are added to those of the config (a fresh instance per run).
    signals = CheckpointOnSignal()
    defaults = {**_TRAINER_DEFAULTS,
                "callbacks": [signals, ResumedProgressBar(), StepFlopsSummary(), LogAtCheckpointStep()]}
    try:
        with lightning_notices_off():
            cli = _lm_cli_class()(LMModule, LMDataModule, args=list(args), trainer_defaults=defaults,
                                  save_config_kwargs=_save_config_kwargs(args[0]), parser_kwargs=parser_kwargs())
    except ArgumentError as exc:
        raise parser_error(str(exc), args) from None
    except SystemExit:
        # Lightning ends a run that Ctrl+C (KeyboardInterrupt) or its own SIGTERM handler stopped with SystemExit;
        # the callback saw which signal it was.
        if signals.received is None:
            raise
        return 128 + int(signal.Signals[signals.received])
    from lmtrain.distributed import end_process_group

    end_process_group()  # after a finished run only: after a failure a rank may still wait in a collective
    received = signals.received or ("SIGTERM" if cli.trainer.received_sigterm else None)
    if received and signals.completed:
        # after the last training step (in the final validation, say): nothing is left to resume
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(f"{received} arrived after the last training step (step {cli.trainer.global_step}): the run "
                       "is complete, exit status 0.")
        return 0
    return 128 + int(signal.Signals[received]) if received else 0


#: Lightning's loggers whose advertisements (``💡 Tip: ...``) and seed line ``lightning_notices_off`` drops.
_LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                      "lightning.fabric.utilities.seed")


class _DropTips(logging.Filter):
    """Drops Lightning's product tips (litlogger, litmodels), its note that the command line's own model summary
    (``StepFlopsSummary``) replaces the default one, and ``Seed set to N``: they say nothing about the run (the seed
    is in the run folder's ``config.yaml``), and the seed line, printed before the data and the callbacks are
    checked, would stand before the one line of an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (text.startswith("💡 Tip:") or text.startswith("Trainer already configured with model summary")
                    or "Seed set to " in text)


@contextmanager
def lightning_notices_off() -> Iterator[None]:
    """While ``fit``/``validate``/``test`` run: no product tips or seed line, and no deprecation warning that
    Lightning's own code triggers in torch (``LeafSpec``), which a user can do nothing about. Everything else is shown
    as usual."""
    tips = _DropTips()
    loggers = [logging.getLogger(name) for name in _LIGHTNING_LOGGERS]
    for lg in loggers:
        lg.addFilter(tips)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                    category=FutureWarning)
            yield
    finally:
        for lg in loggers:
            lg.removeFilter(tips)


def _save_config_kwargs(subcommand: str) -> dict[str, Any]:
    """LightningCLI's saved config: ``config.yaml`` for ``fit``; ``validate``/``test``, which log into the run folder
    of their checkpoint, save theirs beside it (``validate_config.yaml``) instead of replacing the fit's."""
    name = "config.yaml" if subcommand == "fit" else f"{subcommand}_config.yaml"
    return {"overwrite": True, "config_filename": name}


class _Parsed(Exception):
    """Raised by :func:`resolve_args`'s LMCli right after parsing: nothing after the parse runs."""

    def __init__(self, config: Any) -> None:
        super().__init__("parsed")
        self.config = config


def resolve_args(args: Sequence[str], subcommand: str = "fit", module_class: type | None = None) -> ResolvedConfig:
    """Resolve ``fit``-style arguments (``--config FILE``, ``--model.X V``, ...) without running anything.

    Args:
        args: the arguments after the subcommand, as ``python -m lmtrain fit`` takes them.
        subcommand: whose parser to use (``fit``, ``validate`` or ``test``).
        module_class: the LightningModule whose options the ``model`` section holds (None: ``LMModule``; an
            ``LMModule.with_config(schema)`` takes that schema's options).

    Raises:
        LmtrainError: the arguments or the config are wrong (see :func:`parser_error`).
    """
    from jsonargparse import ArgumentError

    from lmtrain.data import LMDataModule
    from lmtrain.module import LMModule

    argv = [subcommand, *args]
    check_config_files(argv)
    base = _lm_cli_class()

    class _Resolve(base):  # type: ignore[misc, valid-type]
        def parse_arguments(self, parser: Any, args: Any) -> None:
            # Stop LightningCLI right after the parse: no seeding, no instantiation, nothing written.
            raise _Parsed(with_strategy_class(parser, args, parser.parse_args(args)))

    try:
        _Resolve(module_class or LMModule, LMDataModule, args=argv, trainer_defaults=_TRAINER_DEFAULTS,
                 parser_kwargs=parser_kwargs())
    except _Parsed as parsed:
        section = parsed.config[subcommand]
    except ArgumentError as exc:
        raise parser_error(str(exc), argv) from None
    else:  # pragma: no cover - parse_arguments always raises
        raise AssertionError("LightningCLI returned without parsing")
    as_dict = section.as_dict()
    config = as_dict.get("config") or []
    source = str(config[-1]) if config else None
    return ResolvedConfig(model=dict(as_dict["model"]), data=dict(as_dict["data"]),
                          config_class=(module_class or LMModule).config_class,
                          trainer=dict(as_dict["trainer"]), seed=as_dict.get("seed_everything"), source=source)


def resolve_config(config: str | Path | None = None, overrides: Sequence[str] | Mapping[str, Any] = (),
                   subcommand: str = "fit") -> ResolvedConfig:
    """Resolve a YAML config and overrides exactly as ``python -m lmtrain fit --config CONFIG OVERRIDES`` would.

    Args:
        config: a YAML config of ``fit`` (None: the defaults of ``LMModule``, ``LMDataModule`` and the trainer).
        overrides: dotted options, either as command-line words (``["--model.context_length", "1024"]``) or as a
            mapping (``{"model.context_length": 1024, "data.batch_size": 8}``; None values are skipped).
        subcommand: whose parser to use.

    Returns:
        The resolved model, data and trainer arguments.

    Raises:
        LmtrainError: the file, an override or a value is wrong.
    """
    args: list[str] = ["--config", str(config)] if config is not None else []
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            if value is not None:
                args += [f"--{key}", _cli_value(value)]
    else:
        args += [str(a) for a in overrides]
    return resolve_args(args, subcommand)


def _cli_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# -- checks before anything runs ------------------------------------------------------------------------------


def check_config_files(args: Sequence[str]) -> None:
    """Every ``--config FILE`` in ``args`` exists and is valid YAML (errors name the file and the line).

    Raises:
        LmtrainError: a config file is missing, unreadable or not YAML.
    """
    import yaml

    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            path = args[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            continue
        file = Path(path)
        if not file.is_file():
            raise LmtrainError("--config", f"the file {path} does not exist.",
                               "give the path of a YAML config, e.g. configs/tiny.yaml.")
        try:
            loaded = yaml.safe_load(file.read_text())
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else path
            problem = " ".join(str(exc.problem or exc.context or "invalid YAML").split())
            raise LmtrainError("--config", f"{where}: {problem}.",
                               "correct the YAML there (indentation, a missing ':' or closing bracket).") from None
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
            raise LmtrainError("--config", f"{path} cannot be read as YAML ({exc}).",
                               "give a UTF-8 YAML file.") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise LmtrainError("--config", f"{path} holds a {type(loaded).__name__}, not sections such as model:.",
                               "write the config as a mapping with model:, data: and trainer: sections.")


def check_has_config(subcommand: str, config: Any) -> None:
    """Refuse ``fit`` without ``--config`` (and ``validate``/``test`` without a config or a checkpoint).

    The defaults alone build the 128M-parameter ``small`` model and let Lightning train it for 1000 epochs: hours
    on a CPU, then a 1.4 GiB checkpoint. Nobody means that.

    Raises:
        LmtrainError: no config file was given.
    """
    if config.get("config"):
        return
    if subcommand != "fit" and config.get("ckpt_path") is not None:
        return  # the checkpoint holds the model's options
    what = "train it for 1000 epochs" if subcommand == "fit" else "evaluate its untrained weights"
    raise LmtrainError("--config", f"{subcommand} was given no config; the defaults alone would build the "
                       f"128M-parameter small model and {what}.",
                       f"start with `{PROG} {subcommand} --config configs/tiny.yaml` (a 1M-parameter model, "
                       "minutes on a CPU), or give another file of configs/.")


def check_runnable(subcommand: str | None, config: Any) -> None:
    """Refuse settings that Lightning would silently change or that would run nothing (before anything is built).

    Args:
        subcommand: ``fit``, ``validate`` or ``test``.
        config: that subcommand's parsed namespace (``trainer`` inside).

    Raises:
        LmtrainError: a precision outside ``PRECISION_CHOICES``, 16-bit float precision without a GPU, or
            ``trainer.max_steps 0`` for ``fit``.
    """
    trainer = config["trainer"]
    precision = normalize_precision(trainer.get("precision") if hasattr(trainer, "get") else trainer.precision)
    accelerator = accelerator_name(trainer.get("accelerator"))
    if precision not in PRECISION_CHOICES:  # 64-true, transformer-engine: nothing in lmtrain is built for them
        raise LmtrainError("trainer.precision", f"{precision} is not a precision lmtrain trains in.",
                           f"use one of {', '.join(PRECISION_CHOICES)}.")
    if precision in ("16-mixed", "16-true") and _runs_on_cpu(accelerator):
        raise LmtrainError("trainer.precision", f"{precision} needs a CUDA GPU; on the CPU Lightning would train in "
                           "bf16 instead, after a warning.",
                           "use --trainer.precision bf16-mixed (or 32-true) on this machine.")
    devices = trainer.get("devices", "auto") if hasattr(trainer, "get") else "auto"
    if _runs_on_cpu(accelerator) and not _cpu_devices_ok(devices):
        raise LmtrainError("trainer.devices", f"{devices!r} picks GPUs (by index, or all of them), but this run is on "
                           f"the CPU (trainer.accelerator {accelerator}), where devices counts processes.",
                           "use --trainer.devices N with N >= 1 (or auto) on the CPU, or a GPU accelerator.")
    if subcommand == "fit" and trainer.get("max_steps") == 0:
        raise LmtrainError("trainer.max_steps", "0 steps trains nothing.",
                           "give a positive number of steps, or -1 to let trainer.max_epochs end the run.")


def check_log_folder(config: Any) -> None:
    """The logger's ``save_dir`` and ``trainer.default_root_dir`` (where Lightning puts checkpoints and the saved
    config without a logger) can be created and written (checked before anything is built).

    Raises:
        LmtrainError: a part of the path is a file, or the nearest existing folder is read-only.
    """
    from lmtrain.errors import check_writable_folder

    logger = config["trainer"].get("logger")
    init_args = logger.get("init_args") if hasattr(logger, "get") else None
    save_dir = init_args.get("save_dir") if hasattr(init_args, "get") else None
    if save_dir is not None:
        check_writable_folder("trainer.logger.init_args.save_dir", save_dir)
    root = config["trainer"].get("default_root_dir")
    if root is not None:
        check_writable_folder("trainer.default_root_dir", root)


def check_compile_cache(config: Any) -> None:
    """``compile_cache``, when it names a folder, can be created and written (checked before anything is built).

    Raises:
        LmtrainError: a part of the path is a file, or the nearest existing folder is read-only.
    """
    from lmtrain.compile_cache import OFF
    from lmtrain.errors import check_writable_folder

    folder = config.get("compile_cache")
    if folder is not None and folder != OFF:
        check_writable_folder("compile_cache", folder)


def compile_cache_callback(config: Any) -> Any:
    """The ``CompileCache`` callback of a parsed subcommand: when the model compiles or runs lmtrain's Triton kernels
    and ``compile_cache`` is not ``off`` (None otherwise)."""
    from lmtrain.attention import needs_gpu
    from lmtrain.compile_cache import OFF, CompileCache

    folder, model = config.get("compile_cache"), config["model"]
    if folder == OFF or not (model.get("compile") or needs_gpu(model.get("attention") or "sdpa")):
        return None
    return CompileCache(folder)


def _cpu_devices_ok(devices: Any) -> bool:
    """Whether Lightning's CPU accelerator takes ``devices``: ``auto`` or a whole number of processes >= 1."""
    if isinstance(devices, str):
        return devices == "auto" or (devices.strip().isdigit() and int(devices) >= 1)
    return isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1


def accelerator_name(accelerator: Any) -> str:
    """The accelerator a parsed ``trainer.accelerator`` names: its name in lower case (``auto`` when unset), or for
    a ``class_path`` entry or an accelerator object ``cpu`` / ``cuda`` when its class is (or derives from)
    Lightning's ``CPUAccelerator`` / ``CUDAAccelerator``, else its class path."""
    if accelerator is None:
        return "auto"
    if isinstance(accelerator, str):
        return accelerator.lower()
    path = accelerator.get("class_path") if hasattr(accelerator, "get") else None
    cls = type(accelerator) if path is None else None
    if path is not None:
        from lmtrain.memory_plan import imported_class

        cls = imported_class(str(path))
    names = [c.__name__ for c in cls.__mro__] if cls is not None else [str(path).rsplit(".", 1)[-1]]
    for name, short in (("CPUAccelerator", "cpu"), ("CUDAAccelerator", "cuda")):
        if name in names:
            return short
    return str(path) if path is not None else f"{cls.__module__}.{cls.__qualname__}"


def _runs_on_cpu(accelerator: str) -> bool:
    if accelerator == "cpu":
        return True
    if accelerator in ("auto", "cuda", "gpu"):
        import torch

        return not torch.cuda.is_available()
    return False


# -- parser errors as one line --------------------------------------------------------------------------------


def parser_error(message: str, args: Sequence[str] = ()) -> LmtrainError:
    """Turn a jsonargparse error message into one :class:`LmtrainError` (field, problem, fix).

    Args:
        message: the parser's message (often many lines).
        args: the arguments that were parsed (for the subcommand in ``--help`` hints).
    """
    sub = next((a for a in args if a in SUBCOMMANDS), "fit")
    help_hint = f"see `{PROG} {sub} --help` for every option"
    text = message.strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if match := re.match(r"unrecognized arguments: (\S+)", text, re.IGNORECASE):
        option = match.group(1).split("=", 1)[0]
        close = difflib.get_close_matches(option, _known_options(sub), n=1)
        fix = f"did you mean {close[0]}? Otherwise {help_hint}." if close else f"{help_hint}."
        return LmtrainError(option.lstrip("-"), "is not an option.", fix)
    if match := re.search(r"does not accept option '([^']+)'", text) or re.search(r'No action for key "([^"]+)"', text):
        key = match.group(1)
        close = difflib.get_close_matches(f"--{key}", _known_options(sub), n=1)
        fix = f"did you mean {close[0].lstrip('-')}? Otherwise {help_hint}." if close else f"{help_hint}."
        return LmtrainError(key, "is not a known key (in the config file or the options).", fix)
    if match := re.match(r'Parser key "([^"]+)":', text):
        key = match.group(1)
        given = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Given value:")), None)
        if key == "trainer.precision":
            return LmtrainError(key, f"{given!r} is not a precision Lightning knows.",
                                f"use one of {', '.join(PRECISION_CHOICES)}.")
        if key.endswith("callbacks") or "class_path" in text:
            if (argument_error := _callback_argument_error(key, text)) is not None:
                return argument_error
            path = re.search(r"class_path '([^']+)'", text) or re.search(r"but (\S+) either not", text)
            name = path.group(1) if path else given
            return LmtrainError(key, f"{name} is not an importable Lightning class of the right kind.",
                                "give the full import path of a Callback class, e.g. "
                                "lmtrain.callbacks.CudaSyncTimer.")
        if "File does not exist" in text:
            return LmtrainError(key, lines[-1].split(":", 1)[-1].strip() + " does not exist.",
                                "give the path of an existing file.")
        detail = next((line[2:] for line in lines if line.startswith("- ")), lines[-1] if len(lines) > 1 else "")
        value = f" {given!r}" if given is not None else ""
        return LmtrainError(key, f"the value{value} is not accepted ({detail.rstrip('.')}).", f"{help_hint}.")
    if text.startswith("Problems parsing config"):
        return LmtrainError("--config", "the config could not be parsed: " + " ".join(lines[1:] or lines) + ".",
                            "correct the YAML.")
    return LmtrainError("arguments", " ".join(lines) + ("" if text.endswith(".") else "."), f"{help_hint}.")


def _callback_argument_error(key: str, text: str) -> LmtrainError | None:
    """The error of a callback whose class imports but whose arguments do not fit (None: another problem).

    jsonargparse reports every union member it tried; the first block, ``Problem with given class_path 'X':``,
    holds the real cause: ``Option 'warmup' is not accepted`` or ``Parser key "depth": Expected ... Got value: v``.
    """
    import importlib
    import inspect

    block = re.search(r"Problem with given class_path '([^']+)':\n(.*?)(?=\n\s*- |\Z)", text, re.DOTALL)
    if block is None:
        return None
    class_path, detail = block.group(1), block.group(2)
    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError):
        return None
    arguments = [name for name, p in inspect.signature(cls.__init__).parameters.items()
                 if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    field = f"{key}.{class_name}"
    if match := re.search(r"Option '([^']+)' is not accepted", detail):
        name = match.group(1)
        close = difflib.get_close_matches(name, arguments, n=1)
        hint = f"did you mean {close[0]}? Otherwise " if close else ""
        return LmtrainError(f"{field}.{name}", "no such argument.",
                            f"{hint}use one of {', '.join(arguments)}.")
    if match := re.search(r'Parser key "([^"]+)":\s*(.*?)(?:\.\s*Got value: (.*))?$', detail.strip(), re.DOTALL):
        name, expected, value = match.group(1), " ".join(match.group(2).split()), match.group(3)
        if literal := re.search(r"Literal\[(.*)\]", expected):
            allowed = ", ".join(v.strip().strip("'\"") for v in literal.group(1).split(","))
            fix = f"use one of {allowed}."
        else:
            expected = re.sub(r"<class '(?:\w+\.)*(\w+)'>", r"\1", expected).rstrip(".")
            fix = f"give a value of type {re.sub(r'^Expected an? ', '', expected)}."
        shown = f"{value.strip()!r} " if value else ""
        return LmtrainError(f"{field}.{name}", f"the value {shown}is not accepted.", fix)
    return None


def _known_options(subcommand: str) -> list[str]:
    """The dotted options of a subcommand (for "did you mean" hints), from its resolved defaults."""
    try:
        defaults = resolve_args([], subcommand)
    except Exception:  # noqa: BLE001 - hints are a courtesy; the error itself is still reported
        return []
    sections = {"model": defaults.model, "data": defaults.data, "trainer": defaults.trainer}
    return [f"--{section}.{key}" for section, values in sections.items() for key in values]
