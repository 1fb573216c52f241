"""Small graphs, modules and a trainer factory shared by the tests."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.data import Data
from torch_geometric.nn import GATConv, GCNConv, GINConv, GraphConv, SAGEConv

from lightning_fullgraph import FullGraphStrategy
from lightning_fullgraph.partition.partitioner import partition_graph


def directed_graph(
    num_nodes: int = 64,
    num_edges: int = 260,
    num_features: int = 8,
    num_classes: int = 3,
    num_isolated: int = 6,
    seed: int = 0,
) -> Data:
    """A random DIRECTED graph whose last ``num_isolated`` nodes have no edge at all."""
    g = torch.Generator().manual_seed(seed)
    active = num_nodes - num_isolated
    src = torch.randint(0, active, (num_edges,), generator=g)
    dst = torch.randint(0, active, (num_edges,), generator=g)
    keep = src != dst
    edge_index = torch.stack([src[keep], dst[keep]])
    x = torch.randn(num_nodes, num_features, generator=g)
    y = torch.randint(0, num_classes, (num_nodes,), generator=g)
    train_mask = torch.rand(num_nodes, generator=g) < 0.5
    val_mask = ~train_mask
    return Data(x=x, y=y, edge_index=edge_index, train_mask=train_mask, val_mask=val_mask,
                test_mask=val_mask.clone(), num_nodes=num_nodes)


def without_training_nodes_on_last_rank(data: Data, num_parts: int, method: str = "metis") -> Data:
    """Clears the train mask of every node the last rank will own (partitions depend only on
    the edges, so the datamodule computes the same assignment)."""
    parts = partition_graph(data.edge_index, data.num_nodes, num_parts, method=method, seed=0)
    data = data.clone()
    data.train_mask = data.train_mask & (parts != num_parts - 1)
    return data


CONV_TYPES = ("gcn", "sage", "gat", "gin", "graph")


def make_conv(kind: str, in_dim: int, out_dim: int, last: bool = False) -> nn.Module:
    if kind == "gcn":
        return GCNConv(in_dim, out_dim)
    if kind == "sage":
        return SAGEConv(in_dim, out_dim)
    if kind == "gat":
        return GATConv(in_dim, out_dim, heads=1 if last else 2, concat=not last)
    if kind == "gin":
        return GINConv(nn.Sequential(nn.Linear(in_dim, out_dim), nn.ReLU(), nn.Linear(out_dim, out_dim)))
    if kind == "graph":
        return GraphConv(in_dim, out_dim)
    raise ValueError(kind)


class NodeClassifier(pl.LightningModule):
    """An ordinary PyG node classifier, written as a user would (no distributed code)."""

    def __init__(self, conv: str = "gcn", in_dim: int = 8, hidden: int = 16, num_classes: int = 3,
                 num_layers: int = 2, lr: float = 0.1, layer_norm: bool = False, dropout: float = 0.0,
                 optimizer: str = "sgd") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        dims = [in_dim] + [hidden] * (num_layers - 1) + [num_classes]
        for i in range(num_layers):
            last = i == num_layers - 1
            out = dims[i + 1]
            self.convs.append(make_conv(conv, dims[i], out, last=last))
            width = out * 2 if conv == "gat" and not last else out
            if not last:
                self.norms.append(nn.LayerNorm(width) if layer_norm else nn.Identity())
            if conv == "gat" and not last:
                dims[i + 1] = width

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = self.norms[i](x)
                x = F.relu(x)
                x = F.dropout(x, p=self.hparams.dropout, training=self.training)
        return x

    def training_step(self, batch: Data, batch_idx: int) -> torch.Tensor:
        out = self(batch.x, batch.edge_index)
        return F.cross_entropy(out[batch.train_mask], batch.y[batch.train_mask])

    def predict_step(self, batch: Data, batch_idx: int) -> torch.Tensor:
        return self(batch.x, batch.edge_index)

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def reference_training(module: NodeClassifier, data: Data, steps: int) -> dict[str, torch.Tensor]:
    """Single-process, whole-graph PyG training: the ground truth."""
    opt = module.configure_optimizers()
    module.train()
    for _ in range(steps):
        opt.zero_grad()
        loss = module.training_step(data, 0)
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def cpu_trainer(world_size: int, max_epochs: int = 3, **kwargs: Any) -> pl.Trainer:
    strategy_kwargs = kwargs.pop("strategy_kwargs", {})
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=world_size,
        strategy=FullGraphStrategy(start_method="fork", timeout=timedelta(seconds=30), **strategy_kwargs),
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def _rank_entry(rank: int, world_size: int, fn: Any, args: tuple) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Any, world_size: int, *args: Any) -> None:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks.

    Raises if any child raises or exits with a non-zero status (torch's ProcessContext.join
    checks every exit code and terminates the other ranks).
    """
    import torch.multiprocessing as mp

    mp.start_processes(_rank_entry, args=(world_size, fn, args), nprocs=world_size, start_method="fork", join=True)


#: Sylvie settings that keep the stale pipeline running whatever the graph: the tests of its
#: mechanics use small graphs whose halo share is far above ``max_halo_share``'s default, and
#: the reference schedule does not model the divergence guard.
PIPELINED = {"max_halo_share": 1.0, "guard": False}
