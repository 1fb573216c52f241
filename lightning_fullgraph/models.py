"""An ordinary PyG node classifier as a LightningModule (the CLI's default model).

Nothing in it is distributed: it is the module a user would write for one process, and the
strategy makes it run on partitions.  Layer sizes left as ``None`` are read from the
datamodule in :meth:`GNNNodeClassifier.configure_model` and recorded in the hyper-parameters,
so checkpoints reload without a datamodule.

The only cross-rank code is optional and uses Lightning's own collectives: torchmetrics
metrics sync themselves, and with ``ogb_evaluator`` the split's labels and predictions are
gathered onto every rank (:meth:`~lightning.pytorch.LightningModule.all_gather`) and scored
by OGB's official :class:`ogb.nodeproppred.Evaluator`.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data
from torch_geometric.nn import GATConv, GCNConv, GINConv, GraphConv, SAGEConv
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy, MulticlassAUROC

from lightning_fullgraph._warnings import ScopedWarningFilter

__all__ = ["GNNNodeClassifier"]

ConvName = Literal["gcn", "sage", "gat", "gin", "graph"]
MetricName = Literal["accuracy", "rocauc"]
METRICS = ("accuracy", "rocauc")



def _check_node_mask(mask: Any, num_nodes: int, name: str) -> None:
    """Refuses anything but a bool ``[num_nodes]`` mask: indexing with an ``[N, S]``
    multi-split mask or an index tensor would silently pick other nodes than the split's."""
    if not isinstance(mask, Tensor):
        raise ValueError(f"batch.{name} must be a bool tensor of shape [{num_nodes}], got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(
            f"batch.{name} has dtype {mask.dtype}; node masks must be bool of shape [{num_nodes}] (an index "
            "tensor? convert it with torch_geometric.utils.index_to_mask)"
        )
    if mask.dim() == 2 and mask.size(0) == num_nodes:
        raise ValueError(
            f"batch.{name} has shape {list(mask.shape)}: a multi-split [N, S] mask, but GNNNodeClassifier "
            f"needs one split, a bool [{num_nodes}] mask; choose it with FullGraphDataModule(split=k) (or set "
            f"data.{name} = data.{name}[:, k] before training)"
        )
    if mask.dim() != 1 or mask.size(0) != num_nodes:
        raise ValueError(
            f"batch.{name} has shape {list(mask.shape)} but the batch has {num_nodes} nodes: a node mask needs "
            f"one bool entry per node, shape [{num_nodes}]"
        )


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


def _auroc(num_classes: int) -> Metric:
    # Exact ROC-AUC (no thresholds): every rank keeps its scores, torchmetrics gathers them.
    return BinaryAUROC() if num_classes == 2 else MulticlassAUROC(num_classes, average="macro")


def _ogb_evaluator(name: str) -> Any:
    """OGB's official evaluator for ``name`` (it needs only the name: nothing is downloaded)."""
    from ogb.nodeproppred import Evaluator

    try:
        evaluator = Evaluator(name)
    except (ValueError, KeyError) as err:
        raise ValueError(f"ogb_evaluator={name!r} is not an OGB node-property dataset ({err})") from err
    if evaluator.eval_metric != "acc":
        raise ValueError(
            f"ogb_evaluator={name!r} scores {evaluator.eval_metric!r}; GNNNodeClassifier predicts one class "
            "per node and supports evaluators whose metric is 'acc' (ogbn-arxiv, ogbn-products, "
            "ogbn-papers100M, ogbn-mag)"
        )
    return evaluator


