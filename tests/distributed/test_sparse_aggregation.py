"""Sparse (CSR) aggregation inside the adapters: exact for every conv option, and really used.

Each case trains 3 ranks for a few SGD steps on a random DIRECTED graph with isolated nodes,
edge weights and edge features, where the last rank owns no training node, and compares
the weights with single-process PyG on the whole graph (edge_index path) under
``assert_close`` fp32 defaults, with and without the central/marginal overlap.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GCNConv, GINConv, GINEConv, GraphConv, MessagePassing, SAGEConv

from lightning_fullgraph import FullGraphDataModule
from tests.helpers import cpu_trainer, directed_graph, reference_training, without_training_nodes_on_last_rank

STEPS = 3


def _mlp(i: int, o: int) -> nn.Module:
    return nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Linear(o, o))


# name -> (conv factory (in, out), extra inputs the module passes: "w" edge weights, "a" edge features)
CASES: dict[str, tuple[Callable[[int, int], MessagePassing], str]] = {
    "gcn_weighted": (lambda i, o: GCNConv(i, o), "w"),
    "gcn_improved": (lambda i, o: GCNConv(i, o, improved=True), ""),
    "gcn_improved_weighted": (lambda i, o: GCNConv(i, o, improved=True), "w"),
    "gcn_no_self_loops": (lambda i, o: GCNConv(i, o, add_self_loops=False), ""),
    "gcn_no_normalize_weighted": (lambda i, o: GCNConv(i, o, normalize=False), "w"),
    "gcn_cached": (lambda i, o: GCNConv(i, o, cached=True), ""),
    "sage_mean": (lambda i, o: SAGEConv(i, o), ""),
    "sage_max": (lambda i, o: SAGEConv(i, o, aggr="max"), ""),
    "sage_sum": (lambda i, o: SAGEConv(i, o, aggr="sum"), ""),
    "sage_no_root": (lambda i, o: SAGEConv(i, o, root_weight=False), ""),
    "sage_project_normalize": (lambda i, o: SAGEConv(i, o, project=True, normalize=True), ""),
    "gin_train_eps": (lambda i, o: GINConv(_mlp(i, o), train_eps=True), ""),
    "graph_weighted": (lambda i, o: GraphConv(i, o), "w"),
    "graph_mean": (lambda i, o: GraphConv(i, o, aggr="mean"), ""),
    "graph_max_weighted": (lambda i, o: GraphConv(i, o, aggr="max"), "w"),
    "gine_edge_attr": (lambda i, o: GINEConv(_mlp(i, o), edge_dim=2), "a"),
}
SPARSE_CASES = [name for name in CASES if not name.startswith("gine")]


class OptionsClassifier(pl.LightningModule):
    """Three layers of one configured conv; passes edge weights / features where configured."""

    def __init__(self, case: str, in_dim: int = 8, hidden: int = 16, num_classes: int = 3, lr: float = 0.1) -> None:
        super().__init__()
        factory, self.inputs = CASES[case]
        dims = [in_dim, hidden, hidden, num_classes]
        self.convs = nn.ModuleList(factory(dims[i], dims[i + 1]) for i in range(3))
        self.lr = lr

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, edge_weight=None, edge_attr=None) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            if "w" in self.inputs:
                x = conv(x, edge_index, edge_weight)
            elif "a" in self.inputs:
                x = conv(x, edge_index, edge_attr)
            else:
                x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.relu(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self(batch.x, batch.edge_index, batch.edge_weight, batch.edge_attr)
        return F.cross_entropy(out[batch.train_mask], batch.y[batch.train_mask])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _graph(seed: int = 5):
    data = without_training_nodes_on_last_rank(directed_graph(seed=seed), 3)
    g = torch.Generator().manual_seed(seed)
    num_edges = data.edge_index.size(1)
    # a few duplicated edges: sum adds them, mean counts them, max compares them
    dup = data.edge_index[:, :7]
    data.edge_index = torch.cat([data.edge_index, dup], dim=1)
    data.edge_weight = torch.rand(num_edges + 7, generator=g) + 0.1
    data.edge_attr = torch.randn(num_edges + 7, 2, generator=g)
    return data


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_conv_options_equal_single_process(case: str, overlap: bool, tmp_path) -> None:
    """Negative control: dropping the global-degree normalisation, the edge weights from the
    CSR values, or the duplicate entries makes the weighted/duplicated cases differ by 1e-2."""
    data = _graph()
    torch.manual_seed(0)
    model = OptionsClassifier(case)
    initial = copy.deepcopy(model.state_dict())
    expected = reference_training(copy.deepcopy(model), data, STEPS)
    assert any(not torch.equal(initial[k], expected[k]) for k in expected)
    trainer = cpu_trainer(3, max_epochs=STEPS, strategy_kwargs={"overlap": overlap})
    trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=tmp_path))
    for key in expected:
        torch.testing.assert_close(model.state_dict()[key], expected[key], msg=lambda m, k=key: f"{case} {k}: {m}")


class _PathProbe(pl.Callback):
    """Counts, with PyG's own hooks, which aggregation path every conv took on this rank."""

    def __init__(self, expect_sparse: bool) -> None:
        self.expect_sparse = expect_sparse

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fused = self.edges = 0

        def fused(*_: Any) -> None:
            self.fused += 1

        def edges(*_: Any) -> None:
            self.edges += 1

        for conv in pl_module.modules():
            if isinstance(conv, MessagePassing):
                conv.register_message_and_aggregate_forward_hook(fused)
                conv.register_message_forward_hook(edges)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.expect_sparse:
            assert self.fused > 0 and self.edges == 0, (self.fused, self.edges)
        else:
            assert self.fused == 0 and self.edges > 0, (self.fused, self.edges)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("case", ["gcn_weighted", "sage_max", "gin_train_eps", "graph_weighted"])
