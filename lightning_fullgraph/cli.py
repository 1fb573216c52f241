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
import json
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import MethodType
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, instantiate_class
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

__all__ = ["DEFAULT_MODEL", "TRAINER_DEFAULTS", "FullGraphCLI", "main", "partition_main"]

PROG = "lightning-fullgraph"

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
      after ``configure_model`` (models that build their layers lazily work).

    Args:
        args: Command-line arguments (``None``: ``sys.argv[1:]``), as for ``LightningCLI``.
        **kwargs: Other :class:`~lightning.pytorch.cli.LightningCLI` arguments; they
            override the presets above.
    """

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        from lightning_fullgraph.datamodule import FullGraphDataModule
        from lightning_fullgraph.models import GNNNodeClassifier

        kwargs.setdefault("model_class", GNNNodeClassifier)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("datamodule_class", FullGraphDataModule)
        kwargs.setdefault("seed_everything_default", 0)
        super().__init__(args=args, **kwargs)

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

    # -- after the subcommands --------------------------------------------------------------
    def after_fit(self) -> None:
        """Prints the final metrics; then tests the final weights if ``--test_after_fit``."""
        trainer = self.trainer
        _print_metrics(f"final metrics after {trainer.current_epoch} epoch(s)", trainer)
        if trainer.checkpoint_callback is not None and getattr(
            trainer.checkpoint_callback, "best_model_path", ""
        ):
            _print(f"checkpoint: {trainer.checkpoint_callback.best_model_path}")
        if trainer.log_dir is not None and trainer.logger is not None:
            _print(f"logs: {trainer.log_dir}")
        if not self.config_init["fit"].get("test_after_fit", False) or trainer.interrupted:
            return
        if not is_overridden("test_step", self.model):
            _print(f"not testing: {type(self.model).__name__} has no test_step")
            return
        from lightning.pytorch.cli import SaveConfigCallback

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
        help="partition cache (default: $LIGHTNING_FULLGRAPH_CACHE or <tmp>/lightning_fullgraph/partitions)",
    )
    parser.add_argument(
        "--dataset-kwargs",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="extra load_dataset arguments as a JSON object, e.g. '{\"num_nodes\": 10000}'",
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
    return f"imbalance: nodes max/mean {imb['node_imbalance']:.3f}, edges max/mean {imb['edge_imbalance']:.3f}"


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

    from lightning_fullgraph.datamodule import load_graph
    from lightning_fullgraph.partition.cache import (
        PartitionResult,
        check_manifest,
        ensure_partitions,
        read_manifest,
    )

    start = time.perf_counter()
    given = Path(args.data)
    if (given / "manifest.json").is_file():
        reason = check_manifest(given, {})
        if reason is not None:
            raise SystemExit(f"{PROG} partition: cannot use {given}: {reason}")
        result = PartitionResult(folder=given, rebuilt=False, reason="partition folder given")
    else:
        graph = load_graph(args.data, root=args.root, **(args.dataset_kwargs or {}))
        result = ensure_partitions(
            graph,
            args.num_parts,
            method=args.method,
            seed=args.seed,
            cache_root=args.cache_dir,
            balance=args.balance,
        )
    manifest = read_manifest(result.folder)
    rows = part_statistics(result.folder)
    elapsed = time.perf_counter() - start
    folder = Path(result.folder).resolve()
    if args.json:
        summary = {
            "folder": str(folder),
            "cache_hit": not result.rebuilt,
            "reason": result.reason,
            "partition_seconds": result.seconds,
            "total_seconds": elapsed,
            **{k: manifest.get(k) for k in ("method", "balance", "num_parts", "seed", "num_nodes", "num_edges")},
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
        f"graph: {manifest.get('num_nodes')} nodes, {manifest.get('num_edges')} edges, "
        f"{manifest.get('num_features')} features, {manifest.get('num_classes')} classes; "
        f"method {manifest.get('method')}, balance {manifest.get('balance', 'nodes (old manifest)')}, "
        f"{manifest.get('num_parts')} parts, seed {manifest.get('seed')}"
    )
    print(_format_table(rows))
    print(_imbalance_line(rows))
    print(f"train on it: {PROG} fit --data.data={folder} --trainer.devices={manifest.get('num_parts')}")
    return 0


# ----------------------------------------------------------------------------------- main
def _help() -> str:
    width = max(len(s) for s in _SUBCOMMAND_HELP)
    commands = "\n".join(f"  {name:<{width}}  {text}" for name, text in _SUBCOMMAND_HELP.items())
    defaults = ", ".join(f"{k}={v}" for k, v in TRAINER_DEFAULTS.items())
    return f"""usage: {PROG} {{fit,validate,test,predict,partition}} [options]

Distributed full-graph GNN training with PyTorch Lightning (also: python -m lightning_fullgraph).

subcommands:
{commands}

Add --help after a subcommand for its options, e.g. `{PROG} fit --help`.
fit/validate/test/predict are LightningCLI subcommands: configure them with --config FILE.yaml
and/or dotted flags (--trainer.*, --model.*, --data.*); --print_config shows the full config.
Model: any LightningModule via --model.class_path (default {DEFAULT_MODEL});
data: lightning_fullgraph.FullGraphDataModule (default: the embedded "community" graph).
Trainer defaults: {defaults}.

examples:
  {PROG} fit
  {PROG} fit --config examples/configs/community_sage.yaml --trainer.max_epochs=50
  {PROG} fit --data.data=Cora --data.root=../shared/datasets/Planetoid --model.conv=gat
  {PROG} partition --data community --num-parts 4
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-fullgraph`` and ``python -m lightning_fullgraph``.

    Args:
        argv: Arguments without the program name (``None``: ``sys.argv[1:]``).  Note that
            the default ``popen`` launcher starts the other ranks by re-running
            ``sys.argv``, so multi-process runs must come from the command line.

    Returns:
        The exit status (0); parsing errors exit through ``SystemExit``.
    """
    import lightning_fullgraph  # noqa: F401  (registers the fullgraph_* strategy names)

    # Lightning 2.6.6 on torch >= 2.13 warns about a torch-internal rename on every step.
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "partition":
        return partition_main(args[1:])
    if not args or args[0] in ("-h", "--help"):
        print(_help())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"{PROG} {lightning_fullgraph.__version__}")
        return 0
    # Give LightningCLI `args=None` when reading sys.argv, so it does not warn about both.
    FullGraphCLI(args=None if argv is None else args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
