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

Modules:

* :mod:`~lightning_fullgraph.cli.entry`: :func:`main`, the entry point (help, dispatch to the
  subcommands, exit status of a configuration error);
* :mod:`~lightning_fullgraph.cli.train`: :class:`FullGraphCLI`, the LightningCLI preset of
  ``fit``/``validate``/``test``/``predict`` (:data:`TRAINER_DEFAULTS`, :data:`DEFAULT_MODEL`);
* :mod:`~lightning_fullgraph.cli.callbacks`: its public callbacks (:class:`EpochLines`,
  :class:`RemoveEmptyRunFolder`);
* :mod:`~lightning_fullgraph.cli.errors`: :class:`ConfigurationError` and how an error is
  turned into one whose last line names the flags to change;
* :mod:`~lightning_fullgraph.cli.partition`: the ``partition`` subcommand;
* :mod:`~lightning_fullgraph.cli.names`: the command's names and its debug variable.
"""

from lightning_fullgraph.cli.callbacks import EpochLines, RemoveEmptyRunFolder
from lightning_fullgraph.cli.entry import main
from lightning_fullgraph.cli.errors import ConfigurationError, explain_parse_error, unknown_strategy
from lightning_fullgraph.cli.names import DEBUG_ENV
from lightning_fullgraph.cli.partition import partition_main
from lightning_fullgraph.cli.train import DEFAULT_MODEL, TRAINER_DEFAULTS, FullGraphCLI

__all__ = [
    "DEBUG_ENV",
    "DEFAULT_MODEL",
    "TRAINER_DEFAULTS",
    "ConfigurationError",
    "EpochLines",
    "FullGraphCLI",
    "RemoveEmptyRunFolder",
    "explain_parse_error",
    "main",
    "partition_main",
    "unknown_strategy",
]
