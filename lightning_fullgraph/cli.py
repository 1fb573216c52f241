"""The ``lightning-fullgraph`` command line (also ``python -m lightning_fullgraph``).

Subcommands:

``fit`` / ``validate`` / ``test`` / ``predict``
    :class:`FullGraphCLI`, a :class:`~lightning.pytorch.cli.LightningCLI` whose model is any
    LightningModule (default :class:`~lightning_fullgraph.models.GNNNodeClassifier`, choose
    another with ``--model.class_path``) and whose data is a
    :class:`~lightning_fullgraph.FullGraphDataModule`.  The trainer defaults run the packaged
    example with no configuration at all: 2 CPU processes, ``strategy="fullgraph_quant"``,
    the embedded ``"community"`` graph.  Everything is overridable from YAML (``--config``)
    or flags (``--trainer.devices=4``, ``--model.conv=sage``, ``--data.data=Cora`` ...).

``partition``
    Partitions a graph into the cache ahead of training (plain argparse, handled before
    LightningCLI sees the arguments) and prints per-part statistics.  The printed folder can
    be given to ``fit`` as ``--data.data=<folder>``; ranks then read only their own part.

Examples::

    python -m lightning_fullgraph fit
    python -m lightning_fullgraph fit --config examples/configs/community_sage.yaml
    python -m lightning_fullgraph fit --trainer.strategy=fullgraph_exact --model.conv=gat
    lightning-fullgraph partition --data Cora --root ../shared/datasets/Planetoid --num-parts 4
    lightning-fullgraph partition --data community --num-parts 4 --balance nodes --json
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import importlib
import inspect
import json
import math
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import MethodType
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback, instantiate_class
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

from lightning_fullgraph._warnings import ScopedWarningFilter, leafspec_filter

__all__ = [
    "DEBUG_ENV",
    "DEFAULT_MODEL",
    "TRAINER_DEFAULTS",
    "ConfigurationError",
    "EpochLines",
    "FullGraphCLI",
    "explain_parse_error",
    "main",
    "partition_main",
    "unknown_strategy",
]

PROG = "lightning-fullgraph"
#: ``python -m lightning_fullgraph``: how the command is named when run that way.
MODULE_PROG = "python -m lightning_fullgraph"
#: Set to 1 for the full traceback of a configuration error instead of its two-line summary.
DEBUG_ENV = "LIGHTNING_FULLGRAPH_DEBUG"

#: Class path of the model used when neither a config nor ``--model`` names one.
DEFAULT_MODEL = "lightning_fullgraph.models.GNNNodeClassifier"

#: Trainer defaults of every subcommand: ``fit`` with no configuration trains the embedded
#: ``"community"`` graph on 2 CPU processes (25-45 s on 2 cores, test accuracy ~0.88).
TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 2,
    "strategy": "fullgraph_quant",
    "max_epochs": 100,
    # One batch (the whole local graph) per epoch: log every step, not every 50.
    "log_every_n_steps": 1,
}

_SUBCOMMAND_HELP = {
    "fit": "Train a model (then test it, unless --test_after_fit=false).",
    "validate": "Evaluate a model on the validation nodes.",
    "test": "Evaluate a model on the test nodes.",
    "predict": "Compute per-node outputs (optionally saved with --predictions_path).",
    "partition": "Partition a graph into the cache ahead of training and print per-part statistics.",
}


class ConfigurationError(ValueError):
    """A configuration error found by :class:`FullGraphCLI` before anything was trained.

    Its message is ``problem`` (what is wrong; an error raised by the package keeps its type
    and wording) followed by one line, ``fix: ...``, that says what to change as command-line
    flags.  The error it summarizes, if any, is its ``__cause__``.  ``main`` prints the two
    parts and exits with status 2 (the traceback with :data:`DEBUG_ENV` ``=1``).

    Args:
        problem: What is wrong (may span lines).
        fix: One line: what to change, as flags (``--data.num_parts``, not ``num_parts=``).
    """

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}\nfix: {fix}")
        self.problem = problem
        self.fix = fix

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.problem, self.fix)


class FullGraphCLI(LightningCLI):
    """:class:`~lightning.pytorch.cli.LightningCLI` preset for full-graph training.

    * model: any LightningModule given by ``class_path`` (subclass mode), default
      :class:`~lightning_fullgraph.models.GNNNodeClassifier`;
    * data: :class:`~lightning_fullgraph.FullGraphDataModule`;
    * trainer defaults: :data:`TRAINER_DEFAULTS` (2 CPU ranks, ``fullgraph_quant``);
    * ``seed_everything`` defaults to 0, so runs are reproducible;
    * ``fit --test_after_fit`` (default true) tests the final weights after training and
      ``predict --predictions_path FILE`` saves the globally ordered node outputs;
    * optimizers given with ``--optimizer`` are built when the trainer asks for them, i.e.
      after ``configure_model`` (models that build their layers lazily work);
    * run folders: unless the configuration names a ``ModelCheckpoint`` (or disables
      checkpointing), checkpoints are kept as ``ModelCheckpoint(save_last=True)`` does, so
      ``<log_dir>/checkpoints/last.ckpt`` (a plain file) always exists after ``fit``;
      ``fit``'s test after training logs into fit's events file; ``predict`` has no logger
      unless one is configured (no ``version_N/`` folder, no ``config.yaml``); a run that
      fails before its first batch removes the ``version_N/`` folder it created (see
      :class:`RemoveEmptyRunFolder`);
    * configuration errors (a mistyped strategy name, a strategy setting its mode does not
      take, a value the class refuses, parts that do not match the ranks) raise
      :class:`ConfigurationError`, whose last line says what to change as flags; so do parse
      errors when the parsers are made with ``exit_on_error=False`` (as :func:`main` does);
    * when stdout is not a terminal and the configuration says nothing about the progress
      bar, it is off and :class:`EpochLines` prints a line every few epochs instead;
    * Lightning's "dirpath has changed" warning of a resumed ``fit`` is printed by rank 0 only.

    Args:
        args: Command-line arguments (``None``: ``sys.argv[1:]``), as for ``LightningCLI``.
        **kwargs: Other :class:`~lightning.pytorch.cli.LightningCLI` arguments; they
            override the presets above.
    """

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        from lightning_fullgraph.data.datamodule import FullGraphDataModule

        # Any LightningModule (subclass mode, default class_path: GNNNodeClassifier).
        kwargs.setdefault("model_class", LightningModule)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("datamodule_class", FullGraphDataModule)
        kwargs.setdefault("seed_everything_default", 0)
        kwargs.setdefault("save_config_callback", _SaveConfigCallback)
        self._deferred_finalize = _DeferredFinalize()
        try:
            super().__init__(args=args, **kwargs)
        except argparse.ArgumentError as err:  # only with exit_on_error=False
            error = _explained(self._parse_error, err, sys.argv[1:] if args is None else args)
            if error is None:
                raise
            raise error from err

    def _prepare_subcommand_parser(
        self, klass: type, subcommand: str, **kwargs: Any
    ) -> LightningArgumentParser:
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand == "predict":
            # predict logs no metrics: without a logger asked for, no version_N/ folder
            parser.set_defaults({"trainer.logger": False})
        return parser

    # -- parser -----------------------------------------------------------------------------
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Sets the trainer and model defaults (see :data:`TRAINER_DEFAULTS`); adds
        ``--test_after_fit`` and ``--predictions_path``."""
        parser.set_defaults({f"trainer.{key}": value for key, value in TRAINER_DEFAULTS.items()})
        if self.subclass_mode_model and self.model_class is not None:
            parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}})
        # Accepted by every subcommand, so that one config file serves fit, test and predict.
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=True,
            help="fit: afterwards, test the final weights (skipped if the model has no test_step).",
        )
        parser.add_argument(
            "--predictions_path",
            type=str | None,
            default=None,
            help="predict: save the predictions (one row per global node, in node order) here with torch.save.",
        )

    # -- lazy optimizers --------------------------------------------------------------------
    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        # LightningCLI builds `--optimizer` from `model.parameters()` right away, but models
        # that create their layers in `configure_model` (like GNNNodeClassifier) have none yet:
        # build the optimizer (and `--lr_scheduler`) when the trainer calls configure_optimizers.
        parser = self._parser(subcommand)
        if not self.auto_configure_optimizers or set(parser._optimizers) != {"optimizer"}:
            return super()._add_configure_optimizers_method_to_model(subcommand)
        if not set(parser._lr_schedulers) <= {"lr_scheduler"}:
            return super()._add_configure_optimizers_method_to_model(subcommand)
        optimizer_init = self._get(self.config_init, "optimizer")
        if not optimizer_init:
            return None
        scheduler_init = self._get(self.config_init, "lr_scheduler")
        if is_overridden("configure_optimizers", self.model):
            rank_zero_warn(
                f"`{type(self.model).__name__}.configure_optimizers` is replaced by the --optimizer "
                f"{'and --lr_scheduler ' if scheduler_init else ''}given on the command line/config."
            )
        configure = self.configure_optimizers

        def configure_optimizers(module: LightningModule) -> Any:
            optimizer = instantiate_class(module.parameters(), optimizer_init)
            scheduler = instantiate_class(optimizer, scheduler_init) if scheduler_init else None
            return configure(module, optimizer, scheduler)

        self.model.configure_optimizers = MethodType(configure_optimizers, self.model)  # type: ignore[method-assign]
        return None

    # -- trainer ----------------------------------------------------------------------------
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Instantiates the trainer with a ``ModelCheckpoint(save_last=True)`` unless the
        configuration gives a ``ModelCheckpoint`` or disables checkpointing, and with
        :class:`RemoveEmptyRunFolder`."""
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        callbacks = _as_list(config.get("callbacks"))
        given = [
            *callbacks,
            *(self._get(self.config_init, key) for key in self._parser(self.subcommand).callback_keys),
            *_as_list(self.trainer_defaults.get("callbacks")),
        ]
        checkpointing = config.get("enable_checkpointing") is not False and not config.get("barebones")
        if checkpointing and not any(isinstance(cb, ModelCheckpoint) for cb in given):
            # Lightning's default ModelCheckpoint keeps only `epoch=E-step=S.ckpt`; a fixed
            # name to resume from or test is what users (and the README) expect.
            callbacks.append(ModelCheckpoint(save_last=True))
        progress_configured = config.get("enable_progress_bar") is not None or any(
            isinstance(cb, ProgressBar) for cb in given
        )
        if not progress_configured and not config.get("barebones") and not _is_terminal(sys.stdout):
            # a bar redrawn into a file is one line per refresh (760 lines for 100 epochs)
            kwargs["enable_progress_bar"] = False
            callbacks.append(EpochLines())
        kwargs["callbacks"] = [*callbacks, RemoveEmptyRunFolder(), _RankZeroWarnings()]
        trainer = super().instantiate_trainer(**kwargs)
        for callback in trainer.callbacks:
            if isinstance(callback, RemoveEmptyRunFolder):
                callback.snapshot(trainer)
        return trainer

    # -- before/after the subcommands -------------------------------------------------------
    def before_instantiate_classes(self) -> None:
        """Refuses an unknown strategy name (:class:`ConfigurationError`, with the nearest
        registered name) before Lightning does it in less helpful words."""
        self._check_strategy_name()
        if self.subcommand in ("validate", "test", "predict"):
            # Evaluating a checkpoint of another run: its ModelCheckpoint state (paths, scores)
            # belongs to that run's folder, and this subcommand saves no checkpoint anyway.
            warnings.filterwarnings("ignore", message=r"The dirpath has changed from", category=UserWarning)

    def instantiate_classes(self) -> None:
        """As LightningCLI's; an error of the configured classes' arguments is raised as a
        :class:`ConfigurationError` whose last line names the flag to change."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, MisconfigurationException) as err:
            if isinstance(err, ConfigurationError):
                raise
            error = _explained(self._instantiation_error, err)
            if error is None:
                raise
            raise error from err

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except Exception as err:
            # Only what the launcher's checks found before any rank started: every other
            # error keeps its type and traceback.
            if isinstance(err, ConfigurationError) or not _found_before_launch(err):
                raise
            error = _explained(self._launch_error, err)
            if error is None:
                raise
            raise error from err

    # -- configuration errors ---------------------------------------------------------------
    def _config(self) -> Any:
        config = getattr(self, "config", None)
        if config is None:
            return None
        return config.get(str(self.subcommand), config) if self.subcommand else config

    def _flags(self) -> dict[str, Any]:
        """``--flag`` -> value of every leaf of the configuration (``init_args`` left out)."""
        config = self._config()
        if config is None:
            return {}
        try:
            items = list(config.items())
        except Exception:  # pragma: no cover - a jsonargparse without flattened items
            return {}
        return {
            "--" + key.replace(".init_args.", ".").replace(".dict_kwargs.", "."): value
            for key, value in items
        }

    def _prog(self) -> str:
        prog = getattr(getattr(self, "parser", None), "prog", None) or PROG
        return f"{prog} {self.subcommand}" if getattr(self, "subcommand", None) else prog

    def _check_strategy_name(self) -> None:
        config = self._config()
        strategy = config.get("trainer.strategy") if config is not None else None
        if not isinstance(strategy, str) or strategy.lower() == "auto":
            return
        registered = StrategyRegistry.available_strategies()
        if strategy.lower() in registered:
            return
        raise ConfigurationError(*unknown_strategy(strategy, registered))

    def _parse_error(self, err: argparse.ArgumentError, args: Any) -> ConfigurationError:
        message = str(err)
        words = [a for a in args if isinstance(a, str)] if isinstance(args, (list, tuple)) else []
        subcommand = next((a for a in words if a in self.subcommands()), None)
        parsers = getattr(self, "_subcommand_parsers", {})
        parser = parsers.get(subcommand) or getattr(self, "parser", None)
        prog = getattr(getattr(self, "parser", None), "prog", PROG)
        if message.startswith("unrecognized arguments:"):
            unknown = message.split(":", 1)[1].split()
            first = unknown[0] if unknown else ""
            options = [
                o for a in getattr(parser, "_actions", []) for o in a.option_strings if o.startswith("--")
            ]
            close = difflib.get_close_matches(first.split("=", 1)[0], options, n=1, cutoff=0.6)
            fix = f"remove or correct {first}" + (f": did you mean {close[0]}?" if close else "")
            return ConfigurationError(f"unrecognized arguments: {' '.join(unknown)}", fix)
        match = re.match(r"argument subcommand: invalid choice: '([^']*)'", message)
        if match:
            close = difflib.get_close_matches(match.group(1), [*self.subcommands(), "partition"], n=1)
            fix = f"did you mean `{prog} {close[0]}`?" if close else f"see `{prog} --help`"
            return ConfigurationError(message, fix)
        problem, fix = explain_parse_error(message)
        if subcommand and not fix:
            fix = f"see `{prog} {subcommand} --help`"
        return ConfigurationError(problem, fix or f"see `{prog} --help`")

    def _instantiation_error(self, err: BaseException) -> ConfigurationError:
        message = str(err)
        leaf = message
        if "Does not validate against any of the Union subtypes" in message:
            leaves = [
                text for _, text in _error_leaves(message)[0] if not text.startswith("Expected a <class")
            ]
            leaf = "; ".join(leaves) or message.splitlines()[0]
        settings = self._strategy_settings_fix(leaf)
        if settings is not None:
            return ConfigurationError(f"--trainer.strategy: {leaf}", settings)
        return ConfigurationError(f"{type(err).__name__}: {leaf}", self._generic_fix(leaf))

    def _strategy_settings_fix(self, message: str) -> str | None:
        """For a FullGraphStrategy given by class path with settings its ``mode`` does not
        take (left from another mode): which flags to drop, or which mode takes them."""
        config = self._config()
        strategy = config.get("trainer.strategy") if config is not None else None
        if strategy is None or isinstance(strategy, str) or not strategy.get("class_path"):
            return None
        from lightning_fullgraph.comm.policies import POLICIES, policy_settings
        from lightning_fullgraph.strategy import FullGraphStrategy

        try:
            module, _, name = strategy["class_path"].rpartition(".")
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return None
        if not (isinstance(cls, type) and issubclass(cls, FullGraphStrategy)):
            return None
        init = strategy.get("init_args") or {}
        if init.get("policy") is not None:
            return None
        mode = init.get("mode") or "exact"
        if mode not in POLICIES:
            return None
        every = set().union(*(policy_settings(m) for m in POLICIES))
        given = {k for k, v in init.items() if v is not None and k in every}
        extra = given - policy_settings(mode)
        extra_names = sorted(extra)
        if not extra_names or not any(name in message for name in extra_names):
            return None
        modes = [m for m in POLICIES if m != mode and extra <= policy_settings(m)]
        flags = ", ".join(f"--trainer.strategy.{k}" for k in extra_names)
        fix = f"drop {flags} (settings of another mode; trainer.strategy.init_args in a config)"
        if modes:
            fix += f", or set --trainer.strategy.mode={' or '.join(modes)}"
        return fix

    def _launch_error(self, err: BaseException) -> ConfigurationError:
        return ConfigurationError(f"{type(err).__name__}: {err}", self._launch_fix(err))

    def _launch_fix(self, err: BaseException) -> str:
        """The flags to change for an error the launcher's checks found."""
        from lightning_fullgraph.nn.errors import UnsupportedConvError

        message = str(err)
        trainer = getattr(self, "trainer", None)
        flags = self._flags()
        parts = flags.get("--data.num_parts")
        if isinstance(parts, int) and trainer is not None and "num_parts" in message:
            nodes = max(1, int(trainer.num_nodes))
            world = int(trainer.num_devices) * nodes
            if parts != world:
                run = (
                    f"--trainer.devices={parts // nodes}"
                    if parts % nodes == 0
                    else f"--trainer.devices x --trainer.num_nodes = {parts}"
                )
                return f"drop --data.num_parts (one part per rank) or set --data.num_parts={world}, or run with {run}"
        if isinstance(err, UnsupportedConvError):
            return (
                "train a model built from the supported convs listed above: --model.conv "
                f"(for {DEFAULT_MODEL.rsplit('.', 1)[-1]}) or another --model.class_path"
            )
        if type(err).__name__ == "GraphValidationError":
            matched = self._matching_flags(message)
            fix = (
                f"change {', '.join(matched)} so that the graph passes this check"
                if matched
                else "give --data.data a graph that passes this check (or change --data.dataset_kwargs / --data.split)"
            )
            clause = _as_flags(_imperative_clause(message) or "", flags)
            return f"{fix}; or: {clause}" if "--" in clause else fix
        return self._generic_fix(message)

    def _matching_flags(self, message: str) -> list[str]:
        """Flags whose (string) value the message quotes."""
        found = []
        for flag, value in self._flags().items():
            if not isinstance(value, str) or len(value) < 2:
                continue
            if any(f"{q}{value}{q}" in message for q in ("'", '"', "`")) or f"={value}" in message:
                found.append(flag)
        return found

    def _generic_fix(self, message: str) -> str:
        matched = self._matching_flags(message)
        clause = _imperative_clause(message)
        if clause:
            clause = _as_flags(clause, self._flags())
        if matched and clause:
            return f"{', '.join(matched)}: {clause}"
        if matched:
            flags = self._flags()
            return "change " + ", ".join(f"{flag} (now {flags[flag]!r})" for flag in matched)
        if clause:
            return clause
        return f"correct the setting named above (`{self._prog()} --help` lists the flags; {DEBUG_ENV}=1 shows the traceback)"

    def before_fit(self) -> None:
        """With ``--test_after_fit``, keeps the loggers open after fit so that the test
        metrics go into fit's events file instead of a second one."""
        if self.config_init["fit"].get("test_after_fit", False) and is_overridden("test_step", self.model):
            for logger in self.trainer.loggers:
                if isinstance(logger, (TensorBoardLogger, CSVLogger)):
                    # fix version_N here: under the fork/spawn launchers fit and test run in
                    # different children, which would otherwise pick one version each
                    _ = logger.version
            self._deferred_finalize = _DeferredFinalize(self.trainer.loggers)

    def after_fit(self) -> None:
        """Prints the final metrics; then tests the final weights if ``--test_after_fit``."""
        trainer = self.trainer
        deferred, self._deferred_finalize = self._deferred_finalize, _DeferredFinalize()
        deferred.restore()
        _print_metrics(f"final metrics after {trainer.current_epoch} epoch(s)", trainer)
        checkpoint = trainer.checkpoint_callback
        if isinstance(checkpoint, ModelCheckpoint):
            if checkpoint.best_model_path:
                _print(f"checkpoint: {checkpoint.best_model_path}")
            if checkpoint.last_model_path and checkpoint.last_model_path != checkpoint.best_model_path:
                _print(f"last checkpoint: {checkpoint.last_model_path}")
        if trainer.log_dir is not None and trainer.logger is not None:
            _print(f"logs: {trainer.log_dir}")
        testing = self.config_init["fit"].get("test_after_fit", False) and not trainer.interrupted
        if testing and not is_overridden("test_step", self.model):
            _print(f"not testing: {type(self.model).__name__} has no test_step")
        if not testing or not is_overridden("test_step", self.model):
            deferred.finalize_pending()
            return
        for callback in trainer.callbacks:
            # fit saved the config in its (forked) worker; this process never saw the flag
            if isinstance(callback, SaveConfigCallback):
                callback.already_saved = True
        trainer.test(self.model, datamodule=self.datamodule, verbose=False)
        _print_metrics("test metrics (final weights)", trainer, prefix="test")

    def after_predict(self) -> None:
        """Saves the predictions on rank 0 if ``--predictions_path`` is given."""
        path = self.config_init["predict"].get("predictions_path")
        if not path:
            return
        predictions = self.trainer.predict_loop.predictions
        if isinstance(predictions, list) and len(predictions) == 1:
            predictions = predictions[0]
        if self.trainer.is_global_zero:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            torch.save(predictions, path)
            rank_zero_info(f"predictions saved to {path}")


