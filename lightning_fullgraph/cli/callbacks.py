"""The CLI's public callbacks, usable in any Trainer: an empty run folder removed, epoch lines.

:class:`~lightning_fullgraph.cli.train.FullGraphCLI` adds both to its trainers:
:class:`RemoveEmptyRunFolder` always, :class:`EpochLines` when stdout is not a terminal."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info


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
