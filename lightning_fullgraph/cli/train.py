"""``fit``/``validate``/``test``/``predict``: :class:`FullGraphCLI`, the LightningCLI preset for full graphs.

Its defaults, optimizers built when the trainer asks for them, the test after fit, saved
predictions, and configuration errors raised as
:class:`~lightning_fullgraph.cli.errors.ConfigurationError`."""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
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

from lightning_fullgraph._warnings import ScopedWarningFilter
from lightning_fullgraph.cli.callbacks import (
    EpochLines,
    RemoveEmptyRunFolder,
)
from lightning_fullgraph.cli.errors import (
    ConfigurationError,
    as_flags,
    error_leaves,
    explain_parse_error,
    found_before_launch,
    imperative_clause,
    unknown_strategy,
)
from lightning_fullgraph.cli.names import DEBUG_ENV, PROG

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
            if isinstance(err, ConfigurationError) or not found_before_launch(err):
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
                text for _, text in error_leaves(message)[0] if not text.startswith("Expected a <class")
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
            clause = as_flags(imperative_clause(message) or "", flags)
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
        clause = imperative_clause(message)
        if clause:
            clause = as_flags(clause, self._flags())
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