class _SaveConfigCallback(SaveConfigCallback):
    """LightningCLI's ``SaveConfigCallback``, except that ``validate``/``test``/``predict``
    without a logger save nothing: their ``log_dir`` would be ``default_root_dir`` (usually the
    working directory), where the next run would then refuse to overwrite ``config.yaml``."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.logger is None and stage != "fit":
            self.already_saved = True
            return
        super().setup(trainer, pl_module, stage)


class RemoveEmptyRunFolder(Callback):
    """Removes the run folder (``lightning_logs/version_N/``) of a run that fails before its
    first batch, e.g. on a configuration error or a missing ``--ckpt_path``.

    The folder is removed on global rank 0, in the process that ran the trainer, only if all of
    these hold: no training/validation/test/predict batch finished; the folder did not exist when
    the trainer was created (:meth:`snapshot`); it holds nothing but ``config.yaml``,
    ``hparams.yaml`` and TensorBoard event files written by this process (checkpoints, CSV
    metrics, anything else: it is kept).  The loggers' own parent folder (``lightning_logs/``)
    goes too if this run created it and it is left empty.  Only
    :class:`~lightning.pytorch.loggers.TensorBoardLogger` and
    :class:`~lightning.pytorch.loggers.CSVLogger` folders are considered.  Under the
    ``fork``/``spawn`` launchers Lightning handles a rank's exception in the parent process,
    whose pid wrote no event file: the folder is then kept.
    """

    #: Files a run writes into its folder before its first batch.
    SETUP_FILES = frozenset({"config.yaml", "hparams.yaml"})

    def __init__(self) -> None:
        self.progressed = False
        # logger index -> (its root dir, the entries of the root dir, or None if missing)
        self._before: dict[int, tuple[str, frozenset[str] | None]] = {}

    def snapshot(self, trainer: Trainer) -> None:
        """Records which run folders exist before the run (call before ``trainer.fit`` etc.)."""
        self._before = {}
        for index, logger in enumerate(trainer.loggers):
            if isinstance(logger, (TensorBoardLogger, CSVLogger)):
                root = str(logger.root_dir)
                entries = frozenset(os.listdir(root)) if os.path.isdir(root) else None
                self._before[index] = (root, entries)

    def _progress(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        if not trainer.sanity_checking:
            self.progressed = True

    on_train_batch_end = on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _progress

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self.progressed or not trainer.is_global_zero:
            return
        if any(getattr(cb, "save_on_exception", False) for cb in trainer.checkpoint_callbacks):
            return
        for index, logger in enumerate(trainer.loggers):
            if index not in self._before:
                continue
            root, entries = self._before[index]
            try:
                relative = Path(logger.log_dir).resolve().relative_to(Path(root).resolve())
            except (OSError, ValueError):
                continue
            if not relative.parts or (entries is not None and relative.parts[0] in entries):
                continue
            folder = Path(root) / relative.parts[0]
            if not folder.is_dir():
                continue
            logger.finalize("failed")  # close the event file before looking at the folder
            if not self._only_setup_files(folder):
                continue
            shutil.rmtree(folder, ignore_errors=True)
            rank_zero_info(f"removed {folder}: the run failed before its first batch")
            if entries is None:
                with contextlib.suppress(OSError):
                    os.rmdir(root)  # only if empty

    def _only_setup_files(self, folder: Path) -> bool:
        pid = str(os.getpid())
        for path in folder.rglob("*"):
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                return False
            if path.is_dir():
                continue
            name = path.name
            if name in self.SETUP_FILES:
                continue
            # events.out.tfevents.<time>.<host>.<pid>.<n>: written by this process
            if name.startswith("events.out.tfevents.") and name.split(".")[-2] == pid:
                continue
            return False
        return True


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


class _DeferredFinalize:
    """Until :meth:`restore`, the loggers' ``finalize("success")`` only saves (the event file
    stays open); other statuses finalize as usual.  :meth:`finalize_pending` then finalizes the
    loggers that asked for it in this process.  Picklable (``spawn`` launcher)."""

    def __init__(self, loggers: Sequence[Logger] = ()) -> None:
        self.loggers = list(loggers)
        self.pending: list[Logger] = []
        for logger in self.loggers:
            logger.finalize = _SaveOnSuccess(logger, self.pending)  # type: ignore[method-assign]

    def restore(self) -> None:
        for logger in self.loggers:
            vars(logger).pop("finalize", None)

    def finalize_pending(self) -> None:
        for logger in self.pending:
            logger.finalize("success")
        self.pending.clear()


class _SaveOnSuccess:
    """A logger's ``finalize`` that for ``"success"`` only saves and records the logger."""

    def __init__(self, logger: Logger, pending: list[Logger]) -> None:
        self.logger = logger
        self.pending = pending

    def __call__(self, status: str) -> None:
        if status != "success":
            type(self.logger).finalize(self.logger, status)
            return
        self.logger.save()
        if not any(logger is self.logger for logger in self.pending):
            self.pending.append(self.logger)


