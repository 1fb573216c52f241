"""Train your own LightningModule with FullGraphStrategy, from plain Python.

The module below is ordinary single-process PyG code (a 2-layer GraphSAGE): no halo
exchange, no rank logic.  ``Trainer(strategy="fullgraph_quant")`` runs it on 2 CPU
processes, each holding one METIS part of the embedded "community" graph; halo messages
travel quantized (AdaQP).  With ``strategy="fullgraph_exact"`` (fp32 messages) the result
equals training on the whole graph in one process.

Validation and test accuracy are torchmetrics ``MulticlassAccuracy`` objects logged with
``self.log(name, metric)``: each rank counts its correct and total nodes, torchmetrics sums the
counts over ranks and divides once, so the logged value is the accuracy over every node of the
split (not a mean of per-rank accuracies).

    python examples/train_custom_module.py
    python examples/train_custom_module.py --strategy fullgraph_exact --devices 4 --max-epochs 50

Keep the ``if __name__ == "__main__":`` guard: the default ``popen`` launcher starts the
other ranks by running this script again.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.data import Data
from torch_geometric.nn import SAGEConv
from torchmetrics.classification import MulticlassAccuracy

import lightning_fullgraph  # noqa: F401  (registers "fullgraph_quant" with Lightning)
from lightning_fullgraph import FullGraphDataModule


class SAGE(pl.LightningModule):
    """A 2-layer GraphSAGE node classifier; each batch is a whole (local) graph."""

    def __init__(self, in_channels: int, num_classes: int, hidden: int = 64, dropout: float = 0.5) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = SAGEConv(in_channels, hidden)
        self.conv2 = SAGEConv(hidden, num_classes)
        # Metric objects: their state (correct and total counts) is summed over ranks when
        # Lightning computes them at epoch end.  One object per split: never share one.
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = F.relu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.hparams.dropout, training=self.training)
        return self.conv2(x, edge_index)

    def training_step(self, batch: Data, batch_idx: int) -> Tensor:
        out = self(batch.x, batch.edge_index)
        # Mean over this rank's training nodes; the strategy weights ranks by their share of
        # training nodes, so the gradient is the one of the global mean.  The masks are bool
        # [N]: for a graph shipping [N, S] multi-split masks (tolokers, Actor, ...),
        # FullGraphDataModule(..., split=k) keeps split k before partitioning.
        loss = F.cross_entropy(out[batch.train_mask], batch.y[batch.train_mask])
        # No batch_size needed: the strategy sets it to this rank's training nodes, so the
        # epoch value synced over ranks is the mean loss over all training nodes.
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def _update(self, metric: MulticlassAccuracy, batch: Data, mask: Tensor) -> None:
        pred = self(batch.x, batch.edge_index).argmax(-1)
        metric.update(pred[mask], batch.y[mask])  # a rank with no node in the mask adds nothing

    def validation_step(self, batch: Data, batch_idx: int) -> None:
        self._update(self.val_acc, batch, batch.val_mask)
        # Log the metric object, not a tensor: torchmetrics syncs exact counts across ranks.
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: Data, batch_idx: int) -> None:
        self._update(self.test_acc, batch, batch.test_mask)
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01, weight_decay=5e-4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="fullgraph_quant", help="fullgraph_quant or fullgraph_exact")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes = graph parts (default 2)")
    parser.add_argument("--max-epochs", type=int, default=100)
    args = parser.parse_args()

    pl.seed_everything(0)
    # The embedded generated graph, a bit smaller and less noisy than the default one so the
    # example runs in seconds.  For a real dataset: FullGraphDataModule("Cora", root=...).
    graph_kwargs = {"num_nodes": 2000, "num_features": 64, "num_classes": 5, "feature_noise": 0.5}
    datamodule = FullGraphDataModule("community", dataset_kwargs=graph_kwargs)
    model = SAGE(
        in_channels=graph_kwargs["num_features"], num_classes=graph_kwargs["num_classes"], dropout=0.8
    )
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.max_epochs,
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=datamodule)
    val_acc = float(trainer.callback_metrics["val_acc"])
    results = trainer.test(model, datamodule=datamodule, verbose=False)
    if trainer.is_global_zero:
        print(f"val accuracy:  {val_acc:.3f}")
        print(f"test accuracy: {results[0]['test_acc']:.3f}")


if __name__ == "__main__":
    main()
