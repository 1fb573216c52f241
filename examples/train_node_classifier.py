"""The example configs without the CLI: GCN, GraphSAGE or GAT on a named dataset, from Python.

Builds the package's :class:`~lightning_fullgraph.models.GNNNodeClassifier` (an ordinary PyG
module) and a :class:`~lightning_fullgraph.FullGraphDataModule`, and trains with
``Trainer(strategy="fullgraph_quant")``.  The sizes per dataset follow (in short) the
configs ``examples/configs/<dataset>_<conv>.yaml``; OGB datasets also report OGB's official
Evaluator (``val_ogb_acc`` / ``test_ogb_acc``), tolokers its ROC-AUC (``test_rocauc``).

    python examples/train_node_classifier.py                                   # community, GCN
    python examples/train_node_classifier.py --dataset Cora --root ../shared/datasets/Planetoid --conv gat
    python examples/train_node_classifier.py --dataset tolokers --root ../shared/datasets/Heterophilous --split 3
    python examples/train_node_classifier.py --dataset ogbn-arxiv --root data/ --conv sage \\
        --accelerator auto --devices 4                                        # downloads ogbn-arxiv

Keep the ``if __name__ == "__main__":`` guard: the default ``popen`` launcher starts the
other ranks by running this script again.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl

from lightning_fullgraph import FullGraphDataModule, FullGraphStrategy
from lightning_fullgraph.models import GNNNodeClassifier

# Model arguments per dataset family (as in examples/configs/), then per conv.
SMALL = {"hidden_channels": 64, "num_layers": 2, "dropout": 0.5, "lr": 0.01, "weight_decay": 5e-4}
LARGE = {"hidden_channels": 256, "num_layers": 3, "layer_norm": True, "dropout": 0.5, "lr": 0.01,
         "weight_decay": 0.0}
SETTINGS: dict[str, tuple[dict[str, Any], int]] = {  # dataset -> (model kwargs, epochs)
    "community": (SMALL, 100),
    "cora": (SMALL, 200),
    "citeseer": (SMALL, 200),
    "tolokers": ({"hidden_channels": 128, "num_layers": 3, "layer_norm": True, "dropout": 0.2, "lr": 0.005,
                  "weight_decay": 0.0, "metric": "rocauc"}, 300),
    "ogbn-arxiv": ({**LARGE, "ogb_evaluator": "ogbn-arxiv"}, 500),
    "ogbn-products": ({**LARGE, "ogb_evaluator": "ogbn-products"}, 300),
    "reddit": (LARGE, 200),
}
GAT = {"cora": {"heads": 8, "dropout": 0.6, "lr": 0.005}, "citeseer": {"heads": 8, "dropout": 0.6, "lr": 0.005}}


def model_kwargs(dataset: str, conv: str) -> dict[str, Any]:
    """GNNNodeClassifier arguments for ``dataset`` and ``conv`` (unknown datasets: the small ones)."""
    kwargs = dict(SETTINGS.get(dataset.lower(), (SMALL, 0))[0])
    if conv == "gat":
        kwargs.update(GAT.get(dataset.lower(), {"heads": 4, "lr": 0.005}))
    return {"conv": conv, **kwargs}


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="community", help="community, Cora, CiteSeer, tolokers, "
                        "ogbn-arxiv, ogbn-products, Reddit, ... (default community)")
    parser.add_argument("--root", default=None, help="dataset folder (default: download into the cache)")
    parser.add_argument("--conv", choices=("gcn", "sage", "gat"), default="gcn")
    parser.add_argument("--mode", choices=("exact", "adaqp", "sylvie"), default="adaqp",
                        help="halo exchange (adaqp is what strategy='fullgraph_quant' means)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="ranks = graph parts (default 2)")
    parser.add_argument("--max-epochs", type=int, default=None, help="default: per dataset")
    parser.add_argument("--dataset-kwargs", default="{}", help="JSON, e.g. '{\"num_nodes\": 10000}'")
    parser.add_argument("--split", type=int, default=0, help="which split of datasets shipping several "
                        "(tolokers, Actor: [N, 10] masks); default 0")
    parser.add_argument("--start-method", default="popen", help="popen (scripts), fork (notebooks, tests)")
    args = parser.parse_args(argv)

    pl.seed_everything(0)
    epochs = args.max_epochs or SETTINGS.get(args.dataset.lower(), (None, 200))[1]
    datamodule = FullGraphDataModule(
        args.dataset, root=args.root, dataset_kwargs=json.loads(args.dataset_kwargs), split=args.split
    )
    # in_channels / num_classes are read from the datamodule when the trainer sets it up.
    model = GNNNodeClassifier(**model_kwargs(args.dataset, args.conv))
    # Same as strategy="fullgraph_quant" for mode="adaqp"; the object form takes the options.
    strategy = FullGraphStrategy(mode=args.mode, start_method=args.start_method, timeout=timedelta(minutes=10))
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        max_epochs=epochs,
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=datamodule)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    (results,) = trainer.test(model, datamodule=datamodule, verbose=False)
    metrics.update({k: float(v) for k, v in results.items()})
    if trainer.is_global_zero:
        print(f"{args.dataset} {args.conv} ({args.mode}, {args.devices} ranks, {epochs} epochs):")
        for name in sorted(metrics):
            print(f"  {name:<14}{metrics[name]:.4f}")
    return metrics


if __name__ == "__main__":
    main()