@rank_zero_only
def _print(message: str) -> None:
    print(message, flush=True)


def _print_metrics(title: str, trainer: Trainer, prefix: str | None = None) -> None:
    metrics = {}
    for name, value in sorted(trainer.callback_metrics.items()):
        if prefix is not None and not name.startswith(prefix):
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            metrics[name] = float(value)
    if not metrics:
        return
    width = max(len(n) for n in metrics)
    lines = [f"{title}:"] + [f"  {name:<{width}}  {value:.4g}" for name, value in metrics.items()]
    _print("\n".join(lines))


class EpochLines(Callback):
    """Prints one line of progress-bar metrics every few training epochs on global rank 0:
    what the CLI shows instead of a progress bar when stdout is not a terminal.

    Args:
        lines: About how many lines a run of ``max_epochs`` prints (every
            ``ceil(max_epochs / lines)``-th epoch, and the last one); every 10th epoch when
            ``max_epochs`` is unbounded.
    """

    def __init__(self, lines: int = 20) -> None:
        self.lines = lines

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        epoch, total = trainer.current_epoch + 1, trainer.max_epochs
        every = max(1, math.ceil(total / self.lines)) if total and total > 0 else 10
        if epoch % every and epoch != total:
            return
        metrics = {k: v for k, v in trainer.progress_bar_metrics.items() if k != "v_num"}
        values = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        line = f"epoch {epoch}/{total if total and total > 0 else '?'}"
        print(f"{line}: {values}" if values else line, flush=True)