def test_aggregation_path_taken(case: str, overlap: bool, sparse: bool, tmp_path) -> None:
    """With ``sparse_aggregation`` on, every conv aggregates through PyG's fused
    ``message_and_aggregate`` (no per-edge ``message`` call); off, through messages.

    Negative control: with the CSR path removed from the adapters the ``sparse=True`` cases
    see ``message`` calls and no fused call, and fail.
    """
    data = _graph()
    torch.manual_seed(0)
    model = OptionsClassifier(case)
    trainer = cpu_trainer(
        2,
        max_epochs=2,
        strategy_kwargs={"overlap": overlap, "sparse_aggregation": sparse},
        callbacks=[_PathProbe(expect_sparse=sparse)],
    )
    trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=tmp_path))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("case", ["gcn_weighted", "sage_max", "graph_weighted"])
def test_bf16_mixed_precision_matches_edge_path(case: str, overlap: bool, tmp_path) -> None:
    """Under ``precision="bf16-mixed"`` the CSR products (which have no bfloat16 kernels and
    which autocast would cast down) run in float32 and train like PyG's edge path.

    Negative control: without the autocast guard in the adapters' ``message_and_aggregate``
    the sum/mean cases raise ``NotImplementedError`` (addmm for BFloat16 sparse CSR)."""
    data = _graph()
    weights = {}
    for sparse in (True, False):
        torch.manual_seed(0)
        model = OptionsClassifier(case)
        trainer = cpu_trainer(
            2, max_epochs=STEPS, precision="bf16-mixed",
            strategy_kwargs={"overlap": overlap, "sparse_aggregation": sparse},
        )
        trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=tmp_path))
        weights[sparse] = model.state_dict()
    for key in weights[False]:
        # bf16 rounding of the edge path's messages against float32 products: a few 1e-3
        torch.testing.assert_close(weights[True][key], weights[False][key], rtol=2e-2, atol=2e-2)