class GNNNodeClassifier(pl.LightningModule):
    r"""A stack of PyG convs for node classification on the nodes in ``batch.train_mask``.

    Each hidden layer is ``conv -> LayerNorm (optional) -> ReLU -> dropout``.  The training loss
    is the mean cross-entropy over the batch's training nodes; the logged ``train_loss`` and
    ``val_loss`` are weighted over ranks, i.e. the mean over all training nodes of the graph.

    Logged metrics: ``train_loss``, ``val_loss``, ``val_acc`` and ``test_acc`` always (accuracy
    over all nodes of the split, synced across ranks by torchmetrics); with
    ``metric="rocauc"`` also ``val_rocauc`` and ``test_rocauc``; with ``ogb_evaluator`` also
    ``val_ogb_acc`` and ``test_ogb_acc``.

    ``train_mask`` / ``val_mask`` / ``test_mask`` must be bool ``[N]`` masks; a multi-split
    ``[N, S]`` mask (or an index tensor) raises ``ValueError`` instead of indexing the wrong
    nodes: choose the split with ``FullGraphDataModule(split=k)``.

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
        metric: Main evaluation metric. ``"accuracy"`` (default). ``"rocauc"`` additionally
            logs ``val_rocauc`` / ``test_rocauc``: ROC-AUC of the class-1 probability for two
            classes (torchmetrics ``BinaryAUROC``, the usual metric of imbalanced binary
            tasks such as tolokers), macro one-vs-rest ROC-AUC otherwise
            (``MulticlassAUROC``); exact, over all nodes of the split on all ranks.
        ogb_evaluator: Name of an OGB node-property dataset (e.g. ``"ogbn-arxiv"``). When
            set, validation and test also log ``val_ogb_acc`` / ``test_ogb_acc``: the labels
            and predicted classes of the split's nodes are gathered from all ranks onto every
            rank and scored by ``ogb.nodeproppred.Evaluator(name)``, the official
            leaderboard metric (it equals ``val_acc`` / ``test_acc``; this checks it with
            OGB's own code).
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
        metric: MetricName = "accuracy",
        ogb_evaluator: str | None = None,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if conv == "gat" and hidden_channels % heads:
            raise ValueError(f"hidden_channels={hidden_channels} must be divisible by heads={heads} for gat")
        if metric not in METRICS:
            raise ValueError(f"metric={metric!r}; choose one of {METRICS}")
        self._evaluator = _ogb_evaluator(ogb_evaluator) if ogb_evaluator is not None else None
        # val_ogb_acc / test_ogb_acc are computed from labels gathered from every rank, so each
        # rank logs the same value: Lightning's advice to add sync_dist=True (warned at epoch
        # end) does not apply to them. Active between setup and teardown only.
        self._ogb_warning = ScopedWarningFilter(r".*self\.log\('(val|test)_ogb_acc'.*sync_dist=True")
        self.save_hyperparameters()
        self.convs: nn.ModuleList | None = None
        self.norms: nn.ModuleList | None = None
        self.train_loss = MeanMetric()
        self.val_loss = MeanMetric()
        self.val_acc: MulticlassAccuracy | None = None
        self.test_acc: MulticlassAccuracy | None = None
        self.val_rocauc: Metric | None = None
        self.test_rocauc: Metric | None = None
        # ogb_evaluator: (y_true, y_pred) of this rank's split nodes, per evaluation epoch
        self._ogb_outputs: dict[str, list[tuple[Tensor, Tensor]]] = {"val": [], "test": []}
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
        if h.metric == "rocauc":
            self.val_rocauc = _auroc(num_classes)
            self.test_rocauc = _auroc(num_classes)

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

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Builds the layers first if they were left to ``configure_model`` and never built.

        Lightning's ``fork``/``spawn`` launchers train in child processes and then load rank
        0's weights into the parent's module (``strict=False``), whose layers were never
        built (``configure_model`` ran in the children): without this the parent's module,
        e.g. the one ``trainer.test`` or ``test_after_fit`` uses next, would silently stay
        untrained.  The sizes are read from the weights: the input width of the first conv's
        first matrix and the length of the last conv's last vector (its output bias).
        """
        if self.convs is None:
            sizes = self._sizes_from_state_dict(state_dict)
            if sizes is not None:
                self.hparams.in_channels, self.hparams.num_classes = sizes
                self._build(*sizes)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _sizes_from_state_dict(self, state_dict: Any) -> tuple[int, int] | None:
        first, last = "convs.0.", f"convs.{self.hparams.num_layers - 1}."
        matrices = [v for k, v in state_dict.items() if k.startswith(first) and v.dim() == 2]
        vectors = [v for k, v in state_dict.items() if k.startswith(last) and v.dim() == 1]
        if not matrices or not vectors:
            return None
        return int(matrices[0].shape[1]), int(vectors[-1].shape[0])

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
    def _masked_loss(out: Tensor, y: Tensor, mask: Tensor, name: str = "mask") -> tuple[Tensor, int]:
        _check_node_mask(mask, out.size(0), name)
        count = int(mask.sum())
        if count == 0:
            # A rank without nodes of this split still runs backward (the halo exchange is
            # collective); its loss contributes nothing.
            return out.sum() * 0.0, 0
        return F.cross_entropy(out[mask], y[mask]), count

    def training_step(self, batch: Data, batch_idx: int) -> Tensor:
        out = self(batch.x, batch.edge_index)
        loss, count = self._masked_loss(out, batch.y, batch.train_mask, "train_mask")
        self.train_loss.update(loss.detach(), weight=max(count, 0))
        self.log("train_loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=1)
        return loss

    def _update_extra(self, stage: str, out: Tensor, y: Tensor) -> None:
        """``metric="rocauc"`` and ``ogb_evaluator`` bookkeeping for one split's nodes."""
        rocauc = self.val_rocauc if stage == "val" else self.test_rocauc
        if rocauc is not None:
            probs = out.detach().softmax(-1)
            rocauc.update(probs[:, 1] if isinstance(rocauc, BinaryAUROC) else probs, y)
            self.log(f"{stage}_rocauc", rocauc, on_step=False, on_epoch=True, prog_bar=True, batch_size=1)
        if self._evaluator is not None:
            self._ogb_outputs[stage].append((y.detach(), out.detach().argmax(-1)))

    def validation_step(self, batch: Data, batch_idx: int) -> None:
        out = self(batch.x, batch.edge_index)
        loss, count = self._masked_loss(out, batch.y, batch.val_mask, "val_mask")
        self.val_loss.update(loss, weight=count)
        assert self.val_acc is not None
        self.val_acc.update(out[batch.val_mask], batch.y[batch.val_mask])
        self.log("val_loss", self.val_loss, on_step=False, on_epoch=True, batch_size=1)
        self.log("val_acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True, batch_size=1)
        self._update_extra("val", out[batch.val_mask], batch.y[batch.val_mask])

    def test_step(self, batch: Data, batch_idx: int) -> None:
        out = self(batch.x, batch.edge_index)
        _check_node_mask(batch.test_mask, out.size(0), "test_mask")
        assert self.test_acc is not None
        self.test_acc.update(out[batch.test_mask], batch.y[batch.test_mask])
        self.log("test_acc", self.test_acc, on_step=False, on_epoch=True, batch_size=1)
        self._update_extra("test", out[batch.test_mask], batch.y[batch.test_mask])

    # -- OGB evaluator --------------------------------------------------------------------
    def _gather_split(self, stage: str) -> tuple[Tensor, Tensor]:
        """``(y_true, y_pred)`` of the split's nodes of ALL ranks, on every rank.

        Each rank pads its rows to the longest rank's count, ``self.all_gather`` collects the
        padded rows and the counts, and the counts mark which rows are real.
        """
        outputs = self._ogb_outputs[stage]
        self._ogb_outputs[stage] = []
        if outputs:
            local = torch.stack([torch.cat([t for t, _ in outputs]), torch.cat([p for _, p in outputs])])
        else:
            local = torch.zeros(2, 0, dtype=torch.long, device=self.device)
        local = local.to(torch.long)
        count = torch.tensor([local.size(1)], dtype=torch.long, device=local.device)
        counts = self.all_gather(count).reshape(-1)  # [world] (a plain [1] on one process)
        longest = int(counts.max())
        padded = torch.zeros(2, longest, dtype=torch.long, device=local.device)
        padded[:, : local.size(1)] = local
        gathered = self.all_gather(padded)
        if gathered.dim() == padded.dim():  # one process: no rank dimension
            gathered = gathered.unsqueeze(0)
        valid = torch.arange(longest, device=counts.device) < counts.view(-1, 1)  # [world, longest]
        rows = gathered.permute(1, 0, 2)[:, valid]  # [2, total]
        return rows[0], rows[1]

    def _log_ogb(self, stage: str) -> None:
        if self._evaluator is None:
            return
        y_true, y_pred = self._gather_split(stage)
        if y_true.numel() == 0:  # the same on every rank: nothing to score
            return
        result = self._evaluator.eval(
            {"y_true": y_true.view(-1, 1).cpu(), "y_pred": y_pred.view(-1, 1).cpu()}
        )
        # Every rank gathered every node, so every rank computed the same value: no sync.
        self.log(f"{stage}_ogb_acc", float(result["acc"]), on_epoch=True, sync_dist=False, batch_size=1)

    def on_validation_epoch_end(self) -> None:
        self._log_ogb("val")

    def on_test_epoch_end(self) -> None:
        self._log_ogb("test")

    def setup(self, stage: str) -> None:
        if self._evaluator is not None:
            self._ogb_warning.install()

    def teardown(self, stage: str) -> None:
        self._ogb_warning.remove()

    def predict_step(self, batch: Data, batch_idx: int) -> Tensor:
        """Logits of this rank's nodes; the strategy returns them for all nodes, globally ordered."""
        return self(batch.x, batch.edge_index)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