class _RankZeroWarnings(Callback):
    """Between ``setup`` and ``teardown``, ranks other than 0 do not repeat Lightning's
    warning that a resumed ModelCheckpoint's folder changed (rank 0 prints it)."""

    def __init__(self) -> None:
        self._filter = ScopedWarningFilter(r"The dirpath has changed from", UserWarning)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not trainer.is_global_zero:
            self._filter.install()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._filter.remove()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._filter.remove()


def _explained(explain: Any, err: BaseException, *args: Any) -> ConfigurationError | None:
    """``explain(err, *args)``, the :class:`ConfigurationError` for ``err``; ``None`` if
    explaining it fails (a bug there must not hide the error it explains)."""
    try:
        return explain(err, *args)
    except Exception:
        return None


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


# ------------------------------------------------------------------- configuration errors
def unknown_strategy(name: str, registered: Sequence[str] | None = None) -> tuple[str, str]:
    """``(problem, fix)`` for a strategy name that is not registered with Lightning: the fix
    suggests the nearest registered name (:func:`difflib.get_close_matches`).

    Args:
        name: The name given (``--trainer.strategy``).
        registered: The registered names (default: Lightning's ``StrategyRegistry``).
    """
    registered = list(StrategyRegistry.available_strategies() if registered is None else registered)
    ours = [n for n in registered if n.startswith("fullgraph_")]
    problem = (
        f"--trainer.strategy={name} is not a registered strategy name; this package registers "
        f"{', '.join(ours)} (Lightning's own include auto, ddp, ddp_spawn, ...), and a class path "
        "such as lightning_fullgraph.FullGraphStrategy is accepted too"
    )
    close = difflib.get_close_matches(name.lower(), ours, n=1, cutoff=0.6) or difflib.get_close_matches(
        name.lower(), registered, n=1, cutoff=0.6
    )
    if close:
        return problem, f"did you mean --trainer.strategy={close[0]}?"
    return problem, f"set --trainer.strategy to one of {', '.join(ours)} (or another registered name)"


