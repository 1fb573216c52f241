"""An ordinary PyG node classifier as a LightningModule (the CLI's default model).

Nothing in it is distributed: it is the module a user would write for one process, and the
strategy makes it run on partitions.  Layer sizes left as ``None`` are read from the
datamodule in :meth:`GNNNodeClassifier.configure_model` and recorded in the hyper-parameters,
so checkpoints reload without a datamodule.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data
from torch_geometric.nn import GATConv, GCNConv, GINConv, GraphConv, SAGEConv
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

__all__ = ["GNNNodeClassifier"]

ConvName = Literal["gcn", "sage", "gat", "gin", "graph"]


def _conv(kind: str, in_dim: int, out_dim: int, heads: int, last: bool) -> nn.Module:
    if kind == "gcn":
        return GCNConv(in_dim, out_dim)
    if kind == "sage":
        return SAGEConv(in_dim, out_dim)
    if kind == "gat":
        # hidden layers concatenate heads (out_dim = heads * per-head), the last averages
        return GATConv(in_dim, out_dim if last else out_dim // heads, heads=heads, concat=not last)
    if kind == "gin":
        return GINConv(nn.Sequential(nn.Linear(in_dim, out_dim), nn.ReLU(), nn.Linear(out_dim, out_dim)))
    if kind == "graph":
        return GraphConv(in_dim, out_dim)
    raise ValueError(f"conv={kind!r}; choose one of gcn, sage, gat, gin, graph")


class GNNNodeClassifier(pl.LightningModule):
    r"""A stack of PyG convs for node classification on the nodes in ``batch.train_mask``.

    Each hidden layer is ``conv -> LayerNorm (optional) -> ReLU -> dropout``.  The training loss
    is the mean cross-entropy over the batch's training nodes; the logged ``train_loss`` and
    ``val_loss`` are weighted over ranks, i.e. the mean over all training nodes of the graph.

    Args:
        conv: ``"gcn"``, ``"sage"``, ``"gat"``, ``"gin"`` or ``"graph"``.
        in_channels: Input features (``None``: from the datamodule).
        num_classes: Classes (``None``: from the datamodule).
        hidden_channels: Width of hidden layers.
        num_layers: Number of conv layers (>= 1).
        dropout: Dropout probability after each hidden layer.
        layer_norm: Per-node ``LayerNorm`` after each hidden conv.
        heads: Attention heads for ``gat``.
        lr: Adam learning rate.
        weight_decay: Adam weight decay.
    """

    def __init__(
        self,
        conv: ConvName = "gcn",
        in_channels: int | None = None,
        num_classes: int | None = None,
        hidden_channels: int = 64,
        num_layers: int = 2,
        dropout: float = 0.5,
        layer_norm: bool = False,
        heads: int = 4,
        lr: float = 0.01,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if conv == "gat" and hidden_channels % heads:
            raise ValueError(f"hidden_channels={hidden_channels} must be divisible by heads={heads} for gat")
        self.save_hyperparameters()
        self.convs: nn.ModuleList | None = None
        self.norms: nn.ModuleList | None = None
        self.train_loss = MeanMetric()
        self.val_loss = MeanMetric()
        self.val_acc: MulticlassAccuracy | None = None
        self.test_acc: MulticlassAccuracy | None = None
        if in_channels is not None and num_classes is not None:
            self._build(in_channels, num_classes)

    def _build(self, in_channels: int, num_classes: int) -> None:
        h = self.hparams
        dims = [in_channels] + [h.hidden_channels] * (h.num_layers - 1) + [num_classes]
        self.convs = nn.ModuleList(
            _conv(h.conv, dims[i], dims[i + 1], h.heads, last=i == h.num_layers - 1) for i in range(h.num_layers)
        )
        self.norms = nn.ModuleList(
            nn.LayerNorm(h.hidden_channels) if h.layer_norm else nn.Identity() for _ in range(h.num_layers - 1)
        )
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def configure_model(self) -> None:
        if self.convs is not None:
            return
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is None or getattr(dm, "num_features", None) is None:
            raise ValueError(
                "GNNNodeClassifier needs in_channels and num_classes, or a FullGraphDataModule to read them from"
            )
        self.hparams.in_channels = int(dm.num_features)
        self.hparams.num_classes = int(dm.num_classes)
        self._build(self.hparams.in_channels, self.hparams.num_classes)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        """``[N, F_in] -> [N, num_classes]`` logits."""
        assert self.convs is not None and self.norms is not None, "call configure_model() first"
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.relu(self.norms[i](x))
                x = F.dropout(x, p=self.hparams.dropout, training=self.training)
        return x

    @staticmethod
    def _masked_loss(out: Tensor, y: Tensor, mask: Tensor) -> tuple[Tensor, int]:
        count = int(mask.sum())
        if count == 0:
            # A rank without nodes of this split still runs backward (the halo exchange is
            # collective); its loss contributes nothing.
            return out.sum() * 0.0, 0
        return F.cross_entropy(out[mask], y[mask]), count

    def training_step(self, batch: Data, batch_idx: int) -> Tensor:
        out = self(batch.x, batch.edge_index)
        loss, count = self._masked_loss(out, batch.y, batch.train_mask)
        self.train_loss.update(loss.detach(), weight=max(count, 0))
        self.log("train_loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=1)
        return loss

    def validation_step(self, batch: Data, batch_idx: int) -> None:
        out = self(batch.x, batch.edge_index)
        loss, count = self._masked_loss(out, batch.y, batch.val_mask)
        self.val_loss.update(loss, weight=count)
        assert self.val_acc is not None
        self.val_acc.update(out[batch.val_mask], batch.y[batch.val_mask])
        self.log("val_loss", self.val_loss, on_step=False, on_epoch=True, batch_size=1)
        self.log("val_acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True, batch_size=1)

    def test_step(self, batch: Data, batch_idx: int) -> None:
        out = self(batch.x, batch.edge_index)
        assert self.test_acc is not None
        self.test_acc.update(out[batch.test_mask], batch.y[batch.test_mask])
        self.log("test_acc", self.test_acc, on_step=False, on_epoch=True, batch_size=1)

    def predict_step(self, batch: Data, batch_idx: int) -> Tensor:
        """Logits of this rank's nodes; the strategy returns them for all nodes, globally ordered."""
        return self(batch.x, batch.edge_index)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