#: Lines of jsonargparse's error messages that only give their structure.
_STRUCTURE = (
    "Does not validate against any of the Union subtypes",
    "Subtypes:",
    "Errors:",
    "Given value type:",
)


def _error_leaves(
    message: str,
) -> tuple[list[tuple[tuple[str, ...], str]], dict[tuple[str, ...], str], dict[tuple[str, ...], str]]:
    """Reads jsonargparse's nested error message.

    Returns:
        ``(leaves, values, class_paths)``: every line that says what is wrong, with the chain
        of ``Parser key`` names above it; the ``Given value`` of a chain; the class path a
        chain's ``Problem with given class_path`` names.
    """
    stack: list[tuple[int, str]] = []
    leaves: list[tuple[tuple[str, ...], str]] = []
    values: dict[tuple[str, ...], str] = {}
    class_paths: dict[tuple[str, ...], str] = {}
    for raw in message.splitlines():
        text = raw.lstrip(" ")
        if not text:
            continue
        indent = len(raw) - len(text)
        if text.startswith("- "):
            text, indent = text[2:], indent + 2
        while stack and stack[-1][0] >= indent:
            stack.pop()
        chain = tuple(key for _, key in stack)
        key = re.match(r'Parser key "([^"]+)":\s*(.*)$', text)
        if key:
            stack.append((indent, key.group(1)))
            if key.group(2):
                leaves.append(((*chain, key.group(1)), key.group(2)))
            continue
        problem = re.match(r"Problem with given class_path '([^']+)':\s*(.*)$", text)
        if problem:
            class_paths[chain] = problem.group(1)
            if problem.group(2):
                leaves.append((chain, problem.group(2)))
            continue
        if text.startswith("Given value:"):
            values.setdefault(chain, text.split(":", 1)[1].strip())
            continue
        if not text.startswith(_STRUCTURE):
            leaves.append((chain, text))
    return leaves, values, class_paths


_TYPE_WORDS = {"int": "an int", "float": "a number", "bool": "true or false", "str": "a string"}


def explain_parse_error(message: str) -> tuple[str, str]:
    """``(problem, fix)`` of a jsonargparse error message, both naming the flag (``--a.b``)
    of the innermost ``Parser key`` the message reports; ``fix`` is ``""`` if the message
    is not one of the known shapes."""
    leaves, values, class_paths = _error_leaves(message)
    useful = [(c, t) for c, t in leaves if t != "Expected a <class 'NoneType'>"]
    if not useful:
        return message.strip().splitlines()[0] if message.strip() else "invalid arguments", ""
    depth = max(len(c) for c, _ in useful)
    deepest = [(c, t) for c, t in useful if len(c) == depth]
    informative = [(c, t) for c, t in deepest if t != "Expected a <class 'str'>"] or deepest
    chain, text = informative[0]
    flag = "--" + ".".join(chain) if chain else "the arguments"
    got = re.search(r"\. Got value: (.*)$", text)
    value = got.group(1) if got else values.get(chain)
    text = text[: got.start()] if got else text
    literal = re.match(r"Expected a typing\.Literal\[(.*)\]$", text)
    if literal:
        try:
            choices = [str(c) for c in ast.literal_eval(f"[{literal.group(1)}]")]
        except (SyntaxError, ValueError):
            choices = [literal.group(1)]
        return (
            f"{flag}={value}: not one of {', '.join(choices)}",
            f"set {flag} to one of: {', '.join(choices)}",
        )
    types = [m.group(1) for _, t in deepest if (m := re.match(r"Expected a <class '(\w+)'>$", t))]
    if types and text.startswith("Expected a <class"):
        words = [_TYPE_WORDS.get(t, f"a {t}") for t in types if t != "NoneType"]
        nullable = any(c == chain and t == "Expected a <class 'NoneType'>" for c, t in leaves)
        wanted = " or ".join(words + (["null"] if nullable else []))
        return f"{flag}={value}: expected {wanted}", f"set {flag} to {wanted}"
    dotted = re.match(r"Expected a dot import path string: (.*)$", text)
    if dotted:
        name = dotted.group(1).strip()
        example = "module.Class"
        registered = flag == "--trainer.strategy" and name.lower() in StrategyRegistry
        # (the registry's own `get` instantiates the strategy: read its entry)
        params = dict.get(StrategyRegistry, name.lower(), {}).get("init_params") or {} if registered else {}
        if params:
            settings = " ".join(f"{flag}.{k}={v}" for k, v in params.items())
            example = f"lightning_fullgraph.FullGraphStrategy {settings}"
        return (
            f"{flag}={name} is a name: it takes no {flag}.* settings, a class path does",
            f"give {flag}={example} with the {flag}.* settings, or drop them",
        )
    option = re.match(r"Option '([^']+)' is not accepted", text)
    if option:
        name = option.group(1)
        class_path = class_paths.get(chain, "")
        params: list[str] = []
        with contextlib.suppress(Exception):
            module, _, attr = class_path.rpartition(".")
            params = [p for p in inspect.signature(getattr(importlib.import_module(module), attr)).parameters]
        close = difflib.get_close_matches(name, params, n=1, cutoff=0.6)
        owner = class_path.rpartition(".")[2] or chain[-1]
        fix = f"remove {flag}.{name}" + (f" (did you mean {flag}.{close[0]}?)" if close else "")
        return f"{flag}.{name}: {owner} has no argument {name!r}", fix
    if class_paths.get(chain):
        return (
            f"{flag}.class_path={class_paths[chain]}: {text}",
            f"set {flag}.class_path to an importable class (module.Class): {text}",
        )
    return f"{flag}: {text}", f"correct {flag}: {text}"


#: Words a fix clause of the package's messages starts with.
_IMPERATIVES = (
    "add",
    "apply",
    "call",
    "choose",
    "convert",
    "drop",
    "give",
    "mark",
    "pass",
    "remove",
    "run",
    "set",
    "use",
)


def _imperative_clause(message: str) -> str | None:
    """The last clause of the message's last line that says what to do, if any."""
    lines = message.strip().splitlines()
    if not lines:
        return None
    parts = re.split(r"[;:]\s+", lines[-1])
    for part in reversed(parts):
        if part.split(" ", 1)[0].lower() in _IMPERATIVES:
            return part.rstrip(".")
    return None


def _as_flags(text: str, flags: dict[str, Any]) -> str:
    """``name=`` and `` `name` `` in ``text`` as ``--group.name=`` / ``--group.name`` where
    exactly one flag ends in ``.name``."""
    owners: dict[str, list[str]] = {}
    for flag in flags:
        owners.setdefault(flag.rsplit(".", 1)[-1].lstrip("-"), []).append(flag)
    for name, found in owners.items():
        if len(found) != 1 or not name.isidentifier():
            continue
        text = re.sub(rf"(?<![\w.\-`]){re.escape(name)}=", f"{found[0]}=", text)
        text = text.replace(f"`{name}`", found[0])
    # Python literals after a flag, as the command line spells them
    return re.sub(r"(--[\w.]+=)(True|False|None)\b", lambda m: m.group(1) + _CLI_LITERALS[m.group(2)], text)


_CLI_LITERALS = {"True": "true", "False": "false", "None": "null"}


def _found_before_launch(err: BaseException) -> bool:
    """Whether the launcher's checks (:func:`lightning_fullgraph.launch.preflight.check_before_launch`),
    which run before any rank starts, raised ``err``."""
    tb = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        module = frame.f_globals.get("__name__", "")
        if module.startswith("lightning_fullgraph") and frame.f_code.co_name in (
            "_preflight",
            "check_before_launch",
        ):
            return True
        tb = tb.tb_next
    return False


# ------------------------------------------------------------------------------ partition
def _partition_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} partition",
        description=(
            "Partition a graph into the partition cache (or reuse a valid cached partition) and print "
            "per-part statistics. Give the printed folder to `fit` as --data.data=<folder> with as many "
            "devices as parts: ranks then read only their own part."
        ),
    )
    parser.add_argument(
        "--data",
        default="community",
        help="dataset name (community, Cora, ogbn-arxiv, ...) or a partition folder (default: community)",
    )
    parser.add_argument(
        "--root", default=None, help="dataset folder for named datasets (e.g. ../shared/datasets/Planetoid)"
    )
    parser.add_argument(
        "--num-parts", type=int, default=2, help="number of parts = training ranks (default: 2)"
    )
    parser.add_argument(
        "--method", choices=("metis", "random"), default="metis", help="partitioner (default: metis)"
    )
    parser.add_argument("--seed", type=int, default=0, help="partitioner seed (default: 0)")
    parser.add_argument(
        "--balance",
        choices=("edges", "nodes"),
        default="edges",
        help=(
            "what metis balances across the parts: 'edges' = the in-edges each part aggregates, which "
            "dominate a rank's compute time, or 'nodes' = node counts (default: edges; random ignores it)"
        ),
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="partition cache (default: $LIGHTNING_FULLGRAPH_CACHE or $XDG_CACHE_HOME/lightning-fullgraph/partitions)",
    )
    parser.add_argument(
        "--dataset-kwargs",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="extra load_dataset arguments as a JSON object, e.g. '{\"num_nodes\": 10000}'",
    )
    parser.add_argument(
        "--metis-max-edges",
        type=int,
        default=None,
        metavar="M",
        help=(
            "bound METIS' memory (about 120 bytes per undirected edge): give it a deterministic sample of at "
            "most M undirected edges of a larger graph; every edge is still kept in the parts (default: no bound)"
        ),
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def part_statistics(folder: str | Path) -> list[dict[str, Any]]:
    """Per-part statistics of a partition folder (reads every part file once).

    Every directed edge lives in the part owning its destination; it is *cut* when its
    source is a halo node (owned by another part), exactly as in
    :func:`~lightning_fullgraph.partition.partitioner.partition_stats`.

    Returns:
        One dict per part: ``part``, ``owned`` (nodes it owns), ``halo``, ``local_edges``
        (edges whose destination it owns: its aggregation work), ``cut_edges`` and
        ``cut_fraction`` (cut edges / local edges).
    """
    from lightning_fullgraph.partition.cache import load_part, read_manifest

    manifest = read_manifest(folder)
    rows = []
    for rank in range(len(manifest.get("parts", []))):
        part = load_part(folder, rank)
        edge_index = part.data.edge_index
        cut = int((edge_index[0] >= part.plan.num_owned).sum())
        local = int(edge_index.size(1))
        rows.append(
            {
                "part": rank,
                "owned": part.plan.num_owned,
                "halo": part.plan.num_halo,
                "local_edges": local,
                "cut_edges": cut,
                "cut_fraction": cut / local if local else 0.0,
            }
        )
    return rows


def _imbalance(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``node_imbalance`` and ``edge_imbalance`` (max / mean over the parts) of the rows."""
    from lightning_fullgraph.partition.partitioner import imbalance

    return {
        "node_imbalance": imbalance([r["owned"] for r in rows]),
        "edge_imbalance": imbalance([r["local_edges"] for r in rows]),
    }


def _imbalance_line(rows: list[dict[str, Any]]) -> str:
    imb = _imbalance(rows)
    return (
        f"imbalance: nodes max/mean {imb['node_imbalance']:.3f}, edges max/mean {imb['edge_imbalance']:.3f}"
    )


def _format_table(rows: list[dict[str, Any]]) -> str:
    columns = ("part", "owned", "halo", "local_edges", "cut_edges", "cut_fraction")
    total_edges = sum(r["local_edges"] for r in rows)
    total_cut = sum(r["cut_edges"] for r in rows)
    total = {
        "part": "total",
        "owned": sum(r["owned"] for r in rows),
        "halo": sum(r["halo"] for r in rows),
        "local_edges": total_edges,
        "cut_edges": total_cut,
        "cut_fraction": total_cut / total_edges if total_edges else 0.0,
    }

    def cell(value: Any) -> str:
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    table = [list(columns)] + [[cell(r[c]) for c in columns] for r in [*rows, total]]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in table)


def partition_main(argv: Sequence[str] | None = None) -> int:
    """``lightning-fullgraph partition``: partition a graph into the cache, print statistics.

    Args:
        argv: Arguments after ``partition`` (``None``: ``sys.argv[2:]``).

    Returns:
        The exit status (0).
    """
    args = _partition_parser().parse_args(sys.argv[2:] if argv is None else list(argv))
    if args.num_parts < 1:
        raise SystemExit(f"{PROG} partition: --num-parts must be >= 1, got {args.num_parts}")
    if args.dataset_kwargs is not None and not isinstance(args.dataset_kwargs, dict):
        raise SystemExit(f"{PROG} partition: --dataset-kwargs must be a JSON object")

    from lightning_fullgraph._os import max_rss_mib
    from lightning_fullgraph.data.datamodule import load_graph
    from lightning_fullgraph.partition.cache import (
        PartitionResult,
        check_manifest,
        ensure_partitions,
        read_manifest,
    )

    baseline_rss = max_rss_mib()  # torch, PyG, this package imported: what any process costs
    start = time.perf_counter()
    given = Path(args.data)
    if (given / "manifest.json").is_file():
        reason = check_manifest(given, {})
        if reason is not None:
            raise SystemExit(f"{PROG} partition: cannot use {given}: {reason}")
        result = PartitionResult(folder=given, rebuilt=False, reason="partition folder given")
    else:
        from lightning_fullgraph.data.datasets import generated_fingerprint, is_generated_name

        kwargs = args.dataset_kwargs or {}
        graph: Any
        fingerprint = None
        if is_generated_name(args.data):
            # a generated graph is keyed by its name and arguments: a cache hit never builds it
            fingerprint = generated_fingerprint(args.data, **kwargs)

            def graph() -> Any:
                return load_graph(args.data, root=args.root, **kwargs)
        else:
            graph = load_graph(args.data, root=args.root, **kwargs)
        load_s = time.perf_counter() - start
        result = ensure_partitions(
            graph,
            args.num_parts,
            method=args.method,
            seed=args.seed,
            cache_root=args.cache_dir,
            balance=args.balance,
            fingerprint=fingerprint,
            metis_max_edges=args.metis_max_edges,
        )
        del graph
        if fingerprint is None:
            result.timings = {"load": load_s, **result.timings}
    timings = {
        "load": 0.0,
        "check": 0.0,
        "metis": 0.0,
        "plan": 0.0,
        "write": 0.0,
        **getattr(result, "timings", {}),
    }
    phase_peaks = dict(getattr(result, "peak_rss_mib", {}))
    manifest = read_manifest(result.folder)
    stats_start = time.perf_counter()
    rows = part_statistics(result.folder)
    timings["statistics"] = time.perf_counter() - stats_start
    elapsed = time.perf_counter() - start
    # This process, or it and the forked orderings together (a bound) where that is more.
    process_peak_rss = max_rss_mib()
    peak_rss = max(process_peak_rss, getattr(result, "forked_peak_mib", 0.0))
    folder = Path(result.folder).resolve()
    # the global graph's own size: edge_index (int64) + x (float32) + y (int64) + 3 bool masks
    n, e, f = (manifest.get(k) or 0 for k in ("num_nodes", "num_edges", "num_features"))
    graph_mib = (16 * e + 4 * n * f + 8 * n + 3 * n) / 2**20
    if args.json:
        summary = {
            "folder": str(folder),
            "cache_hit": not result.rebuilt,
            "reason": result.reason,
            "partition_seconds": result.seconds,
            "total_seconds": elapsed,
            "phase_seconds": timings,
            "peak_rss_mib": peak_rss,
            "process_peak_rss_mib": process_peak_rss,
            "forked_peak_mib": getattr(result, "forked_peak_mib", 0.0),
            "baseline_rss_mib": baseline_rss,
            "phase_peak_rss_mib": phase_peaks,
            "graph_mib": graph_mib,
            **{
                k: manifest.get(k)
                for k in ("method", "balance", "num_parts", "seed", "num_nodes", "num_edges")
            },
            "metis_max_edges": manifest.get("metis_max_edges"),
            "total_halo": manifest.get("total_halo"),
            **{k: manifest.get(k) for k in ("num_features", "num_classes")},
            "nodes_per_part": [r["owned"] for r in rows],
            "edges_per_part": [r["local_edges"] for r in rows],
            **_imbalance(rows),
            "parts": rows,
        }
        print(json.dumps(summary, indent=1))
        return 0
    reason = "not in the cache yet" if result.reason.startswith("no partition manifest") else result.reason
    status = "cache hit" if not result.rebuilt else f"built in {result.seconds:.2f} s ({reason})"
    if result.reason == "partition folder given":
        status = "existing partition folder"
    print(f"partition folder: {folder}")
    print(f"status: {status}; total {elapsed:.2f} s")
    print(
        "time: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items() if v or k in ("check", "statistics"))
        + f"; peak memory (VmHWM, METIS and forked orderings included) {peak_rss:.0f} MiB "
        f"({peak_rss - baseline_rss:.0f} above the "
        f"{baseline_rss:.0f} MiB after imports), {(peak_rss - baseline_rss) / max(graph_mib, 1e-9):.2f}x the graph's "
        f"{graph_mib:.0f} MiB"
        + (
            ""
            if not phase_peaks
            else " (" + ", ".join(f"after {k} {v:.0f}" for k, v in phase_peaks.items()) + ")"
        )
    )
    if not result.rebuilt and result.reason != "partition folder given":
        print(f"cache reused: {result.reason}, nothing recomputed ({elapsed:.2f} s in all)")
    print(
        f"graph: {manifest.get('num_nodes')} nodes, {manifest.get('num_edges')} edges, "
        f"{manifest.get('num_features')} features, {manifest.get('num_classes')} classes; "
        f"method {manifest.get('method')}, balance {manifest.get('balance', 'nodes (old manifest)')}, "
        f"{manifest.get('num_parts')} parts, seed {manifest.get('seed')}"
    )
    print(_format_table(rows))
    print(_imbalance_line(rows))
    print(f"train on it: {PROG} fit --data.data={folder} --trainer.devices={manifest.get('num_parts')}")
    hint = allocator_hint(rows, os.environ)
    if hint:
        print(hint)
    return 0


#: Rows (owned + halo) of a part from which its ``[rows, 128]`` fp32 activations exceed glibc's
#: largest mmap threshold (32 MiB): every such tensor is mapped, faulted in and zeroed afresh.
LARGE_PART_ROWS = 65_536
#: The allocator environment the README's "Large graphs on CPU" section measured.
ALLOCATOR_ENV = {"THP_MEM_ALLOC_ENABLE": "1", "MALLOC_MMAP_THRESHOLD_": "2097152"}


def allocator_hint(parts: Sequence[dict[str, Any]], environ: Any) -> str | None:
    """The line ``partition`` prints when its largest part would train faster on CPU with
    :data:`ALLOCATOR_ENV` (which must be set before Python starts, so it is only suggested),
    or ``None``: parts below :data:`LARGE_PART_ROWS` rows, or the variables already set.

    Args:
        parts: Per-part statistics with ``owned`` and ``halo`` row counts.
        environ: The environment the training job would inherit (``os.environ``).
    """
    largest = max((int(p["owned"]) + int(p["halo"]) for p in parts), default=0)
    missing = {k: v for k, v in ALLOCATOR_ENV.items() if k not in environ}
    if largest < LARGE_PART_ROWS or not missing:
        return None
    env = " ".join(f"{k}={v}" for k, v in missing.items())
    return (
        f"on CPU: a part holds up to {largest:,} rows; with `{env}` in the environment of `{PROG} fit` its "
        "large tensors use transparent huge pages and leave no fragmented heap (products-like graphs, 4 ranks: "
        "peaks 32-54 % lower at 10^5 nodes, epochs 11-26 % shorter from 10^6 nodes on; README, 'Large graphs on CPU')"
    )


# ----------------------------------------------------------------------------------- main
def _invoked_as() -> str:
    """How the user started this command: ``python -m lightning_fullgraph`` (``sys.argv[0]`` is
    this package's ``__main__.py``) or :data:`PROG` (the console script, or ``main()`` called
    from Python)."""
    first = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    if first.name == "__main__.py" and first.parent.name == "lightning_fullgraph":
        return MODULE_PROG
    return PROG


def _parser_kwargs(prog: str) -> dict[str, Any]:
    """LightningCLI ``parser_kwargs`` of :func:`main`: the program name of the usage lines, and
    parse errors raised (then summarized) instead of printed after the whole usage."""
    return {
        "prog": prog,
        "exit_on_error": False,
        **{s: {"exit_on_error": False} for s in FullGraphCLI.subcommands()},
    }


def _help(prog: str = PROG) -> str:
    width = max(len(s) for s in _SUBCOMMAND_HELP)
    commands = "\n".join(f"  {name:<{width}}  {text}" for name, text in _SUBCOMMAND_HELP.items())
    defaults = ", ".join(f"{k}={v}" for k, v in TRAINER_DEFAULTS.items())
    also = PROG if prog == MODULE_PROG else MODULE_PROG
    return f"""usage: {prog} {{fit,validate,test,predict,partition}} [options]

Distributed full-graph GNN training with PyTorch Lightning (also: {also}).

subcommands:
{commands}

Add --help after a subcommand for its options, e.g. `{prog} fit --help`.
fit/validate/test/predict are LightningCLI subcommands: configure them with --config FILE.yaml
and/or dotted flags (--trainer.*, --model.*, --data.*); --print_config shows the full config.
Model: any LightningModule via --model.class_path (default {DEFAULT_MODEL});
data: lightning_fullgraph.FullGraphDataModule (default: the embedded "community" graph).
Trainer defaults: {defaults}.
Each run logs to lightning_logs/version_N/ (config.yaml, TensorBoard events, and for fit
checkpoints/last.ckpt); predict logs nothing unless given --trainer.logger; a run that fails
before its first batch leaves no version_N/ behind.
A configuration error prints what is wrong and, last, a `fix:` line naming the flags to
change (exit status 2); {DEBUG_ENV}=1 shows its traceback instead.  When stdout is not
a terminal, a line every few epochs replaces the progress bar (unless
--trainer.enable_progress_bar is given).

examples:
  {prog} fit
  {prog} test --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt
  {prog} fit --config examples/configs/community_sage.yaml --trainer.max_epochs=50
  {prog} fit --data.data=Cora --data.root=../shared/datasets/Planetoid --model.conv=gat
  {prog} partition --data community --num-parts 4
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-fullgraph`` and ``python -m lightning_fullgraph``.

    Args:
        argv: Arguments without the program name (``None``: ``sys.argv[1:]``).  Note that
            the default ``popen`` launcher starts the other ranks by re-running
            ``sys.argv``, so multi-process runs must come from the command line.

    Returns:
        The exit status: 0, or 2 after a configuration error (:class:`ConfigurationError`:
        what is wrong, then a last line saying which flags to change; with
        :data:`DEBUG_ENV` ``=1`` it is raised, traceback and all).  ``partition``'s parsing
        errors exit through ``SystemExit``.
    """
    import lightning_fullgraph  # noqa: F401  (registers the fullgraph_* strategy names)

    # Lightning 2.6.6 on torch >= 2.13 warns about a torch-internal rename on every step
    # (outside the strategy's setup..teardown too: the CLI's own loops); for this call only.
    leafspec = leafspec_filter()
    leafspec.install()
    try:
        return _main(argv)
    finally:
        leafspec.remove()


def _main(argv: list[str] | None) -> int:
    import lightning_fullgraph

    args = list(sys.argv[1:] if argv is None else argv)
    prog = _invoked_as()
    if args and args[0] == "partition":
        return partition_main(args[1:])
    if not args or args[0] in ("-h", "--help"):
        print(_help(prog))
        return 0 if args else 2
    if args[0] == "--version":
        print(f"{PROG} {lightning_fullgraph.__version__}")
        return 0
    try:
        # Give LightningCLI `args=None` when reading sys.argv, so it does not warn about both.
        FullGraphCLI(args=None if argv is None else args, parser_kwargs=_parser_kwargs(prog))
    except ConfigurationError as err:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        subcommand = next((a for a in args if a in FullGraphCLI.subcommands()), None)
        sys.stdout.flush()  # what was printed before comes first
        sys.stderr.write(f"{prog}{' ' + subcommand if subcommand else ''}: {err.problem}\nfix: {err.fix}\n")
        sys.stderr.flush()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
